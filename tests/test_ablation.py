"""``ljperf ablation`` and ``ljperf report``: real benchmark subprocesses of a tiny model on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

import ljperf.models
from ljperf.ablation import report
from ljperf.ablation.runner import normalized
from ljperf.ablation.stats import Spread, VariantStats, contributions, summarize
from ljperf.ablation.variants import BUILTIN, parse_environments, parse_variants
from ljperf.commands.ablation import check_variant, split_argv
from ljperf.core.errors import (
    Interrupted,
    UsageError,
    forget_signals,
    interrupt_on_signals,
    interrupts_held,
    restore_signals,
)

from conftest import cli_env, read_record, run_ljperf, run_main, use_cli_env

SHORT = ("--model", "torch/llama-tiny", "--seq-len", "64", "--steps", "2", "--warmup", "1")
# Three variants, the third fails at run time (its recompute plan cannot fit 1 MiB): it must not stop the others.
VARIANTS = (
    "--variant",
    "mb1=--micro-batch 1",
    "--variant",
    "mb2=--micro-batch 2",
    "--variant",
    "broken=--recompute auto --memory-budget 1MiB",
)


def _stats(name: str, tokens: list[float], env: str = "local") -> VariantStats:
    return VariantStats(
        environment=env,
        variant=name,
        flags="",
        runs=len(tokens),
        statuses={"ok": len(tokens)} if tokens else {"oom": 1},
        tokens_per_s=Spread.of(tokens),
        losses=[1.0, 0.5] if tokens else [],
    )


def test_contributions_on_known_inputs():
    stats = [
        _stats("base", [100, 90, 110]),
        _stats("compile", [150, 140, 160]),
        _stats("compile+ckpt", [150, 135, 155]),
        _stats("ckpt-full", []),
        _stats("after-oom", [80, 80, 80]),
    ]
    stats[2].losses = [1.0, 0.25]
    contributions(stats)
    base, comp, both, oom, after = stats
    assert base.speedup is None and base.gain is None and base.loss_max_abs_diff == 0.0
    assert comp.speedup.value == pytest.approx(1.5) and not comp.speedup.overlaps
    assert comp.gain.value == pytest.approx(1.5) and comp.gain.reference == "base"
    # 150 vs 150 with ranges 135-155 and 140-160: no gain, and the marker says the repeats overlap.
    assert both.speedup.value == pytest.approx(1.5) and not both.speedup.overlaps
    assert both.gain.value == pytest.approx(1.0) and both.gain.overlaps and both.gain.reference == "compile"
    assert both.loss_max_abs_diff == pytest.approx(0.25)
    assert oom.speedup is None and oom.gain is None and oom.loss_max_abs_diff is None
    assert after.gain is None  # the previous variant failed: nothing to compare with
    assert after.speedup.value == pytest.approx(0.8) and not after.speedup.overlaps


def test_contributions_across_environments():
    stats = [_stats("base", [100, 100], env="stock"), _stats("base", [120, 125]), _stats("compile", [180, 190])]
    contributions(stats)
    assert stats[1].speedup.value == pytest.approx(1.225) and stats[1].gain is None  # other env: vs baseline only
    assert stats[2].speedup.value == pytest.approx(1.85) and stats[2].gain.value == pytest.approx(185 / 122.5)


def test_variant_lists():
    assert [v.name for v in parse_variants(None, [])] == ["base", "compile", "compile+ckpt"]
    assert parse_variants("base,ckpt-full", [])[1].flags == tuple(BUILTIN["ckpt-full"].split())
    user = parse_variants(None, ["a=--micro-batch 1", "b=--micro-batch 2 --lr 1e-3"])
    assert [(v.name, v.flags) for v in user] == [
        ("a", ("--micro-batch", "1")),
        ("b", ("--micro-batch", "2", "--lr", "1e-3")),
    ]
    assert [v.name for v in parse_variants("b,base", ["b=--micro-batch 2", "c=--micro-batch 4"])] == ["b", "base", "c"]
    with pytest.raises(UsageError, match=r"unknown variant 'fast'.*base, compile, compile\+ckpt, ckpt-full"):
        parse_variants("base,fast", [])
    with pytest.raises(UsageError, match="NAME="):
        parse_variants(None, ["--micro-batch 2"])


def test_the_same_settings_written_otherwise_are_the_same_command():
    """Resume compares the benchmark flags however they are ordered or written (``--x=y``)."""
    given = ["--model", "torch/llama-tiny", "--seq-len", "64", "--steps", "2", "--compile", "--lr", "-1e-3"]
    rewritten = ["--compile", "--lr=-1e-3", "--steps=2", "--seq-len", "64", "--model=torch/llama-tiny"]
    assert normalized(given) == normalized(rewritten)
    assert normalized(given) != normalized([*given, "--micro-batch", "2"])
    # A flag given twice: the last one wins, so the order of its values is a setting.
    assert normalized(["--micro-batch", "1", "--micro-batch", "2"]) != normalized(
        ["--micro-batch=2", "--micro-batch=1"]
    )
    assert normalized(["--no-reshard-after-forward", "--reshard-after-forward"]) != normalized(
        ["--reshard-after-forward", "--no-reshard-after-forward"]
    )


def _record(**results: object) -> dict:
    """The smallest run record: what the report reads of it (a run that crashed before its benchmark started)."""
    env = {"name": "local", "python": sys.executable, "prefix": sys.prefix, "versions": {}}
    meta = {"variant": "base", "variant_index": 0, "flags": "", "repeat": 1, "environment": env}
    meta |= {"environment_index": 0, "command": list(SHORT), "wall_s": 1.5, "log": "base.r1.log"}
    results = {"status": "error", "reason": "crashed", **results}
    return {"schema_version": 1, "kind": "ablation-run", "ablation": meta, "results": results}


def test_an_even_count_of_repeats_shows_one_runs_throughput_and_step_time():
    """Two noisy runs of 512 tokens a step: the medians taken apart were 12,288 tokens/s beside 312 ms (1,638)."""
    runs = []
    for repeat, (tps, step) in enumerate([(20480.0, 0.025), (4096.0, 0.6)], start=1):
        rec = _record(status="ok", tokens_per_s=tps, step_time_s_p50=step, mfu=tps / 1e6, losses=[1.0])
        rec["ablation"]["repeat"] = repeat
        runs.append(rec)
    [base] = summarize(runs)
    assert (base.tokens_per_s.median, base.step_time_s.median, base.mfu.median) == (4096.0, 0.6, 0.004096)
    assert (base.tokens_per_s.low, base.tokens_per_s.high, base.step_time_s.low) == (4096.0, 20480.0, 0.025)


def test_a_diverged_variant_is_reported_as_diverged_and_never_ranked(tmp_path):
    """Its measured steps before the NaN loss have a tokens/s; ranked, it stood beside real runs."""
    base = _record(status="ok", tokens_per_s=100.0, step_time_s_p50=0.5, losses=[2.0])
    high_lr = _record(status="diverged", reason="the loss became nan at step 2", tokens_per_s=400.0, losses=[None])
    high_lr["ablation"] |= {"variant": "high-lr", "variant_index": 1}
    stats = summarize([base, high_lr])
    assert stats[1].statuses == {"diverged": 1} and stats[1].tokens_per_s is None and stats[1].speedup is None
    assert stats[1].reason == "the loss became nan at step 2"
    assert "| high-lr | (none) | diverged | - |" in report.markdown([base, high_lr], stats, command=None)


def test_a_file_that_is_not_a_run_record_is_skipped_with_a_warning(tmp_path, capsys):
    runs = tmp_path / "runs" / "local"
    runs.mkdir(parents=True)
    config = {"engine": {"name": "torch"}, "model": {"name": "llama-tiny"}}
    not_records = {
        "junk.json": {"ablation": {}, "results": {}},
        "no-status.json": {**_record(), "results": {}},
        "text-figure.json": _record(status="ok", tokens_per_s="fast"),
        "text-losses.json": _record(status="ok", losses=["nan?"]),
        "no-environment.json": {**_record(), "ablation": {**_record()["ablation"], "environment": "local"}},
        "short-config.json": {**_record(), "config": config},
    }
    for name, record in not_records.items():
        (runs / name).write_text(json.dumps(record))
    (runs / "damaged.json").write_text('{"trunc')
    (runs / "base.r1.json").write_text(json.dumps(_record()))
    assert report.load_records(tmp_path) == [_record()]
    warnings = capsys.readouterr().err.splitlines()
    assert all(line.startswith("warning: skipping ") for line in warnings)
    assert len(warnings) == len(not_records) + 1
    assert all(any(name in line for line in warnings) for name in [*not_records, "damaged.json"])
    # What a record must have is all the report reads: the smallest one renders.
    report.render(tmp_path, [_record()], command=None)
    assert "| base | (none) | error |" in (tmp_path / "report.md").read_text()


def test_the_report_says_what_each_variant_applied(tmp_path):
    """An optimization that changed nothing shows: compile+ckpt's auto plan recomputes no layer, which its row
    alone (slower than compile, the same peak) does not say. A variant that applied neither has no line."""
    base = _record(status="ok", tokens_per_s=100.0, losses=[1.0])
    compiled = {"mode": "regional", "regions": 5, "graph_breaks": 1, "recompiles": 0, "time_s": 24.8, "fallbacks": []}
    plan = {"summary": "0/4 layers (selective 0, full 0)", "budget_bytes": 2**30}
    ckpt = _record(status="ok", tokens_per_s=90.0, losses=[1.0], compile=compiled, recompute=plan)
    ckpt["ablation"] |= {"variant": "compile+ckpt", "variant_index": 1}
    line = "recompute 0/4 layers (selective 0, full 0), budget 1.00 GiB; regional compile: 5 regions, 1 graph breaks, "
    line += "0 recompiles, 24.8 s compiling, 0 fallbacks"
    assert report.applied([base, ckpt], summarize([base, ckpt])) == [("compile+ckpt", line)]
    report.render(tmp_path, [base, ckpt], command=None)
    assert f"## What each variant applied\n\n- `compile+ckpt`: {line}\n" in (tmp_path / "report.md").read_text()


def test_the_title_counts_the_repeats_in_the_table():
    """base's second record was damaged (skipped): the table holds 1 run of base and 2 of compile, not 2 each."""
    runs = [_record(), _record(), _record()]
    runs[1]["ablation"] |= {"variant": "compile", "variant_index": 1}
    runs[2]["ablation"] |= {"variant": "compile", "variant_index": 1, "repeat": 2}
    assert report.title(runs) == "ablation · 1–2 repeat(s)"
    assert report.title(runs[1:]) == "ablation · 2 repeat(s)"


