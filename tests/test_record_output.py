"""A run's record as written (``--output``, ``core.records``): never onto a device, a FIFO or one of the run's
input files; through a symlink to its target; ``-`` alone on stdout; credentials of a DeepSpeed config redacted.

Run: ``.venv/bin/python -m pytest -q -n 0 tests/test_record_output.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
