"""The startup hook: inert unless CHECKPOINT_OPTIMIZATION is set; with it, an unchanged HF Trainer, FSDP2 or
DeepSpeed ZeRO-3 script gets the planned layers checkpointed (they run their MLP twice), same losses; a budget
nothing fits recomputes every layer and warns; any failure warns and leaves training unchanged."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ljperf.startup_hooks.checkpoint_planner import REPLACES

from conftest import FORECAST_TOLERANCE, cli_env, own_cache, read_record, run_ljperf, stale_calibration_cache

SCRIPTS = Path(__file__).parent / "scripts"
LINE = re.compile(r"\[ljperf\] (?:warning: )?recomputing (\d+)/(\d+) layers \(selective (\d+), full (\d+)\)[^\n]*")


def run_script(tmp_path: Path, script: str = "hf_trainer.py", *, nproc: int = 1, **env: str) -> tuple[dict, str]:
    """Run a test script (under torchrun with ``nproc`` > 1); its JSON line and its stderr."""
    base = cli_env(**env)
    for name in ("CHECKPOINT_OPTIMIZATION", "LJPERF_MEMORY_BUDGET"):
        if name not in env:
            base.pop(name, None)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run(
        [*launcher, str(SCRIPTS / script), str(tmp_path / "out")],
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


@pytest.mark.parametrize(("value", "warns"), [("maybe", True), ("false", False), ("0", False), (" ON ", False)])
def test_a_value_neither_on_nor_off_warns_once_where_the_hook_would_act_and_stays_off(value, warns):
    """Said once, by a process that imports what the hook patches (it was said by every Python process)."""
    env = cli_env(CHECKPOINT_OPTIMIZATION=value)
    code = (
        "import sys; import torch.distributed.fsdp;"
        " print([m for m in sys.modules if m.startswith('ljperf.startup_hooks.')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    lines = out.stderr.splitlines()
    assert len(lines) == warns and all(f"CHECKPOINT_OPTIMIZATION={value!r} is neither on" in line for line in lines)
    assert ("ljperf.startup_hooks.checkpoint" in out.stdout) == (value.strip().lower() == "on")
    quiet = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True, env=env, check=True)
    assert quiet.stderr == ""


def test_a_set_variable_loads_three_small_modules_until_a_patched_library_is_imported():
    """``COMPILE_OPTIMIZATION=true`` in an image's environment reaches every ``python``, ``pip`` and tool: the
    hook loaded 66 more modules (+30 ms a start). Now ljperf's package, its hooks package and the import hook alone
    (benchmarks/startup_hook.py measures the time side by side)."""
    code = "import sys; print(' '.join(sys.modules))"
    loaded = {}
    for value in ("", "true"):
        env = cli_env(COMPILE_OPTIMIZATION=value)
        loaded[value] = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                           check=True).stdout.split())  # fmt: skip
    assert loaded["true"] - loaded[""] == {"ljperf", "ljperf.startup_hooks", "ljperf.startup_hooks.post_import"}


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
def test_failing_plan_warns_once_and_training_is_unchanged(tmp_path, plain_trainer):
    plain = plain_trainer
    assert plain["ljperf_imported"] is False
    hooked, stderr = run_script(tmp_path, CHECKPOINT_OPTIMIZATION="true", LJPERF_MEMORY_BUDGET="banana")
    assert stderr.count("CHECKPOINT_OPTIMIZATION left training unchanged") == 1
    # one line of its own (a UserWarning pointed into the script, and the script's simplefilter could hide it)
    # (the Trainer's progress bar may share its line: it ends its lines with \r)
    lines = [line for line in stderr.splitlines() if "CHECKPOINT_OPTIMIZATION left" in line]
    assert "[ljperf] warning: CHECKPOINT_OPTIMIZATION left training unchanged: " in lines[0], lines
    assert "UserWarning" not in stderr, stderr[-2000:]
    assert hooked["losses"] == plain["losses"]
    assert hooked["checkpointed"] == plain["checkpointed"] == [False] * 6
    assert hooked["mlp_calls_per_step"] == plain["mlp_calls_per_step"]


def budget_between_none_and_full(engine: str = "torch", world: int = 1) -> int:
    """Half-way between the forecasts of no and of full recompute for the scripts' model."""
    none, full = forecasts_none_and_full(engine, world)
    return (none + full) // 2


