"""Engine ``fsdp``: PyTorch FSDP2 (``fully_shard``), each decoder block sharded, then the root.

Run: ``ljperf benchmark --model fsdp/llama-tiny --nproc-per-node 2`` (CPU, gloo) or
``ljperf benchmark --model fsdp/qwen2.5-7b --nproc-per-node 8`` (GPU, NCCL); on a device mesh,
``--nproc-per-node 8 --tp 2 --dp-replicate 2`` (2 HSDP replicas × 2 FSDP2 shards × 2 tensor-parallel ranks).
The model is sharded while its parameters are still on the meta device; then each rank allocates only its
shards and fills them from ``models.init_value``, so no rank ever holds the whole model and the weights
equal the torch engine's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from ljperf.core.mesh import MeshShape
from ljperf.core.phases import phase
from ljperf.distributed import memory
from ljperf.distributed.mesh import data_parallel_mesh, device_mesh
from ljperf.engines import Engine, EngineRecord
from ljperf.engines.common import adamw, decoder_blocks, parameter_names
from ljperf.engines.parallelize import apply_optimizations
from ljperf.engines.pipeline import Pipeline, apply_pp, pipeline_counts
from ljperf.models.build import cast_parameters, init_value, parameter_slots
from ljperf.models.step import accumulate
from ljperf.run.context import RunContext


@dataclass(frozen=True, kw_only=True)
class FSDPRecord(EngineRecord):
    wrapper: str
    """How the model is split: FSDP2 (or HSDP), tensor parallel, or both."""
    world: int
    mesh: dict[str, int]
    """The device mesh's shape (``config.mesh``)."""
    reshard_after_forward: bool
    mixed_precision: str | None
    """How bf16 is applied (None: fp32)."""
    pipeline: dict[str, object] | None = None
    """``--pp``: the schedule, micro-batches a step, stages a rank and in all, decoder layers per stage."""


class FSDPEngine:
    """FSDP2 over all ranks of the run: parameters, gradients and optimizer states sharded 1/world; on a mesh
    (``--tp``, ``--dp-replicate``) tensor parallel inside each group of ``tp`` ranks, FSDP2 (HSDP) across them."""

    def __init__(self, run: RunContext, *, mesh: DeviceMesh | None = None):
        self.run = run
        self.mesh = mesh
        """The device mesh to shard over (default: one dimension of every rank, or the run's mesh, made in
        ``setup``)."""
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.split: list[int] = []
        """``--pp``: decoder layers per stage."""
        self.pipeline: Pipeline | None = None

    def setup(self, model: torch.nn.Module) -> None:
        run, shape = self.run, self.run.mesh
        device = run.device.torch_device
        if self.mesh is None:
            self.mesh = (
                device_mesh(device.type, shape) if shape.beyond_fsdp else init_device_mesh(device.type, (run.world,))
            )
        if shape.pp > 1:  # first of the optimizations: each stage then as a whole model
            self.split = pipeline_counts(run)
            stages = apply_pp(model, run, counts=self.split)
            for stage in stages:  # the stage is FSDP2's root: its forward is what the schedule calls
                stage.module.tp_mesh = self.mesh["tp"] if shape.tp > 1 else None
                self._shard(stage.module.model, stage.names, layers=stage.layers, root=stage.module)
            self.model = torch.nn.ModuleList([stage.module for stage in stages])
            self.pipeline = Pipeline.of(stages, run, group=self.mesh["pp"].get_group())
        else:
            self.model = self._shard(model, parameter_names(model), layers=None)
        self.optimizer = adamw(self.model.parameters(), run=run)

    def _shard(
        self,
        model: torch.nn.Module,
        names: dict[tuple[int, str], str],
        *,
        layers: range | None,
        root: torch.nn.Module | None = None,
    ) -> torch.nn.Module:
        """``model`` (a whole model, or a pipeline stage's, of decoder ``layers``, whose ``root`` module runs it)
        optimized, sharded over the mesh's data-parallel ranks and materialized: this rank's shards of the torch
        engine's initial values."""
        run, shape, mesh = self.run, self.run.mesh, self.mesh
        assert mesh is not None
        model = apply_optimizations(model, run, tp_mesh=mesh["tp"] if shape.tp > 1 else None, layers=layers)
        dp_mesh = data_parallel_mesh(mesh, shape) if shape.beyond_fsdp else mesh
        options: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": run.engine_opts.reshard_after_forward}
        if run.weight_dtype != torch.float32:  # bf16 weights: gathered, computed and reduced in bf16
            model = cast_parameters(model, run.weight_dtype)
        elif run.bf16:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if not shape.tp_alone:
            for block in decoder_blocks(model):
                fully_shard(block, **options)
            fully_shard(model if root is None else root, **options)
        _materialize_shards(model, names, device=run.device.torch_device, seed=run.train.seed)
        return model

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What a forward and backward run in: under tensor parallel, cross-entropy on the vocabulary's shards."""
        return loss_parallel() if self.run.mesh.tp > 1 else contextlib.nullcontext()

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        shape = self.run.mesh
        with self.loss_context(), self.run.autocast() if shape.pp > 1 else contextlib.nullcontext():
            if self.pipeline is not None:
                loss = self.pipeline.step(micro_batches)
            else:
                loss = accumulate(self.model, micro_batches, autocast=self.run.autocast)
        if shape.tp_alone:
            _reduce_partial_grads(self.model)
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters, gradients and optimizer states are this rank's shards (``LiveTensorBytes`` counts a
        DTensor's local one); under ``--pp``, the stages' receive buffers too."""
        buffers = self.pipeline.receive_buffers() if self.pipeline is not None else []
        return memory.training_state_tensors(self.model, self.optimizer) + buffers

    def local_params(self) -> int:
        """Parameter elements of this rank's shards."""
        return sum(_local(p).numel() for p in self.model.parameters())

    def describe(self) -> FSDPRecord:
        shape = self.run.mesh
        return FSDPRecord(
            name="fsdp",
            local_params=self.local_params(),
            wrapper=_wrapper(shape),
            world=self.run.world,
            mesh=shape.record(),
            reshard_after_forward=self.run.engine_opts.reshard_after_forward,
            mixed_precision=_mixed_precision(self.run),
            optimizer="AdamW",
            pipeline=self._pipeline_record(),
        )

    def _pipeline_record(self) -> dict[str, object] | None:
        opts = self.run.engine_opts
        if opts.pp == 1:
            return None
        return {
            "schedule": opts.pp_schedule,
            "microbatches": self.run.train.grad_accum,
            "stages_per_rank": opts.pp_stages_per_rank,
            "stages": opts.stages,
            "split": self.split,
        }


