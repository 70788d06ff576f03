"""The result of a benchmark run for people: a table with units, then its memory forecast and compile lines.

Run: ``print_result_table(record)`` on rank 0 when a run ends (``ljperf benchmark`` does).
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from ljperf.compile.line import compile_line
from ljperf.core.console import console, say, titled_table
from ljperf.core.records import STDOUT
from ljperf.core.units import format_bytes
from ljperf.run.titles import run_title


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_result_table(record: dict) -> None:
    """The result of a benchmark run as a table (metric, value, unit), then its memory forecast and compile lines."""
    res = record["results"]
    if res["status"] != "ok" and not res.get("step_times_s") and res.get("peak_allocated_bytes") is None:
        _print_refusal(record)
        return
    table = titled_table(run_title(record["config"]))
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("unit")
    rows = [
        ("status", res["status"], "(reason below)" if res.get("reason") else ""),
        ("steps measured", str(res["steps_completed"]), "steps"),
        ("step time p50 (median)", _fmt(res.get("step_time_s_p50") and res["step_time_s_p50"] * 1e3, ".1f"), "ms"),
        ("step time p90", _fmt(res.get("step_time_s_p90") and res["step_time_s_p90"] * 1e3, ".1f"), "ms"),
        ("throughput", _fmt(res.get("tokens_per_s"), ",.0f"), "tokens/s"),
        ("throughput per device", _fmt(res.get("tokens_per_s_per_device"), ",.0f"), "tokens/s"),
        ("TFLOPS per device", _fmt(res.get("tflops_per_device"), ".3f"), "TFLOP/s"),
        ("MFU", _fmt(res.get("mfu") and res["mfu"] * 100, ".1f"), "%" + _why_no_mfu(record)),
        ("peak allocated (max rank)", format_bytes(res.get("peak_allocated_bytes")), ""),
        ("peak reserved (max rank)", format_bytes(res.get("peak_reserved_bytes")), _why_no_reserved(record)),
        ("loss first → last", _loss_range(res.get("losses") or []), "nats"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if res.get("reason"):
        # A reason quotes errors at length: a line of its own, not a wrapped, right-justified cell.
        say(f"{res['status']}: {res['reason']}")
    if res.get("breakdown"):
        console.print(breakdown_table(res["breakdown"]))
    if pipeline := res.get("pipeline"):
        say(pipeline_line(pipeline, record["config"]["engine"].get("pipeline") or {}))
    if line := forecast_line(res):
        say(line)
    if res.get("profile"):
        say(profile_line(res["profile"]))
    if res.get("compile"):
        say(compile_line(res["compile"]))


PART_NAMES = {
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer step",
    "communication": "communication (exposed)",
    "other": "other",
}


def breakdown_table(bd: dict[str, Any]) -> Table:
    """``results.breakdown`` as a table: each part of the step in ms and % of the step, its source and its statistic
    (the mean over the steps, where the result table gives the median, p50) in the title."""
    ranks = f" and {bd['ranks']} ranks" if bd["ranks"] > 1 else ""
    title = f"step time breakdown ({bd['source']}, mean of {bd['steps']} steps{ranks})"
    table = titled_table(title, caption=bd["note"])
    table.add_column("part")
    table.add_column("ms", justify="right")
    table.add_column("% of step", justify="right")
    for part, name in PART_NAMES.items():
        table.add_row(name, _fmt(bd["ms"][part], ".1f"), _fmt(bd["pct"][part], ".1f"))
    table.add_section()
    table.add_row("step (mean)", _fmt(bd["step_ms"], ".1f"), "100.0")
    return table


def profile_line(profile: dict[str, Any]) -> str:
    """Where ``--profile`` wrote its files, and what opens them (or why a rank's could not be written)."""
    text = f"profile: {len(profile['traces'])} trace(s) in {profile['folder']} (open in https://ui.perfetto.dev)"
    if profile.get("error"):
        text += f"; not written: {profile['error']}"
    if profile["memory_snapshots"]:
        text += "; memory snapshots: drag a .memory.pickle into https://pytorch.org/memory_viz"
    return text


def pipeline_line(results: dict[str, Any], config: dict[str, Any]) -> str:
    """``--pp``: the schedule's bubble (its ranks idle while it fills and drains: in the breakdown's other) and
    each pipeline rank's peak."""
    peaks = ", ".join(format_bytes(p) for p in results["peak_allocated_bytes_per_pp_rank"])
    return (
        f"pipeline: {config.get('schedule')} over {config.get('stages')} stages ({config.get('split')} layers),"
        f" {config.get('microbatches')} micro-batches: bubble {results['bubble_fraction']:.0%} of the step's"
        f" pipeline time (in other); peak per pipeline rank {peaks}"
    )


def _print_refusal(record: dict) -> None:
    """A run that measured nothing (refused before it started, or failed before its first step): its title and
    its reason as lines (it sat in the status cell of a table of dashes), then the forecast's line."""
    res = record["results"]
    say(run_title(record["config"]))
    reason = res.get("reason") or "no reason recorded"
    head, inner = reason[:-1].split(" (", 1) if reason.endswith(")") and " (" in reason else ("", reason)
    say(f"{res['status']}, nothing measured" + (f": {head}:" if head else ":"))
    for part in inner.split("; "):
        say(f"  {part}")
    if line := forecast_line(res):
        say(line)


def _why_no_mfu(record: dict) -> str:
    """Why the table's MFU is ``-``: the peak it divides by is known for a GPU's dense bf16 only."""
    res, train = record["results"], record["config"]["train"]
    if res.get("mfu") is not None or res.get("tflops_per_device") is None:
        return ""
    if train.get("device") == "cpu":
        return " (a CPU has no peak: give --peak-tflops)"
    if train.get("precision") == "fp32":
        return " (the peak table holds bf16: give --peak-tflops)"
    return " (no peak known for this GPU: give --peak-tflops)"


def _why_no_reserved(record: dict) -> str:
    """Why peak reserved is ``-``: only CUDA's caching allocator reserves."""
    cpu = record["config"]["train"].get("device") == "cpu"
    return "(a CPU has no caching allocator)" if cpu and record["results"].get("peak_reserved_bytes") is None else ""


def _loss_range(losses: list[float | None]) -> str:
    """First → last; a loss the record holds as null was NaN or infinite (strict JSON has neither)."""
    shown = ["not finite" if x is None else f"{x:.4f}" for x in (losses[0], losses[-1])] if losses else []
    return " → ".join(shown) or "-"


def forecast_line(results: dict[str, Any]) -> str | None:
    """``memory forecast 30.94 MiB (peak at optimizer step) vs measured 30.94 MiB (+0.0%)``, or None without a
    forecast."""
    fc = results.get("forecast")
    if not fc:
        return None
    text = f"memory forecast {format_bytes(fc['peak_allocated_bytes'])} (peak at {fc['phase']})"
    if fc["error_pct"] is not None:
        text += f" vs measured {format_bytes(results['peak_allocated_bytes'])} ({fc['error_pct']:+.1f}%)"
    if reason := fc.get("analytic_reason"):
        text += f"; by the analytic formula, not traced: {reason}"
    return text


def last_line(reason: str, *, interrupted: bool, output: str | None, status: str = "error") -> str:
    """The line a failed or interrupted run ends with, the same for one process and for ljperf's launcher; an
    out-of-memory run says ``oom``, a diverged one ``diverged``."""
    kept = output not in (None, STDOUT)
    if interrupted:
        return f"ljperf benchmark: {reason}" + (f"; partial result kept: {output}" if kept else "")
    word = status if status in ("oom", "diverged") else "failed"
    return f"ljperf benchmark: {word}: {reason}" + (f"; result record: {output}" if kept else "")
