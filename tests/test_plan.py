"""``ljperf plan``: its JSON and table, exit 4 when it does not fit, bad input, DeepSpeed configs, GPU names, and the
saved calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ljperf.cli import COMMANDS, main
from ljperf.core.errors import EXIT_DOES_NOT_FIT
from ljperf.forecast import Recipe, calibrate, forecast
from ljperf.models.spec import resolve

RECORD = Path(__file__).resolve().parents[1] / "benchmarks/ablation-llama-tiny-cpu-quiet/runs/local/base.r1.json"


def test_plan_json_fits_and_max_micro_batch(capsys):
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--micro-batch", "2", "--seq-len", "64"]
    assert main([*argv, "--gpu-memory", "40MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "breakdown", "fits", "max_micro_batch"):
        assert key in out
    assert out["fits"] is (out["peak_allocated_bytes"] <= 40 * 1024**2)
    spec = resolve(name="llama-tiny")
    best = out["max_micro_batch"]
    assert best >= 1
    recipe = Recipe(device="cpu", precision="fp32", seq_len=64)
    assert forecast(spec, recipe.with_(micro_batch=best)).device_bytes <= 40 * 1024**2
    assert forecast(spec, recipe.with_(micro_batch=best + 1)).device_bytes > 40 * 1024**2


def test_plan_with_gpu_memory_applies_the_saved_calibration(own_calibration, capsys):
    """``--gpu-memory`` sizes the device; the overheads are still this machine's calibration (``cpu`` here)."""
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--seq-len", "64", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["peak_allocated_bytes"]
    own_calibration.write_text(json.dumps({"version": 1, "devices": {"cpu": {"scale": 1.25, "samples": 3}}}))
    for memory in ([], ["--gpu-memory", "1GiB"]):
        assert main([*argv, *memory]) == 0
        assert json.loads(capsys.readouterr().out)["peak_allocated_bytes"] == round(1.25 * plain)


def test_a_calibration_applies_to_its_gpu_model_only(own_calibration):
    """Matched by whole words: H100 is "NVIDIA H100 80GB HBM3"; H20 is not H200, nor L4 L40S."""
    devices = {name: {"scale": scale, "samples": 1} for name, scale in (("NVIDIA H200", 1.5), ("NVIDIA L40S", 1.25))}
    devices |= {"NVIDIA H100 80GB HBM3": {"scale": 1.125}}
    own_calibration.write_text(json.dumps({"version": 1, "devices": devices}))
    scales = {name: calibrate.overheads_for("cuda", name).scale for name in ("H20", "L4", "H200", "H100")}
    default = calibrate.DEFAULTS["cuda"].scale
    assert scales == {"H20": default, "L4": default, "H200": 1.5, "H100": 1.125}


def test_a_damaged_calibration_entry_counts_as_none_saved(own_calibration, capsys):
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--seq-len", "64", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["peak_allocated_bytes"]
    own_calibration.write_text(json.dumps({"version": 1, "devices": {"cpu": {"scale": "x"}}}))
    assert main(argv) == 0  # it crashed with a TypeError in every plan
    assert json.loads(capsys.readouterr().out)["peak_allocated_bytes"] == plain


def test_plan_table_for_a_gpu_recipe(capsys):
    argv = ["plan", "--model", "fsdp/llama-tiny", "--gpus", "8", "--gpu", "H100-80GB", "--seq-len", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # The capacity torch reports on an H100 (the driver keeps the rest of the 80 GiB), not the nominal size.
    assert "peak allocated per rank" in out and "fits in 79.11 GiB" in out
    assert "MiB ┃" in out  # the column in the peak's unit: a tiny model's parts read 0.00 GiB


@pytest.mark.parametrize(
    "extra",
    [
        ["--gpu", "Z999"],
        ["--recompute", "9"],
        ["--recompute", "sometimes"],
        ["--seq-len", "100000"],
        ["--gpu-memory", "lots"],
        ["--micro-batch", "0"],
    ],
)
def test_plan_bad_input_is_exit_2(extra, capsys):
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--gpu-memory", "1GiB"]
    if "--gpu" in extra or "--gpu-memory" in extra:
        argv = argv[:-2]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]


