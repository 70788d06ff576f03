"""The torch engine's real training step at full depth on fake tensors, measured by PyTorch's ``MemTracker``.

Run: ``fake_step_peak(models.resolve(name="llama3-8b"), Recipe(device="cpu", seq_len=8192))``, or
``python benchmarks/forecast_fake.py`` for the table. It checks ``forecast`` at sizes that real tensors cannot
afford here (1B–8B models, thousands of tokens): nothing is allocated, and the measurement shares nothing with the
forecast's 3-layer trace and composition but the model code. CPU kernels, one process, the torch engine only.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from ljperf import models
from ljperf.forecast.recipe import Recipe


def fake_step_peak(spec: models.ModelSpec, recipe: Recipe) -> int:
    """Peak bytes ``MemTracker`` counts over step 2 (the steady state: optimizer states exist) of ``recipe``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import masking_utils

    from ljperf.config import LaunchConfig, OptimConfig, TrainConfig
    from ljperf.engines.common import adamw
    from ljperf.engines.torch_engine import TorchEngine
    from ljperf.forecast.trace import fake_model
    from ljperf.hardware import DeviceInfo
    from ljperf.optimize import apply_optimizations
    from ljperf.runtime import Process, RunContext

    if (recipe.engine, recipe.world, recipe.device, recipe.optimizer or "single") != ("torch", 1, "cpu", "single"):
        raise ValueError("fake_step_peak runs the torch engine in one CPU process (single-tensor AdamW)")
    plan = ",".join(recipe.layer_modes(spec.layers))
    train = TrainConfig(
        micro_batch=recipe.micro_batch,
        seq_len=recipe.seq_len,
        grad_accum=recipe.grad_accum,
        precision=recipe.precision,
        attn_implementation=recipe.attn_implementation,
        device="cpu",
    )
    run = RunContext(
        engine="torch",
        model=spec,
        train=train,
        launch=LaunchConfig(),
        optim=OptimConfig(recompute=plan),
        process=Process(device=DeviceInfo(type="cpu", index=None, name="fake")),
    )
    fake_mode = FakeTensorMode()
    engine = TorchEngine(run)
    # The engine's fp32 master weights, made fake: ``setup``'s ``materialize`` cannot move fake parameters.
    engine.model = apply_optimizations(
        fake_model(spec, attn=recipe.attn_implementation, fake_mode=fake_mode, dtype=torch.float32), run
    )
    engine.optimizer = adamw(engine.model.parameters(), run=run)
    with contextlib.ExitStack() as stack:
        # As in the trace: a real run passes no position ids, so transformers finds no packed sequences and lets
        # SDPA skip the causal mask; on fake tensors it cannot read the values and would build the mask.
        stack.enter_context(mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda *a, **k: None))
        stack.enter_context(fake_mode)
        batches = [torch.zeros(recipe.micro_batch, recipe.seq_len, dtype=torch.long) for _ in range(recipe.grad_accum)]
        engine.train_step(batches)
        tracker = MemTracker()
        tracker.track_external(engine.model, engine.optimizer, *batches)
        with tracker:
            engine.train_step(batches)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