def forecasts_none_and_full(engine: str = "torch", world: int = 1) -> tuple[int, int]:
    """The forecasts of no and of full recompute for the scripts' model."""
    from ljperf.forecast import Recipe, forecast
    from ljperf.forecast.recipe import ZeroSettings
    from ljperf.models.spec import ModelSpec, hf_config
    from scripts.tiny_llama import CONFIG, MICRO_BATCH, SEQ_LEN

    spec = ModelSpec.of(hf_config(CONFIG, source="test"), name="script")
    # deepspeed_train.py sets its own gradient bucket (DeepSpeed's default is 5e8 elements, ljperf's hidden²)
    zero = ZeroSettings(reduce_bucket_size=4096)
    recipe = Recipe(
        engine=engine,
        world=world,
        device="cpu",
        precision="fp32",
        micro_batch=MICRO_BATCH,
        seq_len=SEQ_LEN,
        zero=zero,
    )
    none, full = (forecast(spec, recipe.with_(recompute=(m,) * spec.layers)).device_bytes for m in ("none", "full"))
    return none, full


def assert_planned(hooked: dict, plain: dict, stderr: str) -> tuple[int, int]:
    """One plan line; its recomputed layers (the first ones) checkpoint and run their MLP twice per step; the
    losses are the plain run's. Returns the layers recomputed and of them the fully recomputed."""
    lines = LINE.findall(stderr)  # tqdm's progress may share the line
    assert len(lines) == 1, stderr[-2000:]
    recomputed, layers, selective, full = map(int, lines[0])
    assert recomputed == selective + full
    assert hooked["checkpointed"] == [True] * recomputed + [False] * (layers - recomputed)
    assert hooked["mlp_calls_per_step"] == [2.0] * recomputed + [1.0] * (layers - recomputed)
    assert plain["checkpointed"] == [False] * layers and plain["mlp_calls_per_step"] == [1.0] * layers
    assert hooked["losses"] == plain["losses"]  # recompute changes no number
    return recomputed, full


def assert_partial(recomputed: int, full: int) -> None:
    """A plan between no and full recompute, so the test means something. Every layer selective is one: the
    solver ranks plans by the rates it measures on this CPU, which vary with the load (seen in a CI-like run)."""
    assert recomputed > 0 and full < 6, (recomputed, full)


@pytest.fixture(scope="module")
def plain_trainer(tmp_path_factory) -> dict:
    return run_script(tmp_path_factory.mktemp("plain"))[0]


@pytest.mark.slow
def test_trainer_script_gets_the_planned_layers_and_logs_one_line(tmp_path, plain_trainer):
    """The script's own ``gradient_checkpointing=True`` (every layer) gives way to the plan, and the line says so
    (it was replaced silently: with a large budget no layer recomputed and nothing told)."""
    budget = budget_between_none_and_full()
    hooked, stderr = run_script(
        tmp_path,
        CHECKPOINT_OPTIMIZATION="true",
        LJPERF_MEMORY_BUDGET=str(budget),
        HOOK_SCRIPT_GRADIENT_CHECKPOINTING="1",
    )
    assert_partial(*assert_planned(hooked, plain_trainer, stderr))
    (line,) = (m[0] for m in LINE.finditer(stderr))
    assert line.endswith(f"({REPLACES})"), line
    assert "does not fit" not in stderr


def test_the_scripts_own_gradient_checkpointing_is_told_apart_from_a_plan():
    from ljperf.checkpoint.policies import FullRecompute, script_checkpoints
    from scripts.tiny_llama import build

    model = build()
    assert not script_checkpoints(model)
    model.gradient_checkpointing_enable()
    assert script_checkpoints(model)
    FullRecompute().apply(model)  # the hook's own plan, even with every layer checkpointing
    assert not script_checkpoints(model)


