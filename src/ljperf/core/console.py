"""What ljperf prints for people: one console for tables (stdout) and one-line warnings on stderr.

Run: ``console.print(titled_table("title"))`` or ``warn("...")``; rich renders, never wrapping a line of text.
``check_output(path)`` checks where a command's record goes before it runs (``-``: the tables go to stderr).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ljperf.core.records import STDOUT, check_writable


class _Console(Console):
    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError  # to ljperf.cli, which exits 141 as for print() (rich's own exits 1)


CONSOLE_ENV = "LJPERF_CONSOLE"
"""``stderr``: the tables go to standard error, because standard output carries a record (``--output -``)."""

# Wide enough for the tables when output goes to a file or CI log (rich assumes 80 columns there); lines of
# text are not wrapped (a path stays one line to copy).
console = _Console(soft_wrap=True) if sys.stdout.isatty() else _Console(width=140, soft_wrap=True)
_stderr = _Console(stderr=True, soft_wrap=True, highlight=False)
if os.environ.get(CONSOLE_ENV) == "stderr":
    console.file = sys.stderr


def tables_to_stderr() -> None:
    """What ljperf prints for people goes to standard error, in this process and those it starts: standard
    output carries the JSON record."""
    os.environ[CONSOLE_ENV] = "stderr"
    console.file = sys.stderr


def warn(message: str) -> None:
    """One ``warning: ...`` line on stderr, never wrapped (a long path stays one greppable line)."""
    _stderr.print(f"[yellow]warning[/yellow]: {escape(message)}")


def say(line: str) -> None:
    """One line for people, as written (no markup, never wrapped), where the tables go."""
    print(line, file=console.file, flush=True)


def titled_table(title: str, **options: Any) -> Table:
    """A table whose title prints as written (escaped) on one line: the table is made at least as wide, since rich
    wraps a title to the table's width."""
    return Table(title=escape(title), min_width=len(title) + 4, **options)


def check_output(
    path: str | os.PathLike | None, *, what: str = "--output", inputs: tuple[str | os.PathLike | None, ...] = ()
) -> None:
    """``check_writable`` for a command's record file (None: none); ``-`` sends what ljperf prints for people to
    standard error, so that standard output holds the record alone."""
    if path is None:
        return
    check_writable(path, what=what, inputs=inputs)
    if str(path) == STDOUT:
        tables_to_stderr()
