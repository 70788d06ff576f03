"""The recipes ``ljperf plan --search`` looks through: the axes (each given flag fixes one), the layouts of the
ranks (engine and mesh), the micro batch × accumulation splits of a global batch, and the command that runs one.

Run: ``layouts(axes, world=64, spec=spec, seq_len=8192, per_node=8)`` → every ``Layout``; ``Candidate.recipe(base,
spec)`` → the ``forecast.recipe.Recipe`` to forecast and price; ``Candidate.argv(...)`` → its ``ljperf benchmark``
flags.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

from ljperf.core.choices import EngineName, Loss, OptimizerImpl
from ljperf.core.errors import UsageError
from ljperf.core.options import LARGEST
from ljperf.core.plans import Plan, fixed_plan, parse_recompute
from ljperf.forecast.recipe import Recipe
from ljperf.models.pipeline_split import check_pipelined
from ljperf.models.spec import ModelSpec
from ljperf.run.config import check_tensor_parallel

RECOMPUTE_CHOICES = ("none", "selective", "full", "auto")
"""The recompute axis: one mode for every layer, or the fastest per-layer plan within the budget."""


@dataclass(frozen=True, kw_only=True)
class Axes:
    """The values each axis of the search takes: every value it has, or the one a flag fixed."""

    engines: tuple[EngineName, ...]
    zero_stages: tuple[int, ...] = (1, 2, 3)
    tp: int | None = None
    """Tensor-parallel degree (None: every one the model and a node allow)."""
    dp_replicate: int | None = None
    pp: int | None = None
    """Pipeline stages (None: 1 and each divisor of the world up to ``MOST_STAGES`` a splittable model allows)."""
    reshard_after_forward: tuple[bool, ...] = (True, False)
    micro_batch: int | None = None
    grad_accum: int | None = None
    recompute: tuple[str, ...] = RECOMPUTE_CHOICES
    """``--recompute`` values: the choices above, or the one a flag gave (``K``, ``MODE,MODE,...`` too)."""
    losses: tuple[Loss, ...] = ("plain", "chunked")
    optimizers: tuple[OptimizerImpl, ...] = ("fused", "foreach", "single")
    global_batch: int | None = None
    """Sequences per optimizer step over the data-parallel ranks (None: not held)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the ranks split: the engine and its mesh."""

    engine: EngineName
    zero_stage: int | None = None
    """DeepSpeed's ZeRO stage (deepspeed only)."""
    tp: int = 1
    pp: int = 1
    """Pipeline stages (``--pp``): each forecast per stage, the slowest priced with its bubble."""
    dp_replicate: int = 1
    reshard_after_forward: bool = True

    def dp(self, world: int) -> int:
        """Data-parallel ranks: each trains on sequences of its own."""
        return world // (self.tp * self.pp)

    def describe(self, world: int) -> str:
        """``DDP``, ``ZeRO-2``, ``FSDP2``, ``HSDP 2×4 · tp 2 · no reshard``: for the table."""
        if self.engine == "torch":
            text = "DDP" if world > 1 else "torch"
        elif self.engine == "deepspeed":
            text = f"ZeRO-{self.zero_stage}"
        else:
            shards = world // (self.tp * self.pp * self.dp_replicate)
            text = f"HSDP {self.dp_replicate}×{shards}" if self.dp_replicate > 1 else "FSDP2"
            if self.tp > 1 and self.dp(world) == 1:
                text = "TP"
            if not self.reshard_after_forward:
                text += " · no reshard"
        if self.tp > 1 and text != "TP":
            text += f" · tp {self.tp}"
        return text + (f" · pp {self.pp}" if self.pp > 1 else "")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One recipe of the search: a layout, a batch split, a recompute choice, a loss and an AdamW kind."""

    layout: Layout
    micro_batch: int
    grad_accum: int
    recompute: str
    """A ``--recompute`` value; ``auto`` is solved per candidate (``plan``)."""
    loss: Loss
    optimizer: OptimizerImpl | None
    """None: the engine's own (DeepSpeed's comes from its config)."""
    plan: Plan = ()
    """The per-layer plan ``auto`` solved to (empty before, and for a fixed choice)."""

    def recipe(self, base: Recipe, spec: ModelSpec) -> Recipe:
        """``base`` (the flags' precision, shape, device and ZeRO settings) with this candidate's choices."""
        layout = self.layout
        modes = self.plan or fixed_plan(parse_recompute(self.recompute), spec.layers)
        return base.with_(
            engine=layout.engine,
            zero_stage=layout.zero_stage or 3,
            tp=layout.tp,
            pp=layout.pp,
            dp_replicate=layout.dp_replicate,
            reshard_after_forward=layout.reshard_after_forward,
            micro_batch=self.micro_batch,
            grad_accum=self.grad_accum,
            recompute=() if set(modes) == {"none"} else modes,
            loss=self.loss,
            optimizer=self.optimizer,
        )

    def record(self) -> dict:
        return asdict(self) | {"plan": list(self.plan)}

    def argv(self, *, model: list[str], base: Recipe, per_node: int, extra: list[str]) -> list[str]:
        """The ``ljperf benchmark`` flags that run this candidate on ``base.world`` ranks, ``per_node`` a node;
        ``model``: the model's flags without the engine (``--model`` gets it), ``extra``: flags passed through."""
        layout, world = self.layout, base.world
        nodes = -(-world // per_node)
        out = ["benchmark", *model_flags(model, layout.engine), "--nproc-per-node", str(min(world, per_node))]
        out += ["--nnodes", str(nodes)] if nodes > 1 else []
        out += ["--device", base.device, "--precision", base.precision, "--seq-len", str(base.seq_len)]
        out += ["--micro-batch", str(self.micro_batch), "--grad-accum", str(self.grad_accum)]
        if layout.engine == "deepspeed":
            out += ["--zero-stage", str(layout.zero_stage)]
        if layout.tp > 1:
            out += ["--tp", str(layout.tp)]
        if layout.pp > 1:  # its micro-batches are the accumulation given
            out += ["--pp", str(layout.pp)]
        if layout.dp_replicate > 1:
            out += ["--dp-replicate", str(layout.dp_replicate)]
        if not layout.reshard_after_forward:
            out.append("--no-reshard-after-forward")
        recompute = recompute_flag(self.plan) if self.plan else self.recompute
        if recompute != "none":
            out += ["--recompute", recompute]
        if self.loss != "plain":
            out += ["--loss", self.loss]
        if self.optimizer is not None:
            out += ["--optimizer-impl", self.optimizer]
        if base.attn_implementation != "sdpa":
            out += ["--attn-implementation", base.attn_implementation]
        return out + extra


def recompute_flag(plan: Plan) -> str:
    """``--recompute`` of a per-layer plan, shortest first: one mode, K (the first K layers full), or each mode."""
    if len(set(plan)) == 1:
        return plan[0]
    full = plan.count("full")
    if plan == ("full",) * full + ("none",) * (len(plan) - full):
        return str(full)
    return ",".join(plan)


def model_flags(model: list[str], engine: EngineName) -> list[str]:
    """The model's flags for ``engine``: ``--model ENGINE/NAME``, or ``--model-config PATH --engine ENGINE``."""
    if model[0] == "--model":
        return ["--model", f"{engine}/{model[1]}"]
    return [*model, "--engine", engine]


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


MOST_STAGES = 16
"""Pipeline stages the search tries at most (torchtitan's 405B recipe runs 8)."""


def pipeline_degrees(axes: Axes, *, spec: ModelSpec, world: int) -> list[int]:
    """Pipeline stages a layout may have: ``--pp``, else 1 and, for a decoder ``--pp`` splits (untied), each
    divisor of ``world`` up to ``MOST_STAGES`` and the model's layers."""
    if axes.pp is not None:
        return [axes.pp]
    try:
        check_pipelined(str(spec.fact("model_type")))
    except UsageError:
        return [1]
    if spec.facts.config_dict.get("tie_word_embeddings"):
        return [1]
    return [p for p in divisors(world) if p <= min(MOST_STAGES, spec.layers)]


def tensor_degrees(axes: Axes, *, spec: ModelSpec, world: int, seq_len: int, per_node: int) -> list[int]:
    """Tensor-parallel degrees: ``--tp``, else each divisor of ``world`` within a node that splits the model."""
    if axes.tp is not None:
        return [axes.tp]
    out = []
    for tp in divisors(world):
        if tp > per_node:
            break
        try:
            check_tensor_parallel(spec, tp=tp, seq_len=seq_len)
        except UsageError:
            continue
        out.append(tp)
    return out


def layouts(axes: Axes, *, spec: ModelSpec, world: int, seq_len: int, per_node: int) -> Iterator[Layout]:
    """Every layout of ``world`` ranks on the axes: DDP, each ZeRO stage, FSDP2 over each mesh (tensor parallel,
    HSDP replicas that leave two shards or more, resharding after forward or not where something is sharded)."""
    for engine in axes.engines:
        if engine == "torch":
            yield Layout(engine="torch")
        elif engine == "deepspeed":
            yield from (Layout(engine="deepspeed", zero_stage=s) for s in axes.zero_stages)
        else:
            yield from fsdp_layouts(axes, spec=spec, world=world, seq_len=seq_len, per_node=per_node)


def fsdp_layouts(axes: Axes, *, spec: ModelSpec, world: int, seq_len: int, per_node: int) -> Iterator[Layout]:
    for pp in pipeline_degrees(axes, spec=spec, world=world):
        for tp in tensor_degrees(axes, spec=spec, world=world // pp, seq_len=seq_len, per_node=per_node):
            if (world // pp) % tp:
                continue
            dp = world // (pp * tp)
            given = axes.dp_replicate
            replicas = [given] if given is not None else [r for r in divisors(dp) if r == 1 or dp // r >= 2]
            for r in replicas:
                if dp % r:
                    continue
                open_ = dp // r > 1 or len(axes.reshard_after_forward) == 1  # nothing sharded: nothing to free
                for reshard in axes.reshard_after_forward if open_ else (True,):
                    yield Layout(engine="fsdp", tp=tp, pp=pp, dp_replicate=r, reshard_after_forward=reshard)


def batch_splits(axes: Axes, *, dp: int) -> list[tuple[int, int]] | None:
    """(micro batch, accumulation) pairs for ``dp`` data-parallel ranks, smallest micro batch first: those
    whose product over ``dp`` ranks is ``--global-batch`` (None: it does not divide by ``dp``), or without one
    the micro batches 1, 2, 4, ... (or ``--micro-batch``) at ``--grad-accum`` (default 1)."""
    mb, accum = axes.micro_batch, axes.grad_accum
    if axes.global_batch is None:
        sizes = [mb] if mb is not None else [2**k for k in range(31) if 2**k <= LARGEST]
        return [(b, accum or 1) for b in sizes]
    if axes.global_batch % dp:
        return None
    per = axes.global_batch // dp
    pairs = [(b, per // b) for b in divisors(per)]
    return [(b, a) for b, a in pairs if mb in (None, b) and accum in (None, a)]
