"""The rates a step is priced with: a device's peaks (matmul FLOP/s, memory bytes/s), the efficiency of each op
class against them, the cost of one op, the links, and how much communication can hide behind compute.

Run: ``gpu_rates("H100")`` (the datasheet's peaks, the uncalibrated efficiencies below), or
``cpu_rates(threads=1, processes=2)`` (this CPU's peaks, measured once in process time and cached); an unknown
GPU gets None: no speed rather than a guessed one; ``with_cluster`` sets the links of ``--gpus-per-node`` and
``--link-bandwidth``. ``speed.calibrate`` replaces the efficiencies and links with those fitted from benchmark
records of the device.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ljperf.core import hardware
from ljperf.core.cache import cache_root, cached
from ljperf.speed.census import OP_CLASSES
from ljperf.speed.collectives import Links
from ljperf.speed.traffic import STYLES

GB = 1e9

LINKS_GBPS: tuple[tuple[str, float, float], ...] = (
    (r"H100|H800|GH200", 450.0, 50.0),
    (r"H200", 450.0, 50.0),
    (r"A100|A800", 300.0, 25.0),
    (r"B200", 900.0, 50.0),
)
"""(name pattern, NVLink GB/s per GPU and direction, network GB/s per GPU) from NVIDIA's DGX datasheets: NVLink 4
(H100, H200) 900 GB/s both ways, NVLink 3 (A100) 600, NVLink 5 (B200) 1.8 TB/s; one ConnectX-7 400 Gb/s NIC per
GPU on DGX H100/H200/B200, one 200 Gb/s HDR NIC per GPU on DGX A100."""

GPU_EFFICIENCY: dict[str, float] = {
    "matmul": 0.70,
    "attention": 0.52,
    "elementwise": 0.70,
    "norm": 0.60,
    "optimizer": 0.70,
}
"""Uncalibrated shares of the peak a GPU sustains per op class (docs/speed.md, where each comes from): large bf16
GEMMs reach about 70% of the dense peak (cuBLAS on an H100 SXM: a quoted 600-750 of 989 TFLOP/s); attention is
FlashAttention-2 on an H100 as the FlashAttention-3 paper measured it (head dim 128, 8k tokens: causal forward 333
TFLOP/s; backward 318 non-causal, taken causal at the forward's 333/370; both counted with the causal half and a
backward of 2.5 forwards) over the FLOPs torch's counter counts (no causal half, a backward of 2 forwards): 0.52;
memory-bound kernels reach 60–80% of the HBM bandwidth."""

GPU_LINK_EFFICIENCY = 0.80
"""nccl-tests' bus bandwidth of large all-reduces and all-gathers over the peak link rate (about 360 of 450 GB/s
on NVLink 4, 40 of 50 GB/s on a 400 Gb/s NIC)."""

GPUS_PER_NODE = 8
"""GPUs per node unless ``--gpus-per-node`` says (DGX and HGX boards)."""

GPU_LATENCY_S = 20e-6
"""Seconds of one NCCL collective call beyond its bytes (its small-message floor)."""

CPU_LINK = (2.0 * GB, 100e-6)
"""gloo between processes of one machine (loopback TCP), uncalibrated: bytes/s and seconds a call, until
``ljperf plan --calibrate`` fits them from records (``ljperf comm`` or benchmarks with two processes)."""

CPU_HOOK_OPS = 10
"""Ops' worth of time one engine hook costs a CPU, uncalibrated (Python around a few tensor ops)."""

CPU_ATTENTION = 0.5
"""CPU flash attention over the measured matmul rate, uncalibrated (its blocks are small matmuls)."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Where the ranks sit and what links them (``--gpus-per-node``, ``--link-bandwidth``)."""

    gpus_per_node: int | None = None
    """Ranks per node (default: 8 for a GPU, every rank on one CPU machine)."""
    intra_gbps: float | None = None
    """Bus bandwidth within a node, GB/s per rank (default: the device's NVLink, calibrated or from the table)."""
    inter_gbps: float | None = None
    """Bus bandwidth between nodes, GB/s per rank (default: the device's network)."""


@dataclass(frozen=True, kw_only=True)
class SpeedRates:
    """What one device sustains, and the efficiencies each op class reaches on it."""

    device: str
    """The name the rates are kept under: a GPU's name, or ``cpu N threads``."""
    flops_per_s: float
    """Peak matmul FLOP/s (a GPU's dense bf16 datasheet figure; a CPU's measured)."""
    bytes_per_s: float
    """Peak memory bytes/s (datasheet; a CPU's measured on a norm's kind of ops)."""
    efficiency: dict[str, float] = field(default_factory=lambda: dict(GPU_EFFICIENCY))
    """Share of the roofline each op class (``census.OP_CLASSES``) reaches."""
    op_overhead_s: float = 0.0
    """Seconds each op adds beyond its roofline (a CPU's dispatch; on a GPU the host runs ahead: 0)."""
    links: Links
    overlap: float = 1.0
    """Share of the compute that communication can hide behind (1: a separate stream, as NCCL on a GPU)."""
    hook_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STYLES, 0.0))
    """Seconds of one engine hook per parameter tensor, by engine (``traffic.STYLES``): 0 on a GPU, whose host
    runs ahead of it; a CPU's ``CPU_HOOK_OPS`` ops."""
    calibrated: bool = False
    """The efficiencies and links were fitted from records of this device (``ljperf plan --calibrate``)."""

    def record(self) -> dict:
        return asdict(self)


