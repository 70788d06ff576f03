"""The README's command lines that end in ``# CPU-sized`` run as written: each in a shell of its own (the venv's
``ljperf``, ``python`` and ``torchrun`` first on PATH), in a folder holding a copy of ``examples/``, and exits 0
with what it promises (a record, a trace, the hook's plan line, a calibration).

Run: ``.venv/bin/python -m pytest -q -n 0 tests/test_readme.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, own_cache

ROOT = Path(__file__).resolve().parents[1]
MARK = "# CPU-sized"


def cpu_sized_lines() -> list[str]:
    """The README's code-block lines marked ``# CPU-sized``, the comment left out."""
    lines, fenced = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and MARK in line:
            lines.append(line.split(MARK)[0].strip())
    return lines


LINES = cpu_sized_lines()

HOOK_LINE = re.compile(r"\[ljperf\] recomputing \d+/6 layers \(selective \d+, full \d+\): forecast [\d.]+ of")
"""The startup hook's plan for the examples' 6-layer model."""


def run_line(line: str, cwd: Path) -> subprocess.CompletedProcess:
    env = cli_env(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        LJPERF_CACHE_DIR=str(own_cache(cwd)),  # a calibration it saves reaches no other test
        TMPDIR=str(cwd),
    )
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=420)


def last_json(stdout: str) -> dict:
    """The last line of stdout that is a JSON object (the example scripts' losses, ``--json`` records)."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))


def test_the_readme_marks_its_cpu_sized_lines():
    assert len(LINES) >= 12
    assert sum("examples/" in line for line in LINES) >= 5  # the shipped inputs are used


@pytest.mark.slow
@pytest.mark.parametrize("line", LINES, ids=[line[:70] for line in LINES])
def test_a_cpu_sized_readme_line_runs_as_written(line, tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    proc = run_line(line, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    if line.startswith("ljperf benchmark"):
        assert "throughput" in out and "step time" in out, out[-2000:]
    if "--profile prof/" in line:
        assert (tmp_path / "prof" / "rank0.trace.json.gz").stat().st_size > 0
        assert (tmp_path / "mem.png").stat().st_size > 0
    if "CHECKPOINT_OPTIMIZATION=true" in line:
        assert HOOK_LINE.search(proc.stderr), proc.stderr[-2000:]
    if "examples/train_" in line:
        losses = last_json(proc.stdout)["losses"]
        assert len(losses) == 3 and all(0 < loss < 10 for loss in losses), losses
    if "--calibrate" in line:
        assert re.search(r"^cpu: scale [\d.]+, offset .* from 2 record\(s\)$", proc.stdout, re.M), proc.stdout
        calibration = json.loads((tmp_path / "cache" / "calibration.json").read_text())
        assert calibration["devices"]["cpu"]["samples"] == 2
    if line.startswith("ljperf doctor") and "--json" in line:
        checks = json.loads(proc.stdout)["results"]["checks"]
        lint = [c["status"] for c in checks if c["check"] == "deepspeed-config"]
        assert len(lint) >= 5 and set(lint) == {"OK"}, checks  # the shipped DeepSpeed config lints clean