def test_usage_errors_exit_2(tmp_path, monkeypatch, capsys):
    code, _, err = run_main(capsys, "ablation", *SHORT, "--variants", "base,turbo", "--out", str(tmp_path / "a"))
    assert code == 2 and "unknown variant 'turbo'" in err and "ckpt-full" in err
    assert not (tmp_path / "a").exists()
    # Each variant's command is validated before anything runs, naming the variant.
    with pytest.raises(UsageError, match=r"variant x \(--micro-batch 0\): --micro-batch must be larger"):
        check_variant(list(SHORT), *parse_variants(None, ["x=--micro-batch 0"]))
    with pytest.raises(UsageError, match="unrecognized arguments: --no-such-flag"):
        check_variant(list(SHORT), *parse_variants(None, ["x=--no-such-flag"]))
    with pytest.raises(UsageError, match="--gradient-checkpointing; did you mean --recompute full"):
        check_variant(list(SHORT), *parse_variants(None, ["x=--gradient-checkpointing"]))
    # A plan that does not match the model's 4 layers (it failed in every run, exit 1)
    with pytest.raises(UsageError, match=r"variant x \(--recompute 8\): --recompute 8: the model has only 4 layers"):
        check_variant(list(SHORT), *parse_variants(None, ["x=--recompute 8"]))
    with pytest.raises(UsageError, match="--recompute lists 2 modes but the model has 4 layers"):
        check_variant(list(SHORT), *parse_variants(None, ["x=--recompute full,none"]))
    for flag in ("--help", "-h"):  # not the benchmark's help and exit 0 in the middle of an ablation
        with pytest.raises(UsageError, match=f"variant x \\({flag}\\): unrecognized arguments: {flag}$"):
            check_variant(list(SHORT), *parse_variants(None, [f"x={flag}"]))
    # The runs start without CHECKPOINT_OPTIMIZATION, so it cannot make --memory-budget valid here either.
    monkeypatch.setenv("CHECKPOINT_OPTIMIZATION", "true")
    with pytest.raises(UsageError, match="--memory-budget is the budget of --recompute auto"):
        check_variant(list(SHORT), *parse_variants(None, ["x=--memory-budget 1GiB"]))
    with pytest.raises(UsageError, match="no such interpreter"):
        parse_environments(["x=/nonexistent/python"], default_python=sys.executable)
    with pytest.raises(UsageError, match="cannot import ljperf"):
        parse_environments([f"bare={_venv(tmp_path / 'bare')}"], default_python=sys.executable)
    assert split_argv(["ablation", *SHORT, "--repeat", "2", "--variant", "a=--lr 1", "--out", "d"], "ablation") == list(
        SHORT
    )


