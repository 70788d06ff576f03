"""``COMPILE_OPTIMIZATION=true`` with an unchanged HF Trainer script (``torch_compile=True``): regional compile.

Run: ``.venv/bin/python -m pytest tests/test_compile_trainer.py``. The script below is a user's plain Trainer
script; it runs in a subprocess so the ``.pth`` startup hook decides, as it would for the user.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import cli_env

SCRIPT = r"""
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

config = AutoConfig.for_model("llama", vocab_size=2048, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)
gen = torch.Generator().manual_seed(0)
data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 2048, (3, 64), generator=gen)]
args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, torch_compile=sys.argv[2] == "compile", max_steps=3,
                         per_device_train_batch_size=1, learning_rate=3e-4, logging_steps=1, report_to=[],
                         save_strategy="no", dataloader_num_workers=0)
trainer = Trainer(model=model, args=args, train_dataset=data)
regions = type(model.model.layers[0].forward).__name__
if len(sys.argv) > 3:
    print(json.dumps({"regions": regions}))
    sys.exit(0)
trainer.train()
losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
print(json.dumps({"regions": regions, "losses": losses}))
"""


def run_script(tmp_path, *args: str, hook: bool) -> tuple[dict, str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = cli_env(COMPILE_OPTIMIZATION="true" if hook else "")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize(("hook", "regions"), [(False, "method"), (True, "Region")])
def test_the_trainer_is_compiled_by_region_only_under_the_variable(tmp_path, hook, regions):
    """``torch_compile=True``: the decoder layers' forwards become regions when the Trainer is made under the
    variable, and stay methods without it (no training: what the slow test below trains)."""
    result, _ = run_script(tmp_path, "compile", "--no-train", hook=hook)
    assert result["regions"] == regions


@pytest.mark.slow
def test_trainer_torch_compile_becomes_regional_and_matches_eager(tmp_path):
    compiled, stderr = run_script(tmp_path, "compile", hook=True)
    eager, _ = run_script(tmp_path, "eager", hook=True)
    assert compiled["regions"] == "Region" and eager["regions"] == "method"
    assert "[ljperf] regional compile: 3 regions, 0 graph breaks, 0 recompiles" in stderr
    assert "[ljperf] COMPILE_OPTIMIZATION: compiling 2 decoder blocks and the loss in place" in stderr
    assert len(compiled["losses"]) == 3
    for got, want in zip(compiled["losses"], eager["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
