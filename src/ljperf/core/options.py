"""Option groups as keyword-only dataclasses; the CLI flags are generated from them.

Every field carries its ``--help`` text in ``metadata["help"]``; validation lives in ``__post_init__``
and raises ``UsageError`` (exit 2, one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ljperf.core.choices import (
    Attention,
    CompileMode,
    Device,
    DeviceType,
    EngineName,
    Loss,
    OptimizerImpl,
    PipelineSchedule,
    Precision,
    check_choice,
    values_of,
)
from ljperf.core.errors import UsageError
from ljperf.core.plans import parse_recompute
from ljperf.core.units import parse_memory

LOSS_CHUNKS = 16
"""Chunks ``--loss chunked`` splits a micro-batch's tokens into: one chunk's logits are 1/16 of the whole (Llama 3.2
1B at 8 × 2048 tokens: 1024 tokens a chunk, 250 MiB of bf16 logits of 4 GiB). A fixed count, not a fixed size, keeps
the forecast exact: its traced shapes (multiples of 32 tokens) split evenly, so each chunk's tensors are polynomials in
batch and sequence as every other traced tensor is."""
DEEPCOMPILE_WARMUP = 6
"""Warm-up steps of DeepCompile: DeepSpeed (0.19) adds its prefetch passes at global step 5 and compiles the model
again (``deepspeed/compile/init_z3.py``), so its steady state starts at step 6."""


def opt(
    default: Any,
    help: str,
    *,
    deepspeed: str | None = None,
    values: Mapping[str, str] | None = None,
    **argparse_kwargs: Any,
) -> Any:
    """A dataclass field that is also a CLI flag (``--field-name``); ``deepspeed``: the key of a DeepSpeed config
    that holds the same number, which stands in for the flag left out (``deepspeed_config.settings``). Its
    metavar is ``N`` for a number and ``{a,b}`` for a ``Literal`` type; give one for other text (``SIZE``,
    ``FILE``, ``PATH``). A ``Literal`` field's help lists the values a command takes where it says ``{values}``,
    each with its description in ``values`` (a value without one: its name alone)."""
    metadata = {"help": help, "deepspeed": deepspeed, "values": dict(values or {}), **argparse_kwargs}
    return field(default=default, metadata=metadata)


def one_of(values: tuple[str, ...]) -> str:
    """The metavar of a text flag with a fixed set of values, as argparse shows its ``choices``."""
    return "{" + ",".join(values) + "}"


def listing(values: tuple[str, ...], descriptions: Mapping[str, str]) -> str:
    """``values`` as a help text lists them: ``a, b (what b is) or c``."""
    named = [f"{v} ({descriptions[v]})" if descriptions.get(v) else v for v in values]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"


def default_adamw_impl(device_type: DeviceType) -> OptimizerImpl:
    """The AdamW implementation a run gets when none is asked for: fused on CUDA (one kernel per step, as
    torchtitan defaults to), torch's own pick on a CPU (the loop)."""
    return "fused" if device_type == "cuda" else "single"


