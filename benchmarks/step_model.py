"""The step-time model against measured CPU steps: calibrate on half of a grid of recipes, predict the other half.

Run: ``.venv/bin/python benchmarks/step_model.py [--repeats 2] [--records DIR] [--markdown FILE] [--measured]``
(about a minute a benchmark process on the shared 2-core machine: one repeat took an hour at a load of 5-14).
The grid: engines torch (one process), DDP, FSDP2 (one and two processes), ZeRO-1/2/3 (two processes) × two
architectures (llama-tiny, qwen-tiny) × two shapes × recompute none/full, each recipe one ``ljperf benchmark``
process (fp32, ``--threads 1``, ``OMP_NUM_THREADS=1``), the recipes shuffled anew in each repeat so machine drift
hits them alike. A run's measured step is the median of its timed steps in device seconds (a process's CPU time per
thread: on the shared machine the wall time holds the waits for a core, see ``speed.calibrate.device_seconds``); a
recipe's, the median over its repeats. Every other recipe of each engine (in a fixed order) calibrates (``ljperf
plan --calibrate`` on its records, into a fresh cache), the rest is predicted as ``ljperf plan`` predicts (its
``speed_for``); the table shows both, the footer the held-out median and worst |error| and the Spearman rank
correlation of predicted and measured step times. ``--records DIR`` keeps the records (a rerun measures only the
recipes missing there; ``--measured`` measures none). Each record's ``results.speed`` is derived again by the
current model before the fit (copies in ``DIR/repriced``), so a change to the model is checked against the steps
already measured.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "torch": ("torch", 1, ()),
    "ddp": ("torch", 2, ()),
    "fsdp-1": ("fsdp", 1, ()),
    "fsdp-2": ("fsdp", 2, ()),
    "zero1": ("deepspeed", 2, ("--zero-stage", "1")),
    "zero2": ("deepspeed", 2, ("--zero-stage", "2")),
    "zero3": ("deepspeed", 2, ("--zero-stage", "3")),
}
"""Name: (the model's engine prefix, processes, extra flags)."""
MODELS = ("llama-tiny", "qwen-tiny")
SHAPES = ((2, 256), (4, 512))
RECOMPUTE = ("none", "full")


@dataclass(frozen=True)
class Recipe:
    engine: str
    model: str
    micro_batch: int
    seq_len: int
    recompute: str

    @property
    def name(self) -> str:
        return f"{self.engine} {self.model} {self.micro_batch}x{self.seq_len} {self.recompute}"

    def file(self, repeat: int) -> str:
        return f"{self.name.replace(' ', '_')}_r{repeat}.json"


def grid() -> list[Recipe]:
    return [
        Recipe(engine, model, micro_batch, seq_len, mode)
        for engine, model, (micro_batch, seq_len), mode in itertools.product(ENGINES, MODELS, SHAPES, RECOMPUTE)
    ]


def run(recipe: Recipe, out: Path, *, steps: int, env: dict[str, str]) -> str | None:
    """One benchmark process; None, or why it failed."""
    prefix, processes, extra = ENGINES[recipe.engine]
    cmd = [
        sys.executable, "-m", "ljperf", "benchmark", "--model", f"{prefix}/{recipe.model}", "--device", "cpu",
        "--precision", "fp32", "--threads", "1", "--micro-batch", str(recipe.micro_batch), "--seq-len",
        str(recipe.seq_len), "--steps", str(steps), "--warmup", "2", "--recompute", recipe.recompute,
        "--nproc-per-node", str(processes), *extra, "--output", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:200]}"
    return None


def measure(recipes: list[Recipe], records: Path, *, repeats: int, steps: int, env: dict[str, str]) -> None:
    for repeat in range(repeats):
        order = list(recipes)
        random.Random(repeat).shuffle(order)
        for i, recipe in enumerate(order):
            out = records / recipe.file(repeat)
            if out.exists():
                continue
            why = run(recipe, out, steps=steps, env=env)
            print(f"[repeat {repeat + 1}/{repeats}, {i + 1}/{len(order)}] {recipe.name}: {why or 'ok'}", flush=True)


