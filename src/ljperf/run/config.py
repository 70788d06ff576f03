"""One run's configuration (``RunConfig``): the model, engine and option groups of ``ljperf benchmark`` or
``ljperf plan``, resolved and checked once.

Run: ``from_args(args, argv, device_type="cpu")`` after a command's flags parse; the engine, the forecast recipe
(``forecast.recipe.Recipe.of``) and the benchmark record all derive from the one object it returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field

from ljperf.core import deepspeed_config, options
from ljperf.core.choices import CompileMode, DeviceType, EngineName, Loss
from ljperf.core.console import say
from ljperf.core.errors import UsageError
from ljperf.core.mesh import MeshShape
from ljperf.core.options import (
    DEEPCOMPILE_WARMUP,
    EngineConfig,
    ExplainConfig,
    LaunchConfig,
    OptimizationConfig,
    TrainConfig,
)
from ljperf.core.plans import Plan, fixed_plan, parse_recompute
from ljperf.distributed.launch import local_world_size, under_torchrun
from ljperf.models.catalog import split_model_arg
from ljperf.models.flags import engine_from_args, spec_from_args
from ljperf.models.layout import TENSOR_PARALLEL
from ljperf.models.pipeline_split import check_pipelined, parse_split
from ljperf.models.spec import ModelSpec


@dataclass(kw_only=True)
class RunConfig:
    """A whole run, resolved from the command line."""

    engine: EngineName
    """torch, fsdp or deepspeed."""
    model: ModelSpec
    """The model to train."""
    train: TrainConfig
    """Batch, sequence, precision and steps."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Processes, nodes and timeouts."""
    engine_opts: EngineConfig = field(default_factory=EngineConfig)
    """FSDP2 / DeepSpeed options."""
    optim: OptimizationConfig = field(default_factory=OptimizationConfig)
    """Optimizations (activation checkpoint, compile), as given."""
    explain: ExplainConfig = field(default_factory=ExplainConfig)
    """The profiler trace and the memory picture asked for (``--profile``, ``--plot``)."""
    deepspeed_user: dict = field(default_factory=dict)
    """The ``--deepspeed-config`` file as loaded (deepspeed engine; ``{}``: none)."""
    output: str | None = None
    """Where the JSON record goes (atomically), or None."""
    argv: list[str] = field(default_factory=list)
    """The command line, recorded in ``args``."""

    def __post_init__(self) -> None:
        check_together(self.engine, self.train, self.optim, model=self.model.name)
        check_tensor_parallel(self.model, tp=self.engine_opts.tp, seq_len=self.train.seq_len)
        options.check_loss(self.optim.loss, tp=self.engine_opts.tp)
        check_chunked_loss(self.model, loss=self.optim.loss)
        check_pipeline_model(self.model, self.engine_opts, self.optim)
        if (plan := parse_recompute(self.optim.recompute)) != "auto":
            fixed_plan(plan, self.model.layers)  # one that does not match the model fails here, not in every rank


def check_together(engine: EngineName, train: TrainConfig, optim: OptimizationConfig, *, model: str) -> None:
    """The option groups' rules that span two of them, for ``engine``: checked before the model is read
    (``check_flags``) and when a ``RunConfig`` is made."""
    if optim.compile_mode == "deepspeed" and engine != "deepspeed":
        raise UsageError(f"--compile-mode deepspeed is DeepSpeed's engine.compile(): use deepspeed/{model}")
    options.check_precision(train.precision, engine=engine)
    if optim.optimizer_impl is not None and engine == "deepspeed":
        raise UsageError("--optimizer-impl: the deepspeed engine's AdamW comes from --deepspeed-config: drop the flag")
    if optim.compile_mode != "off" and train.warmup < 1:
        raise UsageError("--compile needs --warmup 1 or more: the first steps compile (kept out of the step times)")


def check_tensor_parallel(spec: ModelSpec, *, tp: int, seq_len: int | None) -> None:
    """A model ``--tp`` can split: one of ``TENSOR_PARALLEL``'s families whose heads, K/V heads, MLP width and
    vocabulary divide by ``tp`` (each rank takes whole heads and equal slices), and a sequence sequence parallel can
    split evenly (``seq_len`` None: not resolved yet, see ``resolve_train``)."""
    if tp == 1:
        return
    kind = spec.fact("model_type")
    if kind not in TENSOR_PARALLEL:
        names = ", ".join(TENSOR_PARALLEL.values())
        raise UsageError(f"--tp splits {names} decoders; {spec.name} is {kind}: use --tp 1 (FSDP2 alone)")
    sizes = (
        ("attention heads", spec.heads),
        ("K/V heads", spec.kv_heads),
        ("MLP width (intermediate_size)", spec.fact("intermediate_size")),
        ("vocabulary", spec.vocab),
    )
    for what, n in sizes:
        if n % tp:
            raise UsageError(f"--tp {tp} must divide {spec.name}'s {what}, {n}: each rank takes an equal share")
    if seq_len is not None and seq_len % tp:
        raise UsageError(f"--tp {tp} must divide --seq-len {seq_len}: sequence parallel gives each rank equal tokens")


