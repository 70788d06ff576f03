"""A plain FSDP2 training script that knows nothing of ljperf (the startup hook's test subject).

Run: ``CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET=20MiB torchrun --nproc-per-node 2
tests/scripts/fsdp_train.py``. Rank 0 prints its losses, each layer's checkpointing flag and MLP calls per step,
every rank's checkpointing flags, and whether ljperf was imported, as one JSON line. A test gives each rank its
own forecast cache (so its own calibration) with ``LJPERF_CACHE_DIR_BY_RANK=DIR0,DIR1``.
"""

import os

import torch
import torch.distributed as dist
from tiny_llama import batch, build, checkpointed, count_mlp_calls, leave_group, print_report
from torch.distributed.fsdp import fully_shard

STEPS = 3


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if caches := os.environ.get("LJPERF_CACHE_DIR_BY_RANK"):
        os.environ["LJPERF_CACHE_DIR"] = caches.split(",")[rank]
    model = build()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calls = count_mlp_calls(model)
    losses = []
    for step in range(STEPS):
        ids = batch(step, rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, checkpointed(model))
    if rank == 0:
        print_report(losses, model, calls, STEPS, checkpointed_by_rank=by_rank)
    leave_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
