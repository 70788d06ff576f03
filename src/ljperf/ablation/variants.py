"""Variants (named sets of ``ljperf benchmark`` flags) and environments (interpreters to run them under)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass

from ljperf.core.errors import UsageError

# The ladder the image is judged by: each variant adds one optimization to the previous one.
BUILTIN: dict[str, str] = {
    "base": "",
    "compile": "--compile",
    "compile+ckpt": "--compile --recompute auto",
    "ckpt-full": "--recompute full",
    "loss-chunked": "--loss chunked",
    "compile+loss": "--compile --loss chunked",
}
DEFAULT_VARIANTS = ("base", "compile", "compile+ckpt")
LOCAL_ENV = "local"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_PROBE = (
    "import json, sys; from ljperf.core.records import versions; "
    "print(json.dumps({'python': sys.executable, 'prefix': sys.prefix, 'versions': versions()}))"
)


@dataclass(frozen=True)
class Variant:
    """A named set of benchmark flags, added to the flags every variant shares."""

    name: str
    flags: tuple[str, ...]

    @property
    def text(self) -> str:
        return shlex.join(self.flags)


@dataclass(frozen=True)
class Environment:
    """An interpreter that can import ljperf, and the versions it reported."""

    name: str
    python: str
    prefix: str
    versions: dict

    def describe(self) -> dict:
        return {"name": self.name, "python": self.python, "prefix": self.prefix, "versions": self.versions}


def _split_definition(text: str, *, flag: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not _NAME.match(name):
        raise UsageError(f"{flag} {text!r}: write NAME={what} (NAME of letters, digits, _ . + -)")
    return name, value


def parse_variants(listed: str | None, defined: list[str]) -> list[Variant]:
    """The variants to run, in order: ``--variants a,b,c`` over built-ins and ``--variant NAME=FLAGS``.

    Without ``--variants`` the ``--variant`` definitions run (or the built-in ladder when there are none);
    defined variants missing from ``--variants`` are appended. The first variant is the baseline.
    """
    definitions = dict(BUILTIN)
    user: list[str] = []
    for text in defined:
        name, flags = _split_definition(text, flag="--variant", what='"FLAGS"')
        if name in user:
            raise UsageError(f"--variant {name} is defined twice")
        definitions[name] = flags
        user.append(name)
    names = [n.strip() for n in listed.split(",")] if listed is not None else (user or list(DEFAULT_VARIANTS))
    if "" in names:
        raise UsageError(f"--variants {listed!r} has an empty name: list them, e.g. base,compile")
    names += [n for n in user if n not in names]
    unknown = [n for n in names if n not in definitions]
    if unknown:
        raise UsageError(
            f"unknown variant {unknown[0]!r}: choose from {', '.join(definitions)} "
            f'or define it with --variant {unknown[0]}="--flags"'
        )
    if len(set(names)) != len(names):
        raise UsageError(f"--variants {listed!r} names a variant twice")
    try:
        return [Variant(n, tuple(shlex.split(definitions[n]))) for n in names]
    except ValueError as exc:
        raise UsageError(f"--variant: cannot split the flags ({exc})") from None


def parse_environments(defined: list[str], *, default_python: str) -> list[Environment]:
    """``--env NAME=PYTHON`` (or this interpreter as ``local``), each probed for its versions."""
    pairs = [_split_definition(text, flag="--env", what="PYTHON") for text in defined]
    if not pairs:
        pairs = [(LOCAL_ENV, default_python)]
    if len({n for n, _ in pairs}) != len(pairs):
        raise UsageError("--env names an environment twice")
    return [probe(name, python) for name, python in pairs]


def probe(name: str, python: str) -> Environment:
    """Ask ``python`` for its prefix and package versions; it must be able to import ljperf."""
    found = shutil.which(python)
    if found is None:
        raise UsageError(f"--env {name}={python}: no such interpreter (give the path of a python executable)")
    # abspath, not realpath: a venv's python is a symlink whose target would leave the venv.
    path = os.path.abspath(found)
    try:
        out = subprocess.run([path, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"--env {name}={python}: cannot run it ({exc})") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"--env {name}={python} cannot import ljperf ({last}); pip install ljperf there first")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    return Environment(name=name, python=path, prefix=info["prefix"], versions=info["versions"])
