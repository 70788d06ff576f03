"""ljperf's on-disk cache (``core.cache``): entries read back as written, a cache that cannot be used said once, an
entry changed outside ljperf made again, and an entry missed by several processes at once made once."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

from ljperf.core.cache import SIGNATURE, cached, digest

from conftest import cli_env, run_main


def test_an_entry_holding_a_number_that_is_not_finite_reads_back_without_a_warning(tmp_path, capsys):
    """A config's ``rms_norm_eps: NaN`` in a model's facts was written as null, so its signature never matched:
    "changed since ljperf wrote it" on every run, and the entry made again each time."""
    path = tmp_path / "entry.json"
    made = []

    def make() -> dict:
        made.append(1)
        return {"eps": math.nan, "scale": math.inf, "layers": 2}

    first = cached(path, load=dict, make=make, dump=dict)
    second = cached(path, load=dict, make=make, dump=dict)
    assert len(made) == 1 and capsys.readouterr().err == ""
    assert math.isnan(second["eps"]) and second["scale"] == math.inf and second["layers"] == first["layers"] == 2
    stored = json.loads(path.read_text())
    assert stored[SIGNATURE] == digest(stored["data"])


def test_a_cache_folder_that_is_a_file_is_said_once_in_one_line(tmp_path, monkeypatch, capsys):
    """It was silent, and every plan traced again (15.7 s instead of about 3)."""
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("")
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(not_a_folder))
    code, _, stderr = run_main(capsys, "plan", "--model", "torch/llama-tiny", "--device", "cpu", "--seq-len", "64")
    assert code == 0, stderr
    said = [line for line in stderr.splitlines() if "cannot be used" in line]
    assert said == [
        f"warning: the cache {not_a_folder} cannot be used (it is a file, not a folder): each forecast traces again;"
        " set LJPERF_CACHE_DIR to a folder"
    ], stderr


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
