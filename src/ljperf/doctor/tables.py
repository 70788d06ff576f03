"""The doctor's rules as data: driver/CUDA compatibility, the socket interface by GPU count, GPU classes.

Add a CUDA version by adding a ``DriverRule``; the checks in ``ljperf.doctor.checks`` only read these tables.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DriverRule:
    """Which NVIDIA drivers run a CUDA version: a minimum, or a forward-compatible data-center branch."""

    min_driver: tuple[int, ...]
    """Any driver at or above this version runs the CUDA version."""
    forward_compatible: dict[int, tuple[int, ...]]
    """Data-center GPUs only: branch (e.g. 535) → the lowest driver of that branch that works."""
    must_upgrade: frozenset[int]
    """Branches that are not forward-compatible with this CUDA version."""
    source: str
    """Where the rule comes from."""


# The image's usage rules (NGC PyTorch container release notes for CUDA 12.8 images).
_NGC_FORWARD_COMPATIBLE: dict[int, tuple[int, ...]] = {470: (470, 57), 525: (525, 85), 535: (535, 86), 545: (545, 23)}
_NGC_MUST_UPGRADE = frozenset({418, 440, 450, 460, 510, 520, 530, 555, 560})

DRIVER_RULES: dict[str, DriverRule] = {
    "12.8": DriverRule(
        min_driver=(575,),
        forward_compatible=_NGC_FORWARD_COMPATIBLE,
        must_upgrade=_NGC_MUST_UPGRADE,
        source="the image's usage rules for CUDA 12.8 (NGC PyTorch release notes)",
    ),
    # CUDA 13 needs the R580 branch (CUDA 13.0 release notes: 580.65.06 on Linux; the data-center driver matrix:
    # R580 is the first branch to run CUDA 13 without the forward-compatibility package, which is not tabled here).
    "13.0": DriverRule(
        min_driver=(580, 65, 6),
        forward_compatible={},
        must_upgrade=frozenset(),
        source="the CUDA 13.0 release notes (minimum driver 580.65.06)",
    ),
    # The image's CUDA (NGC PyTorch 25.12). CUDA's minor-version compatibility runs every CUDA 13.x on the R580
    # driver of 13.0; 13.1's own driver (590.44.01) is needed only to JIT PTX built by the 13.1 compiler.
    "13.1": DriverRule(
        min_driver=(580, 65, 6),
        forward_compatible={},
        must_upgrade=frozenset(),
        source="CUDA minor-version compatibility (CUDA 13.x on the 13.0 minimum driver 580.65.06)",
    ),
}

# Data-center GPUs (forward compatibility through the CUDA compat package works only on these), by name.
DATACENTER_GPU_PATTERNS: tuple[str, ...] = (
    r"\b(A|H|B|GB|GH|L)\d{1,3}[A-Z]?\b",  # A100, A10, A30, A40, H100, H20, H200, B200, GB200, GH200, L4, L20, L40S
    r"\b(T4|V100|P100|P40|P4)\b",
    r"Tesla",
)

# NCCL_SOCKET_IFNAME by visible GPUs: a full 16-GPU node talks over hpn0, a pod with 1/2/4/8 GPUs over eth0.
IFNAME_BY_GPU_COUNT: dict[int, str] = {1: "eth0", 2: "eth0", 4: "eth0", 8: "eth0", 16: "hpn0"}
DEFAULT_IFNAME = "eth0"
