"""The step-time model's terms fitted from records, per device: ``ljperf plan --calibrate results/*.json``.

A benchmark record holds the work the model saw in its step (``results.speed.work``) beside the measured step
times and phase timers; per device (``results.speed.rates.device``: a GPU's name, ``cpu N threads``) the fit finds
the efficiency of each op class, the cost of one op, the share of compute communication can hide behind, and the
link (bandwidth, latency) that make the predicted step and phases closest to the measured ones (least squares of
their logarithms, and a ridge prior: each term's log distance from its default, weighted by ``PRIOR``, so terms the
records do not tell apart stay near their defaults rather than trade against each other). An ``ljperf comm``
record fits the links alone: time = latency + bus bytes / bandwidth over its rows. The terms are saved in the
cache folder (``speed-calibration.json``) and used by every later plan and benchmark on that device.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ljperf.core.cache import cache_root
from ljperf.core.errors import UsageError
from ljperf.core.records import read_json, write_json
from ljperf.forecast.calibrate import _same_model
from ljperf.speed.census import OP_CLASSES
from ljperf.speed.collectives import BUS_FACTOR, Links
from ljperf.speed.rates import SpeedRates
from ljperf.speed.step_time import Speed, StepWork, load_work, predict
from ljperf.speed.traffic import STYLES

VERSION = 1
PRIOR = 0.1
"""Weight of each term's log distance from its default (ridge regression in log space, toward the uncalibrated
rates): a term fitted 2x from its default costs as much as one record predicted 7% off, 17x as much as one 28% off.
The weight does not grow with the records, so enough of them move any term as far as they need; a few records, or
many of one shape whose terms all grow together, leave the terms they cannot tell apart at their defaults. Chosen
a priori (not tuned on the held-out half of ``benchmarks/step_model.py``)."""
PHASE_WEIGHT = 0.5
"""Weight of the phase timers' (forward, backward, optimizer) errors beside the step's."""


@dataclass(frozen=True, kw_only=True)
class Terms:
    """What a device's records fitted: the efficiencies, one op's cost and overlap (benchmark records)."""

    efficiency: dict[str, float]
    op_overhead_s: float
    overlap: float
    hook_s: dict[str, float]
    samples: int


@dataclass(frozen=True, kw_only=True)
class LinkTerms:
    """What a device's records fitted of its links (``ljperf comm`` records, or benchmarks on several ranks)."""

    intra_bytes_per_s: float
    latency_s: float
    samples: int


def calibration_path() -> Path:
    return cache_root() / "speed-calibration.json"