def _wrapper(shape: MeshShape) -> str:
    fsdp = "FSDP2 fully_shard (each decoder block, then the root)"
    if shape.dp_replicate > 1:
        fsdp = f"HSDP: {fsdp} over {shape.dp_shard} ranks, replicated {shape.dp_replicate} times"
    if shape.tp == 1:
        return fsdp
    tp = f"tensor parallel over {shape.tp} ranks (parallelize_module, sequence and loss parallel)"
    return tp if shape.tp_alone else f"{tp}, then {fsdp}"


def _reduce_partial_grads(model: torch.nn.Module) -> None:
    """Tensor parallel alone: a replicated weight's gradient (the norms', summed over this rank's tokens: a partial
    sum) is all-reduced once into its placements before the step, as FSDP2 does before it reduce-scatters; the
    optimizer would otherwise reduce it in every op that reads it."""
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)


def _mixed_precision(run: RunContext) -> str | None:
    if run.weight_dtype != torch.float32:
        return "none: bf16 weights, gradients and reduce (no fp32 master)"
    if run.bf16 and run.mesh.tp_alone:
        return "bf16 autocast over fp32 parameters (no FSDP2 to cast them)"
    return "bf16 params, fp32 reduce" if run.bf16 else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _materialize_shards(
    model: torch.nn.Module, names: dict[tuple[int, str], str], *, device: torch.device, seed: int
) -> None:
    """Allocate this rank's shards on ``device`` and fill them with the torch engine's initial values.

    ``to_empty`` also empties the buffers, so the real ones (RoPE frequencies) are put back.
    """
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device=device)
    std = float(getattr(model.config, "initializer_range", 0.02))
    done: set[int] = set()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
        for module, key, param in parameter_slots(model):
            if id(param) in done:
                continue
            done.add(id(param))
            # One full parameter at a time, on the device the torch engine uses (same RNG stream).
            full = init_value(names[(id(module), key)], param.shape, std=std, seed=seed, device=device)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)


def create(run: RunContext) -> Engine:
    return FSDPEngine(run)
