"""A benchmark run's progress: a live bar on rank 0 and, when ljperf's launcher watches the run, one JSON line
per step in its run folder (what the launcher rebuilds a record from if rank 0 dies).

Run: ``reporter = ProgressReporter(run)``, then ``reporter.step(...)`` after each step and ``reporter.close()``.
"""

from __future__ import annotations

import json
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from ljperf.core.console import console
from ljperf.distributed.launch import RunFolder


class ProgressReporter:
    """Progress bar on rank 0; when a launcher watches the run, one JSON line per step in its run folder."""

    def __init__(self, run: Any):
        self.enabled = run.is_main
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._log = None
        folder = RunFolder.watching()
        self.watched = folder is not None
        """A launcher watches the run (and reports its failure)."""
        if self.enabled and folder is not None:
            self._log = open(folder.progress, "a", buffering=1)

    def step(
        self, step: int, *, timed: tuple[int, int], loss: Any, seconds: float | None, peaks: dict | None = None
    ) -> None:
        """Step ``step`` ended; ``timed``: the timed steps done and asked for (``--steps``: what the bar counts,
        warm-up and the untimed memory step aside); ``peaks``: the memory a measured step used (its line keeps it
        for the launcher)."""
        if not self.enabled:
            return
        value = float(loss)
        if self._bar is None or self._task is None:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  step {task.fields[ms]}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
                refresh_per_second=2,  # a render thread that wakes rarely: it shares the cores with training
            )
            self._task = self._bar.add_task("warm-up", total=timed[1], loss=value, ms="-")
            self._bar.start()
        ms = f"{seconds * 1e3:.1f} ms" if seconds is not None else "(untimed)"
        phase = "warm-up" if timed[0] == 0 else "timed"
        self._bar.update(self._task, description=phase, completed=timed[0], loss=value, ms=ms)
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