LARGEST = 2**31 - 1
"""The largest count or number of seconds a flag takes (kernels index with 32-bit ints; a week is 604800 s)."""


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: torch keeps a learning rate or a peak TFLOPS in one, and a larger value overflows."""


def positive(name: str, value: int | float | None, *, bounded: bool = True) -> None:
    """``value`` (None: unset) must be a number in (0, LARGEST] (a count or seconds), or with ``bounded=False``
    in (0, FLOAT32_MAX] (a learning rate): nan, inf and 1e20 fail later, deep in torch or the C library."""
    if value is None:
        return
    flag, got = f"--{name.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else value
    if bounded and not 0 < value <= LARGEST:
        raise UsageError(f"{flag} must be larger than zero and at most {LARGEST} (got {got})")
    if not bounded and not 0 < value <= FLOAT32_MAX:
        raise UsageError(f"{flag} must be larger than zero and fit a float32, at most {FLOAT32_MAX:.3g} (got {got})")


def check_threads(threads: int | None) -> None:
    """At most one thread per logical CPU of this machine: more only share the cores, and the OpenMP runtime
    cannot start tens of thousands (``--threads 100000`` ended in libgomp's "Thread creation failed" and a
    segmentation fault, with nothing from ljperf)."""
    cores = os.cpu_count() or 1
    if threads is not None and threads > cores:
        raise UsageError(f"--threads {threads}: this machine has {cores} logical CPUs; give at most {cores}")


def check_zero_stage(stage: int) -> None:
    if stage not in (1, 2, 3):
        raise UsageError(f"--zero-stage {stage}: choose 1, 2 or 3")


def not_negative(name: str, value: int) -> None:
    """``value`` must be a count in [0, LARGEST] (a warm-up of 10^12 steps would run for ever)."""
    if not 0 <= value <= LARGEST:
        raise UsageError(f"--{name.replace('_', '-')} must be zero or more and at most {LARGEST} (got {value})")


@dataclass(kw_only=True)
class LaunchConfig:
    """How many processes to start and where (passed through to torchrun)."""

    TITLE: ClassVar[str] = "launch"

    nproc_per_node: int = opt(1, "processes on this node; >1 starts them through torchrun's launcher")
    nnodes: int = opt(1, "number of nodes (multi-node: run the same command on every node)")
    node_rank: int = opt(0, "rank of this node, 0..nnodes-1")
    rdzv_endpoint: str | None = opt(
        None, "the c10d rendezvous of a multi-node run (the same on every node)", metavar="HOST:PORT"
    )
    collective_timeout: float = opt(
        600.0,
        "seconds a collective may wait before the run is failed (a hung rank), and nodes for each other to join",
        deprecated="--timeout",
    )

    def __post_init__(self) -> None:
        positive("nproc_per_node", self.nproc_per_node)
        positive("nnodes", self.nnodes)
        positive("collective_timeout", self.collective_timeout)
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        if self.rdzv_endpoint is not None:
            check_endpoint(self.rdzv_endpoint)

    @property
    def distributed(self) -> bool:
        return self.nproc_per_node * self.nnodes > 1


# HOST or HOST:PORT as torchrun reads it; an IPv6 address in brackets.
_ENDPOINT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+):(\d{1,5})")


def check_endpoint(text: str) -> None:
    """A rendezvous endpoint torchrun can read: a malformed one would hang every node at the rendezvous."""
    match = _ENDPOINT.fullmatch(text)
    if not match or not 1 <= int(match[1]) <= 65535:
        raise UsageError(f"--rdzv-endpoint {text!r}: write HOST:PORT with a port in 1..65535 (e.g. node0:29500)")


@dataclass(kw_only=True)
class TrainConfig:
    """What one benchmark run trains: batch, sequence, precision, steps."""

    TITLE: ClassVar[str] = "training"

    micro_batch: int = opt(1, "sequences per device per micro-step", deepspeed="train_micro_batch_size_per_gpu")
    seq_len: int | None = opt(None, "tokens per sequence (default: min(4096, the model's max positions))")
    grad_accum: int = opt(
        1, "micro-steps per optimizer step (gradient accumulation)", deepspeed="gradient_accumulation_steps"
    )
    steps: int = opt(20, "measured optimizer steps")
    warmup: int = opt(
        3,
        "unmeasured steps before timing (compile, allocator, optimizer-state creation); 6 by default under"
        " --compile-mode deepspeed on CUDA, whose DeepCompile compiles again at DeepSpeed's step 5",
    )
    precision: Precision | None = opt(
        None,
        "{values} (default: bf16-mixed on GPU, fp32 on CPU)",
        values={
            "bf16-mixed": "fp32 master weights, bf16 autocast",
            "bf16": "bf16 weights, gradients and AdamW states under bf16 autocast, as a model loaded in bfloat16"
            " trains; torch and fsdp engines",
        },
    )
    device: Device = opt("auto", "{values}", values={"auto": "cuda when available"})
    lr: float = opt(3e-4, "AdamW learning rate")
    seed: int = opt(0, "seed of the weights and of the synthetic token stream, 0..2^63-1")
    attn_implementation: Attention | None = opt(
        None,
        "transformers attention: {values} (default: sdpa, or eager for a model without SDPA, such as Gemma 2, as"
        " transformers picks)",
        values={"flash_attention_2": "CUDA and the flash-attn package"},
    )
    peak_tflops: float | None = opt(None, "peak TFLOPS per device for MFU (default: the known-device table)")
    threads: int | None = opt(
        None,
        "CPU threads per process (torch.set_num_threads; fix it to compare CPU runs) (default: $OMP_NUM_THREADS,"
        " else this machine's cores shared among its processes)",
    )

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "grad_accum", "steps", "threads"):
            positive(name, getattr(self, name))
        positive("lr", self.lr, bounded=False)
        positive("peak_tflops", self.peak_tflops, bounded=False)
        not_negative("warmup", self.warmup)
        check_threads(self.threads)
        if self.seq_len == 1:  # a sequence of one token has no next token to predict: the loss is nan
            raise UsageError("--seq-len must be 2 or more: the loss predicts each token from the ones before it")
        if not 0 <= self.seed < 2**63:  # torch's generators take a 64-bit seed
            raise UsageError(f"--seed must be in 0..2^63-1 (got {self.seed})")
        check_values(self)

    @property
    def resolved_seq_len(self) -> int:
        """``seq_len`` once ``run.config.resolve_train`` has filled in its default, the model's."""
        if self.seq_len is None:
            raise ValueError("the sequence length is unset: run.config.resolve_train fills it in")
        return self.seq_len

    @property
    def resolved_device(self) -> DeviceType:
        """``device`` once ``run.config.resolve_train`` has made auto the device found."""
        if self.device == "auto":
            raise ValueError("--device auto is unresolved: run.config.resolve_train makes it the device found")
        return self.device


