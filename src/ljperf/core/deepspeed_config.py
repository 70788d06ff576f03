"""DeepSpeed configs: the one ljperf generates from its options, a user's file validated and merged, and the lint.

Run: ``ljperf benchmark --model deepspeed/llama-tiny --nproc-per-node 2 [--deepspeed-config my_ds.json]``;
``ljperf plan`` reads the same file through ``settings`` and ``check``; ``ljperf doctor`` calls ``lint`` on any
DeepSpeed JSON. Rules (docs/engines.md): a flag given on the command line is the source of truth, a number the
file holds stands in for a flag left out (micro batch, accumulation, ZeRO stage); ``"auto"`` values are filled
from the flags the way the HF integration does; a number that contradicts a given flag, or a broken batch
identity, is a usage error (exit 2) with the numbers.
Nothing here imports torch or DeepSpeed, so the lint runs anywhere.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Any

from ljperf.core.errors import UsageError
from ljperf.core.options import EngineConfig, TrainConfig
from ljperf.core.records import read_json_object

AUTO = "auto"
LEVELS = ("ok", "warn", "fail")

# Top-level keys DeepSpeed reads (its config-json documentation and runtime/config.py, 0.17-0.19).
KNOWN_KEYS = frozenset(
    {
        "activation_checkpointing",
        "aio",
        "amp",
        "autotuning",
        "bf16",
        "bfloat16",
        "checkpoint",
        "comet",
        "comms_logger",
        "communication_data_type",
        "compile",
        "compression_training",
        "csv_monitor",
        "curriculum_learning",
        "data_efficiency",
        "data_types",
        "dataloader_drop_last",
        "datastates_ckpt",
        "disable_allgather",
        "disable_python_gc",
        "dump_state",
        "eigenvalue",
        "elasticity",
        "expert_parallel",
        "flops_profiler",
        "fp16",
        "gradient_accumulation_steps",
        "gradient_allreduce_op",
        "gradient_clipping",
        "gradient_predivide_factor",
        "hybrid_engine",
        "load_universal_checkpoint",
        "log_level",
        "managed_gradient_accumulation",
        "memory_breakdown",
        "nebula",
        "optimizer",
        "pipeline",
        "prescale_gradients",
        "progressive_layer_drop",
        "quantize_training",
        "scheduler",
        "seq_parallel_communication_data_type",
        "sequence_parallel_size",
        "sparse_attention",
        "sparse_gradients",
        "steps_per_print",
        "tensor_parallel",
        "tensorboard",
        "timers",
        "torch_autocast",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "use_data_before_expert_parallelism",
        "use_node_local_storage",
        "vocabulary_size",
        "wall_clock_breakdown",
        "wandb",
        "weight_quantization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "zero_optimization",
    }
)


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One result of the lint: what was checked, how it came out, and the fix when it is not ok."""

    level: str
    """``ok``, ``warn`` or ``fail``."""
    message: str
    """What was found, with the numbers."""
    fix: str
    """What to change (empty when ok)."""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"Finding.level must be one of {LEVELS}, not {self.level!r}")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _section(config: dict, key: str) -> dict:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def lint(config: dict, *, world_size: int | None = None) -> list[Finding]:
    """Check a DeepSpeed config: one finding per check (unknown keys, batch identity, precision, prefetch bucket,
    JSON types, ZeRO stage).

    ``world_size`` is the data-parallel world size; without it the batch identity is checked up to the world
    size (``train_batch_size`` must be a multiple of micro batch × accumulation).
    """
    if not isinstance(config, dict):
        return [Finding(level="fail", message="a DeepSpeed config must be a JSON object", fix="write {...}")]
    return [
        _finite(config),
        _unknown_keys(config),
        _batch_identity(config, world_size),
        _precision(config),
        _prefetch(config),
        _types(config),
        _stage(config),
    ]


