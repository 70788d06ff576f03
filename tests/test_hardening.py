"""What an adversarial pass broke, each checked: ``--output`` onto a device, a symlink, an input file or stdout;
credentials in a DeepSpeed config; sizes and counts past any machine.

Run: ``.venv/bin/python -m pytest tests/test_hardening.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ljperf.cli import main
from ljperf.core.records import REDACTED, without_secrets

from conftest import cli_env

TINY = ["benchmark", "--model", "torch/llama-tiny", "--seq-len", "32", "--steps", "1", "--warmup", "1"]


@pytest.mark.parametrize("target", ["/dev/null", "fifo"])
def test_output_onto_a_device_or_fifo_is_refused_before_the_run(target, tmp_path, capsys):
    """As root (usual in containers) ``--output /dev/null`` replaced the device with a 3 kB regular file."""
    if target == "fifo":
        target = str(tmp_path / "fifo")
        os.mkfifo(target)
    before = os.stat(target).st_mode
    assert main([*TINY, "--output", target]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a file" in err[0] and "- for stdout" in err[0], err
    assert os.stat(target).st_mode == before


def test_output_onto_an_input_file_is_refused_and_the_input_kept(tmp_path, capsys):
    """``--output`` equal to ``--deepspeed-config`` (here through a symlink) overwrote the user's config."""
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 2}}')
    (tmp_path / "link.json").symlink_to(config)
    argv = ["benchmark", "--model", "deepspeed/llama-tiny", "--deepspeed-config", str(config)]
    assert main([*argv, "--output", str(tmp_path / "link.json")]) == 2
    assert "one of the run's input files" in capsys.readouterr().err
    assert json.loads(config.read_text()) == {"zero_optimization": {"stage": 2}}


