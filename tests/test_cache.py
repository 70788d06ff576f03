"""ljperf's on-disk cache (``core.cache``): entries read back as written, and a cache that cannot be used said once."""

from __future__ import annotations

import json
import math

from ljperf.core.cache import SIGNATURE, cached, digest

from conftest import run_main


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
