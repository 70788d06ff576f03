"""Engine ``deepspeed``: DeepSpeed ZeRO stage 1, 2 or 3 (``--zero-stage``, default 3) through ``deepspeed.initialize``.

Run: ``ljperf benchmark --model deepspeed/llama-tiny --nproc-per-node 2`` (CPU, gloo) or
``ljperf benchmark --model deepspeed/llama3-8b --nproc-per-node 8 [--deepspeed-config my_ds.json]``.
The DeepSpeed config is ljperf's own or the user's merged with it (``ljperf.deepspeed_config``); the
resolved one is recorded. The weights start equal to the torch engine's, and the optimizer is
``torch.optim.AdamW`` with the same hyper-parameters, so losses match the other engines.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ljperf.compile.regional import compile_deepspeed_engine
from ljperf.core import deepspeed_config
from ljperf.core.console import warn
from ljperf.core.errors import interruption, one_line
from ljperf.core.phases import phase
from ljperf.core.records import without_secrets
from ljperf.distributed import memory
from ljperf.engines import Engine, EngineRecord
from ljperf.engines.common import adamw, decoder_blocks, parameter_names
from ljperf.engines.parallelize import apply_optimizations
from ljperf.models.build import init_value, materialize, replace_parameters
from ljperf.models.step import causal_lm_loss
from ljperf.run.context import RunContext

if TYPE_CHECKING:
    import deepspeed


@dataclass(frozen=True, kw_only=True)
class DeepSpeedRecord(EngineRecord):
    zero_stage: int
    config_source: str
    """``ljperf``, or the ``--deepspeed-config`` file merged with ljperf's options."""
    deepspeed_config: dict[str, Any]
    """The resolved config, secrets left out."""
    warnings: list[str]
    """What the config lint found (also printed)."""


