"""The training recipe a forecast is for, and the forecast it yields.

Build one with ``Recipe(engine="torch", micro_batch=2, seq_len=1024, recompute=("full",) * 4)``, or from
``ljperf plan`` flags; ``ljperf.forecast.forecast(spec, recipe)`` returns a ``Forecast``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ljperf.core import deepspeed_config
from ljperf.core.choices import (
    PRECISIONS,
    TRACED_ATTENTION,
    DeviceType,
    EngineName,
    Loss,
    OptimizerImpl,
    PipelineSchedule,
    Precision,
    TracedAttention,
    check_choice,
    refuse,
)
from ljperf.core.errors import UsageError
from ljperf.core.mesh import MeshShape
from ljperf.core.options import (
    check_engine_flags,
    check_loss,
    check_precision,
    check_zero_stage,
    default_adamw_impl,
    positive,
)
from ljperf.core.plans import MODES, Plan
from ljperf.models.pipeline_split import parse_split

if TYPE_CHECKING:
    from ljperf.run.config import RunConfig
    from ljperf.run.context import RunContext


@dataclass(frozen=True, kw_only=True)
class ZeroSettings:
    """The DeepSpeed ZeRO values the forecast reads, in elements as DeepSpeed counts them (its defaults)."""

    reduce_bucket_size: int | None = None
    """Elements of the gradient (IPG) bucket; None: ljperf's ``"auto"``, hidden² (as the HF integration)."""
    prefetch_bucket_size: int = 50_000_000
    """``stage3_prefetch_bucket_size``: parameter elements fetched ahead of use."""
    max_live_parameters: int = 1_000_000_000
    """``stage3_max_live_parameters``: gathered elements before blocks are released."""
    max_reuse_distance: int = 1_000_000_000
    """``stage3_max_reuse_distance``: a block used again within this many elements stays gathered."""
    sub_group_size: int = 1_000_000_000
    """ZeRO-3's optimizer steps a rank's partition in sub-groups of parameters, each closed once it reaches this
    many elements: the step's fp32 gradient and temporaries are one sub-group's at a time."""
    overlap_comm: bool = False
    """ZeRO-1/2: reduce one bucket while the next fills, so two IPG buffers (DeepSpeed's default for 1/2)."""
    contiguous_gradients: bool = True
    """ZeRO-1/2: copy gradients into the IPG buffers (without it there are none)."""
    offload: tuple[str, ...] = ()
    """What the config offloads (``offload_optimizer``, ``offload_param`` to cpu or nvme): not modelled."""

    def reduce_bucket_elements(self, hidden: int) -> int:
        """Elements of the IPG bucket for a model of ``hidden`` size."""
        return self.reduce_bucket_size or hidden * hidden

    def ipg_buffers(self) -> int:
        """IPG buffers ZeRO-1/2 allocate (``setup_buckets``): two with ``overlap_comm``, none without
        ``contiguous_gradients``."""
        return (2 if self.overlap_comm else 1) if self.contiguous_gradients else 0

    @classmethod
    def from_config(cls, config: dict) -> ZeroSettings:
        """From a DeepSpeed config dict; an absent or ``"auto"`` value keeps the default (DeepSpeed drops
        ``"auto"``; ljperf resolves ``reduce_bucket_size`` itself)."""
        zero = config.get("zero_optimization") or {}
        values: dict[str, Any] = {}  # the sizes and switches the config sets
        for key, name in (
            ("reduce_bucket_size", "reduce_bucket_size"),
            ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
            ("stage3_max_live_parameters", "max_live_parameters"),
            ("stage3_max_reuse_distance", "max_reuse_distance"),
            ("sub_group_size", "sub_group_size"),
        ):
            value = zero.get(key)
            if value is None or value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise UsageError(f'zero_optimization.{key} is {value!r}: give a number of elements or "auto"')
            values[name] = int(value)
        for key in ("overlap_comm", "contiguous_gradients"):
            value = zero.get(key)
            if value is None or value == "auto":
                continue
            if not isinstance(value, bool):
                raise UsageError(f"zero_optimization.{key} is {value!r}: give true or false")
            values[key] = value
        offload = tuple(
            key
            for key in ("offload_optimizer", "offload_param")
            if (zero.get(key) or {}).get("device", "none") != "none"
        )
        return cls(**values, offload=offload)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What one rank runs: engine, sharding, shapes, precision and the per-layer recompute choice."""

    engine: EngineName = "torch"
    """torch (one device / DDP), fsdp (FSDP2) or deepspeed (ZeRO)."""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage 1, 2 or 3 (deepspeed engine only)."""
    world: int = 1
    """Ranks (GPUs): data-parallel, or data-parallel × ``tp``."""
    tp: int = 1
    """FSDP2: tensor-parallel ranks that split each block and share its sequences (``--tp``)."""
    dp_replicate: int = 1
    """FSDP2: HSDP replicas; the parameters shard over ``world / (tp · dp_replicate)`` ranks (``--dp-replicate``)."""
    device: DeviceType = "cuda"
    """cpu or cuda: the optimizer implementation and the reserved-memory terms depend on it."""
    precision: Precision = "bf16-mixed"
    """fp32, bf16-mixed (fp32 master weights, bf16 autocast) or bf16 (bf16 weights, gradients and AdamW states
    under autocast; torch and fsdp engines)."""
    micro_batch: int = 1
    """Sequences per rank per micro-step."""
    seq_len: int = 4096
    """Tokens per sequence."""
    grad_accum: int = 1
    """Micro-steps per optimizer step."""
    attn_implementation: TracedAttention = "sdpa"
    """transformers attention: sdpa or eager (eager keeps the seq² attention weights)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after each block's forward."""
    recompute: Plan = ()
    """One entry per decoder layer: none, full or selective; empty means none for every layer."""
    optimizer: OptimizerImpl | None = None
    """AdamW implementation: single, foreach or fused (default: fused on CUDA, single on a CPU)."""
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    """DeepSpeed's bucket, prefetch and release settings (deepspeed engine only)."""
    loss: Loss = "plain"
    """The next-token loss: plain (HF's, the whole logits) or chunked (``--loss chunked``, a chunk's logits)."""
    pp: int = 1
    """FSDP2: pipeline ranks (``--pp``), the outermost mesh dimension; ``grad_accum`` is the pipeline's
    micro-batches a step."""
    pp_schedule: PipelineSchedule = "1f1b"
    """``--pp-schedule``: how many micro-batches' activations a stage holds at once (``pipeline.in_flight``)."""
    pp_stages_per_rank: int = 1
    """``--pp-stages-per-rank``."""
    pp_split: tuple[int, ...] = ()
    """Decoder layers per stage (empty: the forecast balances them, ``forecast.pipeline.pipeline_split``)."""
    stage: int | None = None
    """The pipeline stage this recipe's rank holds (None: all of them, or no pipeline); its layers are
    ``stage_layers``."""

    def __post_init__(self) -> None:
        check_choice("engine", self.engine, EngineName)
        check_zero_stage(self.zero_stage)
        check_choice("--device", self.device, DeviceType)
        check_choice("--precision", self.precision, Precision)
        check_precision(self.precision, engine=self.engine)
        for name in ("world", "micro_batch", "seq_len", "grad_accum", "tp", "dp_replicate", "pp"):
            positive(name, getattr(self, name))
        check_engine_flags(
            self.engine,
            zero_stage=None,
            reshard_after_forward=True,
            tp=self.tp,
            dp_replicate=self.dp_replicate,
            pp=self.pp,
        )
        MeshShape.of(world=self.world, tp=self.tp, dp_replicate=self.dp_replicate, pp=self.pp)  # refuses a bad mesh
        traced_attention(self.attn_implementation)
        bad = sorted(set(self.recompute) - set(MODES))
        if bad:
            raise UsageError(f"recompute mode {bad[0]!r}: choose one of {', '.join(MODES)}")
        if self.optimizer is not None:
            check_choice("optimizer", self.optimizer, OptimizerImpl)
        check_choice("loss", self.loss, Loss)
        check_loss(self.loss, tp=self.tp)

    @property
    def trace_precision(self) -> str:
        """The code path to trace: FSDP2 (``param_dtype``) and DeepSpeed (``bf16``) compute with bf16 parameters,
        so autocast makes no weight copies and the residual stream is bf16 (``bf16-params``); DDP keeps fp32
        parameters under autocast (``bf16-mixed``), as FSDP2's tensor parallel alone does (no FSDP2 to cast them);
        ``bf16`` weights are bf16 parameters on any engine."""
        autocast = self.engine == "torch" or self.mesh.tp_alone
        if self.precision == "bf16" or (self.precision == "bf16-mixed" and not autocast):
            return "bf16-params"
        return self.precision

    @property
    def mesh(self) -> MeshShape:
        """How the ``world`` ranks split: pipeline stages × HSDP replicas × FSDP2 shards × tensor-parallel ranks."""
        return MeshShape.of(world=self.world, tp=self.tp, dp_replicate=self.dp_replicate, pp=self.pp)

    @property
    def stages(self) -> int:
        """Pipeline stages in all (1 without ``--pp``)."""
        return self.pp * self.pp_stages_per_rank

    @property
    def stage_layers(self) -> range:
        """The decoder layers of ``stage`` (of the whole model without one)."""
        if self.stage is None or not self.pp_split:
            raise ValueError("a recipe of one pipeline stage has its stage and the split (forecast.pipeline)")
        start = sum(self.pp_split[: self.stage])
        return range(start, start + self.pp_split[self.stage])

    @property
    def last_stage(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def weight_bytes(self) -> int:
        """Bytes per element of the parameters the optimizer steps, their gradients and AdamW's moments."""
        return 2 if self.precision == "bf16" else 4

    @property
    def optimizer_impl(self) -> OptimizerImpl:
        """The AdamW implementation the engine runs: ``--optimizer-impl``, else fused on CUDA, single on a CPU."""
        return self.optimizer or default_adamw_impl(self.device)

    def layer_modes(self, layers: int) -> Plan:
        """The recompute mode of each of ``layers`` decoder layers."""
        if not self.recompute:
            return ("none",) * layers
        if len(self.recompute) != layers:
            raise UsageError(f"recompute plan has {len(self.recompute)} entries for a model of {layers} layers")
        return self.recompute

    def with_(self, **changes: Any) -> Recipe:
        return replace(self, **changes)

    @classmethod
    def of(
        cls,
        config: RunConfig,
        *,
        world: int,
        device: DeviceType,
        recompute: Plan = (),
        optimizer: OptimizerImpl | None = None,
    ) -> Recipe:
        """The recipe of a run's configuration on ``world`` ranks of ``device``, with ``recompute`` per layer; the
        AdamW implementation is ``optimizer``, else ``--optimizer-impl``, else what the ``--deepspeed-config`` asks
        for, else the default (fused on CUDA)."""
        train, engine_opts = config.train, config.engine_opts
        deepspeed = config.engine == "deepspeed"
        if (precision := train.precision) not in PRECISIONS:
            refuse("--precision", precision, Precision)
        return cls(
            engine=config.engine,
            zero_stage=engine_opts.zero_stage,
            world=world,
            tp=engine_opts.tp,
            dp_replicate=engine_opts.dp_replicate,
            device=device,
            precision=precision,
            micro_batch=train.micro_batch,
            seq_len=train.resolved_seq_len,
            grad_accum=train.grad_accum,
            attn_implementation=traced_attention(config.model.attention(train.attn_implementation)),
            reshard_after_forward=engine_opts.reshard_after_forward,
            recompute=recompute,
            zero=_zero_settings(config.deepspeed_user) if deepspeed else ZeroSettings(),
            loss=config.optim.loss,
            pp=engine_opts.pp,
            pp_schedule=engine_opts.pp_schedule,
            pp_stages_per_rank=engine_opts.pp_stages_per_rank,
            pp_split=tuple(parse_split(engine_opts.pp_split, layers=config.model.layers, stages=engine_opts.stages))
            if engine_opts.pp_split
            else (),
            optimizer=optimizer
            or config.optim.optimizer_impl
            or (deepspeed_adamw(config.deepspeed_user) if deepspeed else None),
        )

    @classmethod
    def from_run(cls, run: RunContext, *, recompute: Plan = ()) -> Recipe:
        """The recipe a benchmark rank (``RunContext``) executes, with ``recompute`` per layer."""
        return cls.of(run.config, world=run.world, device=run.device.type, recompute=recompute)


@dataclass(frozen=True, kw_only=True)
class Forecast:
    """Predicted peak memory of one rank for one recipe."""

    peak_allocated_bytes: int
    """Peak of live tensor bytes (``torch.cuda.max_memory_allocated`` on CUDA)."""
    peak_reserved_bytes: int | None
    """Allocator reserve at the peak (rounding, fragmentation, workspace); None on CPU."""
    context_bytes: int
    """CUDA context and libraries, outside the allocator (0 on CPU)."""
    breakdown: dict[str, int]
    """Bytes per component at the peak; they add up to ``peak_allocated_bytes``."""
    phase: str
    """Where the peak happens: forward, backward or optimizer (with the micro-step and block)."""
    source: str
    """traced (real model code on fake tensors) or analytic (the formula fallback)."""
    notes: list[str] = field(default_factory=list)
    """Caveats, e.g. a fallback taken."""
    analytic_reason: str | None = None
    """Why the forecast is the analytic formula (``source`` analytic): the trace's error; None when traced."""
    traced_peak_bytes: int | None = None
    """The allocated peak before device overheads (what calibration fits against)."""
    stage_peaks: tuple[int, ...] = ()
    """``--pp``: each pipeline rank's peak allocated bytes (this forecast is the highest's)."""
    pp_split: tuple[int, ...] = ()
    """``--pp``: the decoder layers of each stage the forecast walked."""

    @property
    def device_bytes(self) -> int:
        """What the device must hold: the reserve (or allocation) plus the context."""
        return (self.peak_reserved_bytes or self.peak_allocated_bytes) + self.context_bytes


def traced_attention(attn: str) -> TracedAttention:
    """``attn``, an attention implementation the forecast traces (refused otherwise)."""
    if attn not in TRACED_ATTENTION:
        raise UsageError(f"--attn-implementation {attn!r}: the forecast knows {', '.join(TRACED_ATTENTION)}")
    return attn


def deepspeed_adamw(user: dict | None) -> OptimizerImpl | None:
    """The AdamW kind a ``--deepspeed-config`` asks torch for (``optimizer.params.foreach``), else None (torch's
    pick): ``ljperf benchmark`` and ``ljperf plan`` read the file alike."""
    params = ((user or {}).get("optimizer") or {}).get("params")
    foreach = params.get("foreach") if isinstance(params, dict) else None
    return None if not isinstance(foreach, bool) else "foreach" if foreach else "single"


def _zero_settings(user: dict) -> ZeroSettings:
    """The ZeRO settings of a ``--deepspeed-config`` (merged over ljperf's), or the defaults without one."""
    return ZeroSettings.from_config(deepspeed_config.merge(user)) if user else ZeroSettings()