def split(recipes: list[Recipe]) -> tuple[list[Recipe], list[Recipe]]:
    """Every other recipe of each engine calibrates (a fixed order that alternates shape and recompute), the rest
    is held out."""
    calibrate, held_out = [], []
    for engine in ENGINES:
        mine = sorted((r for r in recipes if r.engine == engine), key=lambda r: (r.model, r.seq_len, r.recompute))
        for i, r in enumerate(mine):
            (calibrate if (i + i // 2) % 2 == 0 else held_out).append(r)
    return calibrate, held_out


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    return statistics.correlation(ranks(xs), ranks(ys))


def measured_steps(recipe: Recipe, records: Path, repeats: int) -> tuple[float, float] | None:
    """(measured, uncalibrated prediction): medians over the recipe's good runs; None without one."""
    import json

    runs = [json.loads(p.read_text()) for i in range(repeats) if (p := records / recipe.file(i)).exists()]
    ok = [r["results"] for r in runs if r["results"]["status"] == "ok" and r["results"].get("speed")]
    if not ok:
        return None
    from ljperf.speed.calibrate import device_seconds

    measured = statistics.median(device_seconds(r, threads=1) for r in ok)
    return measured, statistics.median(r["speed"]["predicted_step_time_s"] for r in ok)


def planned(recipe: Recipe) -> tuple[Any, Any]:
    """(spec, the forecast's ``Recipe``) of ``recipe``: what ``ljperf plan`` and the benchmark price."""
    from ljperf.forecast.recipe import Recipe as Planned
    from ljperf.models.spec import resolve

    prefix, processes, extra = ENGINES[recipe.engine]
    spec = resolve(name=recipe.model)
    return spec, Planned(
        engine=prefix,
        zero_stage=int(extra[1]) if extra else 3,
        world=processes,
        device="cpu",
        precision="fp32",
        micro_batch=recipe.micro_batch,
        seq_len=recipe.seq_len,
        attn_implementation=spec.attention(None),
        recompute=(recipe.recompute,) * spec.layers,
    )


def predicted(recipe: Recipe) -> float:
    """The step time ``ljperf plan`` predicts for ``recipe`` with the saved calibration (its ``speed_for``)."""
    from ljperf.speed.api import speed_for
    from ljperf.speed.rates import Cluster

    spec, plan = planned(recipe)
    speed = speed_for(spec, plan, device_name="cpu", cluster=Cluster(), threads=1)
    assert speed is not None
    return speed.step_time_s


def reprice(recipes: list[Recipe], records: Path, repeats: int) -> Path:
    """Copies of the records whose ``results.speed`` the current model derives again from their measured steps
    (``speed.api.benchmark_speed``, uncalibrated), in ``records/repriced``: a change to the model is checked
    against the steps already measured, without measuring them again."""
    import json

    from ljperf.speed.api import benchmark_speed

    out = records / "repriced"
    out.mkdir(exist_ok=True)
    for recipe in recipes:
        spec, plan = planned(recipe)
        for i in range(repeats):
            if not (path := records / recipe.file(i)).exists():
                continue
            record = json.loads(path.read_text())
            results = record["results"]
            if results["status"] == "ok" and results.get("speed"):
                results["speed"] = benchmark_speed(spec, plan, device_name="cpu", threads=1, results=results)
            (out / recipe.file(i)).write_text(json.dumps(record))
    return out


def report(recipes: list[Recipe], records: Path, halves: tuple[list[Recipe], list[Recipe]], *, repeats: int,
           env: dict[str, str]) -> str:  # fmt: skip
    from ljperf.core.records import versions

    calibrate, held_out = halves
    (Path(env["LJPERF_CACHE_DIR"]) / "speed-calibration.json").unlink(missing_ok=True)
    records = reprice(recipes, records, repeats)
    found = {r: m for r in recipes if (m := measured_steps(r, records, repeats)) is not None}
    files = [str(p) for r in calibrate if r in found for i in range(repeats) if (p := records / r.file(i)).exists()]
    fitted = subprocess.run([sys.executable, "-m", "ljperf", "plan", "--calibrate", *files], env=env, check=True,
                            capture_output=True, text=True).stdout  # fmt: skip
    rows = [
        "| recipe | set | measured s | uncalibrated s | error | calibrated s | error |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    errors, pairs = [], []
    for r in recipes:
        if r not in found:
            rows.append(f"| {r.name} | - | failed | | | | |")
            continue
        measured, uncalibrated = found[r]
        guess = predicted(r)
        error = 100 * (guess - measured) / measured
        held = r in held_out
        if held:
            errors.append(abs(error))
            pairs.append((guess, measured))
        rows.append(
            f"| {r.name} | {'held out' if held else 'calibrates'} | {measured:.4f} | {uncalibrated:.4f} |"
            f" {100 * (uncalibrated - measured) / measured:+.1f}% | {guess:.4f} | {error:+.1f}% |"
        )
    rho = spearman([p for p, _ in pairs], [m for _, m in pairs]) if len(pairs) > 2 else float("nan")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    summary = (
        f"held out: {len(errors)} recipes; median |error| {statistics.median(errors):.1f}%, worst {max(errors):.1f}%;"
        f" Spearman rank correlation {rho:.3f} (targets: median ≤ 5%, worst ≤ 15%, Spearman ≥ 0.9)"
    )
    head = [
        "# Step-time model vs measured CPU steps",
        "",
        f"commit {commit}; {versions()}; {repeats} repeats, --threads 1, fp32, CPU: 2 shared cores",
        "",
        "Calibration (`ljperf plan --calibrate` on the calibrating half):",
        "",
        *[f"    {line}" for line in fitted.strip().splitlines()],
        "",
    ]
    return "\n".join([*head, *rows, "", summary, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--records", type=Path, default=None, help="keep the records here (default: a temporary folder)"
    )
    parser.add_argument("--only", default=None, help="only the recipes whose name holds this (a quick look)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table and summary here")
    parser.add_argument(
        "--measured", action="store_true", help="measure nothing: report on the records already in --records"
    )
    args = parser.parse_args()
    records = args.records or Path(tempfile.mkdtemp(prefix="step-model-"))
    records.mkdir(parents=True, exist_ok=True)
    cache = records / "cache"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LJPERF_CACHE_DIR": str(cache)}
    os.environ.update(env)
    recipes = [r for r in grid() if args.only is None or args.only in r.name]
    if not args.measured:
        measure(recipes, records, repeats=args.repeats, steps=args.steps, env=env)
    text = report(recipes, records, split(recipes), repeats=args.repeats, env=env)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
