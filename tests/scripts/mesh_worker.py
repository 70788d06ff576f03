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
from ljperf.engines.pipeline import stage_indices
from ljperf.models.build import materialize
from ljperf.models.spec import build_meta
from ljperf.models.step import accumulate
from ljperf.run.context import init_process, unjoined


def gradient_error(args: str) -> dict[str, float]:
    """{parameter: max |mesh − reference| / max |reference|} after one step's forward and backward."""
    argv = ["benchmark", *shlex.split(args)]
    cfg = config_from_args(build_parser("benchmark").parse_args(argv), argv)
    run = init_process(unjoined(cfg), need_group=True)
    if run.mesh.pp > 1:
        return pipeline_gradient_error(cfg, run)
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
    return _worst(engine.model.named_parameters(), reference)


def _worst(named, reference: torch.nn.Module) -> dict[str, float]:
    expected = dict(reference.named_parameters())
    worst = {}
    for name, param in named:
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        want = expected[name].grad
        worst[name] = float((grad - want).abs().max() / want.abs().max())
    return worst


def pipeline_gradient_error(cfg, run) -> dict[str, float]:
    """``--pp``: each stage's gradients after one pipelined step (this data-parallel rank's micro-batches) against
    the same layers' of one model on every rank's micro-batches; every pipeline rank's, gathered on each."""
    train, shape = cfg.train, run.mesh
    data = SyntheticTokens(
        vocab=cfg.model.vocab, seq_len=train.seq_len, micro_batch=train.micro_batch, grad_accum=train.grad_accum,
        world=shape.dp, seed=train.seed,
    )  # fmt: skip
    engine = make_engine(run)
    engine.setup(build_meta(cfg.model, attn_implementation=train.attn_implementation))
    with engine.loss_context(), run.autocast():
        engine.pipeline.step(data.micro_batches(0, run.dp_rank, torch.device("cpu")))
    reference = materialize(
        build_meta(cfg.model, attn_implementation=train.attn_implementation),
        device=torch.device("cpu"),
        seed=train.seed,
    )
    every = [mb for rank in range(shape.dp) for mb in data.micro_batches(0, rank, torch.device("cpu"))]
    accumulate(reference, [torch.cat(every)], autocast=run.autocast)
    starts = [sum(engine.split[:i]) for i in range(len(engine.split))]
    named = []
    for stage, module in zip(stage_indices(run), engine.model, strict=True):
        for name, param in module.named_parameters():
            # the stage's own names (``model.model.layers.0...``) as the whole model's
            parts = name.removeprefix("model.").split(".")
            if parts[:2] == ["model", "layers"]:
                parts[2] = str(int(parts[2]) + starts[stage])
            named.append((".".join(parts), param))
    mine = _worst(named, reference)
    gathered: list[dict[str, float] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return {k: max(g[k] for g in gathered if g and k in g) for g in gathered if g for k in g}


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