def _not_finite(value: Any, path: str = "") -> list[str]:
    """Where ``value`` holds NaN or an infinity (Python's JSON reader takes ``NaN`` and ``Infinity``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{path} is {json.dumps(value)}"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _not_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _not_finite(v, f"{path}[{i}]")]
    return []


def _finite(config: dict) -> Finding:
    if not (found := _not_finite(config)):
        return Finding(level="ok", message="every number is finite", fix="")
    return Finding(level="fail", message="; ".join(found), fix='write a finite number, or "auto"')


def _unknown_keys(config: dict) -> Finding:
    unknown = sorted(k for k in config if k not in KNOWN_KEYS)
    if not unknown:
        return Finding(level="ok", message="all top-level keys are DeepSpeed keys", fix="")
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return Finding(
        level="warn",
        message=f"unknown top-level key(s) {', '.join(hints)}: DeepSpeed ignores them",
        fix="correct the spelling or remove them",
    )


def _batch_identity(config: dict, world_size: int | None) -> Finding:
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    values = {}
    for name in names:
        value = config.get(name, AUTO)
        if value == AUTO:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return Finding(
                level="fail", message=f"{name} is {value!r}", fix=f'set {name} to a positive integer or "auto"'
            )
        values[name] = value
    train, micro, accum = (values.get(n) for n in names)
    if train is None:
        return Finding(level="ok", message="batch sizes are partly auto (DeepSpeed derives the rest)", fix="")
    if micro is None or accum is None:
        return _partial_batch(train, micro=micro, accum=accum, world_size=world_size)
    product = micro * accum
    if world_size is not None:
        expected = product * world_size
        equation = f"{micro} (micro) × {accum} (accumulation) × {world_size} (world)"
        if train == expected:
            return Finding(level="ok", message=f"train_batch_size {train} = {equation}", fix="")
        return Finding(
            level="fail",
            message=f"train_batch_size {train} ≠ {equation} = {expected}",
            fix=f'set train_batch_size to {expected} or "auto"',
        )
    if train % product:
        return Finding(
            level="fail",
            message=f"train_batch_size {train} is not a multiple of {micro} (micro) × {accum} (accumulation)",
            fix='set train_batch_size to micro × accumulation × world size, or "auto"',
        )
    return Finding(level="ok", message=f"train_batch_size {train} fits a world size of {train // product}", fix="")


def _partial_batch(train: int, *, micro: int | None, accum: int | None, world_size: int | None) -> Finding:
    """A number for train_batch_size with micro batch or accumulation left to DeepSpeed, which derives them by
    integer division (micro = train // (accumulation × world)) and then fails its own identity check when the
    known factors do not divide train_batch_size."""
    factors = [(micro, "micro"), (accum, "accumulation"), (world_size, "world")]
    known = [(value, name) for value, name in factors if value is not None]
    product = math.prod(value for value, _ in known)
    equation = " × ".join(f"{value} ({name})" for value, name in known)
    if not known or train % product == 0:
        return Finding(level="ok", message="batch sizes are partly auto (DeepSpeed derives the rest)", fix="")
    if len(known) > 1:
        equation += f" = {product}"
    lower, upper = train // product * product, (train // product + 1) * product
    choices = f"{lower} or {upper}" if lower else f"{upper}"
    return Finding(
        level="fail",
        message=f"train_batch_size {train} is not divisible by {equation}: DeepSpeed derives a batch that breaks"
        " its own check",
        fix=f'set train_batch_size to a multiple of {product} ({choices}), or "auto"',
    )


def _enabled(config: dict, *keys: str) -> bool:
    return any(_section(config, key).get("enabled") is True for key in keys)


def _precision(config: dict) -> Finding:
    if _enabled(config, "bf16", "bfloat16") and _enabled(config, "fp16"):
        return Finding(
            level="fail",
            message="bf16 and fp16 are both enabled",
            fix='enable one: "bf16": {"enabled": true} on Ampere or newer, else fp16',
        )
    return Finding(level="ok", message="at most one of bf16/fp16 is enabled", fix="")


def _stage(config: dict) -> Finding:
    stage = _section(config, "zero_optimization").get("stage", AUTO)
    read = _read(stage, 0)
    if stage == AUTO or (read in (0, 1, 2, 3) and not isinstance(read, bool)):
        return Finding(level="ok", message="the ZeRO stage is one DeepSpeed has", fix="")
    return Finding(
        level="fail",
        message=f"zero_optimization.stage is {json.dumps(stage)}: DeepSpeed has stages 0 to 3",
        fix="set 1, 2 or 3 (0 turns ZeRO off)",
    )


def _prefetch(config: dict) -> Finding:
    zero = _section(config, "zero_optimization")
    value, stage = zero.get("stage3_prefetch_bucket_size"), zero.get("stage")
    if _number(stage) and stage in (0, 1, 2):  # a stage-3 setting says nothing of this run
        if stage3 := sorted(k for k in zero if k.startswith("stage3_") and zero[k] != AUTO):  # ljperf's own: auto
            return Finding(
                level="warn",
                message=f"{', '.join(stage3)} set at ZeRO stage {stage}, which does not read them",
                fix="remove them, or set zero_optimization.stage to 3",
            )
        return Finding(level="ok", message=f"no stage-3 settings at ZeRO stage {stage}", fix="")
    if _number(value):
        return Finding(
            level="warn",
            message=f"zero_optimization.stage3_prefetch_bucket_size is a fixed number ({value})",
            fix='leave it out or set it to "auto" (a fixed number fits one model size, and a fractional one '
            "fails DeepSpeed's integer check)",
        )
    return Finding(level="ok", message="stage3_prefetch_bucket_size is left to DeepSpeed", fix="")


# Settings with one JSON type. DeepSpeed 0.19 reads some by pydantic's lax rules ("yes", 1 and "3" pass: bf16,
# fp16, zero_optimization) and others as they are (gradient_clipping "x" fails only when the step clips).
TYPED: dict[tuple[str, ...], str] = {
    ("bf16", "enabled"): "bool",
    ("fp16", "enabled"): "bool",
    ("zero_optimization", "stage"): "int",
    ("zero_optimization", "overlap_comm"): "bool",
    ("zero_optimization", "contiguous_gradients"): "bool",
    ("zero_optimization", "reduce_bucket_size"): "number",
    ("zero_optimization", "allgather_bucket_size"): "number",
    ("zero_optimization", "stage3_max_live_parameters"): "number",
    ("zero_optimization", "stage3_max_reuse_distance"): "number",
    ("zero_optimization", "sub_group_size"): "number",
    ("zero_optimization", "stage3_param_persistence_threshold"): "number",
    ("gradient_clipping",): "number",
    ("steps_per_print",): "int",
    ("optimizer", "type"): "str",
    ("optimizer", "params"): "object",
}
_WANT = {"bool": "true or false", "int": "an integer", "number": "a number", "str": "a string", "object": "an object"}


def _has_type(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return _number(value) and math.isfinite(value) and value == int(value)
    if kind == "number":
        return _number(value) and math.isfinite(value)
    return isinstance(value, str if kind == "str" else dict)


def _types(config: dict) -> Finding:
    wrong = []
    for path, kind in TYPED.items():
        section = config if len(path) == 1 else _section(config, path[0])
        if path[-1] in section and section[path[-1]] != AUTO and not _has_type(section[path[-1]], kind):
            wrong.append(f"{'.'.join(path)} is {json.dumps(section[path[-1]])[:40]} (want {_WANT[kind]})")
    if not wrong:
        return Finding(level="ok", message="the settings ljperf knows have JSON values of the right type", fix="")
    return Finding(
        level="warn",
        message="; ".join(wrong),
        fix='write JSON numbers, true/false and objects without quotes, or "auto": DeepSpeed converts some quoted'
        " values and fails on others only when it uses them",
    )


def load(path: str | Path) -> dict:
    """Read a DeepSpeed JSON config; a missing or malformed file, or a section (``zero_optimization``, ``bf16``,
    ...) that is not an object, is a usage error."""
    what = f"--deepspeed-config {str(path)!r}"
    config = read_json_object(path, what=what)
    sections = template()
    for key, value in config.items():
        if isinstance(sections.get(key), dict) and not isinstance(value, dict):
            raise UsageError(f"{what}: {key} must be a JSON object (got {json.dumps(value)[:40]})")
    return config


@dataclass(frozen=True, kw_only=True)
class Options:
    """The ljperf options a DeepSpeed config is resolved from."""

    micro_batch: int
    """--micro-batch."""
    grad_accum: int
    """--grad-accum."""
    world: int
    """Data-parallel processes."""
    bf16: bool
    """--precision bf16-mixed."""
    zero_stage: int
    """--zero-stage."""
    lr: float
    """--lr."""
    betas: tuple[float, float]
    """AdamW betas of ``engines.common.adamw``."""
    eps: float
    """AdamW eps of ``engines.common.adamw``."""
    weight_decay: float
    """AdamW weight decay of ``engines.common.adamw``."""
    hidden: int
    """The model's hidden size (bucket sizes scale with it, as in the HF integration)."""


def template() -> dict:
    """ljperf's DeepSpeed config before resolution: every value ljperf controls is ``"auto"``."""
    return {
        "train_batch_size": AUTO,
        "train_micro_batch_size_per_gpu": AUTO,
        "gradient_accumulation_steps": AUTO,
        "gradient_clipping": AUTO,
        "steps_per_print": 2**31 - 1,  # ljperf prints progress itself
        "wall_clock_breakdown": False,
        "bf16": {"enabled": AUTO},
        "fp16": {"enabled": AUTO},
        # torch_adam: torch.optim.AdamW, the optimizer of the other engines (FusedAdam needs a CUDA op build).
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO, "torch_adam": True},
        },
        "zero_optimization": {
            "stage": AUTO,
            "reduce_bucket_size": AUTO,
            "stage3_param_persistence_threshold": AUTO,
            "stage3_prefetch_bucket_size": AUTO,  # DeepSpeed keeps its default for "auto"
        },
    }