@dataclass(kw_only=True)
class EngineConfig:
    """Engine options (FSDP2 and DeepSpeed ZeRO); each is refused by the engines it is not for."""

    TITLE: ClassVar[str] = "engine"

    zero_stage: int = opt(3, "DeepSpeed ZeRO stage: 1, 2 or 3", deepspeed="zero_optimization.stage")
    deepspeed_config: str | None = opt(
        None, "a DeepSpeed JSON config to validate and merge with ljperf's options", metavar="FILE"
    )
    reshard_after_forward: bool = opt(True, "FSDP2: free gathered parameters after forward (re-gather in backward)")
    tp: int = opt(
        1,
        "fsdp engine: tensor-parallel degree, the ranks (of a node) that split each block's projections and share its"
        " sequences (Llama, Qwen 2/3, Mistral; heads and K/V heads must divide by N)",
        metavar="N",
    )
    dp_replicate: int = opt(
        1,
        "fsdp engine: HSDP replicas; FSDP2 shards over world / (N × --tp × --pp) ranks and replicates that N times",
        metavar="N",
    )
    pp: int = opt(
        1,
        "fsdp engine: pipeline stages, the outermost mesh dimension; each stage holds a run of decoder layers (the"
        " embedding on the first, the norm, LM head and loss on the last; Llama, Qwen 2/3, Mistral)",
        metavar="N",
    )
    pp_schedule: PipelineSchedule = opt(
        "1f1b",
        "--pp's schedule (torch.distributed.pipelining): {values}",
        values={
            "1f1b": "one forward, one backward: at most --pp micro-batches in flight",
            "gpipe": "all forwards, then all backwards: every micro-batch in flight",
            "interleaved-1f1b": "1F1B over --pp-stages-per-rank stages a rank, a smaller bubble",
        },
    )
    pp_microbatches: int | None = opt(
        None,
        "--pp's micro-batches a step, each --micro-batch sequences (they are the step's gradient accumulation)"
        " (default: --grad-accum when given, else --pp)",
        metavar="N",
    )
    pp_stages_per_rank: int = opt(1, "--pp's stages a rank holds (interleaved-1f1b: 2 or more)")
    pp_split: str | None = opt(
        None,
        "--pp's decoder layers per stage, e.g. 10,12,10 (default: balanced by the forecast's per-layer memory)",
        metavar="N[,N]",
    )

    def __post_init__(self) -> None:
        check_zero_stage(self.zero_stage)
        for name in ("tp", "dp_replicate", "pp", "pp_microbatches", "pp_stages_per_rank"):
            positive(name, getattr(self, name))
        check_values(self)

    @property
    def stages(self) -> int:
        """Pipeline stages in all: ``--pp`` × ``--pp-stages-per-rank``."""
        return self.pp * self.pp_stages_per_rank


