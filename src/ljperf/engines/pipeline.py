"""Pipeline parallel for the fsdp engine (``--pp N``): this rank's stages of the model, and the schedule that runs
them, on ``torch.distributed.pipelining`` (its ``PipelineStage`` and schedules: no scheduler of ljperf's own).

Run: ``stages = apply_pp(model, run)`` first of the optimizations (pipeline split → tensor parallel → checkpoint
→ compile → shard, as torchtitan orders them), each stage then optimized and sharded as a whole model is; then
``pipeline = Pipeline.of(stages, run, group=pp_group)`` and ``pipeline.step(micro_batches)`` in each training step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase, _RecvInfo
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from ljperf.core.choices import Loss, PipelineSchedule
from ljperf.core.phases import phase
from ljperf.engines.common import parameter_names
from ljperf.forecast.pipeline import pipeline_split
from ljperf.forecast.recipe import Recipe
from ljperf.models.pipeline_split import stage_layers
from ljperf.models.stages import DecoderStage, next_token_loss, split_stage
from ljperf.run.context import RunContext


def make_schedule(
    kind: PipelineSchedule, pipes: list[_PipelineStageBase], *, microbatches: int, loss: Loss
) -> _PipelineSchedule:
    """``--pp-schedule`` as torch's schedule (one stage a rank for GPipe and 1F1B; several for interleaving),
    gradients averaged over the micro-batches (``scale_grads``), the loss as every engine's (``chunked``: the last
    stage's output is already its loss)."""
    options = {"loss_fn": next_token_loss if loss == "plain" else given_loss, "scale_grads": True}
    if kind == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(pipes, microbatches, **options)
    return (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(pipes[0], microbatches, **options)


def given_loss(loss: torch.Tensor, _tokens: torch.Tensor) -> torch.Tensor:
    """The loss a last stage computed itself (``--loss chunked``: ``DecoderStage.forward`` given the labels)."""
    return loss


@dataclass(kw_only=True)
class Stage:
    """One pipeline stage this rank holds: its module, its index among all stages, its decoder layers, and the
    whole model's parameter names of its parameters (what their initial values are drawn by)."""

    module: DecoderStage
    index: int
    layers: range
    names: dict[tuple[int, str], str]


class TimedStage(PipelineStage):
    """torch's stage, its backward marked as the step's backward phase (the schedule runs it, so no engine code
    surrounds it; the stage's forward marks itself, ``DecoderStage.forward``)."""

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        with phase("backward"):
            super().backward_one_chunk(*args, **kwargs)


def stage_indices(run: RunContext) -> list[int]:
    """The stages of this rank: ``pp_rank``, then one ``--pp`` further per stage a rank (torch's looped order)."""
    opts = run.engine_opts
    return [run.mesh.pp_rank(run.rank) + v * opts.pp for v in range(opts.pp_stages_per_rank)]


def apply_pp(model: torch.nn.Module, run: RunContext, *, counts: list[int]) -> list[Stage]:
    """This rank's stages of ``model`` (meta), ``counts`` decoder layers each stage in order; each a copy of the
    model cut down to its stage (on the meta device a copy costs no memory), so the ranks' stages are the same
    HF code as the whole model."""
    if not isinstance(model, PreTrainedModel):  # the split names an HF causal LM's modules
        raise TypeError(f"pipeline parallel splits an HF causal LM, not a {type(model).__name__}")
    total, ranges = len(counts), stage_layers(counts)
    stages = []
    for index in stage_indices(run):
        whole = copy.deepcopy(model)
        names = parameter_names(whole)
        module = split_stage(whole, layers=ranges[index], first=index == 0, last=index == total - 1)
        stages.append(Stage(module=module, index=index, layers=ranges[index], names=names))
    return stages


class Pipeline:
    """The schedule over this rank's stages; ``step`` trains one step's micro-batches through it."""

    def __init__(
        self,
        schedule: _PipelineSchedule,
        *,
        first: bool,
        last: bool,
        last_rank: int,
        group: dist.ProcessGroup,
        chunked: bool = False,
    ):
        self.schedule, self.first, self.last = schedule, first, last
        self.last_rank, self.group, self.chunked = last_rank, group, chunked
        self.pipes: list[_PipelineStageBase] = []

    @classmethod
    def of(cls, stages: list[Stage], run: RunContext, *, group: dist.ProcessGroup) -> Pipeline:
        """The ``--pp-schedule`` over ``stages`` with the run's micro-batches (``--pp-microbatches``, made the
        step's accumulation), gradients averaged over them (``scale_grads``), the loss as every engine's."""
        opts, device = run.engine_opts, run.device.torch_device
        total = opts.stages
        pipes: list[_PipelineStageBase] = [TimedStage(s.module, s.index, total, device, group=group) for s in stages]
        loss = run.optim.loss
        schedule = make_schedule(opts.pp_schedule, pipes, microbatches=run.train.grad_accum, loss=loss)
        indices = {s.index for s in stages}
        world = run.world // opts.pp  # the ranks of one pipeline stage
        last_rank = (opts.pp - 1) * world + run.rank % world  # this rank's peer on the last pipeline rank
        first, last = 0 in indices, total - 1 in indices
        pipeline = cls(schedule, first=first, last=last, last_rank=last_rank, group=group, chunked=loss == "chunked")
        pipeline.pipes = pipes
        return pipeline

    def receive_buffers(self) -> list[torch.Tensor]:
        """The buffers this rank's stages receive hidden states and gradients into, one a micro-batch each, made
        when the schedule first runs and kept between steps (none before the first step)."""
        infos = [
            i for pipe in self.pipes for per_mb in (pipe.args_recv_info, pipe.grad_recv_info) for i in per_mb.values()
        ]
        return [
            info.buffer for group in infos for info in group if isinstance(info, _RecvInfo) and info.buffer is not None
        ]

    def step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """Forward and backward of the micro-batches through the pipeline; the mean loss, on every pipeline rank
        (the last stage's, broadcast over this rank's pipeline group)."""
        tokens = torch.cat(micro_batches)  # the schedule splits it again, in order, into as many micro-batches
        losses: list[torch.Tensor] = []
        target = tokens if self.last else None
        # the schedule splits keywords as it splits inputs, and gives them to each of this rank's stages
        labels: dict[str, Any] = {"labels": tokens} if self.last and self.chunked else {}
        inputs = (tokens,) if self.first else ()
        # the outputs are not merged: the last stage's logits of every micro-batch at once
        self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False, **labels)
        local = [x.to_local() if isinstance(x, DTensor) else x for x in losses]  # tensor parallel: replicated
        loss = torch.stack(local).mean().detach() if local else torch.zeros((), device=tokens.device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss


def pipeline_counts(run: RunContext) -> list[int]:
    """Decoder layers per stage: ``--pp-split``, else the forecast's balanced split (``forecast.pipeline``)."""
    return list(pipeline_split(run.model, Recipe.from_run(run)))