def merge(user: dict) -> dict:
    """ljperf's template with the user's file on top: sections merge key by key; a user optimizer or
    scheduler replaces ljperf's whole (its parameters belong to its type)."""
    merged = template()
    for key, value in user.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key not in ("optimizer", "scheduler"):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = copy.deepcopy(value)
    return merged


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The flags a DeepSpeed config can hold a number for, as a run uses them: each is the flag given, or the
    config's number (the key is the field's ``deepspeed`` in ``ljperf.config``), or the flag's default."""

    micro_batch: int
    grad_accum: int
    zero_stage: int


def _fields() -> list[tuple[type, Field]]:
    """The option fields a DeepSpeed config can hold a number for (``opt(..., deepspeed=KEY)`` in ``ljperf.config``):
    their keys, defaults and validation live there, once."""
    return [(cls, f) for cls in (TrainConfig, EngineConfig) for f in fields(cls) if f.metadata.get("deepspeed")]


def _path(f: Field) -> tuple[str, ...]:
    return tuple(f.metadata["deepspeed"].split("."))


def _read(value: Any, like: Any) -> Any:
    """``value`` as DeepSpeed's pydantic (lax mode) reads a setting of ``like``'s type: ``"3"`` is 3 and ``"yes"``
    true; anything else as it is."""
    if isinstance(like, bool):
        if isinstance(value, str):
            return _BOOLS.get(value.strip().lower(), value)
        return bool(value) if value in (0, 1) and not isinstance(value, bool | float) else value
    if isinstance(value, str) and isinstance(like, int | float):
        try:
            return type(like)(value.strip())
        except ValueError:
            return value
    if isinstance(like, int) and not isinstance(like, bool) and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _refusal(cls: type, f: Field, number: Any) -> str | None:
    """Why ljperf cannot run ``number`` as ``f``'s flag (an int its option class accepts), or None if it can."""
    if not isinstance(number, int) or isinstance(number, bool):
        return f'want an integer, or "{AUTO}"'
    try:
        cls(**{f.name: number})
    except UsageError as exc:
        return str(exc)
    return None


