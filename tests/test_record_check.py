"""Records read back (``ljperf report``, ablation resume, ``ljperf plan --calibrate``): a record with a number that
is not finite, of the wrong type or out of range, or of an unknown schema version, is skipped with one line naming
its file and field, never a traceback."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ljperf.ablation import report
from ljperf.core.errors import UsageError
from ljperf.core.record_check import record_problem
from ljperf.forecast.calibrate import valid_records

from conftest import run_main

ROOT = Path(__file__).resolve().parents[1]
GOOD = ROOT / "benchmarks" / "ablation-llama-tiny-cpu-quiet" / "runs" / "local" / "base.r1.json"
"""A run record an ablation wrote (a benchmark record with its ``ablation`` section)."""


def good() -> dict[str, Any]:
    return json.loads(GOOD.read_text())


def numeric_paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Where ``value`` holds a number (not a bool), as key paths."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in numeric_paths(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in numeric_paths(v, (*path, i))]
    return [path] if isinstance(value, int | float) and not isinstance(value, bool) else []


PATHS = numeric_paths(good())
SIGNED = frozenset({"error_pct", "device_overhead"})
"""Figures that may be below zero by what they are: the forecast's error against the measured peak, and the
calibrated overheads beyond the traced peak (a fit that found the trace above the measured peaks)."""
RESULTS = [p for p in PATHS if p[0] == "results" and p[-1] not in SIGNED]
"""The measured figures and the forecast's: each is a count, a size, a time or a rate (the schema says at least
0)."""


def set_at(record: dict, path: tuple, value: Any) -> dict:
    changed = copy.deepcopy(record)
    inner = changed
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return changed


def dotted(path: tuple) -> str:
    return ".".join(str(k) for k in path if not isinstance(k, int))


def test_the_committed_record_is_good_and_has_numbers_in_every_section():
    assert record_problem(good()) is None
    assert {p[0] for p in PATHS} >= {"env", "config", "results", "ablation"} and len(RESULTS) > 20


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_number_that_is_not_finite_is_named_wherever_it_is(bad):
    for path in PATHS:
        problem = record_problem(set_at(good(), path, bad))
        assert problem is not None and problem.startswith(dotted(path)), (path, problem)
        assert {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[repr(bad)] in problem


def test_a_calibration_below_the_trace_is_a_good_record():
    """A fit of this machine's records gave an offset of -96.58 KiB: the record a later benchmark wrote, whose
    forecast's device overhead was below zero, was refused by ljperf report."""
    breakdown = ("results", "forecast", "breakdown")
    assert record_problem(set_at(good(), (*breakdown, "device_overhead"), -98566)) is None
    assert record_problem(set_at(good(), (*breakdown, "activations"), -98566)) is not None  # a size is not signed


def test_an_unknown_or_missing_schema_version_is_named():
    assert record_problem({**good(), "schema_version": 999}) == "schema_version 999 is not one this ljperf reads (1)"
    assert record_problem({**good(), "schema_version": "1"}).startswith('schema_version "1" is not one')
    assert record_problem({k: v for k, v in good().items() if k != "schema_version"}).startswith("schema_version null")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(RESULTS),
    bad=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not math.isfinite(x) or x < 0),
        st.integers(max_value=-1),
        st.text(max_size=5),
        st.booleans(),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
    ),
)
def test_a_measured_figure_that_cannot_be_is_skipped_with_one_line_naming_file_and_field(tmp_path, capsys, path, bad):
    """Every reader of records at once: the report and resume (``read_records`` through ``load_records``) and
    ``--calibrate`` (``valid_records``). Beside a good record the bad one is skipped with one line; alone, the
    readers end with one usage line (exit 2), never a traceback."""
    folder = tmp_path / "abl"
    runs = folder / "runs" / "local"
    runs.mkdir(parents=True, exist_ok=True)
    for old in runs.iterdir():
        old.unlink()
    (runs / "bad.json").write_text(json.dumps(set_at(good(), path, bad)))
    with pytest.raises(UsageError, match=r"bad\.json: " + dotted(path).replace(".", r"\.")):
        report.load_records(folder)
    with pytest.raises(UsageError, match=r"bad\.json: " + dotted(path).replace(".", r"\.")):
        valid_records([str(runs / "bad.json")], what="--calibrate")
    (runs / "base.r1.json").write_text(GOOD.read_text())
    assert report.load_records(folder) == [good()]
    assert len(valid_records([str(runs / "bad.json"), str(runs / "base.r1.json")], what="--calibrate")) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all("bad.json" in line and dotted(path) in line for line in lines), lines


def test_report_of_a_folder_with_a_poisoned_record_skips_it_and_exits_2_when_none_is_left(tmp_path, capsys):
    """The adversarial pass's case: ``peak_allocated_bytes: NaN`` made ``ljperf report`` exit 1 with a traceback."""
    runs = tmp_path / "runs" / "local"
    runs.mkdir(parents=True)
    (runs / "base.r1.json").write_text(json.dumps(set_at(good(), ("results", "peak_allocated_bytes"), math.nan)))
    (runs / "base.r2.json").write_text(json.dumps(set_at(good(), ("results", "tokens_per_s"), math.inf)))
    code, _, stderr = run_main(capsys, "report", str(tmp_path))
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "base.r1.json: results.peak_allocated_bytes is NaN, not a finite number" in stderr
    (runs / "base.r3.json").write_text(GOOD.read_text())
    code, _, stderr = run_main(capsys, "report", str(tmp_path))
    assert code == 0, stderr
    assert [line.split(": ", 2)[1].rsplit("/", 1)[-1] for line in stderr.splitlines()] == [
        "base.r1.json",
        "base.r2.json",
    ]
    assert "results.tokens_per_s is Infinity" in stderr


def test_a_run_record_nested_too_deep_is_skipped_with_a_line(tmp_path):
    """One such record broke ``ljperf report`` and resume for the whole folder (a RecursionError traceback)."""
    from ljperf.ablation.runner import read_records

    (tmp_path / "runs" / "local").mkdir(parents=True)
    (tmp_path / "runs" / "local" / "base.r1.json").write_text("[" * 200_000)
    records, skipped = read_records(tmp_path)
    assert records == {} and len(skipped) == 1 and "nested deeper than Python reads" in skipped[0]
