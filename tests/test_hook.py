"""The startup hook: inert unless CHECKPOINT_OPTIMIZATION is set; with it, an unchanged HF Trainer script gets
the planned layers checkpointed; any failure warns and leaves training unchanged."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import cli_env

SCRIPT = Path(__file__).parent / "scripts" / "hf_trainer.py"


def run_script(tmp_path: Path, **env: str) -> tuple[dict, str]:
    base = cli_env(**env)
    for name in ("CHECKPOINT_OPTIMIZATION", "LJPERF_MEMORY_BUDGET"):
        if name not in env:
            base.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        env=base,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_unset_imports_nothing():
    env = cli_env()
    env.pop("CHECKPOINT_OPTIMIZATION", None)
    code = "import sys, transformers.trainer as t; print([m for m in sys.modules if m.startswith('ljperf')], "
    code += "hasattr(t.Trainer.__init__, '__wrapped__'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["[]", "False"]


def test_set_patches_trainer_only_when_imported():
    code = "import sys; a = 'transformers.trainer' in sys.modules; import transformers.trainer as t; "
    code += "print(a, hasattr(t.Trainer.__init__, '__wrapped__'), 'torch' in sys.modules)"
    env = cli_env(CHECKPOINT_OPTIMIZATION="true")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["False", "True", "True"]
    code = "import sys; print('torch' in sys.modules, [m for m in sys.modules if m.startswith('ljperf')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split(" ", 1)[0] == "False"  # the hook itself imports no torch


@pytest.mark.slow
def test_failing_plan_warns_once_and_training_is_unchanged(tmp_path):
    plain, _ = run_script(tmp_path)
    assert plain["ljperf_imported"] is False
    hooked, stderr = run_script(tmp_path, CHECKPOINT_OPTIMIZATION="true", LJPERF_MEMORY_BUDGET="banana")
    assert stderr.count("CHECKPOINT_OPTIMIZATION left training unchanged") == 1
    assert hooked["losses"] == plain["losses"]
    assert hooked["checkpointed"] == plain["checkpointed"] == [False] * 6


def budget_between_none_and_full() -> tuple[int, list[str]]:
    """Half-way between the forecasts of no and of full recompute for the script's model, and the plan the
    solver picks there (what the hook must apply)."""
    import torch
    from tests.scripts.hf_trainer import CONFIG, MICRO_BATCH, SEQ_LEN

    from ljperf.checkpoint.solver import Rates, solve_recipe
    from ljperf.forecast import Recipe, forecast
    from ljperf.models import ModelSpec, hf_config

    spec = ModelSpec(name="script", config=hf_config(CONFIG, source="test"))
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=MICRO_BATCH, seq_len=SEQ_LEN)
    layers = spec.layers
    none, full = (forecast(spec, recipe.with_(recompute=(m,) * layers)).device_bytes for m in ("none", "full"))
    budget = (none + full) // 2
    return budget, list(solve_recipe(spec, recipe, budget=budget, rates=Rates.measure(torch.device("cpu"))).plan)


@pytest.mark.slow
def test_trainer_script_gets_the_planned_layers_and_logs_one_line(tmp_path):
    budget, plan = budget_between_none_and_full()
    assert "none" in plan and plan.count("none") < len(plan)  # a partial plan: the test means something
    plain, _ = run_script(tmp_path)
    hooked, stderr = run_script(tmp_path, CHECKPOINT_OPTIMIZATION="true", LJPERF_MEMORY_BUDGET=str(budget))
    lines = re.findall(r"\[ljperf\] recomputing [^\n]*", stderr)  # tqdm's progress may share the line
    assert len(lines) == 1, stderr[-2000:]
    recomputed = len(plan) - plan.count("none")
    assert f"recomputing {recomputed}/{len(plan)} layers" in lines[0]
    assert hooked["checkpointed"] == [mode != "none" for mode in plan]
    assert hooked["losses"] == plain["losses"]  # recompute changes no number
