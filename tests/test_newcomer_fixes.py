"""What a new user tripped over (issue 37, items 1, 2, 5, 10 and 12), each checked by a test that failed before
its fix: in-process runs of ``torch/llama-tiny`` (the forecast traces it once, then answers in milliseconds).

Run: ``.venv/bin/python -m pytest -q tests/test_newcomer_fixes.py``.
"""

from __future__ import annotations

import json

import pytest

from ljperf import cli
from ljperf.core.errors import EXIT_DOES_NOT_FIT

TINY = ["--model", "torch/llama-tiny", "--precision", "fp32", "--seq-len", "64"]
"""Traced once at micro batch 1 (none and full recompute), as other tests trace it: plans here that do not fit
need no other trace (the largest micro batch search stops at 1)."""
NO_BUDGET = ["--recompute", "auto", "--memory-budget", "1MiB"]


def plan(capsys, *argv: str) -> tuple[int, dict, str]:
    """``ljperf plan ARGV --json`` in this process: (exit code, the record, stderr)."""
    code = cli.main(["plan", *argv, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


# --- item 5: ljperf plan ------------------------------------------------------------------------------------------


def test_a_plan_that_does_not_fit_exits_4(capsys):
    """It exited 0 beside "does NOT fit": a script could not tell without parsing the table (a plan that fits
    exits 0: ``test_checkpoint_plan``)."""
    code, out, _ = plan(capsys, *TINY, "--device", "cpu", "--gpu-memory", "1MiB")
    assert (code, out["fits"]) == (EXIT_DOES_NOT_FIT, False)
    assert cli.main(["plan", *TINY, "--device", "cpu", "--gpu-memory", "1MiB"]) == EXIT_DOES_NOT_FIT  # the table
    assert "does NOT fit in 1.00 MiB" in capsys.readouterr().out
    # --recompute auto with no plan under its budget: the same code, and one line of what would (it was exit 2)
    code, out, err = plan(capsys, "--model", "fsdp/llama-tiny", "--gpus", "2", "--device", "cpu", *TINY[2:], *NO_BUDGET)
    assert (code, out["fits"], out["recompute"]["fits"]) == (EXIT_DOES_NOT_FIT, False, False)
    assert err.count("\n") == 1 and "full recompute does not fit with 8 processes either" in err  # not GPUs
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    assert "exit codes: 0 it fits; 4 it does NOT fit" in " ".join(capsys.readouterr().out.split())


def test_plan_names_the_gpu_only_when_it_was_not_given(capsys):
    """``--gpu H100`` was told to "name it with --gpu"; ``--gpu-memory 80GiB`` read as "H100 datasheet (give --gpu
    NAME ...)"; the command's description ended in "; --calibrate"."""
    _, named, _ = plan(capsys, *TINY, "--gpu", "H100", *NO_BUDGET)
    _, unnamed, _ = plan(capsys, *TINY, "--gpu-memory", "80GiB", *NO_BUDGET)
    assert not any("--gpu" in n for n in named["notes"]), named["notes"]
    assert any("no calibration for H100 is saved here" in n for n in named["notes"]), named["notes"]
    assert any("name it with --gpu" in n for n in unnamed["notes"]), unnamed["notes"]
    assert named["recompute"]["rates"] == "H100 datasheet"
    rates = unnamed["recompute"]["rates"]
    assert "give --gpu NAME" not in rates and "the given 80.00 GiB (--gpu-memory), uncalibrated overheads" in rates
    assert not cli.COMMANDS["plan"].help.endswith("--calibrate") and "(--calibrate)" in cli.COMMANDS["plan"].help