def test_default_out_of_a_model_config_is_one_folder_named_after_it(tmp_path, monkeypatch, capsys):
    """No --out: the folder is ``ablation-ENGINE-NAME`` in the working directory, also for a --model-config path
    (a file of that name is refused before any run, which shows the folder chosen)."""
    monkeypatch.chdir(tmp_path)
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "my-model.json").write_text(
        (Path(ljperf.models.__file__).parent / "catalog" / "llama-tiny.json").read_text()
    )
    (tmp_path / "ablation-fsdp-my-model").write_text("")
    args = ["--model-config", "configs/my-model.json", "--engine", "fsdp", "--variants", "base", "--steps", "1"]
    code, _, err = run_main(capsys, "ablation", *args)
    assert code == 2, err
    assert err.strip() == "ljperf ablation: error: --out 'ablation-fsdp-my-model' is a file; give a folder"


@pytest.mark.slow
def test_ablation_report_failure_and_resume(tmp_path, monkeypatch, capsys):
    """The runs are processes; after the first ablation (a process, under the hook's variables) the commands that
    resume, refuse or report run in this one."""
    out = tmp_path / "abl"
    # A variant is its flags: the runs must not inherit CHECKPOINT_OPTIMIZATION (auto under a budget of 1 MiB
    # would exit 2 with "does not fit")
    hooked = cli_env(CHECKPOINT_OPTIMIZATION="true", LJPERF_MEMORY_BUDGET="1MiB")
    first = run_ljperf("ablation", *SHORT, *VARIANTS, "--repeat", "2", "--out", str(out), env=hooked)
    assert first.returncode == 1, first.stderr
    assert "2 of 6 runs failed" in first.stderr
    # Interleaved: every variant once per repeat, in order.
    order = [line.split()[1].rstrip(":") for line in first.stdout.splitlines() if line.startswith("[")]
    assert order == [f"local/{v}.r{k}" for k in (1, 2) for v in ("mb1", "mb2", "broken")]

    runs = {p.name: read_record(p) for p in (out / "runs" / "local").glob("*.json")}
    assert sorted(runs) == sorted(f"{v}.r{k}.json" for v in ("mb1", "mb2", "broken") for k in (1, 2))
    for name, rec in runs.items():
        assert rec["ablation"]["environment"]["versions"]["torch"] == rec["env"]["versions"]["torch"]
        if name.startswith("broken"):  # refused by the run itself, which writes no record: the ablation makes one
            assert rec["kind"] == "ablation-run" and rec["results"]["status"] == "error"
            assert rec["ablation"]["exit_code"] == 2
            assert "of 1.0 MiB (does not fit" in rec["results"]["reason"]
        else:
            assert rec["kind"] == "benchmark" and rec["results"]["status"] == "ok", (name, rec["results"])
            assert rec["config"]["optimizations"]["recompute"] == "none"
    # Same seed and data: mb1's repeats train identically.
    assert runs["mb1.r1.json"]["results"]["losses"] == runs["mb1.r2.json"]["results"]["losses"]

    summary = read_record(out / "summary.json")
    assert summary["kind"] == "ablation" and summary["args"][0] == "ablation"
    by_name = {v["variant"]: v for v in summary["variants"]}
    assert [v["variant"] for v in summary["variants"]] == ["mb1", "mb2", "broken"]
    mb1, mb2 = by_name["mb1"], by_name["mb2"]
    assert mb1["statuses"] == {"ok": 2} and by_name["broken"]["statuses"] == {"error": 2}
    ratio = mb2["tokens_per_s"]["median"] / mb1["tokens_per_s"]["median"]
    assert mb2["speedup"]["value"] == pytest.approx(ratio) and mb2["gain"]["value"] == pytest.approx(ratio)
    assert by_name["broken"]["speedup"] is None
    report_md = (out / "report.md").read_text()
    # The title shows what the variants change, each value (broken's refused runs hold no config).
    assert report_md.startswith("# Ablation: torch/llama-tiny · 1 process(es) · mb 1|2 × seq 64 × accum 1 · fp32 · ")
    assert "| mb2 | --micro-batch 2 | ok ×2 |" in report_md and "## Failed runs" in report_md
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resume, also with the flags reordered and written as --flag=value: nothing runs again, no record is rewritten.
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")}
    rewritten = ["--steps=2", "--warmup", "1", "--model=torch/llama-tiny", "--seq-len", "64"]
    rewritten += ["--variant", "mb1=--micro-batch=1", "--variant", "mb2=--micro-batch 2"]
    rewritten += ["--variant", "broken=--memory-budget 1MiB --recompute auto", "--repeat=2"]
    use_cli_env(monkeypatch)
    code, stdout, stderr = run_main(capsys, "ablation", *rewritten, "--out", str(out))
    assert code == 1 and "6 of 6 runs already finished" in stdout, stderr
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")} == mtimes
    # A missing run (as if killed before it finished) is the only one that runs.
    (out / "runs" / "local" / "mb2.r2.json").unlink()
    _, stdout, _ = run_main(capsys, "ablation", *SHORT, *VARIANTS, "--repeat", "2", "--out", str(out))
    assert "5 of 6 runs already finished" in stdout and "[1/1] local/mb2.r2: ok" in stdout
    assert read_record(out / "runs" / "local" / "mb2.r2.json")["results"]["status"] == "ok"
    # A record whose figure is not a number ljperf writes (NaN) counts as unfinished: it runs again.
    poisoned = out / "runs" / "local" / "mb1.r1.json"
    poisoned.write_text(
        poisoned.read_text().replace('"peak_allocated_bytes": ', '"peak_allocated_bytes": NaN, "_": ', 1)
    )
    _, stdout, stderr = run_main(capsys, "ablation", *SHORT, *VARIANTS, "--repeat", "2", "--out", str(out))
    assert "5 of 6 runs already finished" in stdout and "[1/1] local/mb1.r1: ok" in stdout
    assert f"skipping {poisoned}: results.peak_allocated_bytes is NaN, not a finite number" in stderr
    assert read_record(poisoned)["results"]["peak_allocated_bytes"] > 0
    # Other flags with the same folder: refused rather than mixed.
    code, _, stderr = run_main(
        capsys, "ablation", *SHORT, "--lr", "1e-3", *VARIANTS, "--repeat", "2", "--out", str(out)
    )
    assert code == 2 and "--force" in stderr
    # So are runs of other variants: the report would show them beside (or instead of) this command's.
    code, _, stderr = run_main(capsys, "ablation", *SHORT, "--variants", "base", "--repeat", "2", "--out", str(out))
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert "broken.r1: not among this command's runs" in stderr and "--force" in stderr
    assert not list(out.glob("runs/local/base.*"))

    # ljperf report rebuilds everything from the JSON, skipping a file that is not a run record.
    for name in ("summary.json", "report.md", "ablation.png"):
        (out / name).unlink()
    (out / "runs" / "local" / "junk.json").write_text('{"ablation": {}, "results": {}}')
    code, _, stderr = run_main(capsys, "report", str(out))
    assert code == 0, stderr
    assert "junk.json: no valid ablation.variant" in stderr.splitlines()[0]
    assert (out / "ablation.png").exists() and "| mb2 |" in (out / "report.md").read_text()
    assert read_record(out / "summary.json")["args"] is None


