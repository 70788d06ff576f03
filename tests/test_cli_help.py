"""``--help`` lists the values each flag takes, and exactly those: for every subcommand of the real parser
(``ljperf.cli.build_parser``), a flag's metavar and help name the values its parser and its option dataclass accept.

Run: ``.venv/bin/python -m pytest -q -n 0 tests/test_cli_help.py`` (a second, no torch). ``plan --help`` said
``--device ... cpu, cuda or auto`` and ``--attn-implementation ... or flash_attention_2``, both refused.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest

from ljperf import cli
from ljperf.comm.config import CommConfig
from ljperf.commands.compile_report import ReportConfig
from ljperf.core import options
from ljperf.core.choices import values_of
from ljperf.core.errors import UsageError

OPTION_GROUPS = (
    options.TrainConfig,
    options.LaunchConfig,
    options.EngineConfig,
    options.OptimizationConfig,
    options.ExplainConfig,
    CommConfig,
    ReportConfig,
)
"""The option dataclasses whose fields the commands' flags are: a closed field's values are checked there."""


def _closed_fields() -> dict[str, tuple[type, tuple[str, ...]]]:
    """Field name → (its option dataclass, its ``Literal`` type's values), for every closed field."""
    fields: dict[str, tuple[type, tuple[str, ...]]] = {}
    for cls in OPTION_GROUPS:
        for name, kind in typing.get_type_hints(cls).items():
            if values := values_of(kind):
                assert fields.get(name, (cls, values))[1] == values, f"{name}: one name, two closed sets"
                fields[name] = (cls, values)
    return fields


CLOSED = _closed_fields()


def subparser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser(command)
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def flags(command: str) -> list[argparse.Action]:
    """The flags ``command --help`` shows."""
    return [a for a in subparser(command)._actions if a.option_strings and a.help != argparse.SUPPRESS]


def accepted(action: argparse.Action) -> tuple[str, ...] | None:
    """The values a flag's parser takes (its ``choices``), else its field's type's; None: no closed set."""
    if action.choices is not None:
        return tuple(action.choices)
    return CLOSED[action.dest][1] if action.dest in CLOSED else None


def universe() -> dict[str, set[str]]:
    """Per flag (dest), every value any command or type gives it: what a help text could name."""
    seen: dict[str, set[str]] = {}
    for command in cli.COMMANDS:
        for action in flags(command):
            if (values := accepted(action)) is not None:
                seen.setdefault(action.dest, set()).update(values)
    return seen


ALL_VALUES = universe()


def named_in(text: str, values: set[str]) -> set[str]:
    """The ``values`` that ``text`` names as words (``bf16`` is not named by ``bf16-mixed``)."""
    return {v for v in values if re.search(rf"(?<![\w-]){re.escape(v)}(?![\w-])", text)}


def parses(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | None:
    """The namespace of ``argv``, or None where the parser refuses it (exit 2, one line on stderr)."""
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            return parser.parse_known_args(argv)[0]
        except SystemExit as exc:
            assert exc.code == 2
            return None


def takes(command: str, action: argparse.Action, value: str) -> bool:
    """Whether ``command`` takes ``value`` for ``action``'s flag: its parser, then the field's option dataclass."""
    args = parses(subparser(command), [action.option_strings[-1], value])
    if args is None:
        return False
    assert getattr(args, action.dest) == value
    if action.dest not in CLOSED:
        return True
    try:
        CLOSED[action.dest][0](**{action.dest: value})
    except UsageError:
        return False
    return True


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_each_flag_shows_as_its_values_those_its_parser_takes(command):
    for action in flags(command):
        shown = action.metavar or ("{" + ",".join(action.choices) + "}" if action.choices else None)
        values = accepted(action)
        if values is None:
            assert not (isinstance(shown, str) and shown.startswith("{")), (command, action.option_strings, shown)
            continue
        assert shown == "{" + ",".join(values) + "}", (command, action.option_strings)


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_each_flags_help_names_no_value_its_parser_refuses_and_lists_all_it_takes(command):
    for action in flags(command):
        if (values := accepted(action)) is None:
            continue
        named = named_in(action.help or "", ALL_VALUES[action.dest])
        assert named <= set(values), (command, action.option_strings, named - set(values), action.help)
        if len(named) > 1:  # a list of values, not a default: the whole list
            assert named == set(values), (command, action.option_strings, set(values) - named, action.help)


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_a_command_takes_every_value_its_help_lists_and_refuses_the_others(command):
    for action in flags(command):
        if (values := accepted(action)) is None:
            continue
        for value in sorted(ALL_VALUES[action.dest]):
            assert takes(command, action, value) == (value in values), (command, action.option_strings, value)


def test_the_plan_help_refuses_nothing_it_lists():
    """The three lines a new user tripped over (issue 58): ``--device`` auto and ``--attn-implementation``
    flash_attention_2, refused by ``plan``; ``--gpus`` "data-parallel ranks", which ``--tp`` multiplies."""
    by_flag = {a.option_strings[0]: a for a in flags("plan")}
    assert "auto" not in by_flag["--device"].help and by_flag["--device"].help.startswith("cpu or cuda ")
    assert "flash_attention_2" not in by_flag["--attn-implementation"].help
    assert "the world size: data-parallel ranks × --tp" in by_flag["--gpus"].help
    assert parses(subparser("plan"), ["--device", "auto"]) is None
    assert parses(subparser("plan"), ["--attn-implementation", "flash_attention_2"]) is None


@dataclass(kw_only=True)
class Demo:
    """A closed field."""

    TITLE: ClassVar[str] = "demo"
    mode: Literal["a", "b", "c"] = options.opt("a", "the mode: {values}", values={"b": "the second"})
    count: int = options.opt(1, "a number")

    def __post_init__(self) -> None:
        options.check_values(self)


def test_a_closed_fields_help_and_metavar_follow_the_values_a_command_narrows_it_to():
    """A value added to the type reaches the metavar, the help and the check; a command's ``choices`` narrow
    all three."""
    whole, narrowed = argparse.ArgumentParser(), argparse.ArgumentParser()
    options.add_arguments(whole, Demo)
    options.add_arguments(narrowed, Demo, choices={"mode": ("a", "b")})
    (mode,) = (a for a in whole._actions if a.dest == "mode")
    assert (mode.metavar, mode.help, mode.choices) == ("{a,b,c}", "the mode: a, b (the second) or c (default: a)", None)
    (mode,) = (a for a in narrowed._actions if a.dest == "mode")
    narrowed_help = "the mode: a or b (the second) (default: a)"
    assert (mode.metavar, mode.help, mode.choices) == ("{a,b}", narrowed_help, ("a", "b"))
    with pytest.raises(UsageError, match=r"^--mode 'd': choose one of a, b, c$"):
        Demo(mode="d")  # a value from outside the type checker's reach: a flag, a file
    with pytest.raises(TypeError, match="must be of"):
        options.add_arguments(argparse.ArgumentParser(), Demo, choices={"mode": ("a", "z")})
    with pytest.raises(TypeError, match="for a field of a Literal type"):
        options.add_arguments(argparse.ArgumentParser(), Demo, choices={"count": ("1",)})