def check_pipeline(opts: EngineConfig) -> None:
    """``--pp``'s options agree: its flags only with it, interleaving with more than one stage a rank (and only
    then), 1F1B with at least as many micro-batches as stages in flight."""
    given = [f for f in ("pp_microbatches", "pp_split") if getattr(opts, f) is not None]
    if opts.pp == 1 and (given or opts.pp_stages_per_rank != 1 or opts.pp_schedule != "1f1b"):
        named = given[0] if given else "pp_stages_per_rank" if opts.pp_stages_per_rank != 1 else "pp_schedule"
        raise UsageError(f"--{named.replace('_', '-')} is an option of --pp N (pipeline stages): add --pp 2 or more")
    interleaved = opts.pp_schedule == "interleaved-1f1b"
    if interleaved != (opts.pp_stages_per_rank > 1):
        raise UsageError(
            "--pp-schedule interleaved-1f1b runs --pp-stages-per-rank 2 or more stages a rank, and only it does:"
            f" got {opts.pp_schedule} with {opts.pp_stages_per_rank} a rank"
        )
    if opts.pp_microbatches is not None:
        check_microbatches(opts, opts.pp_microbatches)


def check_microbatches(opts: EngineConfig, m: int) -> None:
    """``m`` pipeline micro-batches a step suit ``opts``' schedule: 1F1B keeps ``--pp`` in flight, interleaving
    takes a multiple of ``--pp``."""
    if opts.pp_schedule != "gpipe" and m < opts.pp:
        raise UsageError(
            f"{m} micro-batches a step (--pp-microbatches, or --grad-accum) are fewer than the {opts.pp} stages"
            f" {opts.pp_schedule} keeps in flight: give --pp-microbatches {opts.pp} or more, or --pp-schedule gpipe"
        )
    if opts.pp_schedule == "interleaved-1f1b" and m % opts.pp:
        raise UsageError(f"--pp-schedule interleaved-1f1b takes a multiple of --pp {opts.pp} micro-batches (got {m})")


@dataclass(kw_only=True)
class OptimizationConfig:
    """Optimizations, applied in a fixed order before the engine shards: checkpoint → loss → compile."""

    TITLE: ClassVar[str] = "optimizations"

    recompute: str = opt(
        "none",
        "activation recompute: none, full, selective (save matmuls, recompute the rest), K (the first K layers full), "
        "a mode per layer (full,selective,none,...) or auto (the fastest plan under the budget); "
        "CHECKPOINT_OPTIMIZATION=true makes auto the default",
        metavar="PLAN",
    )
    memory_budget: str | None = opt(
        None,
        "memory budget of --recompute auto, e.g. 70GiB (default: $LJPERF_MEMORY_BUDGET, else the device's)",
        metavar="SIZE",
    )
    compile_mode: CompileMode = opt(
        "off",
        "torch.compile: {values}",
        values={
            "regional": "each block and the loss",
            "whole": "the model",
            "deepspeed": "DeepSpeed's engine.compile(), with DeepCompile on CUDA; deepspeed engine only",
        },
    )
    optimizer_impl: OptimizerImpl | None = opt(
        None,
        "AdamW implementation: {values}; the forecast counts each one's temporaries (default: fused on CUDA, single"
        " on a CPU; the deepspeed engine's comes from its config)",
        values={"single": "a loop", "foreach": "kernels over lists of tensors", "fused": "one kernel"},
        deprecated="--optimizer",
    )
    loss: Loss = opt(
        "plain",
        "next-token loss: {values}",
        values={
            "plain": "HF's: the whole logits, tokens × vocabulary, live from the LM head to its backward",
            "chunked": f"the LM head and cross-entropy over {LOSS_CHUNKS} chunks of the tokens, each recomputed in"
            " backward: one chunk's logits live at a time; the same loss and gradients; not with --tp",
        },
    )

    def __post_init__(self) -> None:
        parse_recompute(self.recompute)
        if self.memory_budget and self.recompute != "auto":
            raise UsageError("--memory-budget is the budget of --recompute auto: add --recompute auto or drop it")
        check_values(self)
        if self.memory_budget is not None:
            parse_memory(self.memory_budget, what="--memory-budget")


