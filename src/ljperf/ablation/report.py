"""The ablation report (terminal table, report.md, PNG chart) from the runs' JSON records.

Run: ``ljperf report runs/llama3-8b``; ``ljperf ablation`` calls the same ``render`` when it finishes.
Writes ``summary.json``, ``report.md`` and ``ablation.png`` into the folder.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any

from rich.markup import escape

from ljperf import __version__
from ljperf.ablation import runner
from ljperf.ablation.stats import VariantStats, summarize
from ljperf.compile.line import compile_line
from ljperf.core.console import console, titled_table, warn
from ljperf.core.errors import UsageError
from ljperf.core.plans import no_recompute_line
from ljperf.core.records import SCHEMA_VERSION, now_iso, write_atomic, write_json
from ljperf.core.spread import OVERLAP_NOTE, Spread, format_ratio, format_spread
from ljperf.core.units import format_bytes
from ljperf.run.titles import run_title

SUMMARY, MARKDOWN, CHART = "summary.json", "report.md", "ablation.png"
IDLE = "†"
"""Marks a variant whose ``--recompute auto`` recomputed nothing (its budget held the whole run)."""


def load_records(out: Path) -> list[dict[str, Any]]:
    """Every finished run in ``out``; a file that is not a run record is skipped with a warning, and when none
    is, the first one's problem is the error."""
    records, skipped = runner.read_records(out)
    if not records:
        held = "no ablation runs (runs/*/*.json)"
        if skipped:
            held = f"no valid ablation runs: {len(skipped)} file(s) are not run records ({skipped[0]})"
        raise UsageError(f"{out} holds {held}; give the --out folder of ljperf ablation")
    for problem in skipped:
        warn(f"skipping {problem}")
    return list(records.values())


def render(out: Path, records: list[dict[str, Any]], *, command: list[str] | None) -> list[VariantStats]:
    """Statistics, then the three outputs and the terminal table."""
    stats = summarize(records)
    write_json(out / SUMMARY, summary(records, stats, command=command))
    write_atomic(out / MARKDOWN, lambda f: f.write(markdown(records, stats, command=command).encode()))
    chart(records, stats, out / CHART)
    print_table(records, stats)
    console.print(f"report: {out / MARKDOWN} · chart: {out / CHART} · summary: {out / SUMMARY}")
    return stats


def summary(records: list[dict], stats: list[VariantStats], *, command: list[str] | None) -> dict[str, Any]:
    first = _reference(records)
    envs = {r["ablation"]["environment"]["name"]: r["ablation"]["environment"] for r in records}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "ablation",
        "created": now_iso(),
        "args": command,
        "config": first.get("config"),
        "environments": list(envs.values()),
        "variants": [dataclasses.asdict(s) for s in stats],
        "runs": sorted(f"runs/{r['ablation']['environment']['name']}/{_run_file(r)}" for r in records),
    }


def _reference(records: list[dict]) -> dict:
    """The baseline's first successful run (its config describes the shared settings), else the first run."""
    return min(records, key=lambda r: (r["results"]["status"] != "ok", *_order(r)))


def _order(record: dict) -> tuple[int, int, int]:
    meta = record["ablation"]
    return meta["environment_index"], meta["variant_index"], meta["repeat"]


def _run_file(record: dict) -> str:
    meta = record["ablation"]
    return f"{meta['variant']}.r{meta['repeat']}.json"


# --- formatting -----------------------------------------------------------------------------------------


def _status(s: VariantStats) -> str:
    return ", ".join(f"{name} ×{n}" if n > 1 else name for name, n in s.statuses.items())


def rows(stats: list[VariantStats], *, marked: Collection[str] = ()) -> tuple[list[str], list[list[str]]]:
    """Header and rows shared by the terminal and the markdown tables; the variants ``marked`` (labels) get
    ``IDLE``: their ``--recompute auto`` recomputed nothing."""
    header = [
        "variant",
        "flags",
        "status",
        "tokens/s",
        "tokens/s min–max",
        "step ms",
        "predicted ms",
        "peak memory",
        "MFU %",
        "speedup vs base",
        "gain vs previous",
        "loss Δ vs base",
        "wall s",
    ]
    body = []
    for s in stats:
        tps, tps_range = format_spread(s.tokens_per_s)
        body.append(
            [
                f"{s.label} {IDLE}" if s.label in marked else s.label,
                s.flags or "(none)",
                _status(s),
                tps,
                tps_range,
                format_spread(s.step_time_s, 1e3, ".1f")[0],
                _predicted(s),
                format_bytes(s.peak_allocated_bytes.median) if s.peak_allocated_bytes else "-",
                format_spread(s.mfu, 100, ".1f")[0],
                format_ratio(s.speedup),
                format_ratio(s.gain),
                "-" if s.loss_max_abs_diff is None else f"{s.loss_max_abs_diff:.1e}",
                format_spread(s.wall_s, 1, ".1f")[0],
            ]
        )
    return header, body