def settings(
    user: dict, *, micro_batch: int | None, grad_accum: int | None, zero_stage: int | None, source: str
) -> Settings:
    """The micro batch, accumulation and ZeRO stage of a run with the user's config ``user`` (``{}``: none): a
    flag given on the command line (not None), else the number the config holds, else ljperf's default.

    A given flag that contradicts the config's number stays: ``resolve`` and ``check`` refuse it, naming both.
    A number that stands in for a flag and that ljperf cannot run (``"stage": 0``) raises ``UsageError``.
    """
    given = {"micro_batch": micro_batch, "grad_accum": grad_accum, "zero_stage": zero_stage}
    values: dict[str, Any] = {}  # the flags', the option fields' defaults or the numbers the config holds
    for cls, f in _fields():
        written = _get(user, _path(f))
        if given[f.name] is not None or written in (None, AUTO):
            values[f.name] = f.default if given[f.name] is None else given[f.name]
            continue
        number = _read(written, f.default)
        if (why := _refusal(cls, f, number)) is not None:
            name = f.metadata["deepspeed"]
            raise UsageError(f"{source} sets {name} to {json.dumps(written)}, which ljperf cannot run: {why}")
        values[f.name] = number
    return Settings(**values)


def from_args(args: Any, *, engine: str) -> tuple[dict, Settings]:
    """The user's ``--deepspeed-config`` as loaded (``{}``: none) and the ``settings`` of the run's flags with it:
    what ``ljperf benchmark`` and ``ljperf plan`` read from their ``args``."""
    if args.deepspeed_config and engine != "deepspeed":
        raise UsageError(f"--deepspeed-config is for the deepspeed engine, not {engine}")
    user = load(args.deepspeed_config) if args.deepspeed_config else {}
    flags = {"micro_batch": args.micro_batch, "grad_accum": args.grad_accum, "zero_stage": args.zero_stage}
    return user, settings(user, **flags, source=f"--deepspeed-config {str(args.deepspeed_config)!r}")