def load(path: Path | None = None) -> tuple[dict[str, Terms], dict[str, LinkTerms]]:
    """The saved terms by device ({} when none); a damaged file counts as none saved."""
    path = path or calibration_path()
    try:
        data = read_json(path)
        devices = {k: Terms(**v) for k, v in data["devices"].items()}
        links = {k: LinkTerms(**v) for k, v in data["links"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, {}
    return devices, links


def _find(saved: dict[str, Any], name: str) -> Any:
    if name in saved:
        return saved[name]
    return next((terms for key, terms in saved.items() if _same_model(key, name)), None)


def calibrated(rates: SpeedRates) -> SpeedRates:
    """``rates`` with the terms and links saved for its device, if any."""
    devices, links = load()
    terms, link = _find(devices, rates.device), _find(links, link_name(rates.device))
    if terms is not None:
        rates = replace(
            rates,
            efficiency=dict(terms.efficiency),
            op_overhead_s=terms.op_overhead_s,
            overlap=terms.overlap,
            hook_s=dict(terms.hook_s),
            calibrated=True,
        )
    if link is not None:
        rates = replace(_with_links(rates, link), calibrated=True)
    return rates


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One benchmark record as the fit sees it."""

    work: StepWork
    rates: SpeedRates
    """The rates the record was predicted with (its peaks stay: the work is priced at them)."""
    step_s: float
    """The median of its timed steps."""
    phases: dict[str, float]
    """Seconds of its phase timers' forward, backward and optimizer (empty where it has none)."""


def device_seconds(results: dict, *, threads: int | None) -> float | None:
    """A run's measured step in device seconds, what the model predicts: the median step's wall time on a GPU; on
    a CPU (``threads`` per process) its process's CPU time per thread, since on a shared machine the wall time
    also holds the waits for a core (two of 2.4 cores' worth a process under a load of 9 on 2 cores)."""
    times = results.get("step_times_s") or []
    if threads is None:
        return statistics.median(times) if times else None
    cpu = results.get("step_cpu_times_s") or []
    return statistics.median(cpu) / threads if cpu else None


def sample(record: dict) -> tuple[str, Sample] | None:
    """(device, ``Sample``) of a benchmark record with a speed section and timed steps, else None. Its phase
    timers (wall) are scaled by the step's device seconds over its wall time."""
    results = record.get("results") if isinstance(record.get("results"), dict) else {}
    speed, times = results.get("speed"), results.get("step_times_s")
    if results.get("status") != "ok" or not isinstance(speed, dict) or not speed.get("work") or not times:
        return None
    try:
        rates, work = rates_from_record(speed["rates"]), load_work(speed["work"])
        step = device_seconds(results, threads=speed.get("threads"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # StatisticsError is a ValueError
        raise UsageError(f"--calibrate: a record's results.speed is damaged ({type(exc).__name__}: {exc})") from None
    if not step:
        return None
    ms = (results.get("breakdown") or {}).get("ms") or {}
    scale = step / statistics.median(times) / 1e3
    phases = {p: ms[p] * scale for p in ("forward", "backward", "optimizer") if isinstance(ms.get(p), int | float)}
    return rates.device, Sample(work=work, rates=rates, step_s=step, phases=phases)


def rates_from_record(data: dict) -> SpeedRates:
    """The ``SpeedRates`` of a record (``SpeedRates.record``)."""
    return SpeedRates(
        device=str(data["device"]),
        flops_per_s=float(data["flops_per_s"]),
        bytes_per_s=float(data["bytes_per_s"]),
        efficiency={str(k): float(v) for k, v in data["efficiency"].items()},
        op_overhead_s=float(data["op_overhead_s"]),
        links=Links(**data["links"]),
        overlap=float(data["overlap"]),
        hook_s={str(k): float(v) for k, v in data["hook_s"].items()},
        calibrated=bool(data["calibrated"]),
    )


def _vector(rates: SpeedRates) -> list[float]:
    """The fitted terms in order: the efficiencies by class, the cost of an op, overlap, the link's bandwidth and
    latency, the hooks by engine."""
    links = rates.links
    return [
        *(rates.efficiency[c] for c in OP_CLASSES),
        rates.op_overhead_s or 1e-6,  # a start for a GPU's 0
        rates.overlap,
        links.intra_bytes_per_s,
        links.latency_s,
        *(rates.hook_s.get(style) or 1e-6 for style in STYLES),
    ]


def _rates(base: SpeedRates, x: list[float]) -> SpeedRates:
    n = len(OP_CLASSES)
    links = replace(base.links, intra_bytes_per_s=x[n + 2], latency_s=x[n + 3])
    return replace(
        base,
        efficiency=dict(zip(OP_CLASSES, x[:n], strict=True)),
        op_overhead_s=x[n],
        overlap=min(x[n + 1], 1.0),
        links=links,
        hook_s=dict(zip(STYLES, x[n + 4 :], strict=True)),
    )


def residuals(samples: list[Sample], x: list[float], x0: list[float]) -> list[float]:
    """Log errors of each step (and, weighted, of its phases), then each term's log distance from ``x0`` weighted
    by ``PRIOR`` (a GPU's op and hook costs from their start of 1 µs: a host that runs ahead): their squares' sum
    is what the fit makes least."""
    out = []
    for s in samples:
        predicted: Speed = predict(s.work, _rates(s.rates, x), peak_mfu=False)
        out.append(math.log(predicted.step_time_s / s.step_s))
        for phase, measured in sorted(s.phases.items()):
            if measured > 0 and predicted.phases[phase] > 0:
                out.append(math.sqrt(PHASE_WEIGHT) * math.log(predicted.phases[phase] / measured))
    return out + [PRIOR * math.log(a / b) for a, b in zip(x, x0, strict=True)]


def minimize(residuals: Callable[[list[float]], list[float]], x0: list[float], *, iterations: int = 100) -> list[float]:
    """Levenberg–Marquardt in log space (positive terms; the Jacobian by finite differences): the ``x`` near
    ``x0`` whose ``residuals`` have the least sum of squares."""
    import torch

    def at(z: torch.Tensor) -> torch.Tensor:
        return torch.tensor(residuals([math.exp(v) for v in z.tolist()]), dtype=torch.float64)

    z = torch.tensor([math.log(v) for v in x0], dtype=torch.float64)
    now = at(z)
    cost, damping, h = float(now @ now), 1e-3, 1e-6
    for _ in range(iterations):
        jacobian = torch.stack([(at(z + h * e) - now) / h for e in torch.eye(len(z), dtype=torch.float64)], dim=1)
        normal, gradient = jacobian.T @ jacobian, jacobian.T @ now
        while damping < 1e10:
            step = torch.linalg.solve(normal + damping * torch.diag(normal.diagonal() + 1e-12), -gradient)
            step = step.clamp(-2.0, 2.0)  # a factor of e² at most per iteration: exp() of a wild step overflows
            try:
                trial = at(z + step)
            except (OverflowError, ZeroDivisionError, ValueError):
                damping *= 4
                continue
            if (trial_cost := float(trial @ trial)) < cost:
                z, now, cost, damping = z + step, trial, trial_cost, max(damping / 3, 1e-9)
                break
            damping *= 4
        else:
            break
        if float(step.abs().max()) < 1e-9:
            break
    return [math.exp(v) for v in z.tolist()]


def fit_device(samples: list[Sample]) -> SpeedRates:
    """The rates that make ``samples``' predictions closest to their measurements (their first's as the start)."""
    base = samples[0].rates
    x0 = _vector(base)
    x = minimize(lambda v: residuals(samples, v, x0), x0)
    return replace(_rates(base, x), calibrated=True)


def fit_links(record: dict) -> tuple[str, LinkTerms] | None:
    """(device, links) of an ``ljperf comm`` record: least squares of time on bus bytes over its rows."""
    results, world = record.get("results") or {}, int(record.get("env", {}).get("world_size") or 0)
    rows = [r for r in results.get("rows", []) if r.get("op") in BUS_FACTOR and r.get("time_us")]
    if record.get("kind") != "comm" or world < 2 or len(rows) < 2:
        return None
    xs = [r["size_bytes"] * BUS_FACTOR[r["op"]](world) for r in rows]
    ys = [r["time_us"] * 1e-6 for r in rows]
    if len(set(xs)) < 2:
        return None
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope <= 0:
        return None
    devices = record.get("env", {}).get("devices") or ["cpu"]
    name = "cpu" if record.get("config", {}).get("backend") == "gloo" else str(devices[0])
    return name, LinkTerms(intra_bytes_per_s=1 / slope, latency_s=max(intercept, 0.0), samples=len(rows))


def link_name(device: str) -> str:
    """The name a device's links are kept under: its own, or ``cpu`` for any thread count of a CPU."""
    return "cpu" if device.startswith("cpu") else device


def fit(records: list[dict]) -> tuple[dict[str, Terms], dict[str, LinkTerms]]:
    """The terms per device from benchmark records, and the links: from ``ljperf comm`` records where there are
    some (measured), else from benchmark records on several ranks (the fit's)."""
    by_device: dict[str, list[Sample]] = {}
    links: dict[str, LinkTerms] = {}
    for record in records:
        if (found := sample(record)) is not None:
            by_device.setdefault(found[0], []).append(found[1])
        if (link := fit_links(record)) is not None:
            links[link[0]] = link[1]
    terms: dict[str, Terms] = {}
    for name, samples in by_device.items():
        if (measured := links.get(link_name(name))) is not None:
            samples = [replace(s, rates=_with_links(s.rates, measured)) for s in samples]
        rates = fit_device(samples)
        terms[name] = Terms(
            efficiency=rates.efficiency,
            op_overhead_s=rates.op_overhead_s,
            overlap=rates.overlap,
            hook_s=rates.hook_s,
            samples=len(samples),
        )
        several = sum(s.work.traffic.communicates for s in samples)
        if several and link_name(name) not in links:
            links[link_name(name)] = LinkTerms(
                intra_bytes_per_s=rates.links.intra_bytes_per_s, latency_s=rates.links.latency_s, samples=several
            )
    return terms, links


def _with_links(rates: SpeedRates, link: LinkTerms) -> SpeedRates:
    return replace(
        rates, links=replace(rates.links, intra_bytes_per_s=link.intra_bytes_per_s, latency_s=link.latency_s)
    )


def save(terms: dict[str, Terms], links: dict[str, LinkTerms], *, out: Path | None = None) -> Path:
    """Merge into the saved terms and save them; the file's path."""
    out = out or calibration_path()
    devices, saved_links = load(out)
    data = {
        "version": VERSION,
        "devices": {k: asdict(v) for k, v in (devices | terms).items()},
        "links": {k: asdict(v) for k, v in (saved_links | links).items()},
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, data)
    except OSError as exc:
        raise UsageError(
            f"--calibrate: cannot save {str(out)!r} ({exc.strerror or exc}); set LJPERF_CACHE_DIR"
        ) from None
    return out


def describe(terms: dict[str, Terms], links: dict[str, LinkTerms]) -> list[str]:
    """One line per fitted device and per fitted link."""
    lines = []
    for name, t in terms.items():
        effs = ", ".join(f"{c} {t.efficiency[c]:.2f}" for c in OP_CLASSES)
        hooks = ", ".join(f"{style} {1e6 * t.hook_s[style]:.1f}" for style in STYLES)
        lines.append(
            f"{name}: efficiency {effs}; {t.op_overhead_s * 1e6:.1f} µs an op; hooks (µs) {hooks}; overlap"
            f" {t.overlap:.2f} from {t.samples} record(s)"
        )
    for name, link in links.items():
        lines.append(
            f"{name} links: {link.intra_bytes_per_s / 1e9:.3g} GB/s bus bandwidth, {link.latency_s * 1e6:.0f} µs a"
            f" call, from {link.samples} record(s) or row(s)"
        )
    return lines
