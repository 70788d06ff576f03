"""Shared test helpers: run the real ``ljperf`` CLI in a subprocess and read its JSON record."""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# One intra-op thread in every process of the suite (set before torch is imported, inherited by every process a
# test starts, read by ljperf's own runs in this process): two workers share the 2-core machines with the
# processes they start, and threads beyond the cores only spin (a twelfth of the suite's CPU time).
os.environ["OMP_NUM_THREADS"] = "1"


FORECAST_TOLERANCE = 0.005
"""Every memory forecast against a real step's measured peak, for every engine and mesh: within ±0.5% (issue 59)."""


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: output unbuffered, no run folder of an outer run."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LJPERF_RUN_DIR", None)
    env.update(extra)
    return env


def run_ljperf(
    *args: str,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    memory_above_imports: int | None = None,
):
    """Run ``python -m ljperf ARGS``; returns the CompletedProcess (text output captured).
    ``memory_above_imports`` (bytes) limits the address space it may map beyond what importing torch and ljperf
    takes, so that a large enough tensor really fails to allocate."""
    address_space = memory_above_imports and imported_address_space() + memory_above_imports

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    return subprocess.run(
        [sys.executable, "-m", "ljperf", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
        cwd=cwd,
        preexec_fn=limit if address_space else None,
        check=False,
    )


def use_cli_env(monkeypatch: pytest.MonkeyPatch, **extra: str) -> None:
    """This process's environment made ``cli_env(**extra)`` for the test: what ``run_main`` of a command that
    starts processes of its own (ablation's benchmark runs) hands them, as a CLI subprocess would."""
    monkeypatch.delenv("LJPERF_RUN_DIR", raising=False)
    for key, value in {"PYTHONUNBUFFERED": "1", **extra}.items():
        monkeypatch.setenv(key, value)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """``ljperf ARGS`` through ``ljperf.cli.main`` in this process: (exit code, stdout, stderr) as ``capsys`` (or
    ``capfd``: file descriptors too) caught them, or ``sys.stdout`` and ``sys.stderr`` when ``capsys`` is None (a
    module fixture's). For checks of an exit code and what is printed, where no process of its own is needed (a
    subprocess first spends seconds importing torch). The signal handlers ``main`` installs are put back."""
    from ljperf import cli

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.ExitStack() as stack:
            if capsys is None:
                stack.enter_context(contextlib.redirect_stdout(out))
                stack.enter_context(contextlib.redirect_stderr(err))
            code = cli.main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if capsys is None:
        return code, out.getvalue(), err.getvalue()
    return code, *capsys.readouterr()


@functools.cache
def imported_address_space() -> int:
    """Bytes of address space a process maps once torch and ljperf's commands are imported: about 0.7 GB with
    the CPU build of torch, 3.2 GB with a CUDA build (its libraries are mapped even without a GPU)."""
    code = "import ljperf.benchmark.loop, ljperf.comm.bench; print(open('/proc/self/status').read())"
    status = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    (peak,) = (line.split()[1] for line in status.splitlines() if line.startswith("VmPeak:"))
    return int(peak) * 1024


def read_record(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


LONGEST_FIRST = (
    "test_forecast.py",
    "test_reliability.py",
    "test_readme.py",
    "test_startup_hooks.py",
    "test_forecast_matrix.py",
    "test_forecast_engines.py",
    "test_compile.py",
    "test_mesh.py",
    "test_benchmark.py",
    "test_ablation.py",
    "test_plan.py",
    "test_engines.py",
    "test_checkpoint_plan.py",
)
"""The longest files of a full run (about 2026-12: together ~80% of it), longest first; the others follow in
their usual order. xdist's ``--dist loadfile`` (with ``--no-loadscope-reorder``, as ``make test`` runs it) hands
files to the workers in this order, so no long file starts last and leaves one worker running alone."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and (reason := no_cuda()):
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=reason))


def no_cuda() -> str | None:
    """Why a test marked ``gpu`` cannot run here, or None where torch sees a CUDA device (torch is imported only
    when a collected test carries the marker)."""
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        return f"needs a CUDA device: torch {torch.__version__} ({build}) sees none"
    return None


def pytest_unconfigure() -> None:
    """Each worker's (and the controller's) interpreter exit would collect garbage over every object the suite
    made, 1.3 s of a worker's end: frozen, they are left to the process's end, as ``ljperf``'s own exit does."""
    gc.freeze()


@pytest.fixture(autouse=True, scope="session")
def fresh_forecast_cache(tmp_path_factory, worker_id):
    """Traced forecast coefficients from an empty cache, inherited by CLI subprocesses: no stale entries from
    development runs on this machine. pytest-xdist's workers share one per test run, so each architecture and
    shape family is traced once, not once per worker. A test that saves a calibration saves it in a cache of its
    own (``own_calibration``): the other worker's runs would read it."""
    if worker_id == "master":
        cache = tmp_path_factory.mktemp("ljperf-cache")
    else:  # the run's folder, above each worker's
        cache = tmp_path_factory.getbasetemp().parent / "ljperf-cache"
        cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LJPERF_CACHE_DIR", str(cache))
        yield


def own_cache(tmp_path: Path) -> Path:
    """A cache folder of a test's own whose traced coefficients are the run's (linked): a calibration saved there
    reaches no other test."""
    shared, own = Path(os.environ["LJPERF_CACHE_DIR"]), tmp_path / "cache"
    own.mkdir()
    for part in ("forecast", "models"):
        (shared / part).mkdir(exist_ok=True)
        (own / part).symlink_to(shared / part)
    return own


@pytest.fixture
def own_calibration(tmp_path, monkeypatch) -> Path:
    """The calibration file of this test's ``own_cache``, which is ``LJPERF_CACHE_DIR`` while it runs."""
    own = own_cache(tmp_path)
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(own))
    return own / "calibration.json"


def stale_calibration_cache(tmp_path: Path, *, scale: float) -> Path:
    """An ``own_cache`` whose saved CPU calibration multiplies every forecast by ``scale`` (a calibration gone
    stale): ``LJPERF_CACHE_DIR`` for a run whose first plan the closed loop must correct."""
    cache = own_cache(tmp_path)
    stale = {"cpu": {"scale": scale, "offset": 0, "reserved_scale": None, "context": 0, "samples": 3}}
    (cache / "calibration.json").write_text(json.dumps({"version": 1, "devices": stale}))
    return cache


MOE = {  # transformers' grouped_mm experts, fp32 (torch's fake grouped_mm takes bf16 only)
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64},
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 256},
    "deepseek_v3": {  # layer 0 dense, layer 1 experts: -8.4% when every layer was counted as the first
        "num_key_value_heads": 4,  # MLA has no GQA (fewer made transformers' selective recompute fail)
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "head_dim": 16,  # its rotary part
        "qk_nope_head_dim": 16,
        "v_head_dim": 32,
        "n_group": 2,
        "topk_group": 1,
    },
}
