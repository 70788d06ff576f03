"""What recomputing a decoder layer costs: the device's rates (matmul FLOP/s, memory-bound bytes/s) and one
layer's forward split the way selective recompute splits it, traced on fake tensors.

Run: ``layer_cost(spec, micro_batch=2, seq_len=1024, attn="sdpa").seconds("full", Rates.measure(device))``.
"""

from __future__ import annotations

import functools
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from ljperf.checkpoint.policies import GROUPED_MM_OPS, every_layer, saves
from ljperf.core import hardware
from ljperf.core.cache import cache_root, cached
from ljperf.core.plans import MODES, RecomputeMode
from ljperf.forecast.blocks import block_params
from ljperf.forecast.cache_key import architecture_key, cache_dir
from ljperf.forecast.patches import real_code_paths
from ljperf.forecast.trace import fake_model, reference_kind
from ljperf.models.build import build_picked, materialize
from ljperf.models.layout import decoder_layers
from ljperf.models.spec import ModelSpec, build_meta, with_layers

if TYPE_CHECKING:
    from torch._ops import OpOverload


@dataclass(frozen=True, kw_only=True)
class Rates:
    """What the device sustains: matmul FLOP/s and memory-bound bytes/s."""

    flops_per_s: float
    bytes_per_s: float

    @classmethod
    def measure(cls, device: torch.device) -> Rates:
        """The rates of ``device``, measured once per device name, CPU thread count and torch version: kept for
        the process and in the cache folder (``rates/``), so every later run on this machine ranks plans with the
        same numbers however busy the machine is when it starts (delete the entry to measure again)."""
        threads = f"{torch.get_num_threads()} threads" if device.type == "cpu" else "gpu"
        name = hardware.cpu_name() if device.type == "cpu" else hardware.calibration_name(device)
        return _kept(device.type, device.index, f"{name} {threads} torch {torch.__version__} v{_RATES_VERSION}")

    @classmethod
    def timed(cls, device: torch.device) -> Rates:
        """A short matmul and a decoder layer's kind of pointwise ops on ``device``, interleaved, the median of
        ``_REPEATS`` of each (0.3–0.5 s on one CPU thread of a busy 2-core machine): a burst of load from another
        process moves a median little, and both rates alike."""
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        n = 4096 if device.type == "cuda" else 512
        # Its own generator: drawing from the global one would change what a model's dropout draws next.
        rng = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=rng)
        x = torch.randn(2**22 // 128, 128, device=device, generator=rng)
        mm, pointwise = _median_times([lambda: a @ a, lambda: _norm_silu(x)], device)
        return cls(
            flops_per_s=2 * n**3 / mm, bytes_per_s=_NORM_SILU_WRITES * 2 * x.numel() * x.element_size() / pointwise
        )

    @classmethod
    def datasheet(cls, device_name: str) -> Rates | None:
        """Peak dense BF16 FLOP/s and memory bandwidth of a known GPU (``ljperf.hardware``), else None."""
        tflops, tbps = hardware.peak_tflops(device_name), hardware.peak_memory_tbps(device_name)
        if tflops is None or tbps is None:
            return None
        return cls(flops_per_s=tflops * 1e12, bytes_per_s=tbps * 1e12)

    @classmethod
    def reference(cls) -> Rates:
        """The datasheet rates of ``REFERENCE_GPU``: a plan for a GPU the tables do not know is ranked by them."""
        rates = cls.datasheet(REFERENCE_GPU)
        if rates is None:
            raise LookupError(f"{REFERENCE_GPU}, the reference GPU, is missing from ljperf.core.hardware's tables")
        return rates


def _norm_silu(x: torch.Tensor) -> torch.Tensor:
    # RMSNorm, SiLU gate and residual: what selective recompute repeats. ``x + x`` alone ran 4× faster than a
    # llama layer's pointwise ops on CPU (transcendentals, reductions), and ranked selective far too cheap.
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return torch.nn.functional.silu(h) * h + x


_NORM_SILU_WRITES = 5 + 3 / 128
"""Tensors of x's size that ``_norm_silu`` writes (pow, norm, silu, mul, add; mean, +eps, rsqrt per row); like
``layer_cost``, each is counted written once and read once."""

REFERENCE_GPU = "H100"
"""Whose datasheet rates rank plans for a GPU that is neither known by name nor here to measure."""


_REPEATS = 7
_LAYER_ROUNDS = (5, 60)
_LAYER_SECONDS = 0.5
"""``timed_layer`` times at least 5 rounds, and more (up to 60) till its steps took half a second: a small layer's
recompute (a few ms on CPU) is within a busy machine's noise over 5 rounds: its median can come out negative."""
_RATES_VERSION = 2
"""In the cached rates' key: a change to what ``Rates.timed`` times makes them again."""


@functools.cache
def _kept(device_type: str, index: int | None, key: str) -> Rates:
    path = cache_root() / "rates" / f"{re.sub(r'[^A-Za-z0-9.+-]+', '_', key)}.json"
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    return cached(path, load=lambda data: Rates(**data), make=lambda: Rates.timed(device), dump=asdict)


def _median_times(fns: list[Callable[[], object]], device: torch.device) -> list[float]:
    """Median seconds of each of ``fns`` over ``_REPEATS`` interleaved rounds, after one call of each."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(_REPEATS):
        for fn, kept in zip(fns, times, strict=True):
            hardware.synchronize(device)
            start = time.perf_counter()
            fn()
            hardware.synchronize(device)
            kept.append(time.perf_counter() - start)
    return [statistics.median(kept) for kept in times]


@dataclass(frozen=True, kw_only=True)
class RecomputeCost:
    """One decoder layer's forward at the run's shape, split the way selective recompute splits it."""

    tokens: int
    """Tokens of the micro-batch traced (micro batch × sequence length)."""
    saved_flops: float
    """FLOPs of the ops whose outputs selective recompute keeps (matmuls, attention)."""
    pointwise_bytes: float
    """Bytes the other (memory-bound) ops write and read."""

    def seconds(self, mode: RecomputeMode, rates: Rates) -> float:
        pointwise = self.pointwise_bytes / rates.bytes_per_s
        return {"none": 0.0, "selective": pointwise, "full": self.saved_flops / rates.flops_per_s + pointwise}[mode]


def layer_cost(spec: ModelSpec, *, micro_batch: int, seq_len: int, attn: str) -> RecomputeCost:
    """``RecomputeCost`` of a decoder layer of ``spec`` of the most frequent kind (DeepSeek-V3's first three are
    dense, the other 58 mixtures of experts), traced on fake tensors; cached on disk per architecture, layer,
    attention and shape."""
    kinds = block_params(spec).layer_kinds
    index = 0 if len(set(kinds)) == 1 else kinds.index(reference_kind(kinds))
    key = architecture_key(spec, "layer cost", f"layer {index}", attn, f"{micro_batch}x{seq_len}")
    return cached(
        cache_dir() / f"{spec.architecture}-cost-{key}.json",
        load=lambda data: RecomputeCost(**data),
        make=lambda: _traced_layer_cost(spec, index, micro_batch=micro_batch, seq_len=seq_len, attn=attn),
        dump=asdict,
    )


def run_rates(
    spec: ModelSpec, cost: RecomputeCost, *, micro_batch: int, seq_len: int, attn: str, device: torch.device, bf16: bool
) -> Rates:
    """The rates a run on ``device`` ranks its plans with: those that make ``cost.seconds`` what recomputing one
    real decoder layer of ``spec`` takes here at the run's shape and precision (``timed_layer``); else, when
    noise hid the recompute there, the device's (``Rates.measure``). Selective measured as dear as full (its
    per-op policy's overhead at a small shape) makes full's matmuls nearly free: selective then saves nothing."""
    full_s, selective_s = timed_layer(
        spec, micro_batch=micro_batch, seq_len=seq_len, attn=attn, device=device, bf16=bf16
    )
    if full_s <= 0 or selective_s <= 0:
        return Rates.measure(device)
    matmuls = max(full_s - selective_s, full_s / 100)
    return Rates(flops_per_s=cost.saved_flops / matmuls, bytes_per_s=cost.pointwise_bytes / min(selective_s, full_s))


def timed_layer(
    spec: ModelSpec, *, micro_batch: int, seq_len: int, attn: str, device: torch.device, bf16: bool
) -> tuple[float, float]:
    """Seconds that recomputing one decoder layer of ``spec`` (of the most frequent kind) adds to a step, full and
    selective: a model of that layer alone, seeded weights, trains forward and backward at the run's shape with
    it none, selective and full, interleaved, ``_LAYER_ROUNDS`` times; the medians of each mode's difference
    from none in the same round. Device seconds: wall on a GPU, the process's CPU time per thread on a CPU
    (waiting for a core is not recompute). Cached on disk per architecture, shape, precision, device name, CPU
    threads and torch version. ``Rates.measure``'s pointwise ops run at 16 MiB a tensor, out of cache: on the
    shared 2-core CPU they priced selective at 0.62 of full where llama-tiny's steps (4 × 512) measured 0.23–0.34,
    and they leave out selective's per-op policy, which at 2 × 256 made it dearer than full."""
    kinds = block_params(spec).layer_kinds
    index = 0 if len(set(kinds)) == 1 else kinds.index(reference_kind(kinds))
    threads = f"{torch.get_num_threads()} threads" if device.type == "cpu" else "gpu"
    name = hardware.cpu_name() if device.type == "cpu" else hardware.calibration_name(device)
    key = architecture_key(spec, "timed layer", f"layer {index}", attn, f"{micro_batch}x{seq_len}", bf16, name, threads)
    full, selective = cached(
        cache_dir() / f"{spec.architecture}-timed-{key}.json",
        load=tuple,
        make=lambda: _timed_modes(
            spec, index, micro_batch=micro_batch, seq_len=seq_len, attn=attn, device=device, bf16=bf16
        ),
        dump=list,
    )
    return full, selective


def _timed_modes(
    spec: ModelSpec, index: int, *, micro_batch: int, seq_len: int, attn: str, device: torch.device, bf16: bool
) -> tuple[float, float]:
    meta = (
        build_meta(with_layers(spec, 1), attn_implementation=attn)
        if index == 0
        else build_picked(spec, (index,), attn_implementation=attn)
    )
    model = materialize(meta, device=device, seed=0).train()
    rng = torch.Generator().manual_seed(0)  # its own: the global one's next draws stay the run's
    ids = torch.randint(spec.facts.config_dict["vocab_size"], (micro_batch, seq_len), generator=rng).to(device)

    def step(mode: RecomputeMode) -> float:
        every_layer(mode).apply(model)
        hardware.synchronize(device)
        start = time.perf_counter() if device.type == "cuda" else time.process_time()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state  # no LM head: its noise
        hidden.float().square().mean().backward()
        hardware.synchronize(device)
        if device.type == "cuda":
            return time.perf_counter() - start
        return (time.process_time() - start) / torch.get_num_threads()

    modes = MODES
    for mode in modes:
        step(mode)
    fewest, most = _LAYER_ROUNDS
    rounds: list[dict[str, float]] = []
    timed = 0.0
    while len(rounds) < fewest or (len(rounds) < most and timed < _LAYER_SECONDS):
        shift = len(rounds) % len(modes)  # each mode in turn first: none is not always the coldest
        rounds.append({mode: step(mode) for mode in modes[shift:] + modes[:shift]})
        timed += sum(rounds[-1].values())
    full, selective = (statistics.median(r[mode] - r["none"] for r in rounds) for mode in ("full", "selective"))
    return full, selective


def _traced_layer_cost(spec: ModelSpec, index: int, *, micro_batch: int, seq_len: int, attn: str) -> RecomputeCost:
    """Trace decoder layer ``index`` of ``spec`` (0: a one-layer copy's own) on fake tensors and split its
    forward ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry

    totals = {"flops": 0.0, "bytes": 0.0}
    inside = [False]

    class Census(TorchDispatchMode):
        def __torch_dispatch__(
            self,
            func: OpOverload,
            types: Sequence[type],
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not inside[0]:
                return out
            packet = func.overloadpacket
            if saves(func):
                if packet in flop_registry:
                    totals["flops"] += flop_registry[packet](*args, **kwargs, out_val=out)
                elif func.name() in GROUPED_MM_OPS:
                    totals["flops"] += 2 * out.numel() * args[0].shape[-1]
                else:  # an attention kernel torch's counter does not know (CPU flash): q·kᵀ and p·v
                    q, k = args[0], args[1]
                    totals["flops"] += 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
            else:
                written = sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
                totals["bytes"] += 2 * written  # written once, read once by the next op
            return out

    fake_mode = FakeTensorMode()
    if index == 0:
        model = fake_model(with_layers(spec, 1), attn=attn, fake_mode=fake_mode)
    else:  # a copy of the full model's layer: no config of one layer builds it
        model = fake_model(spec, attn=attn, fake_mode=fake_mode, pick=(index,))
    layer = decoder_layers(model)[0]
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    # real_code_paths: fp32 experts run transformers' fallback op (torch's fake grouped_mm refuses fp32)
    with fake_mode, Census(), torch.no_grad(), real_code_paths():
        model(input_ids=torch.zeros(micro_batch, seq_len, dtype=torch.long), use_cache=False)
    return RecomputeCost(tokens=micro_batch * seq_len, saved_flops=totals["flops"], pointwise_bytes=totals["bytes"])
