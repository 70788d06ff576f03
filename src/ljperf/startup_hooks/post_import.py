"""Post-import hooks: ``when_imported("deepspeed", fn)`` calls ``fn(module)`` right after ``deepspeed`` is first
imported, or at once if it already is; and ``boot()``, what ``ljperf_startup.pth`` runs when a hook's variable is
set. Nothing is imported ahead of the user's script, and this module imports only ``sys``: every Python process
of an image with ``COMPILE_OPTIMIZATION=true`` loads it.

A ``sys.meta_path`` finder sees only the registered names; it lets the other finders locate the module and wraps
the loader so the callbacks run after the module body. A callback that raises is reported as one warning and the
import goes on unchanged.
"""

import sys

TYPE_CHECKING = False  # typing's own: importing typing here would cost every Python start
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType

    Callback = Callable[[ModuleType], object]

TRIGGERS = ("transformers.trainer", "deepspeed", "torch.distributed.fsdp")
"""The imports a startup hook patches (``startup_hooks.checkpoint``, ``startup_hooks.compile_trainer``): the hooks
load at the first."""

_PENDING: "dict[str, list[Callback]]" = {}
"""Module name → callbacks waiting for its import."""


def boot() -> None:
    """Load the startup hooks (``startup_hooks.install``) when the script first imports one of ``TRIGGERS``: a
    process that never does (``pip``, a tool, ``python -c``) pays for this module alone."""
    for name in TRIGGERS:
        when_imported(name, _install)


def _install(module: "ModuleType") -> None:
    from ljperf.startup_hooks.install import install  # the hooks and their variables' check: only where a hook can act

    install()


def when_imported(name: str, callback: "Callback") -> None:
    """Run ``callback(module)`` once ``name`` is imported (now, if it is already). A module still running its body
    (``transformers.trainer`` imports FSDP2, whose import loads the hooks) waits for the end of it."""
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        _run(callback, module)
        return
    _PENDING.setdefault(name, []).append(callback)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _run(callback: "Callback", module: "ModuleType") -> None:
    try:
        callback(module)
    except Exception as exc:  # a hook must never break the user's import
        print(f"[ljperf] warning: hook on {module.__name__} failed, left unpatched ({exc!r})", file=sys.stderr)


class _Finder:
    """A meta-path finder for the pending names only: the other finders locate the module, its loader is wrapped."""

    def find_spec(
        self, fullname: str, path: "Sequence[str] | None", target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    from typing import cast  # here a hook's module is about to load, and it imports typing anyway

                    # cast: typeshed types a spec's loader as importlib.abc.Loader; the import system takes any
                    # object with its methods (importing importlib.abc to subclass it would cost every start)
                    spec.loader = cast("Loader", _Loader(spec.loader, fullname))
                return spec
        return None


class _Loader:
    """The module's own loader, then the callbacks; every other attribute is the original loader's."""

    def __init__(self, loader: "Loader", name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec: "ModuleSpec") -> "ModuleType | None":
        return self._loader.create_module(spec)

    def exec_module(self, module: "ModuleType") -> None:
        self._loader.exec_module(module)
        while callbacks := _PENDING.pop(self._name, None):  # a callback may register more for this module
            for callback in callbacks:
                _run(callback, module)

    def __getattr__(self, name: str) -> object:
        return getattr(self._loader, name)
