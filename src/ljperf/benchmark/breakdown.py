"""The step time breakdown (``results.breakdown``): forward, backward, optimizer step, communication not hidden
behind compute, and the rest, in ms and % of the step.

Run: ``breakdown(steps, source="timers", world=2)`` on the phase timers' seconds of the timed steps
(``core.phases.PhaseClock.seconds``), or on ``from_trace(events, device_type="cpu")`` of the profiled steps'
trace, whose ranges ``ljperf.step`` and ``ljperf.<phase>`` the clock annotated; ``over_ranks`` averages the ranks'.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ljperf.core.phases import ANNOTATION, PHASES, STEP

PARTS = (*PHASES, "communication", "other")
"""The parts of a step, in the order of the record and the table; they add up to the step."""
Span = tuple[float, float]

TIMERS_NOTE = (
    "timers around the phases cannot tell a wait for a collective from compute: it is counted in the phase that"
    " waits (--profile DIR splits it out)"
)
PROFILER_NOTE = "from the profiled steps' trace events; the profiler slows a step, above all on a CPU"
CPU_COLLECTIVES = ("c10d::", "gloo:", "record_param_comms", "nccl:", "wait_tensor", "_c10d_functional")
"""Names of the profiler's CPU events of collectives: gloo's threads running one, a rank's thread issuing or
waiting for one."""


def breakdown(steps: list[dict[str, float]], *, source: str, world: int) -> dict[str, Any] | None:
    """The record's breakdown of ``steps`` (each: seconds of ``step`` and of each phase and, from a trace,
    ``communication``; the rest is ``other``), averaged over them; None without a step."""
    steps = [s for s in steps if STEP in s]  # a step that failed half-way has no total
    if not steps:
        return None
    step_s = sum(s[STEP] for s in steps) / len(steps)
    comm_known = source == "profiler" or world == 1  # one process runs no collective
    ms: dict[str, float | None] = {}
    for part in PHASES:
        ms[part] = 1e3 * sum(s.get(part, 0.0) for s in steps) / len(steps)
    ms["communication"] = 1e3 * sum(s.get("communication", 0.0) for s in steps) / len(steps) if comm_known else None
    # the phases are timed inside the step: below zero only by rounding
    ms["other"] = max(0.0, 1e3 * step_s - sum(v for v in ms.values() if v is not None))
    return {
        "source": source,
        "steps": len(steps),
        "ranks": 1,
        "step_ms": 1e3 * step_s,
        "ms": ms,
        "pct": _percent(ms, 1e3 * step_s),
        "note": PROFILER_NOTE if source == "profiler" else None if comm_known else TIMERS_NOTE,
    }


def _percent(ms: dict[str, float | None], step_ms: float) -> dict[str, float | None]:
    return {k: None if v is None or not step_ms else 100 * v / step_ms for k, v in ms.items()}


def over_ranks(each: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The mean of the ranks' breakdowns, part by part (a rank without one is left out)."""
    found = [b for b in each if b is not None]
    if not found:
        return None
    ms = {
        part: None if any(b["ms"][part] is None for b in found) else sum(b["ms"][part] for b in found) / len(found)
        for part in PARTS
    }
    step_ms = sum(b["step_ms"] for b in found) / len(found)
    return {**found[0], "ranks": len(found), "step_ms": step_ms, "ms": ms, "pct": _percent(ms, step_ms)}


def from_trace(events: list[dict[str, Any]], *, device_type: str) -> list[dict[str, float]]:
    """Seconds of each profiled step (``ljperf.step``) and of its parts, from a Chrome trace's ``traceEvents``:
    the communication no compute hides (CPU: a collective runs while the rank's main thread runs no operator,
    waiting or between operators; CUDA: NCCL kernels while no other kernel runs), then each phase's range (CUDA:
    its kernels' range, where the trace has it) less the communication in it."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in complete if e.get("name") == ANNOTATION + STEP and e.get("cat") == "user_annotation"]
    if not steps:
        return []
    main = steps[0]["tid"]
    comm = _exposed_cuda(complete) if device_type == "cuda" else _exposed_cpu(complete, main)
    phases = {name: _phase_spans(complete, name, device_type=device_type) for name in PHASES}
    out = []
    for step in steps:
        bounds = (step["ts"], step["ts"] + step["dur"])
        taken = _clip(comm, bounds)
        seconds = {STEP: step["dur"] / 1e6, "communication": _length(taken) / 1e6}
        for name in PHASES:
            mine = _minus(_clip(phases[name], bounds), taken)
            seconds[name] = _length(mine) / 1e6
            taken = _union([*taken, *mine])
        out.append(seconds)
    return out


def _phase_spans(events: list[dict[str, Any]], name: str, *, device_type: str) -> list[Span]:
    """Where phase ``name`` ran: its kernels' range on CUDA (``gpu_user_annotation``) where the trace has one, else
    its range on the host."""
    cats = ("gpu_user_annotation", "user_annotation") if device_type == "cuda" else ("user_annotation",)
    for cat in cats:
        spans = [_span(e) for e in events if e.get("name") == ANNOTATION + name and e.get("cat") == cat]
        if spans:
            return _union(spans)
    return []


def _exposed_cpu(events: list[dict[str, Any]], main: Any) -> list[Span]:
    """Where a collective runs (gloo's threads, or the main thread issuing or waiting for one) while the main
    thread runs no other operator."""
    comm = _union(_span(e) for e in events if _collective(e))
    compute = _union(
        _span(e) for e in events if e.get("tid") == main and e.get("cat") == "cpu_op" and not _collective(e)
    )
    return _minus(comm, compute)


def _collective(event: dict[str, Any]) -> bool:
    return str(event.get("name", "")).startswith(CPU_COLLECTIVES)


def _exposed_cuda(events: list[dict[str, Any]]) -> list[Span]:
    kernels = [e for e in events if e.get("cat") == "kernel"]
    comm = _union(_span(e) for e in kernels if "nccl" in str(e.get("name", "")).lower())
    compute = _union(_span(e) for e in kernels if "nccl" not in str(e.get("name", "")).lower())
    return _minus(comm, compute)


def _span(event: dict[str, Any]) -> Span:
    return (float(event["ts"]), float(event["ts"]) + float(event["dur"]))


def _union(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering the same time."""
    out: list[Span] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def _clip(spans: list[Span], bounds: Span) -> list[Span]:
    return [(max(s, bounds[0]), min(e, bounds[1])) for s, e in spans if e > bounds[0] and s < bounds[1]]


def _minus(spans: list[Span], cut: list[Span]) -> list[Span]:
    """``spans`` without the time in ``cut`` (both sorted and disjoint), in one sweep over both."""
    out: list[Span] = []
    first = 0
    for start, end in spans:
        while first < len(cut) and cut[first][1] <= start:
            first += 1
        i = first
        while i < len(cut) and cut[i][0] < end:
            if cut[i][0] > start:
                out.append((start, cut[i][0]))
            start = max(start, cut[i][1])
            i += 1
        if end > start:
            out.append((start, end))
    return out


def _length(spans: list[Span]) -> float:
    return sum(end - start for start, end in spans)
