"""The optimizations every engine applies to the model before it wraps or shards it, in torchtitan's fixed
order: tensor parallel → activation checkpointing → the chunked loss → compile → (the engine) shard or wrap.

Run: ``model = apply_optimizations(model, run, tp_mesh=...)`` in an engine's ``setup``, once, on the HF model
(meta or materialized).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedModel

from ljperf.checkpoint.policies import PerLayerRecompute
from ljperf.compile.regional import compile_model, zero3_gather_per_block
from ljperf.models.loss import use_chunked_loss
from ljperf.models.tensor_parallel import parallelize
from ljperf.run.context import RunContext


def apply_optimizations(
    model: torch.nn.Module, run: RunContext, *, tp_mesh: DeviceMesh | None = None, layers: range | None = None
) -> torch.nn.Module:
    """Apply the run's optimizations in order; returns the model to wrap or shard. ``tp_mesh``: the mesh dimension
    tensor parallel splits over (FSDP2 with ``--tp``); ``layers``: the decoder layers of the whole model that
    ``model`` holds (a pipeline stage's, split first by ``engines.pipeline.apply_pp``)."""
    apply_tp(model, tp_mesh)
    apply_checkpoint(model, run, layers=layers)
    apply_loss(model, run)
    return apply_compile(model, run)


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh | None) -> None:
    """Split each block's projections, the embedding and the LM head over ``tp_mesh`` (none: no tensor parallel);
    checkpointing and compile then wrap the split blocks."""
    if tp_mesh is not None:
        if not isinstance(model, PreTrainedModel):  # the plan names an HF causal LM's modules
            raise TypeError(f"tensor parallel splits an HF causal LM, not a {type(model).__name__}")
        parallelize(model, tp_mesh)


def apply_checkpoint(model: torch.nn.Module, run: RunContext, *, layers: range | None = None) -> None:
    """The run's recompute plan (``run.plan``, resolved before the engine is built) on the decoder layers (a
    pipeline stage: its ``layers``' modes)."""
    if run.plan is not None:
        PerLayerRecompute(run.plan if layers is None else run.plan[layers.start : layers.stop]).apply(model)


def apply_loss(model: torch.nn.Module, run: RunContext) -> None:
    """``--loss chunked``: the model's forward runs the LM head and loss in chunks (``models.loss``); before
    compile, which compiles each chunk's loss as its "loss" region (``whole``: the chunked forward)."""
    if run.optim.loss == "chunked":
        use_chunked_loss(model)


def apply_compile(model: torch.nn.Module, run: RunContext) -> torch.nn.Module:
    """Regional or whole-model compile, after checkpointing and before the engine wraps; under ZeRO-3 each block
    is first made one unit of parameter gathering. ``--compile-mode deepspeed`` is the DeepSpeed engine's own,
    once it is initialized."""
    mode = run.optim.compile_mode
    if mode != "off" and run.engine == "deepspeed" and run.engine_opts.zero_stage == 3:
        zero3_gather_per_block(model)
    if mode != "deepspeed":
        compile_model(model, mode, verbose=run.is_main)
    return model
