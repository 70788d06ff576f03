"""The HF Trainer peer of ``benchmarks/peers.py``: one Trainer run of a catalog model, timed as ljperf times its own.

Run: ``python benchmarks/peers_trainer.py --model llama-tiny --device cpu --precision fp32 --micro-batch 2
--seq-len 256 --steps 5 --warmup 2 [--compile] --out trainer.json``.

The Trainer as a user runs it: ``bf16=True`` under bf16-mixed, its default optimizer, scheduler and gradient
clipping, SDPA attention, ``torch_compile=True`` with ``--compile``. Only the learning rate is ljperf's (3e-4, not
the Trainer's 5e-5) so the losses are comparable. The model is ljperf's: the catalog config with the same seeded
initial weights, and the tokens are ljperf's synthetic stream (same seed), one optimizer step per batch in order.
A callback times each step between device synchronisations, from ``on_step_begin`` (the batch already fetched, as
ljperf's loop fetches its batch before the timer) to ``on_step_end`` (after the optimizer step); the median of the
steps after the warm-up is the step time. Peak memory as ljperf measures it: CUDA's allocator peak from the second
step on; on CPU the live tensor storages of one untimed step (``ljperf.distributed.memory.LiveTensorBytes``).
Writes one JSON object: step_s, device, peak_bytes, final_loss, losses, step_times_s, trainer settings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ljperf.benchmark.data import SyntheticTokens
from ljperf.core import hardware
from ljperf.distributed import memory
from ljperf.models.build import materialize
from ljperf.models.spec import build_meta, resolve
from peers import runner_main

LEARNING_RATE = 3e-4
"""ljperf's default ``--lr``."""


class Tokens(torch.utils.data.IterableDataset):
    """ljperf's synthetic token stream, row by row in step order (an iterable dataset: no shuffling sampler)."""

    def __init__(self, data: SyntheticTokens, steps: int):
        self.data, self.steps = data, steps

    def __iter__(self):
        for step in range(self.steps):
            for row in self.data.micro_batches(step, 0, torch.device("cpu"))[0]:
                yield {"input_ids": row, "labels": row}


class StepTimer(TrainerCallback):
    """Synchronised step times and the peak memory of the run (CUDA) or of one untimed step (CPU)."""

    def __init__(self, device: torch.device, *, track_step: int):
        self.device, self.track_step = device, track_step
        self.times: list[float] = []
        self.peak: int | None = None
        self._start = 0.0
        self._tracker: memory.LiveTensorBytes | None = None

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: object,
    ) -> None:
        if state.global_step == self.track_step:
            if self.device.type == "cuda":
                memory.reset_cuda_peak(self.device)
            else:
                self._tracker = memory.LiveTensorBytes(memory.training_state_tensors(model, optimizer))
                self._tracker.__enter__()
        hardware.synchronize(self.device)
        self._start = time.perf_counter()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        hardware.synchronize(self.device)
        self.times.append(time.perf_counter() - self._start)
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.peak, self._tracker = self._tracker.peak, None

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self.device.type == "cuda":
            self.peak = memory.cuda_peaks(self.device)[0]


def train(args: argparse.Namespace) -> dict:
    """One Trainer run; its figures."""
    spec = resolve(name=args.model)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    model = materialize(build_meta(spec, attn_implementation="sdpa"), device=device, seed=args.seed)
    # Step 1 creates the optimizer states: memory from step 2 on, on an extra step when the warm-up is too short.
    track_step = 1 if args.warmup >= 2 else args.warmup + args.steps
    total = args.warmup + args.steps + (track_step == args.warmup + args.steps)
    data = SyntheticTokens(
        vocab=spec.vocab, seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=1, world=1, seed=args.seed
    )
    training = TrainingArguments(
        output_dir=str(Path(args.out).parent / "trainer-output"),
        use_cpu=device.type == "cpu",
        bf16=args.precision == "bf16-mixed",
        torch_compile=args.compile,
        per_device_train_batch_size=args.micro_batch,
        max_steps=total,
        learning_rate=LEARNING_RATE,
        seed=args.seed,
        logging_steps=1,  # the losses; logged after on_step_end, outside the timed span
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    timer = StepTimer(device, track_step=track_step)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(data, total), callbacks=[timer])
    trainer.train()
    timed = [t for i, t in enumerate(timer.times) if args.warmup <= i < args.warmup + args.steps]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {
        "step_s": statistics.median(timed),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_bytes": timer.peak,
        "final_loss": losses[-1],
        "losses": losses,
        "step_times_s": timed,
        "settings": {
            "optim": training.optim.value,
            "lr": LEARNING_RATE,
            "lr_scheduler": training.lr_scheduler_type.value,
            "max_grad_norm": training.max_grad_norm,
            "weight_decay": training.weight_decay,
            "bf16": training.bf16,
            "torch_compile": training.torch_compile,
            "attn_implementation": model.config._attn_implementation,
        },
    }


if __name__ == "__main__":
    runner_main(__doc__, train, devices=("cpu", "cuda"), compiled="TrainingArguments(torch_compile=True)")
