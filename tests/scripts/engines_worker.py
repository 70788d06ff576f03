"""Several ``ljperf benchmark`` runs in one torchrun launch (one process start and import for all engines).

Run: ``torchrun --nproc-per-node 2 tests/scripts/engines_worker.py OUT_DIR NAME=ARGS...``, e.g.
``ddp="--model torch/llama-tiny --seq-len 32"``; each run writes ``OUT_DIR/NAME.json`` through the real CLI
path (parse, ``config_from_args``, ``run_worker``). The process group is kept between runs and left at the end.
``python tests/scripts/engines_worker.py ...`` (no torchrun) runs one-process runs the same way. Rank 0 prints
``MARK + NAME`` before each run, so a test can tell each run's output (its table) from the others'. Each
run starts from an empty dynamo cache, so a compiled run compiles (and counts recompiles) as in a process of
its own, also after another compiled run.
"""

from __future__ import annotations

import gc
import os
import shlex
import sys
from pathlib import Path

import torch._dynamo

from ljperf.benchmark import loop as benchmark
from ljperf.benchmark.config import config_from_args
from ljperf.benchmark.loop import run_worker
from ljperf.cli import build_parser

MARK = "[engines_worker] run "


def main() -> int:
    out = Path(sys.argv[1])
    shutdown = benchmark.shutdown_process
    benchmark.shutdown_process = lambda: None  # the next run reuses the group
    for spec in sys.argv[2:]:
        name, _, args = spec.partition("=")
        if os.environ.get("RANK", "0") == "0":
            print(f"{MARK}{name}", flush=True)
        argv = ["benchmark", *shlex.split(args), "--output", str(out / f"{name}.json")]
        args_ns = build_parser("benchmark").parse_args(argv)
        torch._dynamo.reset()
        code = run_worker(config_from_args(args_ns, argv))
        if code:
            return code
    # Left to interpreter exit, the group's destructor can meet a live gloo thread: std::terminate, SIGABRT
    # ("terminate called without an active exception" failed CI once, after every run had passed).
    shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    gc.freeze()  # as ljperf does: the interpreter's exit would collect over every object torch made
    sys.exit(code)