def _predicted(s: VariantStats) -> str:
    """The step-time model's step beside the measured one: its ms and its error (docs/speed.md); on a CPU also the
    step it is compared with, the process's CPU ms per thread (the step ms column is the wall's)."""
    if s.predicted_step_s is None:
        return "-"
    error = f" ({s.predicted_error_pct:+.0f}%)" if s.predicted_error_pct is not None else ""
    against = f" of {1e3 * s.predicted_against_s:.1f} CPU" if s.predicted_against_s is not None else ""
    return f"{1e3 * s.predicted_step_s:.1f}{against}{error}"


def title(records: list[dict]) -> str:
    """The runs' shared settings; one the variants change shows each value, as ``mb 1|2``."""
    # Counted, not the largest repeat number: a run whose record was damaged (skipped) is not in the table.
    counts = Counter((r["ablation"]["environment_index"], r["ablation"]["variant_index"]) for r in records).values()
    low, high = min(counts), max(counts)
    repeats = str(low) if low == high else f"{low}–{high}"
    configs = [r["config"] for r in sorted(records, key=_order) if r.get("config")]
    if not configs:
        return f"ablation · {repeats} repeat(s)"

    def values(section: str, key: str) -> str:
        return "|".join(dict.fromkeys(str(c[section][key]) for c in configs))

    cfg = {
        "engine": {"name": values("engine", "name"), "zero_stage": _same(configs, "zero_stage")},
        "model": {"name": values("model", "name")},
        "launch": {"world_size": values("launch", "world_size")},
        "train": {k: values("train", k) for k in ("micro_batch", "seq_len", "grad_accum", "precision")},
    }
    steps = f"{values('train', 'steps')} steps (+{values('train', 'warmup')} warm-up)"
    return f"{run_title(cfg)} · {steps} × {repeats} repeat(s)"


def _same(configs: list[dict], key: str) -> str | None:
    """``config.engine``'s ``key`` as the title shows it: each value the runs have, None where none has one."""
    found = dict.fromkeys(str(c["engine"][key]) for c in configs if c["engine"].get(key) is not None)
    return "|".join(found) or None


def _overlap_note(stats: list[VariantStats]) -> str | None:
    """What ``≈`` means, where a ratio shows it."""
    return OVERLAP_NOTE if any(r and r.overlaps for s in stats for r in (s.speedup, s.gain)) else None


def print_table(records: list[dict], stats: list[VariantStats]) -> None:
    idle = no_recompute(records, stats)
    header, body = rows(stats, marked=idle)
    table = titled_table(title(records), caption=_overlap_note(stats))
    for i, name in enumerate(header):
        if name != "flags":  # in report.md; too wide for a terminal
            table.add_column(name, justify="left" if i < 3 else "right", no_wrap=i == 0)
    for row in body:
        table.add_row(*(escape(cell) for name, cell in zip(header, row, strict=True) if name != "flags"))
    console.print(table)
    for label, line in idle.items():
        console.print(escape(f"{IDLE} {label}: {line}"), highlight=False, soft_wrap=True)
    revisions = _revisions(records)
    if len(revisions) > 1:
        warn(f"the runs span git revisions {', '.join(revisions)}")
    for label, text in applied(records, stats):
        console.print(f"{escape(label)}: {escape(text)}")
    for s in stats:
        if s.reason:
            console.print(f"[red]{escape(s.label)}[/red]: {escape(_status(s))}: {escape(s.reason)}")


def no_recompute(records: list[dict], stats: list[VariantStats]) -> dict[str, str]:
    """``{variant: line}`` for each variant whose ``--recompute auto`` chose no recompute, because its budget holds
    the whole run (its first successful run's plan): the row alone reads as if it had been tested."""
    out = {}
    for s in stats:
        runs = _ok_runs(records, s)
        if runs and (line := no_recompute_line(min(runs, key=_order)["results"].get("recompute") or {})):
            out[s.label] = line
    return out


def _ok_runs(records: list[dict], s: VariantStats) -> list[dict]:
    """The successful runs of variant ``s``."""
    return [
        r
        for r in records
        if (r["ablation"]["environment"]["name"], r["ablation"]["variant"]) == (s.environment, s.variant)
        and r["results"]["status"] == "ok"
    ]


BREAKDOWN_PARTS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step",
                   "communication": "exposed comm.", "other": "other"}  # fmt: skip


