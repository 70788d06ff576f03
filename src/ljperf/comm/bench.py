"""``ljperf comm``: time collectives over torch.distributed the way nccl-tests does, and check their results.

Run: ``ljperf comm --nproc-per-node 8 --ops all_reduce,all_gather,reduce_scatter --min-bytes 1K --max-bytes 1G``
(NCCL on GPUs, gloo on CPU). For each op and size (doubling from --min-bytes to --max-bytes): warm-up, timed
iterations, then one checked iteration; columns size, count, type, time, algbw, busbw and #wrong, with
nccl-tests' definitions (docs/comm.md). ``--output FILE`` writes the JSON record.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ljperf.comm.config import BUS_FACTOR, DTYPE_NAMES, CommConfig
from ljperf.core import hardware
from ljperf.core.choices import DeviceType
from ljperf.core.console import console, titled_table
from ljperf.core.errors import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    RunFailed,
    failure,
    hold_interrupts,
    interrupt_on_signals,
    raise_if_interrupted,
    restore_signals,
)
from ljperf.core.options import LaunchConfig
from ljperf.core.records import STDOUT, read_json, record_header, write_json
from ljperf.core.units import format_bytes
from ljperf.distributed.launch import RUN_DIR_ENV, RunFolder, failure_reason, local_world_size, run_workers
from ljperf.distributed.runtime import Process, shutdown_process

# Ops whose buffers are split in n equal chunks: their size is rounded down to a multiple of n elements.
SPLIT_OPS = frozenset({"all_gather", "reduce_scatter", "all_to_all"})
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
# Largest integer each dtype holds exactly: the check's values stay below it for small worlds.
_EXACT_INT = {torch.float32: 2**24, torch.bfloat16: 2**8, torch.float16: 2**11}
CHECK_CHUNK = 1 << 24  # elements compared at a time, so the check needs little extra memory


def bandwidth(op: str, size_bytes: int, seconds: float, *, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10⁹ bytes/s) of one ``op`` moving ``size_bytes`` in ``seconds`` on ``world`` ranks."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * BUS_FACTOR[op](world)


def element_count(op: str, size_bytes: int, *, element_size: int, world: int) -> int:
    """Elements of the op's size (nccl-tests' size: the whole buffer; split ops round to a multiple of world)."""
    count = max(1, size_bytes // element_size)
    return max(world, count - count % world) if op in SPLIT_OPS else count


@dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the result: one op at one size."""

    op: str
    size_bytes: int
    count: int
    dtype: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None


# --- buffers, the collectives, and the check --------------------------------------------------------------


def pattern(index: torch.Tensor, rank: int | torch.Tensor) -> torch.Tensor:
    """The value rank ``rank`` puts at input ``index`` (elementwise for a tensor of ranks): small integers, exact
    in every dtype."""
    return (index + rank) % 3


