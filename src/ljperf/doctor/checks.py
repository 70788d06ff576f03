"""The doctor's checks: each a small function returning a ``CheckResult`` (status, finding, fix).

The rules they apply are data in ``ljperf.doctor.tables``; the pure functions (``driver_compatibility``,
``socket_ifname``, ``compare_versions``) take their inputs as arguments, the ``check_*`` functions read the
machine (NVML or ``nvidia-smi``, ``/sys/class/net``, the environment, installed packages, torch).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ljperf.core import deepspeed_config
from ljperf.core.errors import describe
from ljperf.core.records import installed_versions, read_json
from ljperf.doctor import manifest as manifest_mod
from ljperf.doctor.tables import (
    DATACENTER_GPU_PATTERNS,
    DEFAULT_IFNAME,
    DRIVER_RULES,
    IFNAME_BY_GPU_COUNT,
)

if TYPE_CHECKING:
    import torch

OK, WARN, FAIL, INFO = "OK", "WARN", "FAIL", "INFO"
STATUSES = (OK, WARN, FAIL, INFO)
SYS_CLASS_NET = Path("/sys/class/net")


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    """One row of the doctor's report."""

    check: str
    """Which check: driver, nccl-ifname, deepspeed-config, versions, compile, nccl."""
    status: str
    """OK, WARN, FAIL or INFO (nothing to check here, e.g. no GPU)."""
    finding: str
    """What was found, with the numbers."""
    fix: str = ""
    """What to do about it (empty when OK)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {self.status!r}")


# --- NVIDIA driver against the CUDA version of torch ---------------------------------------------------


def parse_driver(version: str) -> tuple[int, ...]:
    """``"575.57.08"`` → ``(575, 57, 8)``."""
    if not re.fullmatch(r"\d+(\.\d+)*", version.strip()):
        raise ValueError(f"not a driver version: {version!r}")
    return tuple(int(p) for p in version.strip().split("."))


def is_datacenter_gpu(name: str) -> bool:
    return any(re.search(p, name) for p in DATACENTER_GPU_PATTERNS)


def driver_compatibility(driver: str, cuda: str, *, datacenter: bool) -> CheckResult:
    """Whether NVIDIA driver ``driver`` runs CUDA ``cuda`` (``"12.8"``), per ``tables.DRIVER_RULES``."""
    rule = DRIVER_RULES.get(cuda)
    version = parse_driver(driver)
    if rule is None:
        known = ", ".join(sorted(DRIVER_RULES))
        return CheckResult(
            check="driver",
            status=INFO,
            finding=f"driver {driver}; no compatibility rule for CUDA {cuda} (rules: CUDA {known})",
            fix="add a DriverRule for this CUDA version to ljperf/doctor/tables.py",
        )
    minimum = ".".join(map(str, rule.min_driver))
    upgrade = f"upgrade the NVIDIA driver to {minimum} or later"
    if version >= rule.min_driver:
        return CheckResult(check="driver", status=OK, finding=f"driver {driver} runs CUDA {cuda} (needs ≥ {minimum})")
    branch = version[0]
    if branch in rule.forward_compatible:
        lowest = ".".join(map(str, rule.forward_compatible[branch]))
        if not datacenter:
            return CheckResult(
                check="driver",
                status=FAIL,
                finding=f"driver {driver} (R{branch}) runs CUDA {cuda} only on data-center GPUs "
                "(forward compatibility); this GPU is not one",
                fix=upgrade,
            )
        if version >= rule.forward_compatible[branch]:
            return CheckResult(
                check="driver",
                status=OK,
                finding=f"driver {driver} runs CUDA {cuda} through forward compatibility (R{branch} ≥ {lowest}, "
                "data-center GPU)",
            )
        return CheckResult(
            check="driver",
            status=FAIL,
            finding=f"driver {driver} is older than {lowest}, the first R{branch} driver forward-compatible "
            f"with CUDA {cuda}",
            fix=f"upgrade to R{branch} {lowest} or later, or to {minimum} or later",
        )
    why = "is not forward-compatible with" if branch in rule.must_upgrade else "is too old for"
    return CheckResult(
        check="driver",
        status=FAIL,
        finding=f"driver {driver} (R{branch}) {why} CUDA {cuda} (needs ≥ {minimum})",
        fix=upgrade,
    )


@dataclass(frozen=True)
class GpuInventory:
    """What the NVIDIA driver reports: its version and the GPUs' names."""

    driver: str
    names: list[str]


