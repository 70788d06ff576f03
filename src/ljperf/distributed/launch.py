"""Start this node's processes of a run through torchrun's launcher, and name the rank that failed first.

Run: ``run_workers(["comm", ...], LaunchConfig(nproc_per_node=2), cpu=True)`` runs ``python -m ljperf <args>``
under torch's elastic launcher (what ``torchrun`` uses), rendezvous on localhost or ``--rdzv-endpoint``;
``failure_reason`` turns what it raises into one line and an exit code. The ranks report to a ``RunFolder``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import math
import os
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ljperf.core.errors import EXIT_DIVERGED, EXIT_ERROR, EXIT_OOM, EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE
from ljperf.core.gc_pause import resume_collection
from ljperf.core.options import LaunchConfig

RUN_DIR_ENV = "LJPERF_RUN_DIR"
LAUNCHER_ENV = "LJPERF_LAUNCHER_PID"
"""Set by ljperf's launcher in the ranks it starts: its process id (the ranks end with it)."""
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def end_with_parent(parent: int | None = None) -> None:
    """Get SIGTERM when the parent process dies, even by SIGKILL (Linux), so that no rank or run is left
    orphaned; ``parent``: its id, when it may have died already (then SIGTERM now)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def launcher_gone() -> bool:
    """Whether ljperf's launcher started this process and has died since (its run folder is nobody's now)."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None:
        return False
    if os.getppid() != int(launcher):
        return True
    # Killed, its threads die one by one, and its children belong to a live one of them till the last is gone:
    # the parent is the launcher still, but its main thread (which started the ranks) has exited.
    try:
        with open(f"/proc/{launcher}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return os.path.isdir("/proc")  # without /proc (not Linux), there is no death signal either
    except OSError:
        return False


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def local_world_size(default: int = 1) -> int:
    """Processes on this node, as torchrun tells each (``LOCAL_WORLD_SIZE``); ``default`` outside it."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


@dataclass(frozen=True)
class RunFolder:
    """The folder ljperf's launcher makes for a multi-process run (``$LJPERF_RUN_DIR`` in its ranks), which the
    ranks report to: rank 0's progress (``progress.jsonl``: a line per step, then ``finished``) and a usage
    error any rank found (``usage-error.RANK``: the launcher prints one, as a one-process run would)."""

    path: Path

    @classmethod
    def watching(cls) -> RunFolder | None:
        """The folder of the launcher watching this process; None without one."""
        path = os.environ.get(RUN_DIR_ENV)
        return cls(Path(path)) if path else None

    @property
    def progress(self) -> Path:
        return self.path / "progress.jsonl"

    def finished(self) -> bool:
        """Whether rank 0 got to the end of its run (and wrote its record)."""
        lines = self.progress.read_text().splitlines() if self.progress.exists() else []
        return bool(lines) and "finished" in json.loads(lines[-1])

    def leave_usage_error(self, message: str, *, rank: str) -> bool:
        try:
            (self.path / f"usage-error.{rank}").write_text(message)
        except OSError:
            return False
        return True

    def usage_error(self) -> str | None:
        """A usage error a rank left (the lowest rank's), or None."""
        found = sorted(self.path.glob("usage-error.*"))
        return found[0].read_text() if found else None

    def leave_failure(self, reason: str, *, rank: int) -> None:
        """Record when (to the microsecond) and why this rank's run failed: the launcher's own times are whole
        seconds, too coarse to tell a failure from its peer's loss of connection an instant later."""
        try:
            (self.path / f"failure.{rank}").write_text(json.dumps({"time": time.time(), "reason": reason}))
        except OSError:
            pass

    def failures(self) -> dict[int, tuple[float, str]]:
        """The ranks that left a failure: when (``time.time()``) and why."""
        found = {}
        for path in self.path.glob("failure.*"):
            try:
                left = json.loads(path.read_text())
                found[int(path.suffix[1:])] = (float(left["time"]), str(left["reason"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a rank killed while writing it: the launcher's time stands
        return found


SHUTDOWN_GRACE_S = 5
"""Seconds the agent waits after SIGTERM before it SIGKILLs the ranks it ends (torchrun's: 30). A rank of ljperf
keeps its record and exits within a second of SIGTERM; one that has not by then is hung (as in a driver call)."""


@functools.cache
def _end_ranks_within_grace() -> None:
    """Make torch's launcher SIGKILL the ranks it ends ``SHUTDOWN_GRACE_S`` after SIGTERM. It waits 30 s, the
    default of its process context's ``close()``, when it ends the others after one rank failed, whatever its
    ``shutdown_timeout`` says (pytorch/pytorch#119856, open in torch 2.13): a hung rank would hold the run 30 s."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close

    def close_within_grace(self: PContext, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        close(self, death_sig, min(timeout, SHUTDOWN_GRACE_S))

    PContext.close = close_within_grace


TIMED_OUT = re.compile(r"timed out|timeout caused", re.IGNORECASE)
"""What a collective that timed out raises: gloo says "Timed out waiting Nms for recv operation" or, when the
timeout closes the connection first, "Application timeout caused pair closure"."""


LOST_PEER = re.compile(r"closed by peer|reset by peer|broken pipe|remote process exited", re.IGNORECASE)
"""What a rank says when its peer vanished (gloo: "Connection closed by peer", "Connection reset by peer"; NCCL:
"remote process exited"): the peer's failure is the cause, whatever second the launcher saw each exit in."""


def failure_reason(exc: Exception, *, folder: RunFolder | None = None) -> tuple[str, int]:
    """One line naming the rank that failed first (or the signal), and the exit code ljperf should return; with
    the run's ``folder``, the ranks' own failure times order them, and the first one's own reason is added."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    if isinstance(exc, SignalException):
        code = EXIT_SIGINT if exc.sigval == signal.SIGINT else EXIT_SIGTERM
        return f"interrupted by {exc.sigval.name}", code
    if isinstance(exc, RendezvousTimeoutError):  # its message is empty
        return (
            "the nodes did not all join the rendezvous in time: check --rdzv-endpoint and --nnodes, and that every "
            "node runs the command",
            EXIT_ERROR,
        )
    if not isinstance(exc, ChildFailedError):
        return f"launcher failed: {type(exc).__name__}: {exc}", EXIT_ERROR
    # The agent ends the other ranks with SIGTERM once one fails: those are not the cause (unless all are). A
    # benchmark rank turns SIGTERM into exit 143 (its record kept), so that code counts as the agent's too.
    ended = (-signal.SIGTERM, EXIT_SIGTERM)
    failures = {r: f for r, f in exc.failures.items() if f.exitcode not in ended} or exc.failures
    # The agent times failures in whole seconds (when it saw the exit), and a rank that lost its peer (exit 1)
    # often fails in the same second as the peer. When every failed rank left its own time (to the microsecond,
    # when it caught the error) those order them. A rank killed outright leaves none: then within a second a
    # signal, an OOM or a usage error is the cause, not an exit 1, and the ranks' own times break what ties remain.
    # A rank that said it lost its peer comes after the others: the launcher may see a killed rank's exit seconds
    # after its peer's, when the machine is loaded.
    left = folder.failures() if folder is not None else {}
    precise = all(r in left for r in failures)

    def first(item: tuple[int, Any]) -> tuple[float, ...]:
        rank, failure = item
        lost_peer = bool(LOST_PEER.search(left.get(rank, (0.0, ""))[1]))
        if precise:
            return lost_peer, left[rank][0], rank
        return lost_peer, failure.timestamp, failure.exitcode == EXIT_ERROR, left.get(rank, (-math.inf, ""))[0], rank

    rank, failure = min(failures.items(), key=first)
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    elif failure.exitcode == EXIT_OOM:
        how = f"ran out of memory (exit code {EXIT_OOM})"
    elif failure.exitcode == EXIT_DIVERGED:
        how = f"diverged (exit code {EXIT_DIVERGED})"
    else:
        how = f"exited with code {failure.exitcode}"
    # Out of memory, a diverged loss, and a usage error only a rank could find (a recompute plan that cannot fit)
    # keep their codes.
    code = failure.exitcode if failure.exitcode in (EXIT_OOM, EXIT_DIVERGED, EXIT_USAGE) else EXIT_ERROR
    if rank in left:
        reason = f"rank {rank} {how}: {left[rank][1]}"
        # A collective that timed out names the rank that waited; the ranks the agent had to end were still in
        # the run, and one of them is what it waited for (one stopped, SIGSTOP, ends only on SIGKILL).
        stuck = (*ended, -signal.SIGKILL)
        waiting = [str(r) for r, f in sorted(exc.failures.items()) if f.exitcode in stuck and r != rank]
        if TIMED_OUT.search(left[rank][1]) and waiting:
            reason += f"; still running when it timed out, so maybe hung: rank {', '.join(waiting)}"
        return reason, code
    # A rank killed outright said nothing: what the first rank that did say (often that it lost its peer).
    said = sorted((when, r, why) for r, (when, why) in left.items())
    return f"rank {rank} {how}" + (f"; rank {said[0][1]} reported {said[0][2]}" if said else ""), code


def run_workers(argv: list[str], lc: LaunchConfig, *, cpu: bool) -> None:
    """Run ``python -m ljperf ARGV`` on this node's ``lc.nproc_per_node`` processes; raises what the launcher raises."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
    from torch.distributed.launcher.api import elastic_launch

    if cpu:
        # gloo on CPU: split the cores between the ranks instead of oversubscribing them.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // lc.nproc_per_node)))
    config = ElasticConfig(
        min_nodes=lc.nnodes,
        max_nodes=lc.nnodes,
        nproc_per_node=lc.nproc_per_node,
        run_id=os.environ.get("LJPERF_RDZV_ID", "ljperf" if lc.nnodes > 1 else uuid.uuid4().hex[:8]),
        rdzv_endpoint=lc.rdzv_endpoint or "localhost:0",
        rdzv_backend="c10d",
        rdzv_configs={
            "rank": lc.node_rank,
            "timeout": int(lc.collective_timeout),
            "join_timeout": int(lc.collective_timeout),
        }
        if lc.nnodes > 1
        else {"rank": 0},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),  # else an empty torchelastic_* folder in $TMPDIR a run
    )
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks end with this process (cli.main)
    _end_ranks_within_grace()
    # The agent logs "failed (exitcode: N) local_rank: ..." and "Sending process P closing signal SIGTERM" with
    # its own timestamp format; ljperf's one last line names the failing rank and why (``failure_reason``).
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_not_the_agents_failure_lines)
    if lc.nnodes > 1:
        print(
            f"node {lc.node_rank} of {lc.nnodes}: waiting up to {lc.collective_timeout:g} s for the others"
            f" at {lc.rdzv_endpoint}",
            file=sys.stderr,
            flush=True,
        )
    resume_collection()  # this process's start-up is over: it now watches the ranks
    elastic_launch(config, sys.executable)("-m", "ljperf", *argv)


def _not_the_agents_failure_lines(record: logging.LogRecord) -> bool:
    # "Received 2 death signal" is the agent's line for Ctrl-C, which ljperf's last line says as "interrupted".
    lines = ("failed (exitcode", "Sending process", "Unable to shutdown process", "Received %s death signal")
    return not str(record.msg).startswith(lines)
