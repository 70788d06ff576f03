"""Overhead terms per device type, fitted from benchmark records: ``ljperf plan --calibrate results/*.json``.

A record of ``ljperf benchmark`` holds the forecast beside the measured peaks (``results.forecast``). Per device
name, the fit is ``measured allocated = scale · forecast + offset`` (least squares; offset only with one
record or one forecast value, or when the line's slope is outside ``PLAUSIBLE_SCALE``: points too close together
for a slope) and ``reserved = reserved_scale · allocated`` (the median ratio). The fitted
terms are saved as JSON in the cache folder (``calibration.json``) and applied to later forecasts.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ljperf.core.cache import cache_root
from ljperf.core.console import warn
from ljperf.core.errors import UsageError
from ljperf.core.record_check import record_problem
from ljperf.core.records import read_json, read_json_object, write_json

MiB = 1024**2
CALIBRATION_VERSION = 1
PLAUSIBLE_SCALE = (0.5, 2.0)
"""Slopes a fit may keep: the forecast counts every tensor, so a miss is a share of it, never twice or half;
two records 10% apart in size fit any slope (one user's fit gave -1.0 and a negative peak for 70B)."""


@dataclass(frozen=True, kw_only=True)
class Overheads:
    """What the traced tensor bytes miss on a device: allocator and library terms."""

    scale: float = 1.0
    """Multiplier of the traced peak (kernels that save more or less than the CPU trace)."""
    offset: int = 0
    """Bytes added to the allocated peak (library workspaces that live in the allocator)."""
    reserved_scale: float | None = None
    """Reserved / allocated at the peak (rounding and fragmentation); None: no allocator (CPU)."""
    context: int = 0
    """Bytes outside the allocator: CUDA context, kernels, library handles."""
    samples: int = 0
    """Records this was fitted from (0: the defaults)."""

    def apply(self, allocated: int) -> tuple[int, int | None]:
        peak = round(self.scale * allocated + self.offset)
        return peak, (round(self.reserved_scale * peak) if self.reserved_scale else None)


DEFAULTS: dict[str, Overheads] = {
    "cpu": Overheads(),
    # Uncalibrated starting points for CUDA: two cuBLAS workspaces (32 MiB each on Hopper in torch's default
    # CUBLAS_WORKSPACE_CONFIG, one per thread's handle: the forward's and autograd's backward thread), counted by
    # the caching allocator; a typical context of ~0.5 GiB. Reserved over allocated: 1.08 to 1.21 over nine
    # H200 runs (2026-12-04: torch, FSDP2 and ZeRO, llama3.2-1b/3b), median 1.145; the offset fitted there was
    # 61 MiB. Calibrate to replace them.
    "cuda": Overheads(offset=64 * MiB, reserved_scale=1.15, context=512 * MiB),
}


def calibration_path() -> Path:
    return cache_root() / "calibration.json"


def load(path: Path | None = None) -> dict[str, Overheads]:
    """Saved overheads by device name ({} when none were saved); a damaged file or entry counts as none saved
    (``--calibrate`` writes it anew)."""
    path = path or calibration_path()
    if not path.exists():
        return {}
    try:
        entries = read_json(path)["devices"].items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    saved = {}
    for name, values in entries:
        try:
            terms = Overheads(**values)
            terms.apply(1)  # every term a number
        except (TypeError, ValueError):
            continue
        saved[name] = terms
    return saved


def _count(value: object) -> int | None:
    """A byte count from a record (None unless a positive int)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def overheads_for(device_type: str, device_name: str | None) -> Overheads:
    """The calibrated terms of ``device_name`` if any, else the defaults of ``device_type``."""
    saved = load()
    if device_name in saved:
        return saved[device_name]
    for name, terms in saved.items():
        if device_name and _same_model(name, device_name):
            return terms
    return DEFAULTS[device_type]


def _same_model(a: str, b: str) -> bool:
    """Whether the shorter name is a whole word of the longer: ``H100`` is ``NVIDIA H100 80GB HBM3``, while
    ``H20`` is not ``NVIDIA H200`` nor ``L4`` ``NVIDIA L40S``."""
    short, long = sorted((a.lower(), b.lower()), key=len)
    return re.search(rf"(?<!\w){re.escape(short)}(?!\w)", long) is not None


def fit(records: list[dict]) -> dict[str, Overheads]:
    """Fit the overheads per device name from benchmark records that hold a forecast and a measured peak."""
    by_device: dict[str, list[tuple[int, int, int | None]]] = {}
    for record in records:
        results = record.get("results")
        if not isinstance(results, dict) or not isinstance(fc := results.get("forecast"), dict):
            continue
        if results.get("status") != "ok":
            continue
        predicted, measured = _count(fc.get("traced_peak_allocated_bytes")), _count(results.get("peak_allocated_bytes"))
        if predicted is None or measured is None:
            continue
        name = str(fc.get("calibration_name") or _device_name(record))
        by_device.setdefault(name, []).append((predicted, measured, _count(results.get("peak_reserved_bytes"))))
    fitted = {}
    for name, rows in by_device.items():
        xs, ys = [r[0] for r in rows], [r[1] for r in rows]
        slope, intercept = statistics.linear_regression(xs, ys) if len(set(xs)) >= 2 else (0.0, 0.0)
        if not PLAUSIBLE_SCALE[0] <= slope <= PLAUSIBLE_SCALE[1]:
            slope, intercept = 1.0, statistics.fmean(y - x for x, y in zip(xs, ys, strict=True))
        ratios = [r[2] / r[1] for r in rows if r[2]]
        base = DEFAULTS["cpu" if name == "cpu" else "cuda"]
        fitted[name] = replace(
            base,
            scale=slope,
            offset=round(intercept),
            reserved_scale=statistics.median(ratios) if ratios else base.reserved_scale,
            samples=len(rows),
        )
    return fitted


def _device_name(record: dict) -> str:
    """The calibration name of an older record, written before records named it: the first device's name
    unless the run said ``--device cpu``."""
    env, config = record.get("env"), record.get("config")
    devices = (env.get("devices") if isinstance(env, dict) else None) or ["unknown"]
    train = config.get("train") if isinstance(config, dict) else None
    return "cpu" if isinstance(train, dict) and train.get("device") == "cpu" else str(devices[0])


def valid_records(paths: list[str], *, what: str) -> list[dict]:
    """The records in ``paths`` that ``record_problem`` passes; each other one is skipped with one line naming its
    file and field, and when none is left that line is the error (exit 2)."""
    records, skipped = [], []
    for p in paths:
        record = read_json_object(p, what=f"{what} {p!r}")
        if (problem := record_problem(record)) is None:
            records.append(record)
        else:
            skipped.append(f"{p}: {problem}")
    if not records and skipped:
        raise UsageError(f"{what}: no valid record ({skipped[0]})")
    for line in skipped:
        warn(f"{what}: skipping {line}")
    return records


def calibrate(paths: list[str], *, out: Path | None = None) -> dict[str, Overheads]:
    """Read benchmark records (JSON), fit, merge into the saved calibration and save it atomically."""
    records = valid_records(paths, what="--calibrate")
    fitted = fit(records)
    if not fitted:
        raise UsageError("--calibrate: no record holds both a forecast and a measured peak (run ljperf benchmark)")
    save(fitted, out=out)
    return fitted


def save(fitted: dict[str, Overheads], *, out: Path | None = None) -> None:
    """Merge ``fitted`` into the saved calibration and save it atomically."""
    out = out or calibration_path()
    merged = {**load(out), **fitted}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, {"version": CALIBRATION_VERSION, "devices": {k: asdict(v) for k, v in merged.items()}})
    except OSError as exc:
        reason = exc.strerror or exc
        raise UsageError(f"--calibrate: cannot save {str(out)!r} ({reason}); set LJPERF_CACHE_DIR") from None
