"""ljperf against its peers on one model, shape, precision and device: the HF Trainer, torchtitan, ljperf.

Run: ``.venv/bin/python benchmarks/peers.py --tiny --device cpu --out /tmp/peers`` (the test's smallest mode:
seven processes and two compiles, about a minute and a half on 2 cores);
GPU: ``python benchmarks/peers.py --device cuda --model llama3.2-1b --micro-batch 4 --seq-len 2048
--out benchmarks/results/peers_llama3.2-1b_h200_<date>`` (bf16-mixed is the GPU default).

Each peer is its own process, with the same global batch, sequence length, precision, seed and CPU threads:
the HF Trainer eager and with ``torch_compile=True`` (``benchmarks/peers_trainer.py``), torchtitan's Llama 3 eager
and compiled where it can be imported (``benchmarks/peers_titan.py``; else one line says why it is skipped), and
ljperf eager, ``--compile`` and ``--compile --recompute auto`` (``ljperf benchmark``). Each reports the median of its
steady step times (between device synchronisations, after ``--warmup`` steps), its peak allocated memory and final
loss; tokens/s and MFU come from that step time through ljperf's one formula (``ljperf.benchmark.metrics``, FLOPs
per token from the catalog model; MFU only on a GPU of known peak under bf16), and the ratio is to the Trainer's
eager tokens/s. The peers start from the same initial weights and train on the same tokens at the same learning
rate; the Trainer runs its own defaults otherwise (AdamW's β₂, weight decay, LR schedule, gradient clipping), so
its losses differ from ljperf's by those: the table's footer lists them side by side. An ljperf row under
``--recompute auto`` names the plan it chose (no layer recomputed where the budget holds the whole run).
``--out DIR`` gets ``peers.md`` and ``peers.json``, written again after every peer; a peer that fails is a row
with its error (its output's tail goes to stderr) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ljperf.benchmark.metrics import throughput
from ljperf.core import hardware
from ljperf.core.records import installed_versions, read_json, record_header, write_atomic, write_json
from ljperf.core.units import format_bytes
from ljperf.models.spec import resolve

HERE = Path(__file__).resolve().parent
PEERS = (
    "trainer",
    "trainer-compile",
    "torchtitan",
    "torchtitan-compile",
    "ljperf",
    "ljperf-compile",
    "ljperf-compile-recompute",
)
BASELINE = "trainer"
LJPERF_OPTIMIZER = {"optim": "adamw (betas 0.9, 0.95)", "lr_scheduler": "constant", "max_grad_norm": None,
                    "weight_decay": 0.1}  # fmt: skip
"""ljperf's AdamW as ``engines.common.adamw`` makes it, for the footer beside the Trainer's own settings."""
TINY = {"model": "llama-tiny", "micro_batch": 1, "seq_len": 64, "steps": 2, "warmup": 2}
DEFAULTS = {"model": "llama-tiny", "micro_batch": 2, "seq_len": 256, "steps": 10, "warmup": 3}


def command(peer: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The peer's command line; it writes its figures to ``out``."""
    shape = ["--device", args.device, "--precision", args.precision, "--micro-batch", str(args.micro_batch),
             "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--seed", str(args.seed)]  # fmt: skip
    compiled = ["--compile"] if "-compile" in peer else []
    if peer.startswith("ljperf"):
        recompute = ["--recompute", "auto"] if peer.endswith("-recompute") else []
        return [sys.executable, "-m", "ljperf", "benchmark", "--model", f"torch/{args.model}", *shape,
                "--threads", str(args.threads), *compiled, *recompute, "--output", str(out)]  # fmt: skip
    script = "peers_trainer.py" if peer.startswith("trainer") else "peers_titan.py"
    return [sys.executable, str(HERE / script), "--model", args.model, *shape, *compiled, "--out", str(out)]


