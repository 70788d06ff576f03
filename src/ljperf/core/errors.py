"""Errors that ljperf turns into exit codes and one-line messages, and the signals that end a run.

Run: raise ``UsageError("...")`` anywhere: ``ljperf.cli.main`` prints it as one line and exits 2.
"""

import _thread
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_OOM = 3
EXIT_DOES_NOT_FIT = 4
"""``ljperf plan``: the forecast does not fit the memory (or ``--recompute auto`` found no plan within its budget);
the answer was printed, so a script can branch on it without reading the table."""
EXIT_DIVERGED = 5
"""``ljperf benchmark``: the loss became NaN or infinite; the run stopped there (``status: "diverged"``)."""
EXIT_SIGINT = 130
EXIT_SIGTERM = 143
EXIT_SIGPIPE = 141
"""What a shell reports for a command whose reader closed the pipe (``ljperf models --json | head``)."""


LINE_LIMIT = 400
"""Characters of a one-line error ljperf prints: input it echoes (a model name of 100,000 characters) is cut."""


def cut(line: str, *, limit: int = LINE_LIMIT) -> str:
    """``line`` as printed: whole up to ``limit`` characters, else its start and its end (what the error says and
    the fix it names) around the cut."""
    if len(line) <= limit:
        return line
    tail = limit // 4
    return f"{line[: limit - tail - 30]} … ({len(line) - limit + 30:,} characters cut) … {line[-tail:]}"


class UsageError(Exception):
    """Bad input from the user: exit 2 with this one-line message, never a traceback."""


class RunFailed(Exception):
    """A run failed after starting; carries the exit code, a one-line reason and the word its line starts with
    (``failed``; ``oom`` or ``diverged`` where the run's status says so, as a one-process run's last line)."""

    def __init__(self, reason: str, *, exit_code: int = EXIT_ERROR, word: str = "failed"):
        super().__init__(reason)
        self.exit_code = exit_code
        self.word = word