@pytest.mark.slow
def test_timeout_force_and_sigterm(tmp_path, monkeypatch, capsys):
    """The timed-out and forced ablations run in this process (their runs are processes); the one that gets
    SIGTERM is a process."""
    out = tmp_path / "t"
    args = ("ablation", *SHORT, "--repeat", "1", "--out", str(out))
    use_cli_env(monkeypatch)
    code, _, stderr = run_main(capsys, *args, "--variants", "base,ckpt-full", "--run-timeout", "0.5")
    assert code == 1 and "2 of 2 runs failed" in stderr
    path = out / "runs" / "local" / "base.r1.json"
    rec = read_record(path)
    assert rec["results"]["status"] == "timeout" and "stopped after --run-timeout 0.5 s" in rec["results"]["reason"]
    assert rec["ablation"]["wall_s"] < 20
    assert not list(out.glob("runs/local/.*"))  # no pending file left behind

    # --force re-runs every run, and deletes those of another command (here ckpt-full, which it does not run):
    # what ljperf report shows is this command's runs.
    before = path.stat().st_mtime_ns
    code, stdout, _ = run_main(capsys, *args, "--variants", "base", "--run-timeout", "0.5", "--force")
    assert code == 1 and "already finished" not in stdout
    assert path.stat().st_mtime_ns > before
    assert sorted(p.name for p in path.parent.iterdir()) == ["base.r1.json", "base.r1.log"]
    assert [r["ablation"]["variant"] for r in report.load_records(out)] == ["base"]

    # SIGTERM (a scheduler ending the job): the running benchmark is stopped, finished runs are kept, exit 143.
    before = path.stat().st_mtime_ns
    proc = subprocess.Popen(
        [sys.executable, "-m", "ljperf", *args, "--variants", "base,ckpt-full"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    child = _wait_for_child(proc.pid, b"benchmark")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and stderr.strip() == "ljperf ablation: interrupted by SIGTERM", stderr
    assert not Path(f"/proc/{child}").exists()  # ended and reaped by the ablation
    assert path.stat().st_mtime_ns == before
    assert sorted(p.name for p in path.parent.glob("*.json")) == ["base.r1.json"]  # no pending, no ckpt-full

    # SIGKILL: the ablation cleans nothing up, yet its benchmark ends with it (parent-death signal) and nothing of
    # theirs is left in $TMPDIR (a run's compile cache lives in --out; it was an ljperf-ablation-* folder there).
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ljperf", *args, "--variants", "base,ckpt-full"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=cli_env(TMPDIR=str(tmpdir)),
    )
    child = _wait_for_child(proc.pid, b"benchmark")
    proc.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while not _ended(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ended(child)
    assert sorted(p.name for p in tmpdir.iterdir() if p.name.startswith(("ljperf-", "torchelastic_"))) == []


def test_a_signal_while_a_run_starts_is_raised_once_it_has_started():
    # A SIGTERM raised inside Popen once the benchmark existed left it unstopped and unreaped: the ablation exited
    # 143 with its benchmark alive (seen in CI). The runner holds signals until Popen has returned.
    previous = interrupt_on_signals()
    reached = []
    try:
        with pytest.raises(Interrupted) as raised, interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            reached.append("after the signal")  # not cut short: the signal is raised on leaving
        assert reached and raised.value.exit_code == 143
    finally:
        restore_signals(previous)
        forget_signals()


def _ended(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def _wait_for_child(pid: int, word: bytes, timeout: float = 120) -> int:
    """The pid of a child of ``pid`` whose command line holds ``word``, once it has started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == pid and word in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except (OSError, ValueError, IndexError):  # not a process, or one that ended meanwhile
                continue
        time.sleep(0.1)
    raise AssertionError(f"no child of {pid} with {word!r} in its command line after {timeout} s")


def _venv(root: Path) -> Path:
    """A bare venv (no pip, no packages); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    return root / "bin" / "python"


def _second_environment(root: Path) -> Path:
    """A venv of its own whose site-packages points at this one's (a different installation, same packages)."""
    python = _venv(root)
    site = subprocess.check_output([python, "-c", "import site; print(site.getsitepackages()[0])"], text=True)
    (Path(site.strip()) / "ljperf_parent.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
    )
    return python


@pytest.mark.slow
def test_env_runs_under_another_interpreter(tmp_path, monkeypatch, capsys):
    """The ablation runs in this process; its runs are processes of the other interpreter."""
    python = _second_environment(tmp_path / "venv2")
    out = tmp_path / "e"
    # The built-in ckpt-full variant too: checkpointing must not change the losses (bitwise on CPU).
    use_cli_env(monkeypatch)
    args = ["--variants", "base,ckpt-full", "--repeat", "1", "--env", f"other={python}", "--out", str(out)]
    code, _, stderr = run_main(capsys, "ablation", *SHORT, *args)
    assert code == 0, stderr
    rec = read_record(out / "runs" / "other" / "base.r1.json")
    env = rec["ablation"]["environment"]
    assert env["name"] == "other" and env["python"] == str(python)
    assert Path(env["prefix"]) == tmp_path / "venv2" and Path(env["prefix"]) != Path(sys.prefix)
    assert rec["results"]["status"] == "ok" and rec["env"]["versions"] == env["versions"]
    assert env["versions"]["torch"] and env["versions"]["ljperf"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["environments"][0]["prefix"] == env["prefix"]
    assert "| other |" in (out / "report.md").read_text()
    ckpt = summary["variants"][1]
    assert ckpt["variant"] == "ckpt-full" and ckpt["statuses"] == {"ok": 1} and ckpt["loss_max_abs_diff"] == 0.0
    assert read_record(out / "runs" / "other" / "ckpt-full.r1.json")["config"]["optimizations"]["recompute"] == "full"


def test_builtin_variants_are_benchmark_flags():
    for variant in parse_variants(",".join(BUILTIN), []):
        cfg = check_variant(list(SHORT), variant)
        assert (cfg.optim.compile_mode != "off") == ("compile" in variant.name), variant


# --- the chart ----------------------------------------------------------------------------------------------------


def ablation_run(variant: str, index: int, repeat: int, tokens_per_s: float) -> dict:
    """A finished run's record, as much of it as the report reads."""
    config = {
        "engine": {"name": "fsdp"},
        "model": {"name": "llama-tiny"},
        "launch": {"world_size": 2},
        "train": {"micro_batch": 4, "seq_len": 256, "grad_accum": 1, "precision": "fp32", "steps": 5, "warmup": 1},
    }
    env = {"name": "local", "python": "python", "prefix": "/", "versions": {}}
    meta = {"variant": variant, "variant_index": index, "flags": "", "repeat": repeat, "environment": env}
    meta |= {"environment_index": 0, "command": [], "wall_s": 9.0, "log": f"{variant}.r{repeat}.log"}
    results = {"status": "ok", "tokens_per_s": tokens_per_s, "peak_allocated_bytes": 2**30, "losses": [1.0]}
    return {"ablation": meta, "config": config, "env": {"devices": ["cpu"]}, "results": results}


def test_the_ablation_chart_is_titled_and_its_bars_are_the_tables_median_run(tmp_path):
    """The chart had no title; then its bar was the mean of 2 repeats while the table showed the slower run (and
    the chart printed the table's ratio above the mean's bar). One statistic for both: the median run (of an even
    count, the slower middle one), named on the chart."""
    from PIL import Image

    two = [ablation_run("base", 0, 1, 20480.0), ablation_run("base", 0, 2, 4096.0)]
    three = [ablation_run("compile", 1, k, tps) for k, tps in enumerate([100.0, 90.0, 250.0], start=1)]
    base, compiled = summarize(two + three)
    assert (report.bar_height(base.tokens_per_s), report.bar_height(compiled.tokens_per_s)) == (4096.0, 100.0)
    header, body = report.rows([base, compiled])
    assert [row[header.index("tokens/s")] for row in body] == ["4,096", "100"]
    assert compiled.speedup.value == pytest.approx(100.0 / 4096.0)
    report.chart(two + three, [base, compiled], tmp_path / "chart.png")
    meta = Image.open(tmp_path / "chart.png").text
    assert meta["Title"].startswith("fsdp/llama-tiny · 2 process(es) · mb 4 × seq 256 × accum 1 · fp32 · ")
    assert meta["Title"].endswith(" · device: cpu")
    assert meta["Description"] == "throughput bar: the median run (of an even count, the slower middle one)"