def check_pipeline_model(spec: ModelSpec, opts: EngineConfig, optim: OptimizationConfig) -> None:
    """A model ``--pp`` can split, into stages of one layer or more each, with the optimizations a stage runs:
    its own LM head and loss (the chunked one on its whole head), each block compiled (not the whole model)."""
    if opts.pp == 1:
        return
    check_pipelined(str(spec.fact("model_type")))
    if spec.facts.config_dict.get("tie_word_embeddings"):
        raise UsageError(
            f"--pp puts the embedding on the first stage and the LM head on the last; {spec.name} ties them"
            " (tie_word_embeddings): run it without --pp"
        )
    if spec.layers < opts.stages:
        raise UsageError(
            f"--pp {opts.pp} × --pp-stages-per-rank {opts.pp_stages_per_rank} = {opts.stages} stages for"
            f" {spec.name}'s {spec.layers} layers: a stage would be empty; give fewer stages"
        )
    if opts.pp_split is not None:
        parse_split(opts.pp_split, layers=spec.layers, stages=opts.stages)
    if optim.compile_mode == "whole":
        raise UsageError(
            "--compile-mode whole runs the whole model's forward; a --pp stage runs its own: use it without --pp"
        )


CHUNKED_LOSS_REFUSES = {
    "logit_scale": "scales its logits (Cohere)",
    "logits_scaling": "scales its logits (Granite)",
    "output_router_logits": "adds its router's load-balancing loss (output_router_logits)",
}
"""Config facts whose model's forward does more between its LM head and its loss than the chunked loss does (it
does Gemma 2's ``final_logit_softcapping``)."""


def check_chunked_loss(spec: ModelSpec, *, loss: Loss) -> None:
    """``--loss chunked`` on a model whose forward it reproduces: its head, soft-capping and HF's loss."""
    if loss != "chunked":
        return
    for fact, what in CHUNKED_LOSS_REFUSES.items():
        if spec.facts.config_dict.get(fact) not in (None, False, 1, 1.0):
            raise UsageError(f"--loss chunked: {spec.name} {what}, which the chunked loss does not: use --loss plain")


def fixed_recompute(cfg: RunConfig) -> Plan | None:
    """The per-layer plan of ``cfg``'s ``--recompute`` when it is fixed; None for ``none`` and ``auto``."""
    value = parse_recompute(cfg.optim.recompute)
    return None if value in ("none", "auto") else fixed_plan(value, cfg.model.layers)