def _lookup_links(name: str) -> tuple[float, float] | None:
    return next(((intra, inter) for pattern, intra, inter in LINKS_GBPS if re.search(pattern, name)), None)


def gpu_rates(name: str) -> SpeedRates | None:
    """The datasheet rates of GPU ``name`` (``core.hardware``'s peaks, ``LINKS_GBPS``), None when unknown."""
    tflops, tbps, links = hardware.peak_tflops(name), hardware.peak_memory_tbps(name), _lookup_links(name)
    if tflops is None or tbps is None or links is None:
        return None
    intra, inter = (GPU_LINK_EFFICIENCY * GB * x for x in links)
    return SpeedRates(
        device=name,
        flops_per_s=tflops * 1e12,
        bytes_per_s=tbps * 1e12,
        links=Links(
            intra_bytes_per_s=intra,
            inter_bytes_per_s=inter,
            latency_s=GPU_LATENCY_S,
            gpus_per_node=GPUS_PER_NODE,
        ),
    )


def cpu_key(threads: int) -> str:
    return f"cpu {threads} threads"


def cpu_rates(*, threads: int, processes: int) -> SpeedRates:
    """This CPU's rates at ``threads`` per process (``cpu_peaks``, and one op's dispatch), measured once per CPU,
    thread count and torch version and cached; gloo's links uncalibrated."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops_per_s, bytes_per_s = cpu_peaks(threads)
        overhead = op_overhead(threads)
    finally:
        torch.set_num_threads(before)
    efficiency = {cls: 1.0 for cls in OP_CLASSES} | {"attention": CPU_ATTENTION}
    bandwidth, latency = CPU_LINK
    return SpeedRates(
        device=cpu_key(threads),
        flops_per_s=flops_per_s,
        bytes_per_s=bytes_per_s,
        efficiency=efficiency,
        op_overhead_s=overhead,
        hook_s=dict.fromkeys(STYLES, CPU_HOOK_OPS * overhead),
        links=Links(
            intra_bytes_per_s=bandwidth,
            inter_bytes_per_s=bandwidth,
            latency_s=latency,
            gpus_per_node=processes,
        ),
    )


def _cache_path(key: str) -> Path:
    return cache_root() / "rates" / f"{re.sub(r'[^A-Za-z0-9.+-]+', '_', key)}.json"


def cpu_peaks(threads: int) -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s) of this CPU at ``threads``: the roofline's two peaks, measured in process
    time per thread (as a CPU step is measured: ``calibrate.device_seconds``), so a busy machine's waits for a core
    do not lower them; the bandwidth is a large copy's bytes read and written (what an op's bytes count), not a
    pointwise op's throughput, whose transcendentals would make small matmuls look memory-bound. Cached per CPU,
    threads and torch version."""
    key = f"{hardware.cpu_name()} {threads} threads torch {torch.__version__} speed peaks v{PEAKS_VERSION}"
    return cached(_cache_path(key), load=lambda d: (float(d[0]), float(d[1])), make=_timed_peaks, dump=list)


PEAKS_VERSION = 1


def _timed_peaks() -> tuple[float, float]:
    n, elements = 512, 2**23  # a 512³ matmul; a 32 MiB copy, beyond the caches
    rng = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=rng)
    x, y = torch.randn(elements, generator=rng), torch.empty(elements)
    threads = torch.get_num_threads()

    def seconds(fn: Callable[[], object], calls: int) -> float:
        fn()
        rounds = []
        for _ in range(5):
            start = time.process_time()
            for _ in range(calls):
                fn()
            rounds.append((time.process_time() - start) / calls / threads)
        return sorted(rounds)[2]

    matmul = seconds(lambda: a @ a, 8)
    copy = seconds(lambda: y.copy_(x), 8)
    return 2 * n**3 / matmul, 2 * elements * x.element_size() / copy


def op_overhead(threads: int) -> float:
    """Seconds one small op costs this CPU from Python with autograd recording (the median of 5 rounds of 200
    adds of 64-element tensors that require gradients), cached per CPU, threads and torch version."""
    key = f"{hardware.cpu_name()} {threads} threads torch {torch.__version__} op overhead"
    return cached(_cache_path(key), load=float, make=_timed_op, dump=float)


def _timed_op() -> float:
    a = torch.zeros(64, requires_grad=True)
    rounds = []
    for _ in range(5):
        start = time.process_time()  # the op's own cost, not the waits for a core of a shared machine
        x = a
        for _ in range(200):
            x = x + 1.0
        rounds.append((time.process_time() - start) / 200)
    return sorted(rounds)[2]


def with_cluster(rates: SpeedRates, cluster: Cluster) -> SpeedRates:
    """``rates`` with the links ``--gpus-per-node`` and ``--link-bandwidth`` set."""
    links = rates.links
    links = replace(
        links,
        gpus_per_node=cluster.gpus_per_node or links.gpus_per_node,
        intra_bytes_per_s=cluster.intra_gbps * GB if cluster.intra_gbps else links.intra_bytes_per_s,
        inter_bytes_per_s=cluster.inter_gbps * GB if cluster.inter_gbps else links.inter_bytes_per_s,
    )
    return replace(rates, links=links)
