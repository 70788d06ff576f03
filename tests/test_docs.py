"""Docs that run: every ``ljperf …`` command line of README.md and docs/*.md (in code blocks and inline code)
parses with the parser ``ljperf.cli`` builds, without running, and every dotted Python reference in docs/ resolves
(its module imports, then each attribute is there), the README's too.

Run: ``.venv/bin/python -m pytest -q -n 0 tests/test_docs.py``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from ljperf import cli
from ljperf.core.options import deprecations
from ljperf.core.phases import ANNOTATION, PHASES, STEP

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PACKAGE = ROOT / "src" / "ljperf"

PLACEHOLDERS = {
    "ENGINE/NAME": "torch/llama-tiny",
    "NAME": "H100",  # --gpu NAME
    "N": "2",
    "SIZE": "1GiB",
    "FILE": "examples/config.json",
    "DIR": "runs/1b",
}
"""What a command line's placeholder stands for, so that it parses as a user's line would: metavars as ``--help``
shows them. ``...`` (more flags of the reader's own) is left out, and ``[--flag]`` (optional) is read as given."""

SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "2>", "&"}
LAUNCHERS = re.compile(r"(.*/)?(python3?|torchrun)")
"""Commands that start ljperf as a module: ``python -m ljperf …``, ``torchrun … -m ljperf …``."""


@dataclass(frozen=True)
class Line:
    """A command line of a doc: where it is, and ljperf's arguments in it."""

    where: str
    argv: tuple[str, ...]
    inline: bool = False
    """In prose (inline code), where ``ljperf COMMAND`` alone names the command."""


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(the line number of its first line, its language, its lines) of each fenced code block."""
    blocks, lines, start, lang = [], text.splitlines(), None, ""
    for number, line in enumerate(lines, start=1):
        if line.startswith("```"):
            if start is None:
                start, lang = number + 1, line[3:].strip()
            else:
                blocks.append((start, lang, lines[start - 1 : number - 1]))
                start = None
    return blocks


def ljperf_argv(command: str) -> list[tuple[str, ...]]:
    """ljperf's arguments of each command of a shell line that runs ljperf (a pipe or ``&&`` may join several)."""
    if not re.search(r"(^|[\s/])ljperf(\s|$)", command):
        return []
    tokens = shlex.split(command.replace("[", "").replace("]", ""), comments=True)
    found, segment = [], []
    for token in [*tokens, ";"]:
        if token not in SHELL_OPERATORS:
            segment.append(token)
            continue
        words = [w for w in segment if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w)]  # VAR=value before it
        if len(words) > 1 and words[1].endswith(":"):
            pass  # "ljperf doctor: failed: ...": a line ljperf prints, not one that runs it
        elif words and Path(words[0]).name == "ljperf":
            found.append(words[1:])
        elif words and LAUNCHERS.fullmatch(words[0]) and "ljperf" in words:
            at = words.index("ljperf")
            if words[at - 1] == "-m":
                found.append(words[at + 1 :])
        segment = []
    return [tuple(PLACEHOLDERS.get(w, w) for w in argv if w != "...") for argv in found]


def command_lines(path: Path) -> list[Line]:
    """Every ljperf command line of a Markdown file: lines of its shell code blocks, and inline code that starts
    with ``ljperf ``."""
    text, lines = path.read_text(), []
    for start, lang, block in fenced_blocks(text):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        joined, first = "", start
        for number, line in enumerate(block, start=start):
            if not joined:
                first = number
            joined = f"{joined} {line.removeprefix('$ ')}" if joined else line.removeprefix("$ ")
            if joined.endswith("\\"):
                joined = joined[:-1]
                continue
            lines += [Line(f"{path.name}:{first}", argv) for argv in ljperf_argv(joined)]
            joined = ""
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    for number, line in enumerate(prose.splitlines(), start=1):
        for span in re.findall(r"`(ljperf [^`]+)`", line):
            lines += [Line(f"{path.name}:{number}", argv, inline=True) for argv in ljperf_argv(span)]
    return lines


COMMAND_LINES = [line for path in [ROOT / "README.md", *DOCS] for line in command_lines(path)]


def test_the_docs_have_command_lines_of_every_command():
    assert len(COMMAND_LINES) > 50
    assert set(cli.COMMANDS) <= {line.argv[0] for line in COMMAND_LINES if line.argv}