def breakdown_section(records: list[dict], stats: list[VariantStats]) -> list[str]:
    """report.md's step time breakdown: each variant's median ms per part over its repeats (``results.breakdown``)
    beside its tokens/s, with the change from the baseline in brackets; none where no run recorded one."""
    medians = {s.label: _breakdown_medians(_ok_runs(records, s)) for s in stats}
    if not any(medians.values()):
        return []
    header = ["variant", "tokens/s", *(f"{name} ms" for name in BREAKDOWN_PARTS.values()), "step ms", "source"]
    lines = ["## Step time breakdown", "", _md_row(header), _md_row(["---"] * len(header))]
    base = medians[stats[0].label]
    for s in stats:
        if (mine := medians[s.label]) is None:
            continue
        ref = base if s is not stats[0] else None
        cells = [_delta(mine["ms"][part], None if ref is None else ref["ms"][part]) for part in BREAKDOWN_PARTS]
        cells.append(_delta(mine["step_ms"], None if ref is None else ref["step_ms"]))
        lines.append(_md_row([s.label, format_spread(s.tokens_per_s)[0], *cells, mine["source"]]))
    lines += [
        "",
        "Each part: the median over the repeats of a run's mean ms (so the step here is a mean, the table's a p50);"
        " in brackets, the change from the baseline. Timers count a"
        " wait for a collective in the phase that waits (exposed comm. `-`); a `--profile` run measures it.",
        "",
    ]
    return lines


def _breakdown_medians(runs: list[dict]) -> dict[str, Any] | None:
    found = [r["results"]["breakdown"] for r in runs if r["results"].get("breakdown")]
    if not found:
        return None
    ms = {}
    for part in BREAKDOWN_PARTS:
        values = [b["ms"][part] for b in found if b["ms"].get(part) is not None]
        ms[part] = statistics.median(values) if values else None
    sources = "/".join(dict.fromkeys(b["source"] for b in found))
    return {"ms": ms, "step_ms": statistics.median(b["step_ms"] for b in found), "source": sources}


def _delta(value: float | None, base: float | None) -> str:
    """``40.1 (-38.0)``: a variant's ms and its change from the baseline's (``base``; None: none shown)."""
    if value is None:
        return "-"
    return f"{value:.1f}" if base is None else f"{value:.1f} ({value - base:+.1f})"


def applied(records: list[dict], stats: list[VariantStats]) -> list[tuple[str, str]]:
    """(variant, what its first successful run recomputed and what compiling cost) for each variant that did
    either: an optimization that changed nothing (``--recompute auto`` whose plan recomputes no layer) shows."""
    out = []
    for s in stats:
        runs = _ok_runs(records, s)
        if not runs:
            continue
        res = min(runs, key=_order)["results"]
        parts = []
        if (plan := res.get("recompute") or {}).get("summary"):
            budget = plan.get("budget_bytes")
            parts.append(f"recompute {plan['summary']}" + (f", budget {format_bytes(budget)}" if budget else ""))
        if res.get("compile"):
            parts.append(compile_line(res["compile"]))
        if parts:
            out.append((s.label, "; ".join(parts)))
    return out


def markdown(records: list[dict], stats: list[VariantStats], *, command: list[str] | None) -> str:
    ref = _reference(records)
    env = ref.get("env", {})
    idle = no_recompute(records, stats)
    header, body = rows(stats, marked=idle)
    lines = [
        f"# Ablation: {title(records)}",
        "",
        f"runs {_time_span(records)} · rendered by ljperf {__version__} · host {env.get('host', '-')} · "
        f"devices {', '.join(env.get('devices', []))}",
        "",
    ]
    variables = env.get("variables") or {}
    if variables:
        lines += ["Variables: " + ", ".join(f"`{k}={v}`" for k, v in variables.items()), ""]
    if command:
        lines += ["```", "ljperf " + " ".join(_quote(a) for a in command), "```", ""]
    lines += ["## Results", "", _md_row(header), _md_row(["---"] * len(header)), *map(_md_row, body), ""]
    lines += [*(f"{IDLE} `{label}`: {line}" for label, line in idle.items()), *([""] if idle else [])]
    memory_method = ref.get("results", {}).get("memory_method")
    lines += [
        "Tokens/s, step ms, MFU and peak memory: the median run's (the run with the median tokens/s; of an even count"
        " of repeats, the slower of the two middle ones), as the chart's bars. "
        f"Speedup: vs `{stats[0].label}`; gain: vs the variant above it (the added optimization). "
        + (_overlap_note(stats) or ""),
        f"Peak memory measured by {memory_method or 'see the run records'}. "
        "Loss Δ: largest difference of the loss curve from the baseline's (same seed and data).",
        "",
        f"![throughput and memory per variant]({CHART})",
        "",
    ]
    if done := applied(records, stats):
        lines += ["## What each variant applied", "", *(f"- `{label}`: {text}" for label, text in done), ""]
    lines += breakdown_section(records, stats)
    failures = [r for r in records if r["results"]["status"] != "ok"]
    if failures:
        lines += ["## Failed runs", ""]
        for r in failures:
            meta = r["ablation"]
            lines.append(
                f"- `{meta['environment']['name']}/{meta['variant']}` repeat {meta['repeat']}: "
                f"{r['results']['status']}: {r['results'].get('reason')} (log: `runs/{meta['environment']['name']}/"
                f"{meta['log']}`)"
            )
        lines.append("")
    revisions = _revisions(records)
    if len(revisions) > 1:
        lines += [
            f"**Warning**: the runs span git revisions {', '.join(revisions)}: the code changed during the ablation.",
            "",
        ]
    envs = {r["ablation"]["environment"]["name"]: r["ablation"]["environment"] for r in records}
    packages = ["python", "torch", "transformers", "deepspeed", "triton", "ljperf"]
    lines += ["## Environments", "", _md_row(["name", "interpreter", *packages])]
    lines.append(_md_row(["---"] * (len(packages) + 2)))
    for e in envs.values():
        lines.append(_md_row([e["name"], f"`{e['python']}`", *(str(e["versions"].get(p) or "-") for p in packages)]))
    return "\n".join(lines) + "\n"


