"""What ``ljperf plan --search`` prints: its JSON record (every recipe forecast, the ranking, the counts) and the
top-K table with the command that runs each, and why the first beats the second.

Run: ``print_search(search_record(setting, outcome, model=["--model", "llama3.1-8b"], extra=[]), top=5)``.
"""

from __future__ import annotations

import shlex
from typing import Any

from rich.markup import escape

from ljperf.core.console import console, say, titled_table
from ljperf.core.records import SCHEMA_VERSION
from ljperf.core.units import format_bytes
from ljperf.plan import search
from ljperf.plan.search import PRUNED, Evaluated, Outcome, Setting, choices, describe

STEP_PARTS = ("forward", "backward", "recompute", "optimizer", "exposed_comm", "bubble")
"""The speed breakdown's entries that add up to the step."""
PART_LABELS = {"exposed_comm": "exposed communication", "bubble": "pipeline bubble"}


def entry(setting: Setting, e: Evaluated, *, rank: int | None, model: list[str], extra: list[str]) -> dict[str, Any]:
    """One forecast recipe: its choices, ``ljperf benchmark`` argv and command line, peak, fit and speed."""
    argv = e.candidate.argv(model=model, base=setting.base, per_node=setting.per_node, extra=extra)
    command = shlex.join(["ljperf", *argv])
    if "--nnodes" in argv:  # each node's own flags
        command += " --node-rank RANK --rdzv-endpoint HOST:PORT"
    speed = e.speed
    return {
        "rank": rank,
        "recipe": describe(e.candidate, setting.base.world),
        "choices": list(choices(e.candidate, setting.base.world)),
        "candidate": e.candidate.record(),
        "argv": argv,
        "command": command,
        "peak_bytes": e.forecast.device_bytes,
        "peak_allocated_bytes": e.forecast.peak_allocated_bytes,
        "phase": e.forecast.phase,
        "headroom_bytes": setting.budget - e.forecast.device_bytes,
        "fits": e.fits,
        "speed": None
        if speed is None
        else {
            "step_time_s": speed.step_time_s,
            "tokens_per_s_per_device": speed.tokens_per_s_per_device,
            "mfu": speed.mfu,
            "breakdown": speed.breakdown,
            "calibrated": speed.calibrated,
        },
    }


def search_record(setting: Setting, outcome: Outcome, *, model: list[str], extra: list[str]) -> dict[str, Any]:
    """The JSON object of ``ljperf plan --search --json``: ``ranked`` (the recipes that fit, fastest first),
    ``evaluated`` (every recipe forecast, in order) and ``counts``."""
    ranked = outcome.ranked()
    ranks = {id(e): i + 1 for i, e in enumerate(ranked)}
    evaluated = [entry(setting, e, rank=ranks.get(id(e)), model=model, extra=extra) for e in outcome.evaluated]
    base = setting.base
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "search",
        "model": {"name": setting.spec.name, "architecture": setting.spec.architecture},
        "world": base.world,
        "device": base.device,
        "device_name": setting.device_name,
        "gpus_per_node": setting.per_node,
        "precision": base.precision,
        "seq_len": base.seq_len,
        "global_batch": setting.axes.global_batch,
        "gpu_memory_bytes": setting.memory,
        "memory_budget_bytes": setting.budget,
        "counts": {
            "evaluated": len(outcome.evaluated),
            "fit": len(ranked),
            "pruned": sum(outcome.pruned.values()),
            "pruned_by": {key: outcome.pruned[key] for key in PRUNED},
        },
        "ranked": sorted((x for x in evaluated if x["rank"] is not None), key=lambda x: x["rank"]),
        "evaluated": evaluated,
    }


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


