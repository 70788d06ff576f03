"""``ljperf doctor``: every check on real inputs (driver table, /sys/class/net, DeepSpeed files, manifests)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from ljperf.doctor import checks, manifest
from ljperf.doctor.checks import FAIL, INFO, OK, WARN

from conftest import cli_env, run_ljperf

MACHINE_CHECKS = ("driver", "nccl-ifname", "nccl", "versions", "compile")


def doctor_json(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    proc = run_ljperf("doctor", "--json", *args, env=env, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def skip_all_but(*keep: str) -> str:
    return "--skip=" + ",".join(c for c in MACHINE_CHECKS if c not in keep)


# --- driver ---------------------------------------------------------------------------------------------

DRIVER_CASES = [
    # (driver, data-center GPU, status, words in the finding)
    ("575.51.03", False, OK, "needs ≥ 575"),
    ("580.65.06", True, OK, "runs CUDA 12.8"),
    ("570.124.06", True, FAIL, "too old"),
    ("550.163.01", True, FAIL, "too old"),
    ("470.57.02", True, OK, "forward compatibility"),
    ("470.256.02", True, OK, "forward compatibility"),
    ("470.42.01", True, FAIL, "470.57"),
    ("470.57.02", False, FAIL, "only on data-center GPUs"),
    ("525.85.12", True, OK, "forward compatibility"),
    ("525.60.13", True, FAIL, "525.85"),
    ("535.86.10", True, OK, "forward compatibility"),
    ("535.54.03", True, FAIL, "535.86"),
    ("545.23.08", True, OK, "forward compatibility"),
    ("545.23.06", False, FAIL, "only on data-center GPUs"),
]
MUST_UPGRADE = ["418.226.00", "440.118.02", "450.248.02", "460.106.00", "510.108.03", "520.61.05"]
MUST_UPGRADE += ["530.41.03", "555.58.02", "560.35.03"]


@pytest.mark.parametrize(("driver", "datacenter", "status", "words"), DRIVER_CASES)
def test_driver_against_cuda_12_8(driver, datacenter, status, words):
    result = checks.driver_compatibility(driver, "12.8", datacenter=datacenter)
    assert result.status == status, result
    assert words in result.finding
    assert bool(result.fix) == (status == FAIL)


@pytest.mark.parametrize("driver", MUST_UPGRADE)
def test_branches_that_must_upgrade(driver):
    for datacenter in (True, False):
        result = checks.driver_compatibility(driver, "12.8", datacenter=datacenter)
        assert result.status == FAIL
        assert "not forward-compatible" in result.finding
        assert "575" in result.fix


@pytest.mark.parametrize(
    ("driver", "status", "words"),
    [("580.159.04", OK, "runs CUDA 13.0"), ("580.65.06", OK, "needs ≥ 580.65.6"), ("575.57.08", FAIL, "too old")],
)
def test_driver_against_cuda_13_0(driver, status, words):
    """The GPU machine of this project: torch cu130 on driver 580.159 (it was 'no compatibility rule')."""
    result = checks.driver_compatibility(driver, "13.0", datacenter=True)
    assert (result.status, words in result.finding) == (status, True), result


@pytest.mark.parametrize(("driver", "status"), [("580.65.06", OK), ("590.44.01", OK), ("575.57.08", FAIL)])
def test_the_images_cuda_13_1_runs_on_the_r580_driver(driver, status):
    """The image's base (NGC 25.12, CUDA 13.1) on a driver of the R580 branch: minor-version compatibility."""
    assert checks.driver_compatibility(driver, "13.1", datacenter=True).status == status


def test_driver_unknown_cuda_and_bad_version():
    assert checks.driver_compatibility("580.65.06", "14.0", datacenter=True).status == INFO
    with pytest.raises(ValueError):
        checks.parse_driver("575.x")