def runner_main(
    doc: str, train: Callable[[argparse.Namespace], dict], *, devices: tuple[str, ...], compiled: str
) -> None:
    """A peer runner's command line (the flags ``command`` gives it): parse them, train, write its figures."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", required=True, help="catalog name, e.g. llama3.2-1b")
    parser.add_argument("--device", choices=devices, default=devices[-1])
    parser.add_argument("--precision", choices=("fp32", "bf16-mixed"), default="bf16-mixed")
    for flag in ("--micro-batch", "--seq-len", "--steps"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help=compiled)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args()
    write_json(args.out, train(args))


def unavailable(peer: str) -> str | None:
    """Why the peer cannot run here, or None."""
    if peer.startswith("torchtitan") and importlib.util.find_spec("torchtitan") is None:
        return "skipped: torchtitan is not importable here (pip install torchtitan; gpu_wheels.sh carries its wheel)"
    return None


def run_peer(peer: str, args: argparse.Namespace, workdir: Path) -> dict:
    """The peer's figures (step_s, peak_bytes, final_loss, device), or its error."""
    out = workdir / f"{peer}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    try:
        proc = subprocess.run(
            command(peer, args, out), env=env, capture_output=True, text=True, timeout=args.timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    if proc.returncode != 0 or not out.exists():
        print(f"{peer} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        last = (proc.stderr.strip().splitlines() or [""])[-1][:300]
        return {"error": f"exit {proc.returncode}: {last}"}
    got = read_json(out)
    if "results" not in got:  # the Trainer's and torchtitan's runners write the figures themselves
        return got
    res = got["results"]  # an ljperf benchmark record
    if res["status"] != "ok":
        return {"error": f"{res['status']}: {res['reason']}"}
    row = {
        "step_s": res["step_time_s_p50"],
        "peak_bytes": res["peak_allocated_bytes"],
        "final_loss": res["losses"][-1],
        "device": got["env"]["devices"][0],
        "step_times_s": res["step_times_s"],
        "settings": LJPERF_OPTIMIZER,
    }
    if recompute := res.get("recompute"):
        row["note"] = f"recompute auto: {recompute['summary']} (budget {format_bytes(recompute['budget_bytes'])})"
    return row


def figures(peer: str, got: dict, args: argparse.Namespace, flops_per_token: float) -> dict:
    """The row of one peer: tokens/s and MFU from its step time by ljperf's formula (the same for every peer)."""
    row = {"peer": peer, **got}
    if "step_s" not in got:
        return row
    peak = hardware.peak_tflops(got["device"]) if args.device == "cuda" and args.precision != "fp32" else None
    made = throughput(
        [got["step_s"]],
        tokens_per_step=args.micro_batch * args.seq_len,
        world=1,
        flops_per_token=flops_per_token,
        peak_tflops=peak,
    )
    return row | {"tokens_per_s": made.tokens_per_s, "tflops": made.tflops_per_device, "mfu": made.mfu}


def table(rows: list[dict], header: str) -> str:
    """The markdown table: units row, one row per peer, ratios to the Trainer's eager tokens/s."""
    base = next((r.get("tokens_per_s") for r in rows if r["peer"] == BASELINE), None)
    lines = [
        header,
        "",
        "| peer | step time p50 | tokens/s | × Trainer eager | TFLOPS | MFU | peak allocated | final loss | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        "| | ms | tokens/s | × | TFLOPS | % | | nats | |",
    ]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['peer']} | {r.get('error') or r.get('skipped')} | | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}" if r["mfu"] is not None else "-"
        loss = f"{r['final_loss']:.4f}" if r.get("final_loss") is not None else "-"
        lines.append(
            f"| {r['peer']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {ratio} | {r['tflops']:.2f} "
            f"| {mfu} | {format_bytes(r['peak_bytes'])} | {loss} | {r.get('note', '')} |"
        )
    return "\n".join([*lines, "", *settings_footer(rows)])


