"""What a new user tripped over, each checked: slow refusals, ...

Run: ``.venv/bin/python -m pytest tests/test_newcomer.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import cli_env

REFUSED = [
    ["benchmark", "--model", "torch/llama-tiny", "--seq-len", "0"],
    ["benchmark", "--model", "deepspeed/llama-tiny", "--zero-stage", "5"],
    ["benchmark", "--model", "torch/llama-tiny", "--compile", "--warmup", "0"],
    ["benchmark", "--model", "torch/llama-tiny", "--memory-budget", "1GiB"],
    ["plan", "--model", "torch/llama-tiny", "--micro-batch", "0"],
    ["plan", "--model", "fsdp/llama-tiny", "--zero-stage", "2"],
    ["compile-report", "--model", "torch/llama-tiny", "--seq-lens", "0"],
    ["comm", "--iters", "0"],
    ["ablation", "--model", "torch/llama-tiny", "--repeat", "0"],
]


@pytest.mark.parametrize("argv", REFUSED, ids=[" ".join(a[:2] + a[-2:]) for a in REFUSED])
def test_a_refused_flag_value_imports_no_torch(argv):
    """Under load a refused value took 4.5–12 s: torch and transformers were imported before the check."""
    code = f"import sys; from ljperf.cli import main; code = main({argv!r}); print('torch' in sys.modules, code)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True)
    assert out.stdout.split() == ["False", "2"], out.stderr[-2000:]


def test_a_second_model_listing_builds_nothing_and_imports_no_torch(tmp_path):
    """``ljperf models`` took 13–17 s to print a static table: it built every catalog model on the meta device."""
    env = cli_env(LJPERF_CACHE_DIR=str(tmp_path))
    code = "import sys; from ljperf.cli import main; code = main(['models', '--json']); print('torch' in sys.modules)"
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert first.stdout.split()[-1] == "True" and second.stdout.split()[-1] == "False"
    assert first.stdout == second.stdout.replace("False", "True")
