"""A plain DeepSpeed training script that knows nothing of ljperf: the model of ``examples/config.json`` (a tiny
Llama) on random tokens with the ZeRO settings of ``examples/ds_config.json``, on GPUs (NCCL) or CPUs (gloo).

Run: ``torchrun --nproc-per-node 2 examples/train_deepspeed.py`` (or ``deepspeed examples/train_deepspeed.py``);
under ljperf's startup hook, unchanged: ``CHECKPOINT_OPTIMIZATION=true LJPERF_MEMORY_BUDGET=100MiB torchrun
--nproc-per-node 2 examples/train_deepspeed.py``. Rank 0 prints the losses as one JSON line.
"""

import argparse
import json
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "config.json"), help="an HF model config (JSON)")
    parser.add_argument("--deepspeed-config", default=str(HERE / "ds_config.json"), help="a DeepSpeed config")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if not cuda:
        # DeepSpeed would JIT-build its CPU shared-memory op here (for inference only): about a minute
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = dist.get_rank()
    ds_config = json.loads(Path(args.deepspeed_config).read_text())
    ds_config.setdefault("train_micro_batch_size_per_gpu", args.micro_batch)

    config = AutoConfig.for_model(**json.loads(Path(args.config).read_text()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), generator=generator)
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 4))
    if rank == 0:
        print(json.dumps({"losses": losses}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