@pytest.mark.slow
def test_budget_nothing_fits_recomputes_every_layer_and_warns(tmp_path, plain_trainer):
    hooked, stderr = run_script(tmp_path, CHECKPOINT_OPTIMIZATION="true", LJPERF_MEMORY_BUDGET="1MiB")
    assert assert_planned(hooked, plain_trainer, stderr) == (6, 6)
    warning = [line for line in stderr.splitlines() if "[ljperf] warning: recomputing 6/6" in line]
    assert len(warning) == 1 and "(does not fit: " in warning[0], stderr[-2000:]
    assert REPLACES not in stderr  # the script left checkpointing off


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "engine", "uneven"), [("fsdp_train.py", "fsdp", False), ("deepspeed_train.py", "deepspeed", True)]
)
def test_distributed_script_gets_the_planned_layers(tmp_path, script, engine, uneven):
    """An unchanged FSDP2 (``fully_shard``) or DeepSpeed ZeRO-3 script, 2 processes: both ranks run one plan.

    The ZeRO-3 ranks' batches differ in length (128 and 256, as per-batch padding gives) and both run the plan for
    the longest, which rank 0's own batches do not need: a rank recomputing layers the others do not would issue
    other parameter gathers (gloo aborts with a collective mismatch)."""
    from scripts.tiny_llama import SEQ_LEN

    lengths = {"SEQ_LEN_BY_RANK": f"{SEQ_LEN // 2},{SEQ_LEN}"} if uneven else {}
    budget = budget_between_none_and_full(engine, world=2)
    plain, _ = run_script(tmp_path, script, nproc=2, **lengths)
    hooked, stderr = run_script(
        tmp_path, script, nproc=2, CHECKPOINT_OPTIMIZATION="true", LJPERF_MEMORY_BUDGET=str(budget), **lengths
    )
    assert hooked["ljperf_imported"] and not plain["ljperf_imported"]
    assert_partial(*assert_planned(hooked, plain, stderr))
    assert hooked["checkpointed_by_rank"] == [hooked["checkpointed"]] * 2
    # The closed loop's CPU measurement of step 2 (live tensors, DeepSpeed's flat partitions included) matches
    # the forecast, so the plan stands (measured: FSDP2 25.00 vs 25.00 MiB, ZeRO-3 25.08 vs 25.08 MiB)
    loop = re.search(r"\[ljperf\] closed loop: measured ([\d.]+) MiB vs forecast ([\d.]+) MiB; the plan stands", stderr)
    assert loop and abs(float(loop[1]) / float(loop[2]) - 1) < 0.01, stderr[-2000:]


@pytest.mark.slow
def test_closed_loop_corrects_a_stale_forecast_after_the_second_step(tmp_path, plain_trainer):
    """A stale calibration (CPU scale 1.25) makes the first plan recompute layers the budget does not need; the
    hook measures step 2, re-plans before step 3 (no recompute), logs both, and the losses stay the plain run's."""
    cache = stale_calibration_cache(tmp_path, scale=1.25)
    none, full = forecasts_none_and_full()
    budget = round(1.1 * none)  # the true no-recompute peak fits; ×1.25 it does not, full recompute does
    assert 1.25 * full < budget < 1.25 * none
    hooked, stderr = run_script(
        tmp_path, CHECKPOINT_OPTIMIZATION="true", LJPERF_MEMORY_BUDGET=str(budget), LJPERF_CACHE_DIR=str(cache)
    )
    ((recomputed, *_),) = LINE.findall(stderr)
    recomputed = int(recomputed)
    loop = re.search(
        r"\[ljperf\] closed loop: measured ([\d.]+) MiB vs forecast ([\d.]+) MiB \(under 85% of the forecast\); "
        r".*recomputing (\d+)/",
        stderr,
    )
    assert recomputed > 0 and loop and loop[3] == "0", stderr[-2000:]
    assert float(loop[1]) < 0.85 * float(loop[2])
    assert hooked["checkpointed"] == [False] * 6
    steps = len(hooked["losses"])  # steps 1 and 2 ran the first plan, step 3 the second
    assert hooked["mlp_calls_per_step"] == [(2 * 2 + 1) / steps] * recomputed + [1.0] * (6 - recomputed)
    assert hooked["losses"] == plain_trainer["losses"]