@pytest.mark.parametrize(
    ("name", "datacenter"),
    [
        ("NVIDIA H100 80GB HBM3", True),
        ("NVIDIA A100-SXM4-80GB", True),
        ("NVIDIA H20", True),
        ("NVIDIA L40S", True),
        ("NVIDIA A10G", True),
        ("Tesla T4", True),
        ("NVIDIA B200", True),
        ("NVIDIA GeForce RTX 4090", False),
        ("NVIDIA GeForce RTX 5090", False),
    ],
)
def test_datacenter_gpu_names(name, datacenter):
    assert checks.is_datacenter_gpu(name) is datacenter


def test_driver_check_without_gpu_is_info():
    """This machine has no NVIDIA driver: NVML's library is missing and there is no nvidia-smi."""
    assert checks.gpu_inventory() is None
    result = checks.check_driver()
    assert result.status == INFO
    assert "no NVIDIA driver" in result.finding


# --- NCCL_SOCKET_IFNAME ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def names() -> list[str]:
    found = checks.interfaces()
    if "eth0" not in found:
        pytest.skip(f"this machine has no eth0 (has {found})")
    return found


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_ifname_eth0_for_pods(names, gpus):
    assert checks.socket_ifname("eth0", gpus=gpus, names=names).status == OK
    assert checks.socket_ifname("=eth0", gpus=gpus, names=names).status == OK
    unset = checks.socket_ifname(None, gpus=gpus, names=names)
    assert unset.status == WARN and "export NCCL_SOCKET_IFNAME=eth0" in unset.fix
    assert "multi-node" in unset.fix


def test_ifname_that_matches_nothing_fails(names):
    result = checks.socket_ifname("ib0", gpus=8, names=names)
    assert result.status == FAIL
    assert "eth0" in result.finding  # lists what the machine has


def test_ifname_selecting_several_interfaces_warns(names):
    selected = checks.ifname_matches("^lo", names)
    assert "lo" not in selected and "eth0" in selected
    result = checks.socket_ifname("^lo", gpus=8, names=names)
    assert result.status == (OK if selected == ["eth0"] else WARN)


def test_ifname_full_node_needs_hpn0(names):
    on_this_machine = checks.socket_ifname("eth0", gpus=16, names=names)
    assert on_this_machine.status == WARN and "no hpn0" in on_this_machine.finding
    node = [*names, "hpn0"]
    assert checks.socket_ifname("hpn0", gpus=16, names=node).status == OK
    wrong = checks.socket_ifname("eth0", gpus=16, names=node)
    assert wrong.status == WARN and "NCCL_SOCKET_IFNAME=hpn0" in wrong.fix


def test_ifname_without_gpu(names, monkeypatch):
    assert checks.socket_ifname(None, gpus=0, names=names).status == INFO
    assert checks.socket_ifname("eth0", gpus=0, names=names).status == INFO
    assert checks.socket_ifname("hpn0", gpus=0, names=names).status == WARN
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    assert checks.check_nccl_ifname().status == INFO  # no GPU on this machine


# --- DeepSpeed config lint ------------------------------------------------------------------------------


def write_config(tmp_path: Path, name: str, config: dict | str) -> str:
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def test_deepspeed_config_rows(tmp_path):
    good = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
    }
    rows = checks.check_deepspeed_config(write_config(tmp_path, "good.json", good), world_size=2)
    assert [r.status for r in rows] == [OK] * len(rows)
    bad = {
        **good,
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7},
        "train_batch_sze": 16,
        "gradient_clipping": float("nan"),  # JSON's NaN, which Python's json reads
        "steps_per_print": "10",
    }
    rows = checks.check_deepspeed_config(write_config(tmp_path, "bad.json", bad), world_size=4)
    by_status = {r.status: [x.finding for x in rows if x.status == r.status] for r in rows}
    assert any("stage3_prefetch_bucket_size" in f for f in by_status[WARN])
    assert any("train_batch_sze" in f for f in by_status[WARN])
    assert any("gradient_clipping is NaN (want a number)" in f for f in by_status[WARN])
    assert any(f.endswith("gradient_clipping is NaN") for f in by_status[FAIL])  # the check plan and benchmark run
    assert any('steps_per_print is "10" (want an integer)' in f for f in by_status[WARN])
    assert any("bf16 and fp16" in f for f in by_status[FAIL])
    assert any("train_batch_size 16 ≠" in f for f in by_status[FAIL])
    assert all(r.fix for r in rows if r.status != OK)