def test_output_through_a_symlink_and_to_stdout(tmp_path):
    """A symlink stays a symlink and its target gets the record; ``-`` puts the record alone on stdout (the table
    on stderr), so it pipes into ``jq``."""
    (tmp_path / "record.json").write_text("")
    (tmp_path / "latest.json").symlink_to("record.json")
    env = cli_env()
    cmd = [sys.executable, "-m", "ljperf", *TINY]
    linked = subprocess.run([*cmd, "--output", "latest.json"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert linked.returncode == 0, linked.stderr[-2000:]
    assert (tmp_path / "latest.json").is_symlink()
    assert json.loads((tmp_path / "record.json").read_text())["results"]["status"] == "ok"
    piped = subprocess.run([*cmd, "--output", "-"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert piped.returncode == 0, piped.stderr[-2000:]
    assert json.loads(piped.stdout)["results"]["status"] == "ok"
    assert "throughput" in piped.stderr and "memory forecast" in piped.stderr


def test_credentials_in_a_config_never_reach_a_record():
    """A DeepSpeed config's ``comet``/``wandb`` sections carry API keys; the resolved config is recorded."""
    config = {
        "comet": {"enabled": True, "api_key": "c0m3t", "project": "p"},
        "wandb": {"team": "t", "apiKey": "w4ndb"},
        "monitor": [{"auth_token": "t0k3n"}, {"password": 1}],
        "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 10, "offload_param": {"device": "cpu"}},
    }
    scrubbed = without_secrets(config)
    assert scrubbed["comet"] == {"enabled": True, "api_key": REDACTED, "project": "p"}
    assert scrubbed["wandb"] == {"team": "t", "apiKey": REDACTED}
    assert scrubbed["monitor"] == [{"auth_token": REDACTED}, {"password": REDACTED}]
    assert scrubbed["zero_optimization"] == config["zero_optimization"]
    assert not any(secret in json.dumps(scrubbed) for secret in ("c0m3t", "w4ndb", "t0k3n"))


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["plan", "--model", "torch/llama-tiny", "--gpu-memory", "9" * 400 + "GiB"], "larger than 1 EiB"),
        (
            ["plan", "--model", "torch/llama-tiny", "--recompute", "auto", "--memory-budget", "9" * 40 + "TiB"],
            "larger than 1 EiB",
        ),
        (["comm", "--max-bytes", "9" * 400], "larger than 1 EiB"),
        ([*TINY, "--warmup", str(10**12)], "--warmup must be zero or more and at most"),
        (["comm", "--iters", str(10**12)], "--iters must be larger than zero and at most"),
        (["comm", "--warmup-iters", str(10**12)], "--warmup-iters must be zero or more and at most"),
    ],
)
def test_sizes_and_counts_past_any_machine_are_one_line(argv, text, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0] and len(err[0]) < 300, err


def _children(pid: int) -> list[int]:
    tasks = os.listdir(f"/proc/{pid}/task")
    return [int(c) for task in tasks for c in open(f"/proc/{pid}/task/{task}/children").read().split()]


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_ranks_end_with_a_killed_launcher_and_leave_nothing_behind(tmp_path):
    """``kill -9`` of the launcher: both ranks trained on and wrote ``status: "ok"`` 40 s after it had exited 137,
    and ``ljperf-run-*`` (and every run's ``torchelastic_*``) stayed in $TMPDIR. Now the ranks get SIGTERM when
    it dies, keep what they measured in the record, and remove the run folder."""
    out = tmp_path / "r.json"
    argv = [*TINY[:5], "--seq-len", "64", "--steps", "1000", "--nproc-per-node", "2", "--output", str(out)]
    env = cli_env(TMPDIR=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-m", "ljperf", *argv], env=env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while len(ranks := _children(launcher.pid)) < 2 or not list(tmp_path.glob("ljperf-run-*/progress.jsonl")):
        assert time.monotonic() < deadline and launcher.poll() is None, "the run did not start"
        time.sleep(0.5)
    time.sleep(2)  # a few steps
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 60
    while any(_alive(r) for r in ranks):
        assert time.monotonic() < deadline, "ranks outlived their launcher"
        time.sleep(0.5)
    results = json.loads(out.read_text())["results"]
    assert results["status"] == "error" and results["reason"] == "interrupted by SIGTERM", results["reason"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("ljperf-", "torchelastic_"))) == []


@pytest.mark.parametrize("content", ["nested", "/dev/zero", "fifo", "large"])
@pytest.mark.parametrize(
    "argv",
    [
        ["benchmark", "--model-config", "{file}"],
        ["plan", "--model", "deepspeed/llama-tiny", "--deepspeed-config", "{file}"],
        ["plan", "--calibrate", "{file}"],
        ["doctor", "--deepspeed-config", "{file}", "--skip", "driver,nccl-ifname,nccl,versions,compile"],
    ],
)
def test_every_json_input_is_read_with_limits(argv, content, tmp_path, capsys):
    """``'[' * 200000`` gave a RecursionError traceback, ``/dev/zero`` was read until memory ran out and a FIFO
    blocked for ever: one reader for every JSON input refuses each in one line naming the file."""
    path = tmp_path / "input.json"
    if content == "nested":
        path.write_text("[" * 200_000)
    elif content == "large":
        path.write_text(" " * (8 * 1024**2 + 1) + "{}")
    elif content == "fifo":
        os.mkfifo(path)
    else:
        path = content
    assert main([a.replace("{file}", str(path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "Traceback" not in err[0], err


def test_a_run_record_nested_too_deep_is_skipped_with_a_line(tmp_path):
    """One such record broke ``ljperf report`` and resume for the whole folder (a RecursionError traceback)."""
    from ljperf.ablation.runner import read_records

    (tmp_path / "runs" / "local").mkdir(parents=True)
    (tmp_path / "runs" / "local" / "base.r1.json").write_text("[" * 200_000)
    records, skipped = read_records(tmp_path)
    assert records == {} and len(skipped) == 1 and "nested deeper than Python reads" in skipped[0]


def test_a_cache_entry_changed_outside_ljperf_is_traced_again_with_one_warning(tmp_path, monkeypatch, capsys):
    """Every number of a cached trace scaled by 0.1 made ``ljperf plan`` answer a largest micro batch 10× too
    large (a plan that "fits" a batch that does not); strings for numbers gave tracebacks. Here the trace's
    numbers are scaled and the block sizes' made strings: each is made again, with one line saying so."""
    from ljperf.forecast import Recipe, blocks, forecast, trace
    from ljperf.models.spec import resolve

    monkeypatch.setenv("LJPERF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(blocks, "_BLOCKS", {})  # what this process read before is not read again
    monkeypatch.setattr(trace, "_PATTERNS", {})
    spec, recipe = resolve(name="llama-tiny"), Recipe(device="cpu", precision="fp32", micro_batch=1, seq_len=64)
    first = forecast(spec, recipe)

    def change(value, edit):
        if isinstance(value, list | dict):
            for key, item in value.items() if isinstance(value, dict) else enumerate(value):
                value[key] = change(item, edit)
        elif isinstance(value, int) and not isinstance(value, bool):
            return edit(value)
        return value

    files = sorted((tmp_path / "forecast").glob("*.json"))
    for path in files:
        entry = json.loads(path.read_text())
        change(entry["data"], str if "-blocks-" in path.name else lambda n: n // 10)
        path.write_text(json.dumps(entry))
    monkeypatch.setattr(blocks, "_BLOCKS", {})
    monkeypatch.setattr(trace, "_PATTERNS", {})
    assert forecast(spec, recipe) == first
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "changed since ljperf wrote it: made again" in line]
    assert len(files) == 2 and len(warnings) == 2 and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("change", "text"),
    [
        ({"hidden_size": 10**9, "num_attention_heads": 1, "num_key_value_heads": 1}, "parameters, more than the 1e+13"),
        ({"num_hidden_layers": 100_000}, "num_hidden_layers 100,000 is more than the 10,000"),
    ],
)
def test_an_absurd_config_is_refused_before_anything_is_built(change, text, tmp_path, capsys):
    """A hidden size of 10^9 made ``plan`` allocate ~4 GB at a time and 100,000 layers built a 100k-layer model:
    neither finished in 300 s. Refused from the file's own numbers, before transformers is imported."""
    import ljperf.plan.record  # noqa: F401 - imported before the clock starts: the command's own imports
    from ljperf.models.catalog import read_config_dict

    config = tmp_path / "config.json"
    config.write_text(json.dumps(read_config_dict(name="llama-tiny") | change))
    started = time.monotonic()
    assert main(["plan", "--model-config", str(config), "--gpu", "H100"]) == 2
    assert time.monotonic() - started < 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0], err


def test_a_meta_build_makes_no_large_filled_tensor_for_real():
    """``torch.ones`` of a norm weight is made for real and only then moved to the meta device."""
    import torch

    from ljperf.models.spec import LARGEST_REAL, _empty_on_meta

    with _empty_on_meta():
        large = torch.ones(LARGEST_REAL + 1), torch.zeros((2, LARGEST_REAL)), torch.full((LARGEST_REAL + 1,), 2.0)
        small = torch.ones(8), torch.arange(4.0)
    assert [t.device.type for t in large] == ["meta"] * 3 and [t.device.type for t in small] == ["cpu"] * 2


MAKE_ONCE = """
import sys, time
from pathlib import Path
from ljperf.core.cache import cached

def make():
    with open(sys.argv[2], "a") as log:
        log.write("made\\n")
    time.sleep(float(sys.argv[3]))
    return {"value": 42}

print(cached(Path(sys.argv[1]), load=dict, make=make, dump=dict)["value"], flush=True)
"""


def test_processes_that_miss_one_cache_entry_at_once_make_it_once(tmp_path):
    """The ranks of a node (or a job's concurrent plans) that find no traced entry each traced it, all at once on
    the same cores: the first makes it, the others wait for it and read it. A maker killed with SIGKILL holds
    no one up (the kernel drops its lock), and the next process makes the entry."""
    entry, log = tmp_path / "cache" / "forecast" / "entry.json", tmp_path / "made.log"

    def start(seconds: float) -> subprocess.Popen:
        argv = [sys.executable, "-c", MAKE_ONCE, str(entry), str(log), str(seconds)]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=cli_env(LJPERF_CACHE_DIR=str(tmp_path)))

    killed = start(60)
    while not log.exists():
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    procs = [start(1.0) for _ in range(3)]
    assert [p.communicate(timeout=60)[0].strip() for p in procs] == ["42"] * 3
    assert log.read_text().splitlines() == ["made"] * 2  # the killed maker's, then one of the three
