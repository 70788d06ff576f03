"""Fault injection with real processes and real signals: ljperf fails loudly, cleanly, and keeps its record.

Each guarantee is listed in docs/reliability.md with the test that proves it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

from ljperf.core.errors import EXIT_DIVERGED, EXIT_SIGINT, forget_signals, note_interrupt
from ljperf.core.records import write_json
from ljperf.distributed.launch import SHUTDOWN_GRACE_S
from ljperf.distributed.memory import CPU_METHOD
from ljperf.distributed.runtime import free_port
from ljperf.models.catalog import read_config_dict
from ljperf.models.spec import build_meta, resolve

from conftest import cli_env, read_record, run_ljperf, run_main, use_cli_env

TINY = ["benchmark", "--model", "torch/llama-tiny", "--seq-len", "64", "--warmup", "1"]


def children(pid: int) -> list[int]:
    """All descendants of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def proc_text(pid: int, name: str) -> str:
    """``/proc/PID/NAME``, or "" once the process has gone (it may end between listing and reading)."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def rank_pid(launcher: int, rank: int) -> int | None:
    for pid in children(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
            return pid
    return None


def start(args: list[str], tmp_path: Path, **env: str) -> subprocess.Popen:
    """``ljperf ARGS`` as started from a terminal: Ctrl-C not ignored. A child inherits an ignored SIGINT, and
    in the full suite this worker had one (ljperf then keeps ignoring it until the run starts: SIGINT 0.5 s and
    2.5 s after the start ran all 400 steps, exit 0; reproduced by starting it with SIGINT ignored)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ljperf", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(TMPDIR=str(tmp_path), **env),
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