class DeepSpeedEngine:
    """A DeepSpeed engine over all ranks; ZeRO partitions optimizer states (1), gradients (2) and parameters (3)."""

    def __init__(self, run: RunContext):
        self.run = run
        self.config, self.warnings = resolved_config(run)
        self.model: deepspeed.DeepSpeedEngine
        self.module: torch.nn.Module
        """The model inside ``self.model`` (DeepSpeed's ``engine.module``)."""
        self.optimizer: Any = None

    def setup(self, model: torch.nn.Module) -> None:
        run = self.run
        if not run.is_main:  # said once, by rank 0; a filter outlasts the level DeepSpeed's import sets
            logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to" not in str(record.msg))
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        # DeepSpeed's comm layer calls these on every collective; the warning says nothing about the run.
        warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
        if run.is_main:
            for finding in self.warnings:
                warn(f"{finding.message}; fix: {finding.fix}")
        _without_shared_memory_comm_op()
        # ZeRO-3's Init reads torchrun's LOCAL_RANK; a one-process run started without torchrun has none.
        os.environ.setdefault("LOCAL_RANK", str(run.process.local_rank))
        deepspeed.init_distributed(dist_backend="gloo" if run.device.type == "cpu" else "nccl")
        if self.config["zero_optimization"]["stage"] == 3:
            names = parameter_names(model)
            model = apply_optimizations(model, run)
            _materialize_partitioned(model, names, config=self.config, run=run)
        else:
            model = materialize(model, device=run.device.torch_device, seed=run.train.seed)
            model = apply_optimizations(model, run)
        if self.config.get("compile", {}).get("deepcompile") and (reason := _deepcompile_unavailable()):
            # engine.compile() would find out after it had taken ZeRO's own gradient buckets away (DeepSpeed
            # 0.19's init_z3 clears them, then builds the op): the eager fallback then fails on its first backward.
            self.config["compile"]["deepcompile"] = False
            if run.is_main:
                warn(f"DeepCompile unavailable, engine.compile() runs without it: {reason}")
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),  # type: ignore[bad-argument-type] (typed as a Module: it takes these)
            config=self.config,
        )
        if run.optim.compile_mode == "deepspeed":
            compile_deepspeed_engine(engine, verbose=run.is_main)
        self.model, self.module, self.optimizer = engine, model, optimizer

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        # DeepSpeed divides each micro-step's loss by gradient_accumulation_steps and steps at the boundary.
        total = torch.zeros((), device=self.run.device.torch_device)
        for tokens in micro_batches:
            with phase("forward"):
                loss = causal_lm_loss(self.model, tokens)
            with phase("backward"):
                self.model.backward(loss)
            with phase("optimizer"):  # at the accumulation boundary; before it, DeepSpeed's bookkeeping only
                self.model.step()
            total += loss.detach().float() / len(micro_batches)
        return total

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor DeepSpeed keeps between steps on this rank: parameters (ZeRO-3: their partitions),
        gradients, the flat fp32 partitions and the optimizer states (``optimizer.state`` misses the flat ones)."""
        found = memory.reachable_tensors(self.optimizer)
        for param in self.module.parameters():
            found += [t for t in (param, getattr(param, "ds_tensor", None), param.grad) if t is not None]
        return found + list(self.module.buffers())

    def local_params(self) -> int:
        """Parameter elements this rank holds (ZeRO-3: its partitions, plus the small persistent parameters)."""
        total = 0
        for param in self.module.parameters():
            part = getattr(param, "ds_tensor", None)
            total += part.numel() if part is not None else param.numel()
        return total

    def describe(self) -> DeepSpeedRecord:
        return DeepSpeedRecord(
            name="deepspeed",
            local_params=self.local_params(),
            optimizer="torch.optim.AdamW (DeepSpeed torch_adam)",
            zero_stage=self.config["zero_optimization"]["stage"],
            config_source=self.run.engine_opts.deepspeed_config or "ljperf",
            deepspeed_config=without_secrets(self.config),
            warnings=[f"{f.message}; fix: {f.fix}" for f in self.warnings],
        )


def _materialize_partitioned(
    model: torch.nn.Module, names: dict[tuple[int, str], str], *, config: dict, run: RunContext
) -> None:
    """ZeRO-3 from the meta device: materialise one decoder block at a time (then the embeddings, norm and
    head) with the torch engine's initial values, and partition it at once (``deepspeed.zero.Init(module=)``),
    so a rank never holds more than one block in full."""
    import deepspeed

    device = run.device.torch_device
    dtype = torch.bfloat16 if config["bf16"]["enabled"] else torch.float32
    std = float(getattr(model.config, "initializer_range", 0.02))

    def make(module: torch.nn.Module, key: str, param: torch.nn.Parameter) -> torch.nn.Parameter:
        value = init_value(names[(id(module), key)], param.shape, std=std, seed=run.train.seed, device=device)
        return torch.nn.Parameter(value.to(dtype), requires_grad=param.requires_grad)

    # The blocks first; then the whole model, whose blocks are no longer on the meta device.
    for piece in [*decoder_blocks(model), model]:
        with torch.no_grad():
            replace_parameters(piece, make, only_meta=True)
            for module in piece.modules():
                for key, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[key] = buf.to(device)
        deepspeed.zero.Init(module=piece, config_dict_or_path=config, dtype=dtype)


def resolved_config(run: RunContext) -> tuple[dict, list[deepspeed_config.Finding]]:
    """ljperf's DeepSpeed config, or ``--deepspeed-config`` merged into it; ``"auto"`` values resolved."""
    path = run.engine_opts.deepspeed_config
    defaults = adamw([torch.zeros(1)], run=run).defaults
    opts = deepspeed_config.Options(
        micro_batch=run.train.micro_batch,
        grad_accum=run.train.grad_accum,
        world=run.world,
        bf16=run.bf16,
        zero_stage=run.engine_opts.zero_stage,
        lr=run.train.lr,
        betas=tuple(defaults["betas"]),
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        hidden=run.model.hidden,
    )
    source = f"--deepspeed-config {path}" if path else "ljperf's DeepSpeed config"
    config, findings = deepspeed_config.resolve(deepspeed_config.merge(run.deepspeed_user), opts, source=source)
    if run.optim.compile_mode in ("regional", "whole") and run.engine_opts.zero_stage == 3:
        # zero.Init swaps F.linear for DeepSpeed's memory-efficient linear, which reads each weight's ds_id:
        # torch 2.11's dynamo guards on it, one recompile per block (2.13's does not). A compiled block saves
        # its weights, not views of them, so plain F.linear keeps the same peak. A user's value stays.
        config["zero_optimization"].setdefault("memory_efficient_linear", False)
    if run.optim.compile_mode == "deepspeed" and run.device.type == "cuda":
        # DeepCompile (CUDA only): ZeRO as graph passes instead of hooks; a user's "deepcompile": false stays
        config["compile"] = {"deepcompile": True, **config.get("compile", {})}
    return config, findings


def _deepcompile_unavailable() -> str | None:
    """Why DeepSpeed's DeepCompile op cannot be loaded (built on first use), or None once it is."""
    from deepspeed.compile.util import get_deepcompile_handle

    try:
        get_deepcompile_handle()
    except Exception as exc:
        if (stop := interruption(exc)) is not None:
            raise stop from None
        return one_line(exc)
    return None


def _without_shared_memory_comm_op() -> None:
    """DeepSpeed's CPU accelerator JIT-builds a shared-memory comm op at ``init_distributed`` (``c++`` on its
    sources: about 60 CPU-s, 20-30 s, on a machine's first run, and again in each new environment). It serves
    ``inference_all_reduce`` (AutoTP inference) alone, which training never calls: marked unavailable, DeepSpeed
    skips the build and trains on gloo as before. (DeepSpeed keeps the probed dict in its module, edits included.)"""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def create(run: RunContext) -> Engine:
    return DeepSpeedEngine(run)