def gpu_inventory() -> GpuInventory | None:
    """The driver and GPUs via NVML (nvidia-ml-py), else ``nvidia-smi``; None without an NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            try:
                driver = pynvml.nvmlSystemGetDriverVersion()
                count = pynvml.nvmlDeviceGetCount()
                names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
            finally:
                pynvml.nvmlShutdown()
            return GpuInventory(_text(driver), [_text(n) for n in names])
        except pynvml.NVMLError:
            pass  # no driver library or no device: ask nvidia-smi
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    out = subprocess.run(
        [smi, "--query-gpu=driver_version,name", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    rows = [line.split(",", 1) for line in out.stdout.splitlines() if "," in line]
    if out.returncode != 0 or not rows:
        return None
    return GpuInventory(rows[0][0].strip(), [r[1].strip() for r in rows])


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def check_driver() -> CheckResult:
    import torch

    cuda = torch.version.cuda
    inventory = gpu_inventory()
    if inventory is None:
        build = f"CUDA {cuda} build" if cuda else "CPU build"
        return CheckResult(
            check="driver", status=INFO, finding=f"no NVIDIA driver or GPU found (torch {torch.__version__}, {build})"
        )
    if cuda is None:
        return CheckResult(
            check="driver",
            status=WARN,
            finding=f"driver {inventory.driver} and {len(inventory.names)} GPU(s), but torch "
            f"{torch.__version__} is a CPU build",
            fix="use the image's torch build (or install a CUDA build of torch)",
        )
    cuda_minor = ".".join(cuda.split(".")[:2])
    result = driver_compatibility(
        inventory.driver, cuda_minor, datacenter=all(is_datacenter_gpu(n) for n in inventory.names)
    )
    gpus = ", ".join(sorted(set(inventory.names)))
    return CheckResult(check="driver", status=result.status, finding=f"{result.finding}; GPUs: {gpus}", fix=result.fix)


# --- NCCL_SOCKET_IFNAME against the GPUs and the interfaces that exist ----------------------------------


def interfaces(root: Path = SYS_CLASS_NET) -> list[str]:
    """The network interfaces of this machine (names in ``/sys/class/net``)."""
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def ifname_matches(value: str, names: list[str]) -> list[str]:
    """The interfaces NCCL would consider for ``NCCL_SOCKET_IFNAME=value``: comma-separated prefixes,
    ``^`` to exclude, ``=`` for exact names (NCCL's environment-variable documentation)."""
    exclude = value.startswith("^")
    body = value[1:] if exclude else value
    exact = body.startswith("=")
    body = body[1:] if exact else body
    patterns = [p for p in body.split(",") if p]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    return [n for n in names if hit(n) != exclude]


def socket_ifname(value: str | None, *, gpus: int, names: list[str]) -> CheckResult:
    """``NCCL_SOCKET_IFNAME`` against the visible GPU count (``tables.IFNAME_BY_GPU_COUNT``) and ``names``."""
    have = ", ".join(names) or "none"
    hint = "multi-node: set the same value on every node"
    matched = ifname_matches(value, names) if value else []
    if gpus == 0:
        if value and not matched:
            return CheckResult(
                check="nccl-ifname",
                status=WARN,
                finding=f"NCCL_SOCKET_IFNAME={value} matches no interface here (have: {have}); no GPU visible",
                fix=f"unset it, or name an interface of this machine ({have}) before NCCL runs here",
            )
        shown = f"NCCL_SOCKET_IFNAME={value}" if value else "NCCL_SOCKET_IFNAME unset"
        return CheckResult(check="nccl-ifname", status=INFO, finding=f"{shown}; no GPU visible, NCCL is not used")
    expected = IFNAME_BY_GPU_COUNT.get(gpus, DEFAULT_IFNAME)
    why = f"{gpus} visible GPU(s) → {expected}"
    if expected not in names:
        return CheckResult(
            check="nccl-ifname",
            status=WARN,
            finding=f"{why}, but this machine has no {expected} (have: {have})",
            fix=f"check the pod's network attachment; export NCCL_SOCKET_IFNAME to the interface that should carry "
            f"NCCL traffic; {hint}",
        )
    fix = f"export NCCL_SOCKET_IFNAME={expected}; {hint}"
    if value is None:
        return CheckResult(
            check="nccl-ifname", status=WARN, finding=f"NCCL_SOCKET_IFNAME unset ({why}): NCCL picks one", fix=fix
        )
    if not matched:
        return CheckResult(
            check="nccl-ifname",
            status=FAIL,
            finding=f"NCCL_SOCKET_IFNAME={value} matches no interface (have: {have}): NCCL cannot bootstrap",
            fix=fix,
        )
    if matched != [expected]:
        return CheckResult(
            check="nccl-ifname",
            status=WARN,
            finding=f"NCCL_SOCKET_IFNAME={value} selects {', '.join(matched)} ({why})",
            fix=fix,
        )
    return CheckResult(check="nccl-ifname", status=OK, finding=f"NCCL_SOCKET_IFNAME={value} ({why}); {hint}")


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def check_nccl_ifname() -> CheckResult:
    return socket_ifname(os.environ.get("NCCL_SOCKET_IFNAME"), gpus=visible_gpus(), names=interfaces())


# --- DeepSpeed config lint ------------------------------------------------------------------------------

_LEVEL_STATUS = {"ok": OK, "warn": WARN, "fail": FAIL}


def check_deepspeed_config(path: str, *, world_size: int | None = None) -> list[CheckResult]:
    """One row per finding of ``ljperf.deepspeed_config.lint`` on the JSON file ``path``."""
    config = deepspeed_config.load(path)
    name = Path(path).name
    return [
        CheckResult(check="deepspeed-config", status=_LEVEL_STATUS[f.level], finding=f"{name}: {f.message}", fix=f.fix)
        for f in deepspeed_config.lint(config, world_size=world_size)
    ]


# --- installed versions against the image's manifest ----------------------------------------------------


def compare_versions(
    installed: dict[str, str | None], built: dict[str, str | None] | None, *, where: str
) -> CheckResult:
    """Installed versions against the manifest's (``built``; None when there is no manifest at ``where``)."""
    present = ", ".join(f"{n} {v}" for n, v in installed.items() if v)
    if built is None:
        return CheckResult(check="versions", status=INFO, finding=f"no image manifest at {where}; installed: {present}")
    changed = manifest_mod.replaced(built, installed)
    if changed:
        return CheckResult(
            check="versions",
            status=WARN,
            finding="reinstalled over the image's build: " + "; ".join(changed),
            fix="start from a fresh container; install extra packages with "
            "`pip install -c /etc/ljperf/constraints.txt ...` so pip keeps the image's builds",
        )
    added = [f"{n} {v}" for n, v in installed.items() if v and not built.get(n)]
    extra = f" (added since: {', '.join(added)})" if added else ""
    return CheckResult(check="versions", status=OK, finding=f"the image's builds: {present}{extra}")


def check_versions() -> CheckResult:
    path = manifest_mod.manifest_path()
    if not path.exists():
        return compare_versions(installed_versions(manifest_mod.WATCHED), None, where=str(path))
    try:
        built = read_json(path)["packages"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return CheckResult(
            check="versions",
            status=WARN,
            finding=f"image manifest {path} is unreadable ({describe(exc)})",
            fix=f"rebuild the image, or point {manifest_mod.MANIFEST_ENV} at a manifest written by "
            "`python -m ljperf.doctor.manifest write`",
        )
    return compare_versions(installed_versions(manifest_mod.WATCHED), built, where=str(path))


# --- torch.compile and NCCL -----------------------------------------------------------------------------


def _smoke(x: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.sin(x) * 2.0 + x.square().mean()


def check_compile() -> CheckResult:
    """A tiny function compiles (inductor, ``fullgraph=True``) and matches eager, on GPU 0 or the CPU."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.linspace(-2.0, 2.0, 256, device=device)
    start = time.perf_counter()
    try:
        got = torch.compile(_smoke, fullgraph=True)(x)
    except Exception as exc:  # any compile failure is the finding
        return CheckResult(
            check="compile",
            status=FAIL,
            finding=f"torch.compile failed on {device}: {describe(exc)}",
            fix="install a working C++ compiler (CXX) and Triton for GPUs, or run with COMPILE_OPTIMIZATION=false",
        )
    seconds = time.perf_counter() - start
    if not torch.allclose(got, _smoke(x), rtol=1e-5, atol=1e-6):
        return CheckResult(
            check="compile",
            status=FAIL,
            finding=f"torch.compile's result differs from eager on {device}",
            fix="report it to PyTorch; run with COMPILE_OPTIMIZATION=false meanwhile",
        )
    return CheckResult(
        check="compile", status=OK, finding=f"a tiny function compiles and matches eager on {device} ({seconds:.1f} s)"
    )


def check_nccl() -> CheckResult:
    """The NCCL version torch links (CPU builds use gloo)."""
    import torch
    import torch.cuda.nccl
    import torch.distributed as dist

    if torch.version.cuda is None:
        return CheckResult(
            check="nccl", status=INFO, finding=f"torch {torch.__version__} is a CPU build: collectives use gloo"
        )
    if not dist.is_available() or not dist.is_nccl_available():
        return CheckResult(
            check="nccl",
            status=FAIL,
            finding=f"torch {torch.__version__} has no NCCL backend",
            fix="use the image's torch build (built with NCCL)",
        )
    version = ".".join(map(str, torch.cuda.nccl.version()))
    return CheckResult(check="nccl", status=OK, finding=f"torch links NCCL {version}")