def test_doctor_cli_deepspeed_config(tmp_path):
    path = write_config(tmp_path, "ds.json", {"zero_optimization": {"stage3_prefetch_bucket_size": 50000000}})
    code, record = doctor_json("--deepspeed-config", path, skip_all_but())
    assert code == 0  # a WARN is not a failure
    assert record["kind"] == "doctor" and record["results"]["status"] == WARN
    warned = [c for c in record["results"]["checks"] if c["status"] == WARN]
    assert [c["check"] for c in warned] == ["deepspeed-config"]
    assert '"auto"' in warned[0]["fix"]
    # Two failing rows of one check: the summary names it once (it said "deepspeed-config, deepspeed-config")
    on = {"enabled": True}
    bad = {"bf16": on, "fp16": on, "train_batch_size": 3, "gradient_accumulation_steps": 2}
    proc = run_ljperf("doctor", "--json", "--deepspeed-config", write_config(tmp_path, "bad.json", bad), skip_all_but())
    record = json.loads(proc.stdout)
    assert proc.returncode == 1 and record["results"]["status"] == FAIL
    assert [c["check"] for c in record["results"]["checks"] if c["status"] == FAIL] == ["deepspeed-config"] * 2
    assert proc.stderr.strip().splitlines()[-1] == "ljperf doctor: failed: deepspeed-config ×2 (see their fixes)"


@pytest.mark.parametrize(
    ("content", "words"),
    [("{ not json", "not valid JSON"), ("[1, 2]", "JSON object"), (None, "no such file")],
)
def test_doctor_cli_bad_deepspeed_file_is_usage_error(tmp_path, content, words):
    path = write_config(tmp_path, "ds.json", content) if content is not None else str(tmp_path / "missing.json")
    proc = run_ljperf("doctor", "--deepspeed-config", path, skip_all_but())
    assert proc.returncode == 2
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_doctor_cli_unknown_skip_is_usage_error():
    proc = run_ljperf("doctor", "--skip", "drivers")
    assert proc.returncode == 2 and "no such check" in proc.stderr


# --- versions against the image's manifest --------------------------------------------------------------


def test_compare_versions():
    built = {"torch": "2.7.0a0+7c8ec84dab", "deepspeed": "0.16.4", "vllm": None}
    same = checks.compare_versions(dict(built), built, where="m.json")
    assert same.status == OK
    added = checks.compare_versions({**built, "vllm": "0.9.0"}, built, where="m.json")
    assert added.status == OK and "added since: vllm 0.9.0" in added.finding
    reinstalled = checks.compare_versions({**built, "torch": "2.7.1"}, built, where="m.json")
    assert reinstalled.status == WARN
    assert "reinstalled over the image's build: torch: 2.7.0a0+7c8ec84dab → 2.7.1" in reinstalled.finding
    removed = checks.compare_versions({**built, "deepspeed": None}, built, where="m.json")
    assert removed.status == WARN and "deepspeed: 0.16.4 → removed" in removed.finding
    assert checks.compare_versions(built, None, where="m.json").status == INFO


def manifest_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ljperf.doctor.manifest", *args], capture_output=True, text=True, check=False
    )