PLOT_FORMATS = (".png", ".svg", ".pdf")
"""File types ``--plot`` writes (matplotlib picks the format by the suffix)."""


@dataclass(kw_only=True)
class ExplainConfig:
    """Why a step is slow or large: a profiler trace, and a picture of the memory forecast over the step."""

    TITLE: ClassVar[str] = "explanation"

    profile: str | None = opt(
        None,
        "after the timed steps, profile 2 more with torch.profiler and write DIR/rank{N}.trace.json.gz (Perfetto,"
        " chrome://tracing) per rank, on CUDA also DIR/rank{N}.memory.pickle (pytorch.org/memory_viz); the step"
        " time breakdown then comes from the trace",
        metavar="DIR",
    )
    profile_with_stack: bool = opt(False, "--profile records each op's Python stack too (larger trace, slower steps)")
    plot: str | None = opt(
        None,
        "draw the forecast memory over the step (stacked by component, block by block) with the budget and the"
        " device's capacity into FILE (.png, .svg or .pdf)",
        metavar="FILE",
    )

    def __post_init__(self) -> None:
        if self.profile_with_stack and self.profile is None:
            raise UsageError("--profile-with-stack is an option of --profile DIR: add it or drop this flag")
        if self.plot is not None and not self.plot.lower().endswith(PLOT_FORMATS):
            raise UsageError(f"--plot {self.plot!r}: give a file ending in {', '.join(PLOT_FORMATS)}")


def check_precision(precision: Precision | None, *, engine: EngineName) -> None:
    """``bf16`` (no fp32 master weights) is what the torch engine and FSDP2 can run; ZeRO keeps fp32 masters."""
    if precision == "bf16" and engine == "deepspeed":
        raise UsageError(
            "--precision bf16 (bf16 weights, no fp32 master copy) runs on the torch and fsdp engines; deepspeed"
            " keeps fp32 master weights: use bf16-mixed"
        )


def check_loss(loss: Loss, *, tp: int) -> None:
    """The chunked loss runs the LM head as one module; tensor parallel splits it over the vocabulary."""
    if loss == "chunked" and tp > 1:
        raise UsageError(f"--loss chunked runs the LM head whole; --tp {tp} splits it: use --loss plain with --tp")


def check_engine_flags(
    engine: EngineName,
    *,
    zero_stage: int | None,
    reshard_after_forward: bool,
    tp: int = 1,
    dp_replicate: int = 1,
    pp: int = 1,
) -> None:
    """Another engine's flag would be ignored, and the run or plan would not be the one asked for."""
    for flag, value in (("--tp", tp), ("--dp-replicate", dp_replicate), ("--pp", pp)):
        if value != 1 and engine != "fsdp":
            raise UsageError(f"{flag} builds a device mesh for the fsdp engine (FSDP2 on DTensor), not {engine}")
    if zero_stage is not None and engine != "deepspeed":
        like = " (FSDP2 shards like ZeRO-3)" if engine == "fsdp" else ""
        raise UsageError(f"--zero-stage is for the deepspeed engine, not {engine}{like}")
    if not reshard_after_forward and engine != "fsdp":
        raise UsageError(f"--no-reshard-after-forward is for the fsdp engine, not {engine}")