def resolve(config: dict, opts: Options, *, source: str) -> tuple[dict, list[Finding]]:
    """Fill the ``"auto"`` values of a merged config from ``opts``; returns it and the lint's warnings.

    A number that contradicts an ljperf option, and every ``fail`` finding, raise ``UsageError``.
    """
    _refuse_not_finite(config, source=source)
    config = copy.deepcopy(config)
    lr = {("optimizer", "params", "lr"): (opts.lr, f"--lr {opts.lr:g}")}
    batch = Settings(micro_batch=opts.micro_batch, grad_accum=opts.grad_accum, zero_stage=opts.zero_stage)
    retyped = _agree(config, _wanted(batch, bf16=opts.bf16) | lr, source=source)
    _fill_train_batch(config, batch, world=opts.world)
    fills: dict[tuple[str, ...], Any] = {
        ("gradient_clipping",): 0.0,
        ("optimizer", "params", "betas"): list(opts.betas),
        ("optimizer", "params", "eps"): opts.eps,
        ("optimizer", "params", "weight_decay"): opts.weight_decay,
        ("zero_optimization", "reduce_bucket_size"): opts.hidden * opts.hidden,
        ("zero_optimization", "stage3_param_persistence_threshold"): 10 * opts.hidden,
    }
    for path, value in fills.items():
        if _get(config, path) == AUTO:
            _set(config, path, value)
    return config, retyped + _warnings(config, world=opts.world, source=source)


def check(config: dict, batch: Settings, *, world: int, bf16: bool, source: str) -> list[Finding]:
    """``resolve``'s checks of a merged config for a command without an optimizer (``ljperf plan``): a number
    that contradicts ``batch`` or the precision, and every ``fail`` finding, raise ``UsageError``; returns the
    lint's warnings."""
    _refuse_not_finite(config, source=source)
    config = copy.deepcopy(config)
    retyped = _agree(config, _wanted(batch, bf16=bf16), source=source)
    _fill_train_batch(config, batch, world=world)
    return retyped + _warnings(config, world=world, source=source)


def _wanted(batch: Settings, *, bf16: bool) -> dict[tuple[str, ...], tuple[Any, str]]:
    """Where a DeepSpeed config holds each setting of ljperf's flags: (the value ljperf runs, the flag)."""
    wanted = {}
    for _, f in _fields():
        value = getattr(batch, f.name)
        wanted[_path(f)] = (value, f"--{f.name.replace('_', '-')} {value}")
    return wanted | {
        ("bf16", "enabled"): (bf16, f"--precision {'bf16-mixed' if bf16 else 'fp32'}"),
        ("fp16", "enabled"): (False, "ljperf's precisions (fp32, bf16-mixed)"),
    }


def _agree(config: dict, wanted: dict[tuple[str, ...], tuple[Any, str]], *, source: str) -> list[Finding]:
    """Fill the ``"auto"`` values of ``wanted`` in ``config``; a number that differs raises ``UsageError``. A
    quoted value that reads as the same (``"stage": "3"``) is written as a number (some DeepSpeed reads take it as
    it is, and fail on it later); the returned warnings say so."""
    mismatches, quoted = [], []
    for path, (value, flag) in wanted.items():
        current = _get(config, path)
        if current is None:
            continue
        name = ".".join(path)
        if current == AUTO:
            _set(config, path, value)
        elif (read := _read(current, value)) != value or isinstance(read, bool) != isinstance(value, bool):
            mismatches.append(
                f'{name} is {json.dumps(current)} but ljperf runs {flag} (set it to "auto" or {json.dumps(value)})'
            )
        elif type(read) is not type(current):
            _set(config, path, value)
            quoted.append(f"{name} is {json.dumps(current)}, read as {json.dumps(value)}")
    if mismatches:
        raise UsageError(f"{source} contradicts ljperf's options: {'; '.join(mismatches)}")
    fix = "write JSON numbers and true/false without quotes"
    return [Finding(level="warn", message="; ".join(quoted), fix=fix)] if quoted else []


def _fill_train_batch(config: dict, batch: Settings, *, world: int) -> None:
    if _get(config, ("train_batch_size",)) == AUTO:
        _set(config, ("train_batch_size",), batch.micro_batch * batch.grad_accum * world)


def _refuse_not_finite(config: dict, *, source: str) -> None:
    """The lint's finite-number check first: a NaN that another check compares reads as a contradiction."""
    if (finding := _finite(config)).level == "fail":
        raise UsageError(f"{source}: {finding.message} (fix: {finding.fix})")


def _warnings(config: dict, *, world: int, source: str) -> list[Finding]:
    findings = lint(config, world_size=world)
    failed = [f for f in findings if f.level == "fail"]
    if failed:
        raise UsageError(f"{source}: " + "; ".join(f"{f.message} (fix: {f.fix})" for f in failed))
    return [f for f in findings if f.level == "warn"]


def _get(config: dict, path: tuple[str, ...]) -> Any:
    node: Any = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _set(config: dict, path: tuple[str, ...], value: Any) -> None:
    node = config
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
