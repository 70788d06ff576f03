"""The garbage collector paused while an ``ljperf`` process starts and resumed where its work starts
(``core.gc_pause``), in processes of their own: a pause or freeze here would change this worker's collector."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import cli_env

CYCLE = """
import gc, weakref
from ljperf.core.gc_pause import pause_collection, resume_collection

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.b, b.a = b, a
    return weakref.ref(a)
"""


def printed_with_cycles(code: str) -> list[str]:
    """What ``code`` prints, run after ``CYCLE`` in a process of its own."""
    proc = subprocess.run([sys.executable, "-c", CYCLE + code], capture_output=True, text=True, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_a_paused_start_collects_once_when_the_work_starts():
    code = """
pause_collection()
start_up = cycle()
more = [cycle() for _ in range(100_000)]  # enough allocations for collections of every generation
print(gc.isenabled(), start_up() is None)
resume_collection()
print(gc.isenabled(), start_up() is None, gc.get_freeze_count() > 0)
work = cycle()
gc.collect()
print(work() is None)
"""
    assert printed_with_cycles(code) == ["False", "False", "True", "True", "True", "True"]


def test_resuming_without_a_pause_leaves_the_programs_collector_alone():
    """A run inside another program (a test, a user's script calling ``run_worker``) keeps its own GC."""
    code = """
gc.disable()
resume_collection()
print(gc.isenabled(), gc.get_freeze_count())
"""
    assert printed_with_cycles(code) == ["False", "0"]


def test_a_benchmark_process_collects_nothing_until_its_first_step_and_then_collects():
    """The real entry point: no full collection over the heap while torch and transformers import (0 before the
    one ``resume_collection`` makes), the start-up frozen, and the collector on when the process ends."""
    code = """
import atexit, gc, sys
from ljperf import cli

before_freeze = []
gc.callbacks.append(lambda phase, info: phase == "start" and not gc.get_freeze_count() and before_freeze.append(info))
atexit.register(lambda: print(len(before_freeze), gc.isenabled(), gc.get_freeze_count() > 100_000, file=sys.stderr))
sys.argv = ["ljperf", *sys.argv[1:]]
cli.entry()
"""
    argv = ["benchmark", "--model", "torch/llama-tiny", "--seq-len", "32", "--steps", "1", "--warmup", "0"]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *argv], capture_output=True, text=True, env=cli_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == "1 True True", proc.stderr[-3000:]