class OptionGroup(typing.Protocol):
    """An option dataclass: its flags' group is titled ``TITLE`` and described by its docstring's first line."""

    TITLE: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


Group = typing.TypeVar("Group", bound=OptionGroup)


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type[OptionGroup],
    *,
    only: tuple[str, ...] | None = None,
    defaults: Mapping[str, Any] | None = None,
    choices: Mapping[str, tuple[str, ...]] | None = None,
    deepspeed: bool = True,
) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls`` (``only``: these fields), typed from its annotation, to
    ``parser``'s group titled ``cls.TITLE`` (its docstring's first line describes it), or to ``parser`` when it is
    a group already. A command that runs a field otherwise narrows it here: its own ``defaults`` and ``choices`` by
    field name (a ``Literal`` field's metavar and help list the values the command takes); ``deepspeed``: the
    command takes ``--deepspeed-config``, whose numbers stand in for the flags left out. A field's ``deprecated``
    spelling still works, with a line saying the new one."""
    group = parser
    if isinstance(parser, argparse.ArgumentParser):
        group = parser.add_argument_group(cls.TITLE, (cls.__doc__ or cls.TITLE).splitlines()[0])
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or (only is not None and f.name not in only):
            continue
        default = (defaults or {}).get(f.name, f.default if f.default is not dataclasses.MISSING else None)
        extra = {k: v for k, v in f.metadata.items() if k not in ("help", "deepspeed", "deprecated", "values")}
        narrowed = (choices or {}).get(f.name)
        if narrowed is not None:
            extra["choices"] = narrowed
        allowed, text = _values_help(f, hints[f.name], narrowed)
        if allowed:
            extra["metavar"] = one_of(allowed)
        flag = _flag(f, hints[f.name], default, text=text, deepspeed=deepspeed)
        if "type" in flag:
            extra.setdefault("metavar", "N" if flag["type"] in (int, float) else "TEXT")
        new = "--" + f.name.replace("_", "-")
        group.add_argument(new, **flag, **extra)
        if old := f.metadata.get("deprecated"):
            group.add_argument(old, dest=f.name, type=flag["type"], action=Deprecated, new=new, help=argparse.SUPPRESS)


def _values_help(
    f: dataclasses.Field[Any], kind: object, narrowed: tuple[str, ...] | None
) -> tuple[tuple[str, ...], str]:
    """The values field ``f`` (of type ``kind``) takes in a command (``narrowed``: the command's own), and its help
    text listing them where it says ``{values}``; ``()`` and the help as written for a field of no closed set."""
    text, described, values = f.metadata["help"], f.metadata.get("values", {}), values_of(kind)
    allowed = values if narrowed is None else narrowed
    if not values:
        if narrowed is not None or described:
            raise TypeError(f"{f.name}: choices and value descriptions are for a field of a Literal type")
        return (), text
    if not set(allowed) <= set(values) or not set(described) <= set(values) or "{values}" not in text:
        raise TypeError(f"{f.name}: its choices, descriptions and help's {{values}} must be of {values}")
    return allowed, text.format(values=listing(allowed, described))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The resolved field annotations of ``cls`` (``get_type_hints`` evaluates them: once per class)."""
    return typing.get_type_hints(cls)


def check_values(group: object) -> None:
    """Refuse a field of the option dataclass ``group`` whose value is not one of its ``Literal`` type's (None is
    an optional field's "unset"); the message names the field's flag."""
    for name, kind in _hints(type(group)).items():
        value = getattr(group, name)
        if values_of(kind) and not (value is None and type(None) in typing.get_args(kind)):
            check_choice("--" + name.replace("_", "-"), value, kind)


class Deprecated(argparse.Action):
    """An old spelling of flag ``new``: it sets the same value, and ``deprecations(args)`` says which flag to
    write instead."""

    def __init__(self, *args: Any, new: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any):
        namespace.deprecated = [*getattr(namespace, "deprecated", []), (option, self.new)]
        setattr(namespace, self.dest, values)


def deprecations(args: argparse.Namespace) -> list[str]:
    """A line for each old flag spelling in ``args``."""
    return [f"{old} is deprecated here: write {new}" for old, new in getattr(args, "deprecated", [])]


def _flag(f: dataclasses.Field[Any], kind: Any, default: Any, *, text: str, deepspeed: bool) -> dict[str, Any]:
    """The ``default``, ``type`` (or boolean action) and ``help`` (``text``, ending in the default) of field ``f``'s
    flag. A field a DeepSpeed config can hold parses to None when left out, so the file's number can fill it."""
    if deepspeed and f.metadata.get("deepspeed"):
        text += f" (default: --deepspeed-config's {f.metadata['deepspeed']}, else {default})"
        return {"default": None, "type": _base_type(kind), "help": text}
    if kind is bool:
        text += f" (default: {'on' if default else 'off'})"
        return {"default": default, "action": argparse.BooleanOptionalAction, "help": text}
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    shown = "" if default is None or default is False else f" (default: {shown})"
    return {"default": default, "type": _base_type(kind), "help": text + shown}


def _base_type(kind: Any) -> type:
    """What argparse converts a flag's text with: the field's type, a ``Literal``'s values' (str), an optional
    field's other type."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return type(values_of(kind)[0]) if values_of(kind) else kind


def from_args(cls: type[Group], args: argparse.Namespace) -> Group:
    """Build the dataclass ``cls`` from the parsed flags (validation runs in ``__post_init__``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


@dataclass(kw_only=True)
class ClusterConfig:
    """Where the ranks sit and what links them: the step-time model's communication tiers (docs/speed.md)."""

    TITLE: ClassVar[str] = "cluster"

    gpus_per_node: int | None = opt(
        None, "ranks per node: a collective over a wider group runs on the network (default: 8 GPUs; a CPU: all)"
    )
    link_bandwidth: str | None = opt(
        None,
        "bus bandwidth per rank in GB/s within a node (NVLink), and between nodes after a comma (the network),"
        " e.g. 450,50 (default: the device's, calibrated or from its datasheet)",
        metavar="INTRA[,INTER]",
    )

    def __post_init__(self) -> None:
        positive("gpus_per_node", self.gpus_per_node)
        self.links_gbps()

    def links_gbps(self) -> tuple[float | None, float | None]:
        """(within a node, between nodes) in GB/s from ``--link-bandwidth``; None where not given."""
        if self.link_bandwidth is None:
            return None, None
        parts = [p.strip() for p in self.link_bandwidth.split(",")]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if not 1 <= len(values) <= 2 or not all(0 < v < 1e6 for v in values):
            raise UsageError(
                f"--link-bandwidth {self.link_bandwidth!r}: give GB/s within a node and, after a comma, between"
                " nodes, e.g. 450,50"
            )
        return values[0], values[1] if len(values) == 2 else None


@dataclass(kw_only=True)
class SearchConfig:
    """Every recipe that fits, ranked by predicted speed, without trials (``ljperf plan --search``)."""

    TITLE: ClassVar[str] = "search"

    search: bool = opt(
        False,
        "rank every recipe that fits by its predicted tokens/s per device: engine (DDP, FSDP2 with and without"
        " resharding, HSDP, ZeRO-1/2/3) × mesh × micro batch × accumulation × recompute × loss × AdamW"
        " implementation; a recipe flag given fixes its axis, and --model NAME without an engine searches the"
        " engines",
    )
    global_batch: int | None = opt(
        None,
        "--search: sequences per optimizer step over all data-parallel ranks, held fixed: micro batch ×"
        " accumulation × data-parallel ranks (default: accumulation as --grad-accum, any micro batch)",
    )
    top: int = opt(5, "--search: recipes the table shows (--json holds every one evaluated)")

    def __post_init__(self) -> None:
        positive("global_batch", self.global_batch)
        positive("top", self.top)
        if not self.search and (self.global_batch is not None or self.top != SearchConfig.top):
            raise UsageError("--global-batch and --top are options of --search: add --search or drop them")
