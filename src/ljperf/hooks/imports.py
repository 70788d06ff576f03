"""Post-import hooks: ``when_imported("deepspeed", fn)`` calls ``fn(module)`` right after ``deepspeed`` is
first imported, or at once if it already is. Nothing is imported ahead of the user's script.

A ``sys.meta_path`` finder sees only the registered names; it lets the other finders locate the module and
wraps the loader so the callbacks run after the module body. A callback that raises is reported as one
warning and the import goes on unchanged.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

_PENDING: dict[str, list[Callable[[ModuleType], None]]] = {}
_LOCK = threading.RLock()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` once ``name`` is imported (now, if it is already)."""
    with _LOCK:
        module = sys.modules.get(name)
        if module is None:
            _PENDING.setdefault(name, []).append(callback)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
            return
    _run(callback, module)


def _run(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:  # a hook must never break the user's import
        warnings.warn(f"ljperf: hook on {module.__name__} failed, left unpatched ({exc!r})", stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the callbacks; every other attribute is the original loader's."""

    def __init__(self, loader: importlib.abc.Loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _LOCK:
            callbacks = _PENDING.pop(self._name, [])
        for callback in callbacks:
            _run(callback, module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)