class Lines:
    """A process's output read line by line on a thread of its own, so a test can wait for a line and the pipe
    never fills."""

    def __init__(self, stream: IO[str]):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self._thread.start()

    def wait_for(self, text: str, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline and self._thread.is_alive(), f"no {text!r} within {timeout} s"
            time.sleep(0.1)


def wait_for_steps(tmp_path: Path, n: int, timeout: float = 240) -> None:
    """Wait until rank 0 has reported ``n`` steps in its run folder's progress file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for progress in tmp_path.glob("ljperf-run-*/progress.jsonl"):
            if sum(1 for line in progress.read_text().splitlines() if '"step"' in line) >= n:
                return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} steps within {timeout} s")


@pytest.mark.slow
def test_a_killed_rank_is_named_and_the_record_kept(tmp_path):
    out = tmp_path / "r.json"
    proc = start([*TINY, "--nproc-per-node", "2", "--steps", "400", "--output", str(out)], tmp_path)
    wait_for_steps(tmp_path, 4)
    victim = rank_pid(proc.pid, 1)
    assert victim is not None
    workers = children(proc.pid)
    os.kill(victim, signal.SIGKILL)
    started = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - started < 60  # the survivor does not hang
    assert proc.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert "rank 1 was killed by SIGKILL" in last
    res = read_record(out)["results"]
    assert res["status"] == "error" and "rank 1" in res["reason"]
    assert 1 <= res["steps_completed"] < 400
    assert len(res["losses"]) == res["steps_completed"]
    assert not [p for p in workers if alive(p)]


@pytest.mark.slow
def test_an_oom_on_another_rank_is_the_runs_oom(tmp_path):
    """Rank 1 runs out of memory: exit 3 and an ``oom`` record naming rank 1 (it said rank 0 was killed by
    SIGTERM, the launcher's own signal, with exit 1). Rank 0 either sees its peer vanish (a gloo error) or gets
    torchrun's SIGTERM first; its record is the same either way."""
    out = tmp_path / "r.json"
    args = [*TINY, "--nproc-per-node", "2", "--steps", "1", "--warmup", "3", "--output", str(out)]
    # Memory is measured in step 1. Rank 1 ran out in step 2 at first, and rank 0, still in its step 1 when
    # SIGTERM came (a loaded CI machine), had no peak. Out of memory in step 3: rank 1 passed step 2's
    # all-reduce, so rank 0 had finished step 1.
    proc = start(args, tmp_path, LJPERF_FAULT="oom,step=3,rank=1")
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 3, stderr[-2000:]
    assert "rank 1 ran out of memory" in stderr.strip().splitlines()[-1]
    res = read_record(out)["results"]
    assert res["status"] == "oom" and "rank 1" in res["reason"]
    # What rank 0 knew: its own peak, a forecast beside it, and no figure for the rank that failed.
    assert res["peak_allocated_bytes_per_rank"][1] is None and res["peak_allocated_bytes_per_rank"][0] > 0
    assert res["forecast"]["peak_allocated_bytes"] > 0 and "memory forecast" in stdout
    # One table, the launcher's, with the run's cause (rank 0 saw only its peer vanish: a gloo error).
    assert stdout.count("│ status") == 1 and "│        oom │" in stdout, stdout
    assert "oom: rank 1 ran out of memory" in stdout, stdout


def test_the_cause_is_named_before_a_rank_that_lost_its_peer_in_the_same_second():
    """torch elastic's failures carry whole-second times; a rank that fails with exit 1 because its peer died
    (gloo: connection reset) is often in the same second as the peer. The peer is the cause; a failure a whole
    second earlier still comes first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ljperf.distributed.launch import failure_reason

    def failures(cause_code: int, *, lost_earlier_by: int = 0) -> ChildFailedError:
        cause = ProcessFailure(local_rank=1, pid=2, exitcode=cause_code, error_file="")
        lost = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="")
        lost.timestamp = cause.timestamp - lost_earlier_by
        return ChildFailedError("ljperf", {0: lost, 1: cause})

    assert failure_reason(failures(-signal.SIGKILL)) == ("rank 1 was killed by SIGKILL", 1)
    assert failure_reason(failures(3)) == ("rank 1 ran out of memory (exit code 3)", 3)
    assert failure_reason(failures(2)) == ("rank 1 exited with code 2", 2)
    assert failure_reason(failures(-signal.SIGKILL, lost_earlier_by=1)) == ("rank 0 exited with code 1", 1)


def test_the_ranks_own_failure_times_order_two_exits_with_code_1(tmp_path):
    """Both ranks exit 1 in the same whole second: the times the ranks left in the run folder (to the
    microsecond) say which failed first, and its own reason is named; it named rank 0, which lost its peer."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ljperf.distributed.launch import RunFolder, failure_reason

    lost, cause = (ProcessFailure(local_rank=r, pid=r + 1, exitcode=1, error_file="") for r in (0, 1))
    lost.timestamp = cause.timestamp
    exc = ChildFailedError("ljperf", {0: lost, 1: cause})
    folder = RunFolder(tmp_path)
    folder.leave_failure("RuntimeError: injected", rank=1)
    folder.leave_failure("RuntimeError: Connection closed by peer", rank=0)
    assert failure_reason(exc, folder=folder) == ("rank 1 exited with code 1: RuntimeError: injected", 1)
    # A rank killed outright leaves no time: the agent's second and the exit-1 rule name it, as before, with what
    # the rank that lost it said.
    cause.exitcode = -signal.SIGKILL
    (tmp_path / "failure.1").unlink()
    killed = "rank 1 was killed by SIGKILL; rank 0 reported RuntimeError: Connection closed by peer"
    assert failure_reason(exc, folder=folder) == (killed, 1)
    # On a loaded machine the launcher may see the killed rank's exit seconds after rank 0's, which only lost its
    # peer: rank 1 is still the cause.
    lost.timestamp = cause.timestamp - 2
    assert failure_reason(exc, folder=folder) == (killed, 1)
    folder.leave_failure("RuntimeError: [gloo/transport/tcp/pair.cc:590] Connection reset by peer", rank=0)
    assert failure_reason(exc, folder=folder)[0].startswith("rank 1 was killed by SIGKILL")


GLOO_TIMEOUTS = (
    "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Timed out waiting 15000ms for recv operation to complete",
    "RuntimeError: Application timeout caused pair closure",
)


@pytest.mark.parametrize("error", GLOO_TIMEOUTS)
def test_both_of_gloos_timeouts_name_the_rank_that_may_hang(tmp_path, error):
    """gloo reports a collective's timeout in two words (which one is a race): both name the rank still running.
    The second made the hung-rank test below fail once in a full suite (the reason said no more than gloo's)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ljperf.distributed.launch import RunFolder, failure_reason

    waited = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="")
    stopped = ProcessFailure(local_rank=1, pid=2, exitcode=-signal.SIGKILL, error_file="")
    stopped.timestamp = waited.timestamp + 30  # the agent's SIGKILL, after its grace for SIGTERM
    folder = RunFolder(tmp_path)
    folder.leave_failure(error, rank=0)
    reason, code = failure_reason(ChildFailedError("ljperf", {0: waited, 1: stopped}), folder=folder)
    assert reason == f"rank 0 exited with code 1: {error}; still running when it timed out, so maybe hung: rank 1"
    assert code == 1


@pytest.mark.slow
def test_an_error_on_another_rank_is_named_with_its_reason(tmp_path):
    out = tmp_path / "r.json"
    args = [*TINY, "--nproc-per-node", "2", "--steps", "1", "--warmup", "0", "--output", str(out)]
    proc = start(args, tmp_path, LJPERF_FAULT="error,step=0,rank=1")
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1, stderr[-2000:]
    cause = "rank 1 exited with code 1: RuntimeError: injected by LJPERF_FAULT"
    assert stderr.strip().splitlines()[-1].startswith(f"ljperf benchmark: failed: {cause}"), stderr[-2000:]
    assert read_record(out)["results"]["reason"] == cause  # not rank 0's "Connection closed by peer" after it


def test_a_node_alone_at_the_rendezvous_fails_after_the_timeout_with_a_reason(tmp_path):
    """--nnodes 2 and only one node comes: it says what it waits for, gives up after --collective-timeout (it
    waited torch's 600 s whatever the limit said) and names the cause (torch's error has an empty message)."""
    args = [*TINY, "--steps", "1", "--nnodes", "2", "--node-rank", "0", "--collective-timeout", "5"]
    proc = start([*args, "--rdzv-endpoint", f"127.0.0.1:{free_port()}"], tmp_path)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert lines[0].startswith("node 0 of 2: waiting up to 5 s for the others at 127.0.0.1:"), stderr[-2000:]
    assert lines[-1].startswith("ljperf benchmark: failed: the nodes did not all join the rendezvous in time")


@pytest.mark.slow
def test_a_plan_that_cannot_fit_is_exit_2_in_one_line_with_two_ranks(tmp_path):
    """A usage error only the ranks can find keeps exit 2 through the launcher (it was 1), in one line (each
    rank, the agent's own log and the launcher each printed one; whichever rank exits first, and a rank's exit
    once aborted with SIGABRT), and the launcher's folder is removed. Run twice: the ranks race."""
    out = tmp_path / "r.json"
    args = ["benchmark", "--model", "fsdp/llama-tiny", "--nproc-per-node", "2", "--seq-len", "32", "--steps", "1"]
    args += ["--output", str(out)]
    for _ in range(2):
        proc = start([*args, "--recompute", "auto", "--memory-budget", "1MiB"], tmp_path)
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 2, stderr[-2000:]
        assert len(stderr.strip().splitlines()) == 1, stderr[-2000:]
        # the cheapest plan at full recompute's peak: 2 of 4 layers reach it (it is in layer 1's backward)
        assert re.match(r"ljperf benchmark: error: recomputing \d/4 layers", stderr) and "does not fit" in stderr
        assert not list(tmp_path.glob("ljperf-run-*"))
        assert not out.exists()  # refused before training, as a one-process run is: no record


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_after_the_timeout(tmp_path):
    """A rank stopped by SIGSTOP (as a rank hung in a driver call: it ignores SIGTERM) is killed and named."""
    out = tmp_path / "r.json"
    proc = start(
        [*TINY, "--nproc-per-node", "2", "--steps", "400", "--collective-timeout", "15", "--output", str(out)],
        tmp_path,
    )
    wait_for_steps(tmp_path, 2)
    workers = children(proc.pid)
    os.kill(rank_pid(proc.pid, 1), signal.SIGSTOP)
    stopped = time.monotonic()
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1
    # the 15 s timeout, then launch.SHUTDOWN_GRACE_S between SIGTERM and SIGKILL (torchrun's 30 s made it 45+)
    assert time.monotonic() - stopped < 15 + SHUTDOWN_GRACE_S + 10
    assert "Traceback" not in stdout + stderr, stdout[-3000:]  # gloo's error quotes "[/path.cc:N]": not markup
    last = stderr.strip().splitlines()[-1]
    assert "rank" in last and "timed out" in last.lower(), last
    assert "still running when it timed out, so maybe hung: rank 1" in last  # rank 0 waited; rank 1 slept
    res = read_record(out)["results"]
    assert res["status"] == "error" and res["steps_completed"] >= 1 and "timed out" in res["reason"].lower()
    time.sleep(1)
    assert not [p for p in workers if alive(p)], "orphan worker processes"


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signals_keep_a_partial_record_and_end_the_children(tmp_path, sig, code):
    out = tmp_path / "r.json"
    proc = start([*TINY, "--nproc-per-node", "2", "--steps", "400", "--output", str(out)], tmp_path)
    wait_for_steps(tmp_path, 3)
    workers = children(proc.pid)
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code
    name = signal.Signals(sig).name
    # the same last line as one process's (tested below), and none of the agent's 'death signal' lines
    assert stderr.strip().splitlines()[-1] == f"ljperf benchmark: interrupted by {name}; partial result kept: {out}"
    assert "death signal" not in stderr, stderr[-2000:]
    res = read_record(out)["results"]
    assert res["status"] == "error" and res["steps_completed"] >= 1
    assert signal.Signals(sig).name in res["reason"]
    time.sleep(1)
    assert not [p for p in workers if alive(p)]


@pytest.mark.slow
def test_a_signal_while_inductor_runs_the_cpp_compiler_ends_the_run(tmp_path):
    """Inductor wraps its C++ compiler in ``except Exception`` (the CPU's vector ISA check returns False): the
    signal's exception must not be an ``Exception``, or the run went on and exited 0 with status ok."""
    out = tmp_path / "r.json"
    args = [*TINY, "--compile", "--steps", "3", "--output", str(out)]
    proc = start(args, tmp_path, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # empty: it must compile
    deadline = time.monotonic() + 120
    while not any(proc_text(pid, "comm") in ("g++", "cc1plus", "gcc", "cc") for pid in children(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, "no C++ compiler ran"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == f"ljperf benchmark: interrupted by SIGTERM; partial result kept: {out}"
    assert read_record(out)["results"]["reason"] == "interrupted by SIGTERM"


def test_single_process_sigterm_keeps_the_record(tmp_path):
    out, run_dir = tmp_path / "r.json", tmp_path / "ljperf-run-single"
    run_dir.mkdir()
    proc = start(
        [*TINY, "--warmup", "2", "--steps", "400", "--output", str(out)],  # memory is measured in step 1
        tmp_path,
        LJPERF_FAULT="sleep,step=3,rank=0,seconds=3600",
        LJPERF_RUN_DIR=str(run_dir),
    )
    wait_for_steps(tmp_path, 3)  # now inside the injected stall at step 3
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    res = read_record(out)["results"]
    assert res["status"] == "error" and "SIGTERM" in res["reason"] and res["steps_completed"] == 1
    # The peak measured in step 1 and the forecast made before the run, beside it.
    assert res["peak_allocated_bytes"] > 0 and res["forecast"]["peak_allocated_bytes"] > 0
    assert res["forecast"]["error_pct"] is not None


# importing torch; resolving the config; building the model (later: seconds of a process each)
@pytest.mark.parametrize(
    "delay", [0.5, pytest.param(2.5, marks=pytest.mark.slow), pytest.param(4.5, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_start_up_exits_with_one_line(tmp_path, sig, code, delay):
    """Ctrl-C or SIGTERM before the first step: its exit code and one line, never a traceback (a signal inside
    an import comes out of transformers as ModuleNotFoundError, which printed one)."""
    proc = start([*TINY, "--steps", "400"], tmp_path)
    time.sleep(delay)
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr[-3000:]


def run_benchmark_command(run: Callable[[argparse.Namespace, list[str]], int]) -> int:
    """``cli._run_command`` of a stand-in benchmark module whose ``run`` is ``run``, with the SIGINT handler
    ``cli.main`` leaves for a command; its exit code."""
    from ljperf import cli

    forget_signals()
    previous = signal.signal(signal.SIGINT, note_interrupt)
    try:
        return cli._run_command(types.SimpleNamespace(run=run), argparse.Namespace(command="benchmark"), [])
    finally:
        signal.signal(signal.SIGINT, previous)
        forget_signals()


def test_a_ctrl_c_an_import_turned_into_another_error_is_an_interruption(capsys):
    """Ctrl-C inside torch's C++ init (``import torch`` in a command's ``run``) came out as ``TypeError: expected a
    message argument``: a traceback and exit 1 (a full suite's start-up test met it). The noted signal wins."""

    def run(_args, _argv) -> int:
        with contextlib.suppress(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        raise TypeError("expected a message argument")  # what torch's C++ init raised, the interrupt gone

    assert run_benchmark_command(run) == EXIT_SIGINT
    assert capsys.readouterr().err == "ljperf benchmark: interrupted by SIGINT\n"


def test_a_ctrl_c_inside_an_import_is_raised_once_the_import_has_ended(tmp_path, monkeypatch, capsys):
    """A Ctrl-C raised inside torch's C++ initialisation aborted the process (SIGABRT, pybind11's
    ``error_already_set``) or ended as a RecursionError (one in 15 start-up signals at ~0.5 s). The handler
    ``cli.main`` leaves for the command notes it and raises it once the import has ended: here a module whose
    import gets the signal finishes, and the command ends before its next step."""
    (tmp_path / "signalled_module.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.3)\nDONE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reached = []

    def run(_args, _argv) -> int:
        import signalled_module

        reached.append(signalled_module.DONE)
        time.sleep(5)
        reached.append("the end")
        return 0

    assert run_benchmark_command(run) == EXIT_SIGINT
    assert reached == [True]
    assert capsys.readouterr().err == "ljperf benchmark: interrupted\n"


def test_a_ctrl_c_an_import_swallowed_still_ends_the_run(tmp_path):
    """Ctrl-C while the benchmark imports transformers, whose import machinery can catch the KeyboardInterrupt
    (it turns one into ModuleNotFoundError): the handler ``cli.main`` leaves for the command notes the signal,
    and the run's first check ends it as an interrupted run instead of training on to exit 0."""
    from ljperf.benchmark.config import config_from_args
    from ljperf.benchmark.loop import run_worker
    from ljperf.cli import build_parser

    out = tmp_path / "r.json"
    argv = [*TINY, "--steps", "400", "--output", str(out)]
    cfg = config_from_args(build_parser("benchmark").parse_args(argv), argv)
    previous = signal.signal(signal.SIGINT, note_interrupt)
    try:
        with contextlib.suppress(KeyboardInterrupt):  # as an import that catches it would
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert run_worker(cfg) == EXIT_SIGINT
    finally:
        signal.signal(signal.SIGINT, previous)
        forget_signals()
    res = read_record(out)["results"]
    assert res["status"] == "error" and "SIGINT" in res["reason"] and res["steps_completed"] < 400, res


@pytest.mark.slow
def test_a_signal_that_lands_inside_a_destructor_still_ends_the_run(tmp_path):
    """Python swallows an exception raised inside a ``__del__`` (the garbage collector runs them at any
    allocation), so a signal handled there once let the run go on to its end with status 0 and a printed
    traceback (seen 1 in 6 times with Ctrl-C while the model was built). A stand-in sends SIGTERM from a
    destructor right after the memory check; the run still stops before its first step with one line."""
    out = tmp_path / "r.json"
    (tmp_path / "stand_in.py").write_text(
        "import os, signal, sys, time\n"
        "from ljperf import cli\n"
        "from ljperf.benchmark import loop as benchmark\n"
        "class SignalsWhenCollected:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(0.1)  # the handler runs here, inside __del__\n"
        "checked = benchmark.check_memory\n"
        "def check_then_collect(*args, **kwargs):\n"
        "    made = checked(*args, **kwargs)\n"
        "    SignalsWhenCollected()\n"
        "    return made\n"
        "benchmark.check_memory = check_then_collect\n"
        f"sys.argv = ['ljperf', *{[*TINY, '--steps', '400', '--output', str(out)]!r}]\n"
        "cli.entry()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "stand_in"], capture_output=True, text=True, timeout=120, env=cli_env(), cwd=tmp_path
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    last = f"ljperf benchmark: interrupted by SIGTERM; partial result kept: {out}"
    assert proc.stderr.strip().splitlines() == [last], proc.stderr
    res = read_record(out)["results"]
    assert res["reason"] == "interrupted by SIGTERM" and res["steps_completed"] == 0


@pytest.mark.slow
def test_a_signal_while_a_failure_is_handled_still_leaves_the_record(tmp_path):
    """torchrun sends SIGTERM to every rank once one failed; it lands while the others handle their own error
    (rank 0 saw its peer vanish). It once escaped from there and rank 0 wrote no record: the launcher rebuilt one
    without rank 0's peak (``test_an_oom_on_another_rank_is_the_runs_oom`` failed so, 1 in 2 full runs). A
    stand-in sends SIGTERM while the injected error is handled; the record keeps the error and the peak."""
    out = tmp_path / "r.json"
    (tmp_path / "stand_in.py").write_text(
        "import os, signal, sys, time\n"
        "from ljperf import cli\n"
        "from ljperf.benchmark import loop as benchmark\n"
        "handled = benchmark.failure\n"
        "def failure_then_signal(exc):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.1)  # the handler runs here\n"
        "    return handled(exc)\n"
        "benchmark.failure = failure_then_signal\n"
        f"sys.argv = ['ljperf', *{[*TINY, '--warmup', '3', '--steps', '2', '--output', str(out)]!r}]\n"
        "cli.entry()\n"
    )
    env = cli_env() | {"LJPERF_FAULT": "error,step=4,rank=0"}
    proc = subprocess.run(
        [sys.executable, "-m", "stand_in"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    res = read_record(out)["results"]
    assert res["status"] == "error" and "injected" in res["reason"], res["reason"]
    assert res["steps_completed"] == 1 and res["peak_allocated_bytes"] > 0


@pytest.mark.slow
def test_rank_0_dying_after_its_measured_step_keeps_its_peak(tmp_path):
    """Rank 0 dies with no record; the launcher rebuilds it from rank 0's progress lines, whose measured step's
    line carries its peak."""
    out = tmp_path / "r.json"
    args = [*TINY, "--nproc-per-node", "2", "--warmup", "3", "--steps", "2", "--output", str(out)]
    proc = start(args, tmp_path, LJPERF_FAULT="exit,step=4,rank=0")
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1, stderr[-2000:]
    res = read_record(out)["results"]
    assert res["status"] == "error" and "rank 0" in res["reason"], res["reason"]
    assert res["steps_completed"] == 1
    assert res["peak_allocated_bytes_per_rank"][0] > 0 and res["peak_allocated_bytes_per_rank"][1] is None
    assert res["memory_method"] == CPU_METHOD


def test_ctrl_c_inside_an_exec_of_source_still_exits_130(tmp_path):
    """CPython marks a KeyboardInterrupt raised inside ``exec`` of a string (dataclasses and namedtuple build
    their methods so, at import) as unhandled even when it is caught; under ``python -m`` it then kills itself
    with SIGINT at exit: status -2, not 130 (seen 1 in 16 times with Ctrl-C during start-up). A stand-in
    command raises it so, and ``python -m`` runs ljperf's entry point as ``python -m ljperf`` does."""
    (tmp_path / "stand_in.py").write_text(
        "import sys, types\n"
        "from ljperf import cli\n"
        "command = types.ModuleType('interrupted_in_exec')\n"
        "command.add_arguments = lambda parser: None\n"
        "command.run = lambda args, argv: exec('raise KeyboardInterrupt')\n"
        "sys.modules[command.__name__] = command\n"
        "cli.COMMANDS['models'] = cli.Command('stand-in', command.__name__)\n"
        "sys.argv = ['ljperf', 'models']\n"
        "cli.entry()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "stand_in"], capture_output=True, text=True, timeout=60, env=cli_env(), cwd=tmp_path
    )
    assert (proc.returncode, proc.stderr) == (130, "ljperf models: interrupted\n")


@pytest.mark.slow
def test_host_memory_running_out_is_an_oom(tmp_path):
    """The CPU allocator raises a plain RuntimeError, not torch.OutOfMemoryError; the run is still ``oom``."""
    out = tmp_path / "r.json"
    big = ["--micro-batch", "64", "--seq-len", "2048", "--steps", "1", "--warmup", "0", "--output", str(out)]
    # 2.3 GB above the imports: a 64 × 2048-token batch does not fit.
    proc = run_ljperf(*TINY, *big, timeout=120, memory_above_imports=2300 * 10**6)
    assert proc.returncode == 3, proc.stderr[-3000:]
    res = read_record(out)["results"]
    assert res["status"] == "oom" and res["reason"].startswith("out of host memory (DefaultCPUAllocator"), res
    last = f"ljperf benchmark: oom: {res['reason']}; result record: {out}"
    assert proc.stderr.strip().splitlines()[-1] == last
    # What the forecast expected is kept; nothing was measured to compare it with.
    assert res["forecast"]["peak_allocated_bytes"] > 2300 * 10**6 and res["forecast"]["error_pct"] is None


def test_unwritable_output_fails_before_the_run(capsys):
    code, _, stderr = run_main(capsys, *TINY, "--steps", "1", "--output", "/sys/ljperf-result.json")
    assert code == 2
    assert "not writable" in stderr and len(stderr.strip().splitlines()) == 1


def test_full_disk_fails_before_the_run(tmp_path, capsys):
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=False).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        (mnt / "filler").write_bytes(b"\0" * 60_000)
        code, _, stderr = run_main(capsys, *TINY, "--steps", "1", "--output", str(mnt / "r.json"))
        assert code == 2
        assert "No space left" in stderr
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_killed_writer_never_leaves_half_a_file(tmp_path):
    target = tmp_path / "record.json"
    write_json(target, {"version": "old"})
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from ljperf.core.records import write_json; "
            "write_json(sys.argv[1], {'version': 'new', 'payload': list(range(8_000_000))})",
            str(target),
        ]
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".record.json.*")) and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert json.loads(target.read_text()) == {"version": "old"}


def test_written_files_get_the_mode_a_plain_open_gives(tmp_path):
    """Records on a shared cluster folder are readable by the team (mkstemp alone makes them 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    write_json(tmp_path / "r.json", {})
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o666 & ~mask


def test_records_are_strict_json_when_a_loss_diverges(tmp_path):
    """A nan or inf (a diverged loss) is written as null: Python wrote bare NaN, which strict parsers refuse."""
    write_json(tmp_path / "r.json", {"losses": [2.5, float("nan"), float("inf")], "nested": ({"x": -float("inf")},)})

    def refuse(name: str) -> None:
        raise ValueError(name)

    data = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert data == {"losses": [2.5, None, None], "nested": [{"x": None}]}


def test_secrets_never_reach_records_or_logs(tmp_path, monkeypatch, capfd):
    """In-process: the record and everything written to this process's stdout and stderr (file descriptors 1
    and 2, so C++ output too)."""
    secrets = {"HF_TOKEN": "hf_s3cr3tvalue", "AWS_SECRET_ACCESS_KEY": "aws-s3cr3t-key", "MY_TEAM_TOKEN": "tok-777"}
    out = tmp_path / "r.json"
    use_cli_env(monkeypatch, **secrets)
    code, stdout, stderr = run_main(capfd, *TINY, "--steps", "2", "--output", str(out))
    assert code == 0, stderr
    written = out.read_text() + stdout + stderr
    for name, value in secrets.items():
        assert value not in written and name not in written


@pytest.mark.slow
def test_a_killed_ablation_leaves_nothing_resume_mistakes_for_finished(tmp_path, monkeypatch, capsys):
    """The killed ablation is a process; the resume runs in this one (its benchmark run is a process)."""
    out = tmp_path / "abl"
    args = [*TINY, "--steps", "60", "--variants", "base", "--repeat", "1", "--out", str(out)]
    args[0] = "ablation"
    proc = start(args, tmp_path, LJPERF_FAULT="sleep,step=2,rank=0,seconds=3600")  # the run stalls mid-way
    deadline = time.monotonic() + 120
    while not (runs := [p for p in children(proc.pid) if "benchmark" in proc_text(p, "cmdline")]):
        assert time.monotonic() < deadline, "the benchmark run never started"
        time.sleep(0.2)
    time.sleep(2)
    proc.kill()  # SIGKILL: the runner gets no chance to clean up
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while any(alive(p) for p in runs):  # its benchmark child ends too (parent-death signal)
        assert time.monotonic() < deadline, "the benchmark child outlived the killed ablation"
        time.sleep(0.2)
    record = out / "runs" / "local" / "base.r1.json"
    assert not record.exists()
    use_cli_env(monkeypatch)
    code, stdout, stderr = run_main(capsys, *args)
    assert code == 0, stderr
    assert "[1/1] local/base.r1: ok" in stdout  # re-run, not skipped
    assert read_record(record)["results"]["status"] == "ok"


def test_no_remote_code_and_no_pickle_anywhere_in_ljperf():
    """Configs never run remote code; records and calibration files are JSON, never unpickled."""
    import ljperf

    root = Path(ljperf.__file__).parent
    sources = {p: p.read_text() for p in root.rglob("*.py")}
    for path, text in sources.items():
        assert "import pickle" not in text and "torch.load(" not in text, path
        assert "trust_remote_code=True" not in text, path
    assert "trust_remote_code=False" in sources[root / "models" / "spec.py"]


def test_auto_map_in_a_config_is_ignored(tmp_path):
    """A config that asks for remote code still builds the stock transformers class."""
    data = read_config_dict(name="llama-tiny")
    data["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel"}
    (tmp_path / "config.json").write_text(json.dumps(data))
    model = build_meta(resolve(path=tmp_path))
    assert type(model).__module__.startswith("transformers.models.llama")


def test_a_full_disk_during_profile_keeps_the_timed_results_and_lists_no_partial_trace(tmp_path, capsys):
    """The probe before the run passes (the folder has room for a small file); the trace of the profiled steps
    does not fit. The measured run stands (status ok, exit 0), the profile's failure is in the record, and no
    part of a trace is left in the folder or listed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], check=False).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = tmp_path / "r.json"
        code, _, stderr = run_main(capsys, *TINY, "--steps", "2", "--profile", str(mnt / "prof"), "--output", str(out))
        left = sorted(p.name for p in (mnt / "prof").iterdir())
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    res = read_record(out)["results"]
    assert code == 0 and res["status"] == "ok" and res["tokens_per_s"] > 0, (code, res["status"], stderr)
    assert res["profile"]["traces"] == [] and "No space left" in res["profile"]["error"]
    assert left == []
    assert res["breakdown"]["source"] == "timers"
    assert "the profile could not be written (No space left on device)" in stderr


def test_a_loss_that_becomes_nan_ends_the_run_as_diverged(tmp_path, capsys):
    """``rms_norm_eps: NaN`` makes every loss NaN: the run was exit 0 with ``status: ok`` and ``losses: [null,
    null]``, beside real runs in an ablation. It stops at the first such step, with its own status and code."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**read_config_dict(name="llama-tiny"), "rms_norm_eps": float("nan")}))
    out = tmp_path / "r.json"
    argv = ["benchmark", "--model-config", str(config), "--engine", "torch", "--seq-len", "32", "--steps", "3"]
    code, _, stderr = run_main(capsys, *argv, "--warmup", "1", "--output", str(out))
    res = read_record(out)["results"]
    assert code == EXIT_DIVERGED == 5 and res["status"] == "diverged", (code, res["status"], stderr[-500:])
    assert res["reason"] == "the loss became nan at step 1" and res["steps_completed"] == 0
    assert stderr.strip().splitlines()[-1] == f"ljperf benchmark: diverged: {res['reason']}; result record: {out}"


@pytest.mark.slow
def test_a_diverged_run_on_two_processes_keeps_its_status_and_exit_code(tmp_path):
    """DDP at a learning rate of 10^10: step 2's loss is NaN on both ranks; the launcher keeps the status, the
    code and the record (its table printed the NaN loss, a traceback before)."""
    out = tmp_path / "r.json"
    proc = run_ljperf(*TINY, "--nproc-per-node", "2", "--steps", "3", "--lr", "1e10", "--output", str(out))
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-2000:]
    res = read_record(out)["results"]
    assert res["status"] == "diverged" and res["reason"] == "the loss became nan at step 2"
    assert res["losses"] == [None] and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ljperf benchmark: diverged: the loss became nan at step 2")
    assert "not finite → not finite" in proc.stdout


@pytest.mark.slow
def test_faults_on_two_processes_during_profile_keep_the_record_and_leave_no_process(tmp_path):
    """Rank 1 dies in the first profiled step (its trace never written), then, in a second run, SIGTERM reaches
    the launcher while rank 0 stalls there: each keeps the timed steps' record, lists no trace and leaves no
    process behind. (``--steps 2 --warmup 1`` profile from step 4: the untimed memory step is 3.)"""
    for fault, sig, code in (("exit,step=4,rank=1", None, 1), ("sleep,step=4,rank=0", signal.SIGTERM, 143)):
        out, prof = tmp_path / f"{code}.json", tmp_path / f"prof{code}"
        args = [*TINY, "--nproc-per-node", "2", "--steps", "2", "--profile", str(prof), "--output", str(out)]
        proc = start(args, tmp_path, LJPERF_FAULT=fault)
        wait_for_steps(tmp_path, 4)
        workers = children(proc.pid)
        if sig is not None:
            os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == code, stderr[-2000:]
        res = read_record(out)["results"]
        assert res["status"] == "error" and res["steps_completed"] == 2, res
        assert ("rank 1 exited with code 1" if sig is None else "interrupted by SIGTERM") in res["reason"]
        assert res["profile"]["traces"] == [] and list(prof.iterdir()) == []
        time.sleep(1)
        assert not [p for p in workers if alive(p)], "orphan processes"


@pytest.mark.slow
def test_faults_on_two_processes_during_an_ablation_keep_the_records_and_leave_no_process(tmp_path):
    """A rank of an ablation's 2-process run dies: that run's record names it and the ablation ends 1. Then
    SIGTERM to an ablation whose 2-process run is in its steps: exit 143, no pending record, nothing left."""
    out = tmp_path / "abl"
    args = ["ablation", *TINY[1:], "--steps", "2", "--nproc-per-node", "2", "--variants", "base", "--repeat", "1"]
    killed = run_ljperf(*args, "--out", str(out), env=cli_env(LJPERF_FAULT="exit,step=2,rank=1"))
    assert killed.returncode == 1 and "1 of 1 runs failed" in killed.stderr, killed.stderr[-2000:]
    res = read_record(out / "runs" / "local" / "base.r1.json")["results"]
    assert res["status"] == "error" and res["reason"].startswith("rank 1 exited with code 1")
    proc = start([*args, "--out", str(tmp_path / "abl2")], tmp_path, LJPERF_FAULT="sleep,step=3,rank=0")
    wait_for_steps(tmp_path, 3)
    workers = children(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and stderr.strip().splitlines()[-1] == "ljperf ablation: interrupted by SIGTERM"
    assert list((tmp_path / "abl2" / "runs" / "local").glob("*.json")) == []  # no pending run counted finished
    time.sleep(1)
    assert not [p for p in workers if alive(p)], "orphan processes"


@pytest.mark.slow
def test_faults_on_two_processes_of_comm_keep_the_sizes_measured_and_name_the_cause(tmp_path):
    """SIGTERM to the launcher, then a rank killed: one line each (rank 0 and the launcher both said it), the
    record keeps the sizes measured before and says what the launcher found (the killed rank, not rank 0's lost
    peer); no process is left."""
    # all_reduce's table prints once its sizes are measured; the fault comes while all_gather's are
    sizes = ["--device", "cpu", "--ops", "all_reduce,all_gather", "--min-bytes", "1K", "--max-bytes", "256M"]
    for fault in ("sigterm", "kill rank 1"):
        out = tmp_path / f"{fault.split()[0]}.json"
        proc = start(["comm", "--nproc-per-node", "2", *sizes, "--iters", "2", "--output", str(out)], tmp_path)
        stdout = Lines(proc.stdout)
        stdout.wait_for("avg bus bandwidth", timeout=240)
        victim, workers = rank_pid(proc.pid, 1), children(proc.pid)
        assert victim is not None
        os.kill(*((proc.pid, signal.SIGTERM) if fault == "sigterm" else (victim, signal.SIGKILL)))
        stderr = proc.stderr.read()
        proc.wait(timeout=120)
        lines = [line for line in stderr.strip().splitlines() if line.startswith("ljperf comm:")]
        res = read_record(out)["results"]
        assert res["status"] == "error" and len(res["rows"]) >= 1, res
        if fault == "sigterm":
            assert proc.returncode == 143 and lines == [
                f"ljperf comm: interrupted by SIGTERM; partial result kept: {out}"
            ]
        else:
            assert proc.returncode == 1 and len(lines) == 1 and "rank 1 was killed by SIGKILL" in lines[0], lines
            assert res["reason"].startswith("rank 1 was killed by SIGKILL")
        time.sleep(1)
        assert not [p for p in workers if alive(p)], "orphan processes"


# --- a launcher killed with SIGKILL ----------------------------------------------------------------------------


def direct_children(pid: int) -> list[int]:
    """The processes ``pid`` started itself (its ranks), from each of its threads' ``/proc`` children list."""
    tasks = os.listdir(f"/proc/{pid}/task")
    return [int(c) for task in tasks for c in open(f"/proc/{pid}/task/{task}/children").read().split()]


@pytest.mark.slow
def test_ranks_end_with_a_killed_launcher_and_leave_nothing_behind(tmp_path):
    """``kill -9`` of the launcher: both ranks trained on and wrote ``status: "ok"`` 40 s after it had exited 137,
    and ``ljperf-run-*`` (and every run's ``torchelastic_*``) stayed in $TMPDIR. Now the ranks get SIGTERM when
    it dies, keep what they measured in the record, and remove the run folder."""
    out = tmp_path / "r.json"
    argv = ["benchmark", "--model", "torch/llama-tiny", "--seq-len", "64", "--steps", "1000", "--nproc-per-node", "2"]
    env = cli_env(TMPDIR=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-m", "ljperf", *argv, "--output", str(out)], env=env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while len(ranks := direct_children(launcher.pid)) < 2 or not list(tmp_path.glob("ljperf-run-*/progress.jsonl")):
        assert time.monotonic() < deadline and launcher.poll() is None, "the run did not start"
        time.sleep(0.5)
    time.sleep(2)  # a few steps
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 60
    while any(alive(r) for r in ranks):
        assert time.monotonic() < deadline, "ranks outlived their launcher"
        time.sleep(0.5)
    results = json.loads(out.read_text())["results"]
    assert results["status"] == "error" and results["reason"] == "interrupted by SIGTERM", results["reason"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("ljperf-", "torchelastic_"))) == []
