"""A plain DeepSpeed ZeRO-3 training script that knows nothing of ljperf (the startup hook's test subject).

Run: ``CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET=20MiB torchrun --nproc-per-node 2
tests/scripts/deepspeed_train.py``. Rank 0 prints its losses, each layer's checkpointing flag and MLP calls per
step, every rank's checkpointing flags, and whether ljperf was imported, as one JSON line.
"""

import deepspeed
import torch
import torch.distributed as dist
from tiny_llama import MICRO_BATCH, batch, build, checkpointed, count_mlp_calls, leave_group, print_report

STEPS = 3


def main() -> None:
    # Not what the test is about: DeepSpeed's CPU shared-memory op (inference_all_reduce only) would be JIT-built
    # at init, about 60 CPU-s in a new environment. The script trains the same without it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = build()
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 4096},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    calls = count_mlp_calls(model)
    losses = []
    for step in range(STEPS):
        ids = batch(step, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, checkpointed(model))
    if rank == 0:
        print_report(losses, model, calls, STEPS, checkpointed_by_rank=by_rank)
    leave_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