def distinct(ranked: list[dict[str, Any]], top: int) -> tuple[list[dict[str, Any]], int]:
    """The first ``top`` ranked recipes that are not ties of one shown before (``search.distinct``), and the ties
    left out on the way."""
    shown = search.distinct(ranked, top, speed=lambda r: r["speed"]["tokens_per_s_per_device"],
                            peak=lambda r: r["peak_bytes"])  # fmt: skip
    if len(shown) < top:  # every one ranked was looked at
        return shown, len(ranked) - len(shown)
    last = next(i for i, r in enumerate(ranked) if r is shown[-1])
    return shown, last + 1 - len(shown)


def print_search(record: dict[str, Any], *, top: int) -> None:
    """The top ``top`` recipes (ties left out) as a table, their commands, why the first beats the second, and the
    counts."""
    where = f"{record['world']} × {record['device_name'] or record['device']}"
    title = f"plan --search · {record['model']['name']} · {where} · seq {record['seq_len']}"
    if record["global_batch"] is not None:
        title += f" · global batch {record['global_batch']}"
    table = titled_table(title)
    for name in ("#", "recipe", "tokens/s/device", "step", "MFU", "peak", "headroom"):
        table.add_column(name, justify="left" if name == "recipe" else "right")
    ranked, ties = distinct(record["ranked"], top)
    for r in ranked:
        speed = r["speed"]
        mfu = f"{100 * speed['mfu']:.1f}%" if speed["mfu"] is not None else "-"
        table.add_row(
            str(r["rank"]),
            escape(r["recipe"]),
            f"{speed['tokens_per_s_per_device']:,.0f}",
            _seconds(speed["step_time_s"]),
            mfu,
            format_bytes(r["peak_bytes"]),
            format_bytes(r["headroom_bytes"]),
        )
    console.print(table)
    lines = [f"{r['rank']}: {r['command']}" for r in ranked]
    if ties:
        lines.append(f"{ties} ties of a recipe above left out (the same predicted speed and peak; --json lists them)")
    if len(ranked) > 1:
        lines.append(why_line(ranked[0], ranked[1]))
    lines.append(counts_line(record))
    for line in lines:
        say(line)


def why_line(first: dict[str, Any], second: dict[str, Any]) -> str:
    """Why #1 beats #2: how much faster per device, and the part of the step per token it saves most on."""
    a, b = first["speed"], second["speed"]
    ratio = a["tokens_per_s_per_device"] / b["tokens_per_s_per_device"]

    def per_token(speed: dict[str, Any], part: str) -> float:
        """Seconds of ``part`` per 1,000 tokens a device trains."""
        return 1000 * speed["breakdown"][part] / (speed["tokens_per_s_per_device"] * speed["step_time_s"])

    saved = {part: per_token(b, part) - per_token(a, part) for part in STEP_PARTS}
    part = max(saved, key=lambda p: saved[p])
    faster = f"{100 * (ratio - 1):.1f}% more tokens/s per device" if ratio > 1 else "as fast"
    if ratio <= 1 and first["peak_bytes"] < second["peak_bytes"]:
        faster += ", and a smaller peak"
    why = ""
    if saved[part] > 0:
        before, after = per_token(b, part), per_token(a, part)
        share = f"{100 * (1 - after / before):.0f}% less" if before else "less"
        why = f": {PART_LABELS.get(part, part)} {share} per token ({_seconds(after)} vs {_seconds(before)}"
        why += " per 1,000 tokens a device)"
    differ = [f"{x} vs {y}" for x, y in zip(first["choices"], second["choices"], strict=True) if x != y]
    return f"why {first['rank']} over {second['rank']} ({'; '.join(differ)}): {faster}{why}"


def counts_line(record: dict[str, Any]) -> str:
    counts = record["counts"]
    by = ", ".join(f"{n} {PRUNED[key]}" for key, n in counts["pruned_by"].items() if n)
    budget = format_bytes(record["memory_budget_bytes"])
    return (
        f"searched: {counts['evaluated']} recipes forecast exactly, {counts['fit']} fit the budget {budget};"
        f" {counts['pruned']} pruned without a forecast{f' ({by})' if by else ''}"
    )
