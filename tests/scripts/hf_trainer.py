"""A plain HF Trainer script that knows nothing of ljperf (the startup hook's test subject).

Run: ``CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET=20MiB python tests/scripts/hf_trainer.py OUT_DIR``.
Prints the losses, which layers checkpoint, their MLP calls per step, and whether ljperf was imported (one JSON line).
``HOOK_SCRIPT_GRADIENT_CHECKPOINTING=1`` sets ``TrainingArguments(gradient_checkpointing=True)``, which the hook's
plan replaces.
``HOOK_SCRIPT_DEVICE=cuda`` trains on the GPU (``benchmarks/gpu_session.sh``); the tests run it on CPU.
"""

import os
import sys

from tiny_llama import MICRO_BATCH, batch, build, count_mlp_calls, print_report
from transformers import Trainer, TrainingArguments


def main() -> None:
    model = build()
    data = [{"input_ids": row, "labels": row} for step in range(4) for row in batch(step, rank=0)]
    args = TrainingArguments(
        output_dir=sys.argv[1],
        use_cpu=os.environ.get("HOOK_SCRIPT_DEVICE", "cpu") == "cpu",
        per_device_train_batch_size=MICRO_BATCH,
        max_steps=3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        gradient_checkpointing=os.environ.get("HOOK_SCRIPT_GRADIENT_CHECKPOINTING") == "1",
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    calls = count_mlp_calls(model)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print_report(losses, model, calls, args.max_steps)


if __name__ == "__main__":
    main()