@pytest.mark.parametrize("line", COMMAND_LINES, ids=[f"{c.where} {' '.join(c.argv)}"[:90] for c in COMMAND_LINES])
def test_a_docs_command_line_parses(line):
    """Parsed as ``ljperf.cli.main`` parses it (the command's own flags, types and choices), nothing run; no flag
    unknown and no old spelling."""
    argv = list(line.argv)
    if len(argv) == 1 and line.inline:
        assert argv[0] in cli.COMMANDS, f"{line.where}: no command {argv[0]}"  # `ljperf report` names the command
        return
    command = next((a for a in argv if a in cli.COMMANDS), None)
    parser = cli.build_parser(command)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args, unknown = parser.parse_known_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{line.where}: ljperf {' '.join(argv)}: exit {exc.code}: {err.getvalue().strip()}")
    assert args.command in cli.COMMANDS and not unknown, f"{line.where}: unknown {unknown}"
    assert deprecations(args) == [], f"{line.where}: {deprecations(args)}"


# --- dotted Python references ---------------------------------------------------------------------------------

TOP = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()} - {"__init__"}
"""ljperf's packages and top-level modules: a reference may be written relative to ``ljperf.`` (``forecast.walk.
walk_step``), as docs/architecture.md writes them."""
BASENAMES = [p.relative_to(PACKAGE).with_suffix("") for p in PACKAGE.rglob("*.py") if p.stem != "__init__"]
SHORT = {
    name: ".".join(paths[0].parts)
    for name in {p.name for p in BASENAMES}
    if len(paths := [p for p in BASENAMES if p.name == name]) == 1 and name not in TOP
}
"""A module's own name where no other module of ljperf has it (``errors`` for ``core.errors``): a doc that named
the module's package before may write its functions as ``errors.failure``."""
NOT_CODE = {f"{ANNOTATION}{name}" for name in (STEP, *PHASES)}
"""The profiler's range names (``ljperf.forward``): names in a trace, not references."""
FILES = re.compile(r".*\.(py|json|jsonl|md|png|sh|pth|toml|txt|gz|html|yaml)")
REFERENCE = re.compile(r"[a-z_][a-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+(\(\))?")


def references(path: Path) -> list[tuple[str, str]]:
    """(where, the reference written relative to ``ljperf``) of each inline-code dotted name of ljperf's."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        for span in re.findall(r"`([^`]+)`", line):
            if not REFERENCE.fullmatch(span) or FILES.fullmatch(span) or span in NOT_CODE:
                continue
            first, _, rest = span.removesuffix("()").partition(".")
            if first == "ljperf":
                found.append((f"{path.name}:{number}", rest))
            elif first in TOP:
                found.append((f"{path.name}:{number}", f"{first}.{rest}"))
            elif first in SHORT:
                found.append((f"{path.name}:{number}", f"{SHORT[first]}.{rest}"))
    return found


REFERENCES = [ref for path in [ROOT / "README.md", *DOCS] for ref in references(path)]


def resolve(dotted: str) -> object:
    """``ljperf.DOTTED``: the longest prefix that imports as a module, then each attribute after it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(["ljperf", *parts[:cut]]))
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("ljperf"):
                raise
            continue
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        return value
    return importlib.import_module("ljperf")


def test_the_docs_reference_ljperfs_code():
    assert len(REFERENCES) > 100


@pytest.mark.parametrize(("where", "dotted"), REFERENCES, ids=[f"{w} {d}" for w, d in REFERENCES])
def test_a_dotted_reference_in_the_docs_resolves(where, dotted):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{where}: ljperf.{dotted} does not resolve: {exc}")


def test_placeholders_are_metavars_the_help_shows():
    """The table stands only for what ``--help`` writes (``--gpu NAME``, ``--gpus N``): no value a doc invented."""
    shown = set()
    for command in cli.COMMANDS:
        (sub,) = (a for a in cli.build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
        shown |= {a.metavar for a in sub.choices[command]._actions if isinstance(a.metavar, str)}
    assert set(PLACEHOLDERS) <= shown, set(PLACEHOLDERS) - shown


IMPORTS = [
    (f"{path.name}:{start + node.lineno - 1}", node)
    for path in DOCS
    for start, lang, block in fenced_blocks(path.read_text())
    if lang == "python"
    for node in ast.walk(ast.parse("\n".join(block)))
    if isinstance(node, ast.Import | ast.ImportFrom)
]


@pytest.mark.parametrize(("where", "node"), IMPORTS, ids=[f"{w} {ast.unparse(n)}" for w, n in IMPORTS])
def test_an_import_in_a_docs_python_block_resolves(where, node):
    """Each ``import`` of a doc's Python example: the module imports, and each name it takes is there."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            importlib.import_module(alias.name)
        return
    module = importlib.import_module(node.module or "")
    for alias in node.names:
        assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
            f"{where}: {ast.unparse(node)}: no {alias.name} in {node.module}"
        )