def _sum_over_ranks(index: torch.Tensor, world: int) -> torch.Tensor:
    """Σ_r pattern(index, r) for r < world, in closed form (full cycles of 0+1+2, then the remainder)."""
    total = torch.full_like(index, 3 * (world // 3))
    for r in range(world % 3):
        total += pattern(index, r)
    return total


def expected(op: str, index: torch.Tensor, *, rank: int, world: int, chunk: int) -> torch.Tensor:
    """The value output element ``index`` of ``rank`` must hold after ``op`` (sum reductions, root 0)."""
    if op == "all_reduce":
        return _sum_over_ranks(index, world)
    if op == "broadcast":
        return pattern(index, 0)
    if op == "all_gather":
        return pattern(index % chunk, index // chunk)
    if op == "reduce_scatter":
        return _sum_over_ranks(rank * chunk + index, world)
    if op == "all_to_all":
        return pattern(rank * chunk + index % chunk, index // chunk)
    raise ValueError(op)


def buffers(
    op: str, count: int, *, world: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of ``op`` for a size of ``count`` elements; in-place ops share one tensor."""
    if op in ("all_reduce", "broadcast"):
        buf = torch.zeros(count, dtype=dtype, device=device)
        return buf, buf
    per_rank = count // world
    if op == "all_gather":
        return torch.zeros(per_rank, dtype=dtype, device=device), torch.zeros(count, dtype=dtype, device=device)
    if op == "reduce_scatter":
        return torch.zeros(count, dtype=dtype, device=device), torch.zeros(per_rank, dtype=dtype, device=device)
    return torch.zeros(count, dtype=dtype, device=device), torch.zeros(count, dtype=dtype, device=device)


def check_host_memory(op: str, count: int, *, world: int, dtype: torch.dtype) -> None:
    """Refuse a size whose buffers, twice over for gloo's own copies, exceed the RAM available to each of this
    node's ranks: allocated anyway, its zeroed pages are committed as they are written and the kernel kills
    the process, leaving no table and no record. A ``MemoryError`` is recorded as out of memory. The ranks
    agree on the smallest share among them, so none waits in a collective the others left."""
    inp, out = buffers(op, count, world=world, dtype=dtype, device=torch.device("meta"))
    need = 2 * (inp.nbytes + (out.nbytes if out is not inp else 0))
    ram = hardware.available_ram()
    share = torch.tensor([2**62 if ram is None else ram // local_world_size()], dtype=torch.int64)
    dist.all_reduce(share, op=dist.ReduceOp.MIN)
    if need > int(share):
        raise MemoryError(
            f"{op} of {format_bytes(count * inp.element_size())} needs about {format_bytes(need)} per rank (its"
            f" buffers, twice for gloo's copies); {format_bytes(int(share))} of RAM is available to each"
        )


def collective(op: str) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """``op`` as a function of (input, output)."""
    gather = _renamed("all_gather_single", "all_gather_into_tensor")
    scatter = _renamed("reduce_scatter_single", "reduce_scatter_tensor")
    return {
        "all_reduce": lambda inp, out: dist.all_reduce(out),
        "broadcast": lambda inp, out: dist.broadcast(out, src=0),
        "all_gather": lambda inp, out: gather(out, inp),
        "reduce_scatter": lambda inp, out: scatter(out, inp),
        "all_to_all": lambda inp, out: dist.all_to_all_single(out, inp),
    }[op]


def _renamed(new: str, old: str) -> Callable[..., object]:
    """The collective ``torch.distributed`` names ``new``: torch 2.13 renamed the tensor forms, and deprecated the
    ``old`` names that older torch (≥ 2.6 is supported) has alone."""
    return getattr(dist, new, None) or getattr(dist, old)


def tolerance(dtype: torch.dtype, world: int) -> float:
    """Relative tolerance of the check: 0 while every sum (≤ 2·world) is an exact integer of ``dtype``."""
    return 0.0 if 2 * world <= _EXACT_INT[dtype] else torch.finfo(dtype).eps * world


def count_wrong(op: str, out: torch.Tensor, *, rank: int, world: int, chunk: int) -> int:
    """Elements of ``out`` that differ from what ``op`` must produce."""
    rtol = tolerance(out.dtype, world)
    wrong = 0
    for start in range(0, out.numel(), CHECK_CHUNK):
        got = out[start : start + CHECK_CHUNK].double()
        index = torch.arange(start, start + got.numel(), device=out.device)
        want = expected(op, index, rank=rank, world=world, chunk=chunk).double()
        wrong += int((~torch.isclose(got, want, rtol=rtol, atol=0.0)).sum())
    return wrong


def measure(op: str, size_bytes: int, cfg: CommConfig, *, process: Process) -> Row:
    """Warm-up, timed iterations (average over ranks, as nccl-tests reports), then one checked iteration."""
    rank, world, device = process.rank, process.world, process.device.torch_device
    dtype = DTYPES[cfg.dtype]
    count = element_count(op, size_bytes, element_size=torch.tensor([], dtype=dtype).element_size(), world=world)
    if device.type == "cpu":
        check_host_memory(op, count, world=world, dtype=dtype)
    inp, out = buffers(op, count, world=world, dtype=dtype, device=device)
    run = collective(op)
    for _ in range(cfg.warmup_iters):
        run(inp, out)
    dist.barrier()
    hardware.synchronize(device)
    start = time.perf_counter()
    for _ in range(cfg.iters):
        run(inp, out)
    hardware.synchronize(device)
    seconds = torch.tensor([(time.perf_counter() - start) / cfg.iters], dtype=torch.float64, device=device)
    dist.all_reduce(seconds)
    mean = float(seconds) / world
    wrong = None
    if cfg.check:
        for start in range(0, inp.numel(), CHECK_CHUNK):  # a whole index would be twice the buffer (int64)
            piece = inp[start : start + CHECK_CHUNK]
            piece.copy_(pattern(torch.arange(start, start + piece.numel(), device=device), rank))
        run(inp, out)
        mine = count_wrong(op, out, rank=rank, world=world, chunk=count // world)
        total = torch.tensor([mine], dtype=torch.int64, device=device)
        dist.all_reduce(total)
        wrong = int(total)
    size = count * inp.element_size()
    algbw, busbw = bandwidth(op, size, mean, world=world)
    return Row(
        op=op,
        size_bytes=size,
        count=count,
        dtype=cfg.dtype,
        time_us=mean * 1e6,
        algbw_gbps=algbw,
        busbw_gbps=busbw,
        wrong=wrong,
    )


def run_worker(
    cfg: CommConfig, launch: LaunchConfig, *, device_type: DeviceType, output: str | None, argv: list[str]
) -> int:
    """One rank: join the group, measure every op and size, print and write the record on rank 0. A failure
    (a signal, memory running out, a lost peer) keeps the rows measured before it in the record."""
    process = Process.here(device_type)
    process.join(launch=launch, need_group=True)
    record = {
        **record_header("comm", args=argv, devices=[process.device.name], world_size=process.world),
        "config": {
            **asdict(cfg),
            "backend": dist.get_backend(),
            "launch": {**asdict(launch), "world_size": process.world},
        },
    }
    rows: list[Row] = []
    status, reason, exit_code = "ok", None, EXIT_OK
    previous = interrupt_on_signals()
    try:
        for op in cfg.op_list:
            start = len(rows)
            try:
                for size in cfg.sizes:
                    raise_if_interrupted()
                    rows.append(measure(op, size, cfg, process=process))
            finally:  # also the sizes an op measured before it failed
                if process.is_main and rows[start:]:
                    print_table(op, rows[start:], world=process.world, backend=dist.get_backend())
        hold_interrupts()  # a signal from here on must not interrupt writing the record
        raise_if_interrupted()
    except (Exception, KeyboardInterrupt) as exc:
        hold_interrupts()
        status, reason, exit_code = failure(exc)
    wrong = sum(r.wrong or 0 for r in rows)
    if status == "ok" and wrong:
        reason = f"{wrong} element(s) differ from the expected result (see the #wrong column)"
        status, exit_code = "error", EXIT_ERROR
    record["results"] = {
        "status": status,
        "reason": reason,
        "wrong": wrong if cfg.check else None,
        "avg_busbw_gbps": {op: average_busbw(r) for op in cfg.op_list if (r := [x for x in rows if x.op == op])},
        "rows": [asdict(r) for r in rows],
    }
    if process.is_main and output:
        write_json(output, record)
    if status == "ok" or process.world == 1:  # a failed group is kept: its barrier could wait on a lost peer
        shutdown_process()
    restore_signals(previous)
    if status != "ok" and (folder := RunFolder.watching()) is not None:
        folder.leave_failure(reason or "", rank=process.rank)
        return exit_code  # ljperf's launcher names the rank that failed first, in one line
    if reason is not None:  # the run failed
        raise RunFailed(reason, exit_code=exit_code)
    return 0


def launch(argv: list[str], launch: LaunchConfig, *, device_type: DeviceType, output: str | None) -> int:
    """The ranks through ljperf's launcher. A failed run's record gets the launcher's reason (the rank that failed
    first, which rank 0 may only have seen as a lost peer), and one line says it."""
    folder = RunFolder(Path(tempfile.mkdtemp(prefix="ljperf-comm-")))
    os.environ[RUN_DIR_ENV] = str(folder.path)
    try:
        run_workers(argv, launch, cpu=device_type != "cuda")
        return EXIT_OK
    except Exception as exc:  # torch's SignalException too: SIGTERM or SIGINT to this process
        reason, code = failure_reason(exc, folder=folder)
    finally:
        os.environ.pop(RUN_DIR_ENV, None)
        shutil.rmtree(folder.path, ignore_errors=True)
    kept = output is not None and output != STDOUT and os.path.isfile(output)
    if kept:
        record = read_json(output)
        record["results"]["reason"] = reason
        write_json(output, record)
    if code in (EXIT_SIGINT, EXIT_SIGTERM):
        print(f"ljperf comm: {reason}" + (f"; partial result kept: {output}" if kept else ""), file=sys.stderr)
        return code
    raise RunFailed(reason + (f"; result record: {output}" if kept else ""), exit_code=code)


def average_busbw(rows: list[Row]) -> float:
    """nccl-tests' footer: the mean bus bandwidth over all sizes."""
    return sum(r.busbw_gbps for r in rows) / len(rows)


def print_table(op: str, rows: list[Row], *, world: int, backend: str) -> None:
    table = titled_table(f"{op} · {world} rank(s) · {backend}")
    for name, unit in (
        ("size", "(B)"),
        ("count", "(elements)"),
        ("type", ""),
        ("time", "(us)"),
        ("algbw", "(GB/s)"),
        ("busbw", "(GB/s)"),
        ("#wrong", ""),
    ):
        table.add_column(f"{name}\n{unit}", justify="left" if name == "type" else "right")
    for r in rows:
        wrong = "N/A" if r.wrong is None else str(r.wrong)
        table.add_row(
            str(r.size_bytes),
            str(r.count),
            r.dtype,
            f"{r.time_us:.1f}",
            f"{r.algbw_gbps:.2f}",
            f"{r.busbw_gbps:.2f}",
            wrong,
        )
    table.caption = f"avg bus bandwidth: {average_busbw(rows):.3f} GB/s"
    console.print(table)
