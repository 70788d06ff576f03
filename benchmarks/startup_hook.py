"""What the startup hook costs every Python process: ``python -c pass`` with and without its variable, side by side.

Run: ``.venv/bin/python benchmarks/startup_hook.py [--repeat 40]`` (in the venv where ljperf is installed, so its
``ljperf_startup.pth`` is in site-packages). The runs alternate (plain, set, plain, set, …) so machine drift hits
both alike; prints the median and fastest wall time of each and what the variable adds (target ≤ 3 ms), and the
modules a process with the variable set loads beyond a plain one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

VARIABLE = "COMPILE_OPTIMIZATION"


def started(env: dict[str, str]) -> float:
    """Seconds of one ``python -c pass``, from the parent's side."""
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - begin


def modules(env: dict[str, str]) -> set[str]:
    code = "import sys; print(' '.join(sys.modules))"
    return set(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
               .stdout.split())  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=40, help="runs of each (default: 40)")
    args = parser.parse_args()
    plain = {k: v for k, v in os.environ.items() if k not in ("CHECKPOINT_OPTIMIZATION", VARIABLE)}
    hooked = {**plain, VARIABLE: "true"}
    times: dict[str, list[float]] = {"plain": [], "set": []}
    started(plain)  # the file cache warm for both
    for _ in range(args.repeat):
        times["plain"].append(started(plain))
        times["set"].append(started(hooked))
    print(f"python -c pass, {args.repeat} runs each, alternating ({sys.executable})")
    print(f"{'':>22} {'median ms':>10} {'fastest ms':>11}")
    for name, values in times.items():
        label = "plain" if name == "plain" else f"{VARIABLE}=true"
        print(f"{label:>22} {1e3 * statistics.median(values):10.1f} {1e3 * min(values):11.1f}")
    added = statistics.median(times["set"]) - statistics.median(times["plain"])
    print(f"{'added by the variable':>22} {1e3 * added:10.1f} {1e3 * (min(times['set']) - min(times['plain'])):11.1f}")
    print("modules loaded beyond a plain process:", " ".join(sorted(modules(hooked) - modules(plain))))


if __name__ == "__main__":
    main()