def test_manifest_script_and_doctor(tmp_path, monkeypatch):
    """The build-time script writes the manifest of this venv; doctor reads it through LJPERF_MANIFEST."""
    torch_dist = metadata.version("torch")  # a wheel's own version: 2.13.0+cpu, 2.11.0 (PyPI's CUDA build)
    pins = manifest_cli("constraints")
    assert pins.returncode == 0 and f"torch=={torch_dist}\n" in pins.stdout
    base = tmp_path / "base.json"
    assert manifest_cli("write", str(base)).returncode == 0
    final = tmp_path / "etc" / "manifest.json"
    assert manifest_cli("write", str(final), "--base", str(base), "--base-image", "test").returncode == 0
    written = json.loads(final.read_text())
    assert written["packages"]["torch"] == torch_dist and written["base_image"] == "test"

    code, record = doctor_json(skip_all_but("versions"), env=cli_env(**{manifest.MANIFEST_ENV: str(final)}))
    assert code == 0 and record["results"]["checks"][0]["status"] == OK

    monkeypatch.setenv(manifest.MANIFEST_ENV, str(final))
    written["packages"]["torch"] = "2.7.0a0+7c8ec84dab"  # as if torch was reinstalled after the build
    final.write_text(json.dumps(written))
    row = checks.check_versions()
    assert row.status == WARN
    assert f"torch: 2.7.0a0+7c8ec84dab → {torch_dist}" in row.finding
    assert "constraints.txt" in row.fix

    # The build guard: an install that replaced a base build fails the image build.
    base.write_text(json.dumps(written))
    guard = manifest_cli("write", str(tmp_path / "other.json"), "--base", str(base))
    assert guard.returncode == 1 and "replaced builds of the base image: torch" in guard.stderr

    final.write_text("{ broken")
    assert checks.check_versions().status == WARN
    monkeypatch.setenv(manifest.MANIFEST_ENV, str(tmp_path / "none.json"))
    missing = checks.check_versions()
    assert missing.status == INFO and "torch " in missing.finding


# --- torch.compile, NCCL, the whole command -------------------------------------------------------------


def test_nccl_row_follows_the_torch_build():
    import torch

    row = checks.check_nccl()
    if torch.version.cuda is None:
        assert row.status == INFO and "CPU build" in row.finding
    else:  # a CUDA build links NCCL with or without a GPU (the GPU image's torch, run on a CPU machine)
        assert row.status == OK and "NCCL" in row.finding


@pytest.mark.slow
def test_doctor_on_this_cpu_machine_exits_0(tmp_path):
    """All checks, compile included: exit 0 with INFO for the missing GPU; the record is written."""
    out = tmp_path / "doctor.json"
    proc = run_ljperf("doctor", "--output", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "INFO" in proc.stdout and "compile" in proc.stdout
    record = json.loads(out.read_text())
    rows = {c["check"]: c for c in record["results"]["checks"]}
    assert list(rows) == list(MACHINE_CHECKS)
    assert rows["driver"]["status"] == INFO and rows["compile"]["status"] == OK
    assert record["schema_version"] == 1 and record["env"]["versions"]["torch"]


@pytest.mark.slow
def test_compile_without_a_compiler_fails(tmp_path):
    """A real inductor failure: no C++ compiler (CXX points nowhere) and a cold cache → FAIL, exit 1."""
    env = cli_env(CXX=str(tmp_path / "no-such-compiler"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    proc = run_ljperf("doctor", "--json", skip_all_but("compile"), env=env, timeout=300)
    row = json.loads(proc.stdout)["results"]["checks"][0]
    assert proc.returncode == 1 and row["status"] == FAIL
    assert "C++ compiler" in row["finding"] and "COMPILE_OPTIMIZATION=false" in row["fix"]
    assert proc.stderr.strip().splitlines()[-1] == "ljperf doctor: failed: compile (see its fix)"


def test_a_crashing_check_is_a_fail_row():
    from ljperf.commands.doctor import guarded

    row = guarded("nccl-ifname", lambda: checks.socket_ifname("eth0", gpus=8, names=None))
    assert row.status == FAIL and row.check == "nccl-ifname" and "TypeError" in row.finding


def test_a_zero_2_config_is_not_linted_with_a_stage_3_finding():
    """doctor read a ZeRO-2 file's (absent) stage3_prefetch_bucket_size as "left to DeepSpeed"."""
    from ljperf.core.deepspeed_config import lint

    found = {f.message: f.level for f in lint({"zero_optimization": {"stage": 2}})}
    assert found.get("no stage-3 settings at ZeRO stage 2") == "ok"
    assert not [m for m in found if "stage3_prefetch_bucket_size is" in m]
    stray = lint({"zero_optimization": {"stage": 1, "stage3_max_live_parameters": 10}})
    assert any(f.level == "warn" and "stage3_max_live_parameters set at ZeRO stage 1" in f.message for f in stray)
