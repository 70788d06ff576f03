"""Every module of ``src/ljperf`` imports. ``make test-quick`` runs the tests not marked slow, which import and
exercise each module; this one fails for a module that cannot be imported at all (a file left out of a commit, a
syntax error), whichever tests reach it."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import ljperf


def test_every_module_imports():
    """``ljperf.__main__`` aside: importing it runs the command line."""
    names = [m.name for m in pkgutil.walk_packages(ljperf.__path__, "ljperf.") if m.name != "ljperf.__main__"]
    assert len(names) > 80  # the walk found the packages' modules
    for name in names:
        importlib.import_module(name)


def test_the_launcher_of_the_ranks_imports_no_dynamo():
    """``ljperf benchmark --nproc-per-node N`` starts N processes and trains in none of its own: importing
    ``torch._dynamo`` there (through the engines' compile wrappers) cost 1.3 of its 2.7 s of imports on 2 cores."""
    code = "import sys, ljperf.benchmark.loop, ljperf.commands.benchmark; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
