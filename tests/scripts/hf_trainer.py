"""A plain HF Trainer script that knows nothing of ljperf (the startup hook's test subject).

Run: ``CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET=20MiB python tests/scripts/hf_trainer.py OUT_DIR``.
Prints the losses, which layers checkpoint, and whether ljperf was imported, as one JSON line.
"""

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

CONFIG = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
MICRO_BATCH, SEQ_LEN = 4, 256


def main() -> None:
    config = AutoConfig.for_model(**CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 512, (16, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=sys.argv[1],
        use_cpu=True,
        per_device_train_batch_size=MICRO_BATCH,
        max_steps=3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    print(
        json.dumps(
            {
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                "checkpointed": [bool(layer.gradient_checkpointing) for layer in model.model.layers],
                "ljperf_imported": "ljperf" in sys.modules,
            }
        )
    )


if __name__ == "__main__":
    main()