@pytest.mark.slow
def test_each_fsdp2_rank_corrects_its_own_plan(tmp_path):
    """Outside ZeRO-3 each rank judges its own measured step: rank 1's stale calibration (×1.25) plans recompute
    the budget does not need, rank 0's does not. Rank 1 alone re-plans before step 3, says so, and both ranks
    end without recompute."""
    stale = stale_calibration_cache(tmp_path, scale=1.25)
    (tmp_path / "rank0").mkdir()
    clean = own_cache(tmp_path / "rank0")  # no calibration saved; the run's traced coefficients, as rank 1's
    none, full = forecasts_none_and_full("fsdp", world=2)
    budget = round(1.1 * none)  # as in the test above: fits no recompute, but not ×1.25
    assert 1.25 * full < budget < 1.25 * none
    hooked, stderr = run_script(
        tmp_path,
        "fsdp_train.py",
        nproc=2,
        CHECKPOINT_OPTIMIZATION="true",
        LJPERF_MEMORY_BUDGET=str(budget),
        LJPERF_CACHE_DIR_BY_RANK=f"{clean},{stale}",
    )
    assert hooked["checkpointed_by_rank"] == [[False] * 6] * 2, stderr[-2000:]
    assert re.search(r"\[ljperf\] closed loop: [^\n]*; the plan stands", stderr), stderr[-2000:]
    rank1 = r"\[ljperf\] rank 1: closed loop: measured [^\n]*; activations × [\d.]+; recomputing 0/6"
    assert re.search(rank1, stderr), stderr[-2000:]


