"""``benchmarks/peers.py --tiny``: the HF Trainer and ljperf run, each in its own process, and torchtitan is skipped
with its reason where it is not installed, so the comparison script cannot rot.

Run: ``.venv/bin/python -m pytest tests/test_peers.py`` (about 20 s: two training processes of two timed steps).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"


@pytest.mark.slow
def test_tiny_peers_write_a_table_and_rows_with_figures(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--peers", "trainer,torchtitan,ljperf",
         "--threads", "1", "--out", str(tmp_path)],
        env=cli_env(), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "peers.json").read_text())
    rows = {r["peer"]: r for r in record["rows"]}
    assert list(rows) == ["trainer", "torchtitan", "ljperf"]
    assert record["config"]["model"] == "llama-tiny" and record["config"]["precision"] == "fp32"
    for peer in ("trainer", "ljperf"):
        row = rows[peer]
        assert row["tokens_per_s"] > 0 and row["step_s"] > 0 and row["peak_bytes"] > 0
        assert math.isfinite(row["final_loss"]) and 5 < row["final_loss"] < 9  # near ln(2048) = 7.6, Zipf tokens
        assert row["mfu"] is None  # no known peak for a CPU
        # one formula: tokens/s is the global batch over the median step time
        assert row["tokens_per_s"] == pytest.approx(1 * 64 / row["step_s"])
    # the same seeded weights and the same tokens: the same model state's memory within the batch's bytes
    assert rows["ljperf"]["peak_bytes"] == pytest.approx(rows["trainer"]["peak_bytes"], rel=0.15)
    table = (tmp_path / "peers.md").read_text()
    assert "| trainer |" in table and "| ljperf |" in table and "| 1.00 |" in table
    # what the final losses differ by: each peer's optimizer settings, side by side
    assert "\ntrainer: optim adamw_torch" in table and "weight_decay 0.0" in table
    assert (
        "\nljperf: optim adamw (betas 0.9, 0.95), lr_scheduler constant, max_grad_norm None, weight_decay 0.1" in table
    )
    if rows["torchtitan"].get("skipped"):
        assert "torchtitan is not importable" in rows["torchtitan"]["skipped"]
        assert "torchtitan: skipped: torchtitan is not importable" in proc.stderr
    else:
        assert "tokens_per_s" in rows["torchtitan"] or rows["torchtitan"].get("error")