def settings_footer(rows: list[dict]) -> list[str]:
    """The optimizer settings each kind of peer trained with: why the final losses differ (same weights and data)."""
    seen: dict[str, dict] = {}
    for r in rows:
        if r.get("settings"):
            seen.setdefault(r["peer"].split("-")[0], r["settings"])
    keys = ("optim", "lr_scheduler", "max_grad_norm", "weight_decay")
    return [
        f"{peer}: " + ", ".join(f"{k} {settings.get(k)}" for k in keys if k in settings)
        for peer, settings in seen.items()
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"catalog name (default: {DEFAULTS['model']})")
    parser.add_argument("--micro-batch", type=int, help=f"sequences per step (default: {DEFAULTS['micro_batch']})")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence (default: {DEFAULTS['seq_len']})")
    parser.add_argument("--steps", type=int, help=f"timed steps (default: {DEFAULTS['steps']})")
    parser.add_argument("--warmup", type=int, help=f"untimed steps first (default: {DEFAULTS['warmup']})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--precision", choices=("fp32", "bf16-mixed"), help="default: bf16-mixed on cuda, fp32 on cpu")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--seed", type=int, default=0, help="weights and tokens, every peer")
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))),
        help="CPU threads of every peer (default: $OMP_NUM_THREADS, else all cores)",
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds one peer may take")
    parser.add_argument("--tiny", action="store_true", help=f"the smallest run, for the test: {TINY}")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for peers.md and peers.json")
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.precision = args.precision or ("bf16-mixed" if args.device == "cuda" else "fp32")
    args.peers = [p for p in args.peers.split(",") if p]
    if unknown := [p for p in args.peers if p not in PEERS]:
        parser.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = resolve(name=args.model)
    flops_per_token = spec.flops_per_token(args.seq_len)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = record_header("peers", args=sys.argv[1:] if argv is None else argv, devices=[args.device], world_size=1)
    record["env"]["versions"] |= installed_versions(("torchtitan",))
    record["config"] = {k: v for k, v in vars(args).items() if k not in ("out", "tiny", "timeout")} | {
        "flops_per_token": flops_per_token,
        "tokens_per_step": args.micro_batch * args.seq_len,
    }
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ljperf-peers-") as tmp:
        for peer in args.peers:
            if reason := unavailable(peer):
                print(f"{peer}: {reason}", file=sys.stderr)
                rows.append({"peer": peer, "skipped": reason})
            else:
                print(f"{peer}: {' '.join(command(peer, args, Path(tmp) / f'{peer}.json')[1:])}", file=sys.stderr)
                rows.append(figures(peer, run_peer(peer, args, Path(tmp)), args, flops_per_token))
            text = table(rows, header(record, rows, args))
            write_atomic(out / "peers.md", lambda f, text=text: f.write((text + "\n").encode()))
            write_json(out / "peers.json", record | {"rows": rows})
    print(text)
    return 1 if any("error" in r for r in rows) else 0


def header(record: dict, rows: list[dict], args: argparse.Namespace) -> str:
    """The table's title: model, device, shape, precision, steps, versions and revision."""
    device = next((r["device"] for r in rows if r.get("device")), args.device)
    ver = record["env"]["versions"]
    packages = ", ".join(f"{k} {ver.get(k) or 'not installed'}" for k in ("torch", "transformers", "torchtitan"))
    return (
        f"## Peers: {args.model} · {device} · mb {args.micro_batch} × seq {args.seq_len} · {args.precision} · "
        f"{args.steps} timed steps after {args.warmup} · seed {args.seed} · {args.threads} CPU thread(s)\n\n"
        f"{packages}, ljperf {ver.get('ljperf')} at {record['env'].get('git_revision') or 'unknown revision'}; "
        f"{record['start_time']}; tokens/s and MFU from the median step time, "
        f"{record['config']['flops_per_token']:.4g} FLOPs per token"
    )


if __name__ == "__main__":
    sys.exit(main())