@pytest.mark.slow
def test_ljperf_benchmark_plans_itself_under_the_variable(tmp_path):
    """``CHECKPOINT_OPTIMIZATION=true ljperf benchmark`` means ``--recompute auto`` (budget from
    ``LJPERF_MEMORY_BUDGET``): the benchmark plans, records and forecasts the plan; the startup hook does not
    also plan inside its FSDP2 engine (it did: the record said no recompute, the forecast was +12% off)."""
    from ljperf.forecast import Recipe, forecast
    from ljperf.models.spec import resolve

    spec = resolve(name="llama-tiny")
    recipe = Recipe(engine="fsdp", world=2, device="cpu", precision="fp32", micro_batch=2, seq_len=256)
    none, full = (forecast(spec, recipe.with_(recompute=(m,) * spec.layers)).device_bytes for m in ("none", "full"))
    out = tmp_path / "r.json"
    proc = run_ljperf(
        "benchmark", "--model", "fsdp/llama-tiny", "--nproc-per-node", "2", "--micro-batch", "2", "--seq-len", "256",
        "--steps", "1", "--output", str(out),
        env=cli_env(CHECKPOINT_OPTIMIZATION="true", LJPERF_MEMORY_BUDGET=str((none + full) // 2)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[ljperf]" not in proc.stdout + proc.stderr  # the hook kept off ljperf's own model
    results = read_record(out)["results"]
    plan = results["recompute"]["plan"]
    assert results["recompute"]["budget_bytes"] == (none + full) // 2
    # Between none and full: some recompute, less than full everywhere. Which layers, and selective or full,
    # follows the rates measured in the run (under CI load it once chose full + 3 selective on 4 layers).
    assert plan.count("full") + plan.count("selective") > 0 and plan.count("full") < spec.layers
    assert abs(results["forecast"]["error_pct"]) < 100 * FORECAST_TOLERANCE, results["forecast"]


def test_a_trainer_deepspeed_config_without_a_stage_is_planned_as_zero_1():
    """A stage-less (stage 0) DeepSpeed config turned the hook off: Recipe refuses stage 0."""
    from types import SimpleNamespace

    from ljperf.forecast import Recipe
    from ljperf.startup_hooks.checkpoint_planner import trainer_setup

    ds = SimpleNamespace(config={"zero_optimization": {}, "train_micro_batch_size_per_gpu": 1})
    args = SimpleNamespace(fsdp="", world_size=2, bf16=True, gradient_accumulation_steps=1, hf_deepspeed_config=ds)
    setup = trainer_setup(SimpleNamespace(args=args, model=torch.nn.Linear(2, 2)))
    assert setup["engine"] == "deepspeed" and setup["zero_stage"] == 1
    Recipe(**setup)  # what the plan is made from


@pytest.mark.parametrize(
    ("dtype", "bf16", "engine", "precision"),
    [
        (torch.bfloat16, True, "torch", "bf16"),  # loaded in bfloat16: weights, gradients and moments in bf16
        (torch.bfloat16, False, "torch", "bf16"),
        (torch.float32, True, "torch", "bf16-mixed"),
        (torch.float32, False, "torch", "fp32"),
        (torch.bfloat16, False, "fsdp", "bf16"),  # FSDP2 of a bf16 model without mixed precision
        (torch.float32, True, "fsdp", "bf16-mixed"),  # accelerate upcast the bf16 model before the first forward
        (torch.bfloat16, True, "deepspeed", "bf16-mixed"),  # DeepSpeed keeps fp32 master weights of a bf16 model
    ],
)
def test_a_trainer_model_loaded_in_bf16_is_planned_with_bf16_weights(dtype, bf16, engine, precision):
    """A bf16 model's states are half of fp32 master weights': llama3.2-1b b1 s2048 forecasts 13.2 GiB, not the
    23.0 of bf16-mixed, which would have recomputed layers that fit."""
    from types import SimpleNamespace

    from ljperf.forecast import Recipe
    from ljperf.startup_hooks.checkpoint_planner import trainer_setup

    ds = SimpleNamespace(config={"zero_optimization": {"stage": 3}}) if engine == "deepspeed" else None
    fsdp = "full_shard auto_wrap" if engine == "fsdp" else ""
    args = SimpleNamespace(fsdp=fsdp, world_size=2, bf16=bf16, gradient_accumulation_steps=1, hf_deepspeed_config=ds)
    setup = trainer_setup(SimpleNamespace(args=args, model=torch.nn.Linear(2, 2, dtype=dtype)))
    assert (setup["engine"], setup["precision"]) == (engine, precision)
    Recipe(**setup)


@pytest.mark.parametrize(
    ("dtype", "param_dtype", "precision"),
    [(torch.bfloat16, None, "bf16"), (torch.float32, torch.bfloat16, "bf16-mixed"), (torch.float32, None, "fp32")],
)
def test_a_fully_shard_script_is_planned_in_its_models_dtype(dtype, param_dtype, precision):
    """``fully_shard(model)`` of a model loaded in bfloat16 trains bf16 weights and moments (was planned as fp32:
    twice its model states)."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ljperf.startup_hooks.checkpoint_planner import fsdp_setup

    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    kwargs = {"mesh": SimpleNamespace(size=lambda: 2), "mp_policy": policy}
    setup = fsdp_setup(torch.nn.Linear(2, 2, dtype=dtype), kwargs)
    assert (setup["world"], setup["precision"]) == (2, precision)


@pytest.mark.slow
def test_planning_leaves_the_global_random_state_alone(monkeypatch):
    """The plan (rates measured on this device, layers traced, the solver) draws nothing from torch's global
    generator: a model with dropout trained differently under the variable (the rates drew from it)."""
    from ljperf.startup_hooks.checkpoint_planner import plan_model
    from scripts.tiny_llama import MICRO_BATCH, SEQ_LEN, build

    model = build()
    monkeypatch.setenv("LJPERF_MEMORY_BUDGET", str(budget_between_none_and_full()))
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    decision, _ = plan_model(model, micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, engine="torch", world=1, precision="fp32")
    assert decision.fits and decision.plan != ("none",) * len(decision.plan)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_model_the_forecast_cannot_plan_is_named_in_the_warning():
    """Not ``'Tiny' object has no attribute 'config'`` or ``'XLNetModel' object has no attribute 'layers'``."""
    from transformers import XLNetConfig, XLNetLMHeadModel

    from ljperf.core.errors import UsageError
    from ljperf.startup_hooks.checkpoint_planner import model_recipe

    xlnet = XLNetLMHeadModel(XLNetConfig(d_model=32, n_layer=2, n_head=2, d_inner=64, vocab_size=64))
    for model, message in (
        (torch.nn.Sequential(torch.nn.Linear(2, 2)), "Sequential is not an HF model"),
        (xlnet, "XLNetLMHeadModel keeps its decoder layers elsewhere than model.layers or transformer.h"),
    ):
        with pytest.raises(UsageError, match=message):
            model_recipe(model, micro_batch=1, seq_len=8, world=1, precision="fp32", engine="torch")


def test_no_fit_is_warned_once_and_a_replan_for_a_longer_batch_is_logged(monkeypatch, capsys):
    """Each longer batch re-plans; when nothing fits, only the first plan warns (a warning per re-plan was noise
    in every longer batch's log), the later ones print their line."""
    from ljperf.startup_hooks.checkpoint_planner import attach
    from ljperf.startup_hooks.messages import PREFIX
    from scripts.tiny_llama import build

    model = build().train()
    monkeypatch.setenv("LJPERF_MEMORY_BUDGET", "1MiB")
    attach(model, lambda: {"engine": "torch", "world": 1, "precision": "fp32"})
    for seq_len in (32, 64):
        model(input_ids=torch.randint(0, 512, (1, seq_len)))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 2 and all("does not fit" in line for line in lines), lines
    assert lines[0].startswith(f"{PREFIX} warning: ") and not lines[1].startswith(f"{PREFIX} warning: "), lines


def test_the_scripts_adamw_implementation_is_planned():
    """HF Trainer's default AdamW is fused (torch 2.8+): planned as foreach it had one more copy of the model in
    the optimizer step (llama3.2-1b fp32: 4.6 GiB). Read through accelerate's and ZeRO's ``.optimizer`` wrappers."""
    from types import SimpleNamespace

    from ljperf.startup_hooks.checkpoint_planner import optimizer_impl, trainer_setup

    params = [torch.nn.Parameter(torch.zeros(2))]
    for kwargs, impl in (({"fused": True}, "fused"), ({"foreach": True}, "foreach"), ({"foreach": False}, "single")):
        adamw = torch.optim.AdamW(params, **kwargs)
        assert optimizer_impl(SimpleNamespace(optimizer=SimpleNamespace(optimizer=adamw))) == impl
    assert optimizer_impl(torch.optim.AdamW(params)) is None  # torch's own pick, as the forecast's default
    assert optimizer_impl(torch.optim.SGD(params)) is None
    args = SimpleNamespace(fsdp="", world_size=1, bf16=False, gradient_accumulation_steps=1, hf_deepspeed_config=None)
    trainer = SimpleNamespace(args=args, model=torch.nn.Linear(2, 2), optimizer=torch.optim.AdamW(params, fused=True))
    assert trainer_setup(trainer)["optimizer"] == "fused"


def test_a_hook_warning_is_one_line_that_a_scripts_filter_does_not_hide(capsys):
    """Hook warnings were ``train.py:19: UserWarning: [ljperf] ...`` and ``warnings.simplefilter("ignore")`` in
    the script hid them (the DeepSpeed bucket advice among them)."""
    import warnings

    from ljperf.startup_hooks.messages import warn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warn("recomputing 8/8 layers (does not fit)")
    assert capsys.readouterr().err == "[ljperf] warning: recomputing 8/8 layers (does not fit)\n"