def cpu_threads(threads: int | None, *, processes: int) -> int:
    """``--threads``, else ``$OMP_NUM_THREADS``, else the cores this process may run on shared among the node's
    ``processes``."""
    if threads is not None:
        return threads
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        if int(given) > (cores := os.cpu_count() or 1):
            raise UsageError(f"OMP_NUM_THREADS={given}: this machine has {cores} logical CPUs; set at most {cores}")
        return int(given)
    return max(1, len(os.sched_getaffinity(0)) // processes)


def resolve_train(
    train: TrainConfig, *, model: ModelSpec, device_type: DeviceType, seq_flag: str = "--seq-len", processes: int = 1
) -> TrainConfig:
    """Fill in the defaults that depend on the model and device (``auto`` becomes the device type, so records
    say which ran; on a CPU, the threads of each of the node's ``processes``); check the sequence length
    (``seq_flag``) fits."""
    seq_len = model.seq_len(train.seq_len, flag=seq_flag)
    attn = model.attention(train.attn_implementation)
    if attn == "flash_attention_2":
        if device_type != "cuda":
            raise UsageError("--attn-implementation flash_attention_2 runs on CUDA only: use sdpa or eager on a CPU")
        if importlib.util.find_spec("flash_attn") is None:
            raise UsageError("--attn-implementation flash_attention_2 needs the flash-attn package (or use sdpa)")
    precision = train.precision or ("bf16-mixed" if device_type == "cuda" else "fp32")
    threads = cpu_threads(train.threads, processes=processes) if device_type == "cpu" else train.threads
    return dataclasses.replace(
        train, seq_len=seq_len, precision=precision, device=device_type, attn_implementation=attn, threads=threads
    )


def _warmup(args: argparse.Namespace, *, device_type: DeviceType) -> int:
    """``--warmup``, or its default: DeepCompile (0.19) adds its prefetch passes at DeepSpeed's global step 5
    and compiles the model again (``deepspeed/compile/init_z3.py``), so steps 0-5 are its warm-up."""
    deepcompile = args.compile_mode == "deepspeed" and device_type == "cuda"
    if args.warmup is None:
        return DEEPCOMPILE_WARMUP if deepcompile else TrainConfig.warmup
    if deepcompile and args.warmup < DEEPCOMPILE_WARMUP and os.environ.get("RANK", "0") == "0":
        say(f"note: DeepCompile compiles again at step 5; --warmup {DEEPCOMPILE_WARMUP} keeps that out of the timing")
    return args.warmup


def _compile_mode(args: argparse.Namespace) -> CompileMode:
    """``--compile-mode``, with ``--compile`` as ``regional``."""
    if args.compile and args.compile_mode not in (None, "regional"):
        raise UsageError(f"--compile is --compile-mode regional: it contradicts --compile-mode {args.compile_mode}")
    return "regional" if args.compile else args.compile_mode or OptimizationConfig.compile_mode


@dataclass(frozen=True)
class Flags:
    """A command's flags once checked: the engine, the ``--deepspeed-config`` as loaded and the flags as the run
    takes them (a DeepSpeed config's numbers for flags left out, ``--compile`` as ``--compile-mode regional``)."""

    engine: EngineName
    deepspeed_user: dict
    args: argparse.Namespace


def launch_world(launch: LaunchConfig) -> int:
    """The ranks a benchmark runs on: a user's torchrun's, else ``--nproc-per-node`` × ``--nnodes``."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else launch.nproc_per_node * launch.nnodes


def check_flags(args: argparse.Namespace, *, world: int | None = None) -> Flags:
    """Every check of a command's parsed flags that needs neither the model nor torch, so that a bad value is
    refused at once (``args`` is left as it is); ``world``: the ranks planned for (default: the launch's)."""
    engine = engine_from_args(args)
    options.check_engine_flags(
        engine,
        zero_stage=args.zero_stage,
        reshard_after_forward=args.reshard_after_forward,
        tp=args.tp,
        dp_replicate=args.dp_replicate,
        pp=getattr(args, "pp", 1),
    )
    user, taken = deepspeed_config.from_args(args, engine=engine)
    resolved = argparse.Namespace(**vars(args))
    resolved.micro_batch, resolved.grad_accum, resolved.zero_stage = (
        taken.micro_batch,
        taken.grad_accum,
        taken.zero_stage,
    )
    given = argparse.Namespace(**vars(resolved))
    if hasattr(args, "compile"):
        resolved.compile_mode = given.compile_mode = _compile_mode(args)
        given.warmup = TrainConfig.warmup if args.warmup is None else args.warmup  # its default waits for the device
    train, launch = options.from_args(TrainConfig, given), options.from_args(LaunchConfig, given)
    engine_opts, optim = options.from_args(EngineConfig, given), options.from_args(OptimizationConfig, given)
    options.from_args(ExplainConfig, given)
    model = split_model_arg(args.model)[1] if args.model else "MODEL"
    check_together(engine, train, optim, model=model)
    options.check_loss(optim.loss, tp=engine_opts.tp)
    options.check_pipeline(engine_opts)  # --pp's flags together (each alone is a valid value)
    world = world if world is not None else launch_world(launch)
    MeshShape.of(world=world, tp=engine_opts.tp, dp_replicate=engine_opts.dp_replicate, pp=engine_opts.pp)
    resolved.grad_accum = pipeline_accumulation(engine_opts, grad_accum=train.grad_accum)
    return Flags(engine=engine, deepspeed_user=user, args=resolved)


def pipeline_accumulation(opts: EngineConfig, *, grad_accum: int) -> int:
    """Under ``--pp`` the pipeline's micro-batches are the step's accumulation: ``--pp-microbatches``, else
    ``--grad-accum`` when given, else ``--pp`` (refused when the two flags disagree); without it ``grad_accum``."""
    if opts.pp == 1:
        return grad_accum
    m = opts.pp_microbatches
    if m is not None and grad_accum not in (1, m):
        raise UsageError(
            f"--grad-accum {grad_accum} and --pp-microbatches {m}: under --pp the pipeline's micro-batches are the"
            " accumulation; give one of them"
        )
    m = m or (grad_accum if grad_accum > 1 else opts.pp)
    options.check_microbatches(opts, m)
    return m


def from_args(
    args: argparse.Namespace, argv: list[str], *, device_type: DeviceType | None = None, flags: Flags | None = None
) -> RunConfig:
    """The ``RunConfig`` of a command's parsed flags (those it has: ``plan`` has no launch or compile flags) on
    ``device_type`` (None: ``--device``, resolved); ``flags``: ``check_flags``' answer where the command asked it
    first. The model is read last, after every flag that needs none."""
    from ljperf.distributed.runtime import resolve_device_type  # torch: after the flags are checked

    flags = flags or check_flags(args)
    engine, user, args = flags.engine, flags.deepspeed_user, flags.args
    device_type = device_type or resolve_device_type(args.device)
    if hasattr(args, "compile"):
        args.warmup = _warmup(args, device_type=device_type)
    train, launch = options.from_args(TrainConfig, args), options.from_args(LaunchConfig, args)
    engine_opts, optim = options.from_args(EngineConfig, args), options.from_args(OptimizationConfig, args)
    explain = options.from_args(ExplainConfig, args)
    spec = spec_from_args(args)  # after the flags: reading the model takes seconds
    processes = local_world_size() if under_torchrun() else launch.nproc_per_node
    train = resolve_train(train, model=spec, device_type=device_type, processes=processes)
    return RunConfig(
        engine=engine,
        model=spec,
        train=train,
        launch=launch,
        engine_opts=engine_opts,
        optim=optim,
        explain=explain,
        deepspeed_user=user,
        output=getattr(args, "output", None),
        argv=argv,
    )
