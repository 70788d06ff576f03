"""The cyclic garbage collector paused while an ``ljperf`` process starts, resumed where its work starts.

Run: ``pause_collection()`` first in the process (``cli.entry``), ``resume_collection()`` where the work begins
(before the first training step, before the launcher starts the ranks). Importing torch and transformers makes
millions of objects, and Python 3.11 collects over all of them again each time the heap has grown by a quarter:
about 0.75 of the 6 CPU-seconds an ``ljperf benchmark`` process of llama-tiny spends starting (measured
2026-12-06, six full collections). What start-up made is frozen (``gc.freeze``) when collection resumes: later
collections pass over the training's objects only.
"""

from __future__ import annotations

import gc

_paused = False


def pause_collection() -> None:
    """Stop cyclic collection until ``resume_collection``; nothing when it is off already."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collection() -> None:
    """Collect once, freeze what is left (modules, the model, the engine) out of later collections, and collect
    from here on; nothing unless ``pause_collection`` paused it (a run inside another program keeps its GC)."""
    global _paused
    if _paused:
        _paused = False
        gc.collect()
        gc.freeze()
        gc.enable()