@pytest.mark.parametrize(
    ("model", "config", "extra", "message"),
    [
        ("deepspeed", {"zero_optimization": {"stage": 3}}, ["--zero-stage", "2"], "contradicts"),
        ("deepspeed", {"zero_optimization": {"stage3_max_live_parameters": "lots"}}, [], "max_live"),
        ("deepspeed", {"zero_optimization": {"overlap_comm": "yes"}}, [], "overlap_comm"),
        ("torch", {"zero_optimization": {"stage": 3}}, [], "deepspeed engine"),
        ("deepspeed", None, [], "no such file"),
    ],
)
def test_plan_deepspeed_config_errors_are_exit_2(model, config, extra, message, tmp_path, capsys):
    path = tmp_path / "ds.json"
    if config is not None:
        path.write_text(json.dumps(config))
    argv = ["plan", "--model", f"{model}/llama-tiny", "--device", "cpu", "--deepspeed-config", str(path), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


DS_PLAN = ["plan", "--model", "deepspeed/llama-tiny", "--device", "cpu", "--gpus", "2", "--seq-len", "64"]


def plan_with_config(config: dict, tmp_path, capsys, *extra: str) -> tuple[int, dict | None, str]:
    """``ljperf plan --json`` of ``DS_PLAN`` with ``config`` as --deepspeed-config: (exit code, record, stderr)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    code = main([*DS_PLAN, "--gpu-memory", "1GiB", "--deepspeed-config", str(path), "--json", *extra])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else None, captured.err


def test_plan_takes_batch_and_stage_from_the_deepspeed_config_unless_a_flag_is_given(tmp_path, capsys):
    """The numbers of --deepspeed-config stand in for flags left out, as in ``ljperf benchmark``; a given flag
    that contradicts one is exit 2 naming both; an "auto" is the flag's."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 2}}
    code, record, _ = plan_with_config(config, tmp_path, capsys)
    recipe = record["recipe"]
    assert code == 0 and (recipe["micro_batch"], recipe["grad_accum"], recipe["zero_stage"]) == (4, 8, 2)
    assert plan_with_config(config, tmp_path, capsys, "--micro-batch", "4", "--zero-stage", "2")[0] == 0
    code, _, err = plan_with_config(config, tmp_path, capsys, "--micro-batch", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "train_micro_batch_size_per_gpu is 4 but ljperf runs --micro-batch 2" in err
    code, _, err = plan_with_config(config, tmp_path, capsys, "--grad-accum", "1")
    assert code == 2 and "gradient_accumulation_steps is 8 but ljperf runs --grad-accum 1" in err
    # train_batch_size must be micro × accumulation × world (2 ranks)
    code, _, err = plan_with_config({**config, "train_batch_size": 32}, tmp_path, capsys)
    assert code == 2 and "train_batch_size 32 ≠ 4 (micro) × 8 (accumulation) × 2 (world) = 64" in err
    assert plan_with_config({**config, "train_batch_size": 64}, tmp_path, capsys)[0] == 0
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
    code, record, _ = plan_with_config(auto, tmp_path, capsys, "--micro-batch", "2")
    recipe = record["recipe"]
    assert code == 0 and (recipe["micro_batch"], recipe["grad_accum"], recipe["zero_stage"]) == (2, 1, 3)


def test_plan_runs_the_benchmarks_deepspeed_config_lint(tmp_path, capsys):
    """Warnings are printed (and in the JSON); a fail, or a precision ljperf does not run, is exit 2."""
    config = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7}, "wall_clock_breakdwn": True}
    code, record, _ = plan_with_config(config, tmp_path, capsys)
    assert code == 0
    warnings = record["warnings"]
    assert len(warnings) == 2 and "stage3_prefetch_bucket_size" in warnings[1], warnings
    assert "did you mean 'wall_clock_breakdown'" in warnings[0]
    path = tmp_path / "ds.json"
    assert main([*DS_PLAN, "--gpu-memory", "1GiB", "--deepspeed-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning: zero_optimization.stage3_prefetch_bucket_size is a fixed number" in out
    both = {"bf16": {"enabled": True}, "fp16": {"enabled": True}}
    code, _, err = plan_with_config(both, tmp_path, capsys, "--precision", "bf16-mixed")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "fp16.enabled is true" in err


def test_plan_finds_the_largest_micro_batch_past_4096(capsys):
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--seq-len", "64", "--gpu-memory", "80GiB"]
    assert main([*argv, "--micro-batch", "16384", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["max_micro_batch"]
    assert out["fits"] and best > 16384
    recipe = Recipe(device="cpu", precision="fp32", seq_len=64)
    spec = resolve(name="llama-tiny")
    assert forecast(spec, recipe.with_(micro_batch=best)).device_bytes <= 80 * 1024**3
    assert forecast(spec, recipe.with_(micro_batch=best + 1)).device_bytes > 80 * 1024**3


def test_gpu_names_in_any_case_and_a_model_alone_when_unambiguous(capsys):
    argv = ["plan", "--model", "torch/llama-tiny", "--seq-len", "64", "--json"]
    memory = {}
    for name in ("H100-80GB", "h100-80gb", "H100", "h100", "h20"):
        assert main([*argv, "--gpu", name]) == 0, capsys.readouterr().err
        memory[name] = json.loads(capsys.readouterr().out)["gpu_memory_bytes"]
    assert len({memory[name] for name in ("H100-80GB", "h100-80gb", "H100", "h100")}) == 1
    assert memory["h20"] == round(94.97 * 1024**3)  # H20-96GB, not H200-141GB
    assert main([*argv, "--gpu", "a100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "A100-40GB, A100-80GB" in err[0]


def test_plan_output_keeps_each_note_on_one_line_and_zero_for_deepspeed(capsys):
    argv = ["plan", "--model", "fsdp/llama-tiny", "--gpus", "2", "--gpu", "H100-80GB", "--seq-len", "64"]
    assert main(argv) == 0
    (note,) = [line for line in capsys.readouterr().out.splitlines() if "CUDA overheads" in line]
    assert note.endswith("then plan again"), note  # rich broke it at 140 columns in a pipe
    assert main([*argv, "--json"]) == 0
    assert not {"zero_stage", "zero"} & set(json.loads(capsys.readouterr().out)["recipe"])
    assert main([*DS_PLAN, "--gpu-memory", "1GiB", "--json"]) == 0
    recipe = json.loads(capsys.readouterr().out)["recipe"]
    assert recipe["zero_stage"] == 3 and recipe["zero"]["prefetch_bucket_size"] == 50_000_000


def test_calibration_fits_scale_and_offset(tmp_path, monkeypatch, capsys):
    def record(predicted: int, measured: int) -> dict:
        """A benchmark record as ljperf writes it (a committed one), with a GPU's figures: --calibrate checks it."""
        rec = json.loads(RECORD.read_text())
        rec["env"]["devices"], rec["config"]["train"]["device"] = ["NVIDIA H200"], "cuda"
        figures = {"peak_allocated_bytes": measured, "peak_reserved_bytes": int(measured * 1.1)}
        rec["results"] |= {"status": "ok", **figures, "forecast": {"traced_peak_allocated_bytes": predicted}}
        return rec

    paths = []
    for i, (p, m) in enumerate([(10_000, 11_000 + 500), (20_000, 22_000 + 500)]):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(record(p, m)))
        paths.append(str(path))
    fitted = calibrate.calibrate(paths, out=tmp_path / "calibration.json")["NVIDIA H200"]
    assert fitted.scale == pytest.approx(1.1) and fitted.offset == 500
    assert fitted.reserved_scale == pytest.approx(1.1, rel=1e-3)
    assert calibrate.load(tmp_path / "calibration.json")["NVIDIA H200"].samples == 2
    # Two records 10% apart, one 2 GiB over its forecast: least squares gave scale -1, and 70B a negative peak
    GiB = 1024**3
    close = [tmp_path / "c0.json", tmp_path / "c1.json"]
    for path, (p, m) in zip(close, [(10 * GiB, 12 * GiB), (11 * GiB, 11 * GiB)], strict=True):
        path.write_text(json.dumps(record(p, m)))
    fitted = calibrate.calibrate(list(map(str, close)), out=tmp_path / "close.json")["NVIDIA H200"]
    assert fitted.scale == 1.0 and fitted.offset == GiB  # the offset alone: the mean miss
    # The command: --json prints what it fitted (it printed the text lines); a --model is refused, not ignored
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["plan", "--calibrate", *paths, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"]["NVIDIA H200"]["offset"] == 500 and out["saved_to"] == str(
        tmp_path / "cache" / "calibration.json"
    )
    assert main(["plan", "--calibrate", *paths, "--model", "torch/llama3-8b"]) == 2
    assert "it takes no --model" in capsys.readouterr().err


def test_the_plans_title_names_the_zero_stage_of_its_deepspeed_config_and_fsdp2s_setting(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    base = ["plan", "--device", "cpu", "--seq-len", "64"]
    assert main([*base, "--model", "deepspeed/llama-tiny", "--deepspeed-config", str(ds)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("deepspeed/llama-tiny · 1 × cpu · ZeRO-2 · mb 1")
    assert main([*base, "--model", "fsdp/llama-tiny", "--gpus", "2", "--no-reshard-after-forward"]) == 0
    assert "· 2 × cpu · FSDP2 over 2 shards, no reshard after forward · mb 1" in capsys.readouterr().out


def test_the_largest_micro_batch_says_what_one_more_would_need_and_none_is_said_as_none(capsys):
    """ "headroom 27.83 GiB; largest micro batch that fits: 1" and "largest micro batch that fits: 0" read as
    contradictions."""
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--seq-len", "64", "--json"]
    assert main([*argv, "--gpu-memory", "40MiB"]) == 0
    report = json.loads(capsys.readouterr().out)
    best, above = report["max_micro_batch"], report["next_micro_batch_bytes"]
    assert best >= 1 and above > 40 * 1024**2 >= report["device_bytes"]
    assert main([*argv[:-1], "--gpu-memory", "40MiB"]) == 0
    assert f"largest micro batch that fits: {best} (micro batch {best + 1} would need " in capsys.readouterr().out
    assert main([*argv[:-1], "--gpu-memory", "1MiB"]) == 4
    assert "largest micro batch that fits: none (micro batch 1 needs " in capsys.readouterr().out


def test_auto_recomputes_budget_says_where_it_came_from(capsys, monkeypatch):
    base = ["plan", "--model", "torch/llama3.2-1b", "--gpu", "H100", "--seq-len", "4096", "--recompute", "auto"]
    monkeypatch.delenv("LJPERF_MEMORY_BUDGET", raising=False)
    main(base)
    assert "(budget 71.20 GiB: 90% of the device's 79.11 GiB, 10% left for the CUDA context" in capsys.readouterr().out
    main([*base, "--memory-budget", "40GiB"])
    assert "(budget 40.00 GiB: --memory-budget; rates: H100 datasheet)" in capsys.readouterr().out


# --- exit 4 for a plan that does not fit, and where the GPU is named ------------------------------------------------

FP32_TINY = ["--model", "torch/llama-tiny", "--precision", "fp32", "--seq-len", "64"]
"""Traced once at micro batch 1 (none and full recompute), as other tests trace it: plans here that do not fit
need no other trace (the largest micro batch search stops at 1)."""
NO_BUDGET = ["--recompute", "auto", "--memory-budget", "1MiB"]


def plan_json(capsys, *argv: str) -> tuple[int, dict, str]:
    """``ljperf plan ARGV --json`` in this process: (exit code, the record, stderr)."""
    code = main(["plan", *argv, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def test_a_plan_that_does_not_fit_exits_4(capsys):
    """It exited 0 beside "does NOT fit": a script could not tell without parsing the table (a plan that fits
    exits 0: ``test_checkpoint_plan``)."""
    code, out, _ = plan_json(capsys, *FP32_TINY, "--device", "cpu", "--gpu-memory", "1MiB")
    assert (code, out["fits"]) == (EXIT_DOES_NOT_FIT, False)
    assert main(["plan", *FP32_TINY, "--device", "cpu", "--gpu-memory", "1MiB"]) == EXIT_DOES_NOT_FIT  # the table
    assert "does NOT fit in 1.00 MiB" in capsys.readouterr().out
    # --recompute auto with no plan under its budget: the same code, and one line of what would (it was exit 2)
    fsdp = ["--model", "fsdp/llama-tiny", "--gpus", "2", "--device", "cpu", *FP32_TINY[2:], *NO_BUDGET]
    code, out, err = plan_json(capsys, *fsdp)
    assert (code, out["fits"], out["recompute"]["fits"]) == (EXIT_DOES_NOT_FIT, False, False)
    assert err.count("\n") == 1 and "full recompute does not fit with 8 processes either" in err  # not GPUs
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "exit codes: 0 it fits; 4 it does NOT fit" in " ".join(capsys.readouterr().out.split())


def test_plan_names_the_gpu_only_when_it_was_not_given(capsys):
    """``--gpu H100`` was told to "name it with --gpu"; ``--gpu-memory 80GiB`` read as "H100 datasheet (give --gpu
    NAME ...)"; the command's description ended in "; --calibrate"."""
    _, named, _ = plan_json(capsys, *FP32_TINY, "--gpu", "H100", *NO_BUDGET)
    _, unnamed, _ = plan_json(capsys, *FP32_TINY, "--gpu-memory", "80GiB", *NO_BUDGET)
    assert not any("--gpu" in n for n in named["notes"]), named["notes"]
    assert any("no calibration for H100 is saved here" in n for n in named["notes"]), named["notes"]
    assert any("name it with --gpu" in n for n in unnamed["notes"]), unnamed["notes"]
    assert named["recompute"]["rates"] == "H100 datasheet"
    rates = unnamed["recompute"]["rates"]
    assert "give --gpu NAME" not in rates and "the given 80.00 GiB (--gpu-memory), uncalibrated overheads" in rates
    assert not COMMANDS["plan"].help.endswith("--calibrate") and "(--calibrate)" in COMMANDS["plan"].help
