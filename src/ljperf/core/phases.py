"""The phases of a training step (forward, backward, optimizer step), marked where the engines run them, and timed
when a benchmark asks.

Use: an engine's step runs ``with phase("forward"): ...``, which does nothing unless a ``PhaseClock`` is running;
the benchmark loop runs ``with clock.step(): engine.train_step(batches)`` and reads ``clock.seconds()`` (seconds of
each step and of each phase in it). CPU: ``time.perf_counter``. CUDA: events on the current stream, read once the
steps have synchronised, so the timers add no synchronisation inside a step. ``annotate=True`` (under
``torch.profiler``): each step and phase is also a ``record_function`` range named ``ljperf.<name>``, which the
trace shows and the profiler's breakdown reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from typing import Any

PHASES = ("forward", "backward", "optimizer")
"""The step's phases, in the order they run (a micro-step repeats forward and backward)."""
STEP = "step"
ANNOTATION = "ljperf."
"""Prefix of the profiler ranges: ``ljperf.step``, ``ljperf.forward``, ``ljperf.backward``, ``ljperf.optimizer``."""

_running: PhaseClock | None = None


@contextlib.contextmanager
def phase(name: str) -> Generator[None, None, None]:
    """Phase ``name`` of the step that runs now: timed (and annotated) while a ``PhaseClock`` runs the step."""
    clock = _running
    if clock is None:
        yield
        return
    with clock.span(name):
        yield


class PhaseClock:
    """Times the steps it runs and their phases on ``device_type``; ``timed=False`` only annotates them."""

    def __init__(self, *, device_type: str, annotate: bool = False, timed: bool = True):
        self.cuda = device_type == "cuda"
        self.annotate = annotate
        self.timed = timed
        self._steps: list[list[tuple[str, Any, Any]]] = []
        """Per step: (name, start, end) of the step and of each phase; floats, or CUDA events until read."""

    @contextlib.contextmanager
    def step(self) -> Generator[None, None, None]:
        """One training step: its phases (``phase``) are timed while it runs."""
        global _running
        self._steps.append([])
        _running = self
        try:
            with self.span(STEP):
                yield
        finally:
            _running = None

    @contextlib.contextmanager
    def span(self, name: str) -> Generator[None, None, None]:
        annotation = contextlib.nullcontext()
        if self.annotate:
            from torch.profiler import record_function

            annotation = record_function(ANNOTATION + name)
        with annotation:
            if not self.timed:
                yield
                return
            start = self._now()
            yield
            self._steps[-1].append((name, start, self._now()))

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self) -> list[dict[str, float]]:
        """Each step's seconds: ``step`` and each phase that ran (summed over its micro-steps). CUDA: call it once
        the steps have synchronised."""
        out = []
        for spans in self._steps:
            totals: dict[str, float] = {}
            for name, start, end in spans:
                elapsed = start.elapsed_time(end) / 1e3 if self.cuda else end - start
                totals[name] = totals.get(name, 0.0) + elapsed
            out.append(totals)
        return out