class Diverged(Exception):
    """The training loss became NaN or infinite: the figures of such a run measure nothing worth comparing."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived (``ljperf benchmark``'s handler raises it); the run unwinds so the partial result
    is kept. Not an ``Exception``: libraries' ``except Exception`` would swallow it (inductor's check of the CPU's
    vector ISA, around the compiler it runs, returns False instead), and the run would go on. Code that turns
    failures into fallbacks (compile) must let a wrapped one through too: see ``interruption``."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.exit_code = EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and what it wraps (torch.compile re-raises its workers' errors as its own; transformers' lazy
    imports re-raise a ``KeyboardInterrupt`` as ``ModuleNotFoundError``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        yield exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__


def interruption(exc: BaseException) -> Interrupted | None:
    """The ``Interrupted`` that ``exc`` is or wraps (a ``KeyboardInterrupt`` counts as SIGINT), else None."""
    for inner in _chain(exc):
        if isinstance(inner, Interrupted):
            return inner
        if isinstance(inner, KeyboardInterrupt):
            return Interrupted(signal.SIGINT)
    return None


def out_of_memory(exc: BaseException) -> str | None:
    """Why ``exc`` is (or wraps) running out of memory: the device's (``torch.OutOfMemoryError``) or the host's
    (the CPU allocator raises a plain ``RuntimeError``); None for any other error."""
    for inner in _chain(exc):
        if type(inner).__name__ == "OutOfMemoryError":
            return "out of device memory (torch.OutOfMemoryError)"
        if isinstance(inner, MemoryError):
            return f"out of host memory ({inner})" if str(inner) else "out of host memory (MemoryError)"
        text = str(inner)
        if "DefaultCPUAllocator: can't allocate memory" in text:
            tried = text.partition("you tried to allocate ")[2].partition(" bytes")[0]
            return f"out of host memory (DefaultCPUAllocator could not allocate {tried or 'a tensor'} bytes)"
    return None


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` (300 characters at most): an error in one line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def failure(exc: BaseException) -> tuple[str, str, int]:
    """(status, reason, exit code) of a run that ``exc`` ended: a signal (also wrapped), memory running out, or
    any other error."""
    if (stop := interruption(exc)) is not None:
        return "error", str(stop), stop.exit_code
    if oom := out_of_memory(exc):
        return "oom", oom, EXIT_OOM
    if isinstance(exc, Diverged):
        return "diverged", str(exc), EXIT_DIVERGED
    return "error", describe(exc), EXIT_ERROR


_received: list[int] = []
"""The signals ``raise_interrupted`` took since ``interrupt_on_signals``."""
_held = False
"""Set by ``hold_interrupts``: signals are noted, not raised."""


def forget_signals() -> None:
    """A new command starts: no signal received yet (``ljperf.cli.main``, also when called in-process)."""
    _received.clear()


IMPORT_RETRY_S = 0.05
"""How often a Ctrl-C that came during an import looks whether the import has ended."""
_waiting_for_import = threading.Event()
"""Set while a thread waits to send a Ctrl-C again: one thread, however many came."""


def note_interrupt(signum: int, _frame: object) -> None:
    """Ctrl-C while a command imports and sets up: a ``KeyboardInterrupt`` as Python's own handler raises, and
    noted, since an import can catch it (transformers turns one inside an import into ModuleNotFoundError; a
    probe that catches that would let the run go on to its end, exit 0); ``raise_if_interrupted`` raises it
    again where the run first checks. During an import it is raised once the import has ended (a thread sends it
    again): raised inside torch's C++ initialisation, it aborted the process (pybind11 ``error_already_set``:
    SIGABRT) or ended as a RecursionError."""
    _received.append(signum)
    if not _importing():
        raise KeyboardInterrupt
    if not _waiting_for_import.is_set():
        _waiting_for_import.set()
        threading.Thread(target=_interrupt_after_imports, args=(signum,), daemon=True).start()


def _interrupt_after_imports(signum: int) -> None:
    while _importing():
        time.sleep(IMPORT_RETRY_S)
    _waiting_for_import.clear()
    _thread.interrupt_main(signal.Signals(signum))


def _importing() -> bool:
    """Whether a module is being imported (its spec is marked while its code runs)."""
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False) for m in list(sys.modules.values()))


def raise_interrupted(signum: int, _frame: object) -> None:
    """A SIGTERM/SIGINT handler for runs that keep a partial result: the run unwinds, then writes it. The signal
    is kept too: raised inside a ``__del__`` or a weakref callback (the garbage collector runs them at any
    allocation), the exception goes to ``sys.unraisablehook`` and the run would go on to its end, exit status 0;
    ``raise_if_interrupted`` raises it again where the run checks."""
    _received.append(signum)
    if not _held:
        raise Interrupted(signum)


def hold_interrupts() -> None:
    """From here on a signal is noted (``raise_if_interrupted`` sees it) but not raised: the run is unwinding to
    write its record, which a signal must not cut short (torchrun sends SIGTERM to every rank once one failed,
    and it lands while the others handle their own error)."""
    global _held
    _held = True


@contextlib.contextmanager
def interrupts_held() -> Generator[None, None, None]:
    """Inside, a signal ``raise_interrupted`` takes is noted, not raised; leaving raises it: a step that must not
    be cut in two (starting a process: a signal raised inside ``Popen`` once the child exists leaves no handle
    to stop it with)."""
    global _held
    outer = _held
    _held = True
    try:
        yield
    finally:
        _held = outer
    if not outer:
        raise_if_interrupted()


def noted_interruption() -> Interrupted | None:
    """The ``Interrupted`` of the first signal noted since the command started, or None."""
    return Interrupted(_received[0]) if _received else None


def raise_if_interrupted() -> None:
    """Raise the ``Interrupted`` of a signal that came (one swallowed where Python ignores exceptions)."""
    if (stop := noted_interruption()) is not None:
        raise stop


_QUIETED = "_ljperf"
"""The attribute that marks ``sys.unraisablehook`` as ljperf's (``_quiet_when_interrupted``'s): put in place once."""


def interrupt_on_signals() -> dict[int, Any]:
    """Make SIGTERM and SIGINT raise ``Interrupted``; returns the handlers they had. A signal ``note_interrupt``
    took before (a Ctrl-C whose KeyboardInterrupt an import swallowed) stays received: the run's first check
    raises it. A
    swallowed ``Interrupted`` prints nothing (it is raised again), other unraisable errors print as before."""
    global _held
    _held = False
    if not getattr(sys.unraisablehook, _QUIETED, False):
        sys.unraisablehook = _quiet_when_interrupted(sys.unraisablehook)
    return {sig: signal.signal(sig, raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}


def restore_signals(previous: dict[int, Any]) -> None:
    """Give SIGTERM and SIGINT back the handlers ``interrupt_on_signals`` returned; signals raise again."""
    global _held
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    _held = False


def _quiet_when_interrupted(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    def unraisable(info: Any) -> None:
        if not isinstance(info.exc_value, Interrupted):
            hook(info)

    setattr(unraisable, _QUIETED, True)
    return unraisable


def one_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception, with dynamo's ``Explanation:`` line when it has one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    explanation = next((line for line in lines if line.startswith("Explanation:")), None)
    if explanation:
        text = f"{text}: {explanation.removeprefix('Explanation:').strip()}"
    return f"{type(exc).__name__}: {text}"[:400]
