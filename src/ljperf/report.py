"""What a run shows people: a live progress bar (rank 0 only) and a final table with units."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ljperf.forecast.bench import forecast_line
from ljperf.launch import RunFolder
from ljperf.models import catalog_names
from ljperf.units import format_bytes


class _Console(Console):
    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError  # to ljperf.cli, which exits 141 as for print() (rich's own exits 1)


# Wide enough for the tables when output goes to a file or CI log (rich assumes 80 columns there); lines of
# text are not wrapped (a path stays one line to copy).
console = _Console(soft_wrap=True) if sys.stdout.isatty() else _Console(width=140, soft_wrap=True)
_stderr = _Console(stderr=True, soft_wrap=True, highlight=False)


def warn(message: str) -> None:
    """One ``warning: ...`` line on stderr, never wrapped (a long path stays one greppable line)."""
    _stderr.print(f"[yellow]warning[/yellow]: {escape(message)}")


class ProgressReporter:
    """Progress bar on rank 0; when a launcher watches the run, one JSON line per step in its run folder."""

    def __init__(self, run: Any):
        self.enabled = run.is_main
        self._bar: Progress | None = None
        self._task = None
        self._log = None
        folder = RunFolder.watching()
        self.watched = folder is not None
        """A launcher watches the run (and reports its failure)."""
        if self.enabled and folder is not None:
            self._log = open(folder.progress, "a", buffering=1)

    def step(self, step: int, *, total: int, loss: Any, seconds: float | None, peaks: dict | None = None) -> None:
        """Step ``step`` ended; ``peaks``: the memory a measured step used (its line keeps it for the launcher)."""
        if not self.enabled:
            return
        value = float(loss)
        if self._bar is None:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  step {task.fields[ms]}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
                refresh_per_second=2,  # a render thread that wakes rarely: it shares the cores with training
            )
            self._task = self._bar.add_task("train", total=total, loss=value, ms="-")
            self._bar.start()
        ms = f"{seconds * 1e3:.1f} ms" if seconds is not None else "(memory)"
        self._bar.update(self._task, completed=step + 1, loss=value, ms=ms)
        if self._log is not None:
            line = {"step": step, "loss": value, "time_s": seconds} | ({"peaks": peaks} if peaks else {})
            self._log.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def finished(self, record: dict) -> None:
        if self._log is not None:
            self._log.write(json.dumps({"finished": record["results"]["status"]}) + "\n")
            self._log.close()
            self._log = None


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def shape_title(engine: str, model: str, *, where: str, shape: dict) -> str:
    """``engine/model · where · mb × seq × accum · precision``, the title of a run's or a forecast's table, from
    ``shape``'s ``micro_batch``, ``seq_len``, ``grad_accum`` and ``precision`` (a record's train or a recipe).
    A ``--model-config`` path is ``engine · path`` (``torch//abs/config.json`` read as neither)."""
    subject = f"{engine}/{model}" if model in catalog_names() else f"{engine} · {model}"
    sizes = f"mb {shape['micro_batch']} × seq {shape['seq_len']} × accum {shape['grad_accum']}"
    return f"{subject} · {where} · {sizes} · {shape['precision']}"


def run_title(cfg: dict) -> str:
    """The table title of a benchmark record's ``config``: ``shape_title`` with ``N process(es)``."""
    where = f"{cfg['launch']['world_size']} process(es)"
    return shape_title(cfg["engine"]["name"], cfg["model"]["name"], where=where, shape=cfg["train"])


def titled_table(title: str, **options: Any) -> Table:
    """A table whose title prints as written (escaped) on one line: the table is made at least as wide, since rich
    wraps a title to the table's width."""
    return Table(title=escape(title), min_width=len(title) + 4, **options)


def print_result_table(record: dict) -> None:
    """The result of a benchmark run as a table (metric, value, unit), then its memory forecast and compile lines."""
    res = record["results"]
    table = titled_table(run_title(record["config"]))
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("unit")
    rows = [
        # A reason quotes errors (gloo's name source files in brackets): text, never rich markup.
        ("status", escape(res["status"] + (f" ({res['reason']})" if res.get("reason") else "")), ""),
        ("steps measured", str(res["steps_completed"]), "steps"),
        ("step time p50", _fmt(res.get("step_time_s_p50") and res["step_time_s_p50"] * 1e3, ".1f"), "ms"),
        ("step time p90", _fmt(res.get("step_time_s_p90") and res["step_time_s_p90"] * 1e3, ".1f"), "ms"),
        ("throughput", _fmt(res.get("tokens_per_s"), ",.0f"), "tokens/s"),
        ("throughput per device", _fmt(res.get("tokens_per_s_per_device"), ",.0f"), "tokens/s"),
        ("TFLOPS per device", _fmt(res.get("tflops_per_device"), ".3f"), "TFLOP/s"),
        ("MFU", _fmt(res.get("mfu") and res["mfu"] * 100, ".1f"), "%"),
        ("peak allocated (max rank)", format_bytes(res.get("peak_allocated_bytes")), ""),
        ("peak reserved (max rank)", format_bytes(res.get("peak_reserved_bytes")), ""),
        ("loss first → last", _loss_range(res.get("losses") or []), "nats"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if line := forecast_line(res):
        print(line)
    if res.get("compile"):
        print(compile_line(res["compile"]))


def compile_line(compiled: dict[str, Any]) -> str:
    """``regional compile: 5 regions, 1 graph breaks, 0 recompiles, 6.1 s compiling, 0 fallbacks``: a result's
    ``compile`` part in one line (the startup hook's Trainer summary too)."""
    mode = compiled["mode"]
    if "deepcompile" in compiled:
        mode += f" (DeepCompile {'on' if compiled['deepcompile'] else 'off'})"
    return (
        f"{mode} compile: {compiled['regions']} regions, {compiled['graph_breaks']} graph breaks, "
        f"{compiled['recompiles']} recompiles, {compiled['time_s']:.1f} s compiling, "
        f"{len(compiled['fallbacks'])} fallbacks"
    )


def _loss_range(losses: list[float]) -> str:
    return f"{losses[0]:.4f} → {losses[-1]:.4f}" if losses else "-"