def _revisions(records: list[dict]) -> list[str]:
    """The checkouts' git revisions in the order the runs saw them."""
    ordered = sorted((r.get("start_time") or "", r.get("env", {}).get("git_revision")) for r in records)
    return list(dict.fromkeys(rev for _, rev in ordered if rev))


def _time_span(records: list[dict]) -> str:
    starts = sorted(r["start_time"] for r in records if r.get("start_time"))
    return f"{starts[0]} – {starts[-1]}" if starts else "-"


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _quote(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_./=+,:@" for c in arg) else repr(arg)


BAR = "bar: the median run (of an even count, the slower middle one)"
"""What a chart's bar is: the run the table's tokens/s, step time and MFU come from (``stats._one``)."""


def bar_height(s: Spread | None) -> float:
    """A chart's bar for ``s``: the median run's figure, as the table shows it; 0 for none."""
    return 0.0 if s is None else s.median


def chart_title(records: list[dict]) -> str:
    """The table's title (model, engine, shape, precision, repeats) and, on a second line, the devices."""
    devices = ", ".join(dict.fromkeys(d for r in records for d in (r.get("env") or {}).get("devices") or []))
    return f"{title(records)}\ndevice: {devices or '-'}"


def chart(records: list[dict], stats: list[VariantStats], path: Path) -> None:
    """Throughput per variant (the median run's, as the table's; min–max error bars) and peak memory beside it,
    titled with the model, engine, shape and device (also the PNG's ``Title``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [s.label for s in stats]
    x = list(range(len(stats)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(stats) + 3), 5.0))
    heading = chart_title(records)
    fig.suptitle(heading, fontsize=10)
    tps = [bar_height(s.tokens_per_s) for s in stats]
    err = [
        [tps[i] - s.tokens_per_s.low if s.tokens_per_s else 0.0 for i, s in enumerate(stats)],
        [s.tokens_per_s.high - tps[i] if s.tokens_per_s else 0.0 for i, s in enumerate(stats)],
    ]
    left.bar(x, tps, yerr=err, capsize=6, color="tab:blue", label=f"{BAR}\nwhiskers: min–max")
    left.set_title("throughput", fontsize=10)
    left.set_ylabel("tokens/s")
    left.legend(loc="best", fontsize=8)
    peaks = [bar_height(s.peak_allocated_bytes) for s in stats]
    scale, unit = (1024**3, "GiB") if max(peaks, default=0) >= 1024**3 else (1024**2, "MiB")
    right.bar(x, [p / scale for p in peaks], color="tab:orange")
    right.set_title("peak memory (bar: as throughput's)", fontsize=10)
    right.set_ylabel(unit)
    for i, s in enumerate(stats):
        if s.tokens_per_s is None:
            for ax in (left, right):
                ax.text(i, 0, _status(s), ha="center", va="bottom", color="tab:red")
        elif s.speedup is not None:
            left.annotate(
                format_ratio(s.speedup), (i, s.tokens_per_s.high), xytext=(0, 4), textcoords="offset points",
                ha="center",
            )  # fmt: skip
    for ax in (left, right):
        ax.set_xticks(x, labels, rotation=20 if len(stats) > 3 else 0, ha="right" if len(stats) > 3 else "center")
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.12)
    fig.tight_layout()
    meta = {"Title": heading.replace("\n", " · "), "Description": f"throughput {BAR}"}
    write_atomic(path, lambda f: fig.savefig(f, dpi=120, format="png", metadata=meta))
    plt.close(fig)
