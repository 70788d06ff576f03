"""Every module of ``src/ljperf`` imports. ``make test-quick`` runs the tests not marked slow, which import and
exercise each module; this one fails for a module that cannot be imported at all (a file left out of a commit, a
syntax error), whichever tests reach it."""

from __future__ import annotations

import importlib
import pkgutil

import ljperf


def test_every_module_imports():
    """``ljperf.__main__`` aside: importing it runs the command line."""
    names = [m.name for m in pkgutil.walk_packages(ljperf.__path__, "ljperf.") if m.name != "ljperf.__main__"]
    assert len(names) > 80  # the walk found the packages' modules
    for name in names:
        importlib.import_module(name)
