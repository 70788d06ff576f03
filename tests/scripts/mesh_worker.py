"""Device-mesh runs in one torchrun launch: one step's gradients of each mesh against one model's on the whole
global batch, then every run benchmarked through the real CLI path (``engines_worker.py``).

Run: ``torchrun --nproc-per-node 4 tests/scripts/mesh_worker.py OUT_DIR NAME=ARGS...``, e.g.
``tp2-fsdp2="--model fsdp/llama-tiny --tp 2 --micro-batch 4 --seq-len 32"``. Each fsdp run's gradients of its
first step, gathered whole, are compared with those of the torch engine's model on the global batch that step's
ranks share (the mean loss over every sequence, which data parallelism averages): rank 0 writes the worst
relative difference per parameter to ``OUT_DIR/NAME.grads.json``; each run's record is ``OUT_DIR/NAME.json``.
"""

from __future__ import annotations

import gc
import json
import shlex
import sys
from pathlib import Path

import engines_worker
import torch
from torch.distributed.tensor import DTensor

from ljperf.benchmark.config import config_from_args
from ljperf.benchmark.data import SyntheticTokens
from ljperf.cli import build_parser
from ljperf.engines import make_engine
from ljperf.models.build import materialize
from ljperf.models.spec import build_meta
from ljperf.models.step import accumulate
from ljperf.run.context import init_process, unjoined


def gradient_error(args: str) -> dict[str, float]:
    """{parameter: max |mesh − reference| / max |reference|} after one step's forward and backward."""
    argv = ["benchmark", *shlex.split(args)]
    cfg = config_from_args(build_parser("benchmark").parse_args(argv), argv)
    run = init_process(unjoined(cfg), need_group=True)
    train, shape = cfg.train, run.mesh
    data = SyntheticTokens(
        vocab=cfg.model.vocab, seq_len=train.seq_len, micro_batch=train.micro_batch * shape.dp, grad_accum=1,
        world=1, seed=train.seed,
    )  # fmt: skip
    (whole,) = data.micro_batches(0, 0, torch.device("cpu"))
    engine = make_engine(run)
    engine.setup(build_meta(cfg.model, attn_implementation=train.attn_implementation))
    rows = slice(run.dp_rank * train.micro_batch, (run.dp_rank + 1) * train.micro_batch)
    with engine.loss_context():
        accumulate(engine.model, [whole[rows]], autocast=run.autocast)
    reference = materialize(
        build_meta(cfg.model, attn_implementation=train.attn_implementation),
        device=torch.device("cpu"),
        seed=train.seed,
    )
    accumulate(reference, [whole], autocast=run.autocast)
    expected = dict(reference.named_parameters())
    worst = {}
    for name, param in engine.model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        want = expected[name].grad
        worst[name] = float((grad - want).abs().max() / want.abs().max())
    return worst


def main() -> int:
    out = Path(sys.argv[1])
    for spec in sys.argv[2:]:
        name, _, args = spec.partition("=")
        if "fsdp/" in args:
            worst = gradient_error(args)
            if torch.distributed.get_rank() == 0:
                (out / f"{name}.grads.json").write_text(json.dumps(worst))
    return engines_worker.main()


if __name__ == "__main__":
    code = main()
    gc.freeze()  # as ljperf does: the interpreter's exit would collect over every object torch made
    sys.exit(code)
