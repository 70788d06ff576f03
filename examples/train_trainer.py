"""A plain HF Trainer script that knows nothing of ljperf: the model of ``examples/config.json`` (a tiny Llama) on
random tokens, on the GPU where there is one, else on the CPU.

Run: ``python examples/train_trainer.py``; under ljperf's startup hooks, unchanged:
``CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET=80MiB python examples/train_trainer.py`` (checkpoints the
layers the plan for that budget picks) and ``COMPILE_OPTIMIZATION=true python examples/train_trainer.py
--torch-compile`` (``torch_compile=True`` becomes regional compile). ``--config`` takes another HF config.
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "config.json"), help="an HF model config (JSON)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per device per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--torch-compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    args = parser.parse_args()

    config = AutoConfig.for_model(**json.loads(Path(args.config).read_text()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    tokens = torch.randint(0, config.vocab_size, (args.steps * args.micro_batch, args.seq_len))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            use_cpu=not torch.cuda.is_available(),
            per_device_train_batch_size=args.micro_batch,
            max_steps=args.steps,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            torch_compile=args.torch_compile,
        )
        trainer = Trainer(model=model, args=training, train_dataset=data)
        trainer.train()
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
