"""The torchtitan peer of ``benchmarks/peers.py``: torchtitan's own Llama 3 training on one GPU, its ``train.main()``
entry, on the torchtitan flavor with a catalog model's dims (torchtitan 0.3's API).

Run: ``python benchmarks/peers_titan.py --model llama3.2-1b --device cuda --precision bf16-mixed --micro-batch 4
--seq-len 2048 --steps 8 --warmup 3 [--compile] --out titan.json``.

``train.main()`` runs with ``--module peers_titan --config ljperf_peer``: this module is its config registry.
``ljperf_peer()`` takes torchtitan's ``llama3_debugmodel()`` config and sets the Llama 3 flavor whose dims,
vocabulary and parameter count are the catalog model's (none: an error), SDPA causal attention (as the other peers
run; torchtitan's default is FlexAttention with document masks), no activation checkpointing, torchtitan's AdamW
and scheduler at ljperf's learning rate, its one-GPU FSDP mixed precision (bf16 parameters in compute, fp32
master weights) or fp32, per-block ``torch.compile`` with ``--compile``, no checkpoints or validation, and the data:
ljperf's synthetic tokens (seed and distribution; ``seq_len + 1`` per row, as torchtitan predicts every input
token) behind a tokenizer that only knows the vocabulary size. A step is timed from one batch fetch to the next,
each after a device synchronisation: torchtitan's whole step. Peak allocated memory is CUDA's from the second step
on; the final loss is torchtitan's own log line's. Writes step_s, device, peak_bytes, final_loss, losses.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.optimizer import default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import llama3_configs, model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from ljperf.benchmark.data import SyntheticTokens
from ljperf.models.spec import ModelSpec, resolve
from peers import runner_main

SETTINGS = "LJPERF_PEERS_TITAN"
"""The run's flags as JSON: torchtitan calls ``ljperf_peer()`` with no arguments."""
LEARNING_RATE = 3e-4
"""ljperf's default ``--lr``."""
FETCHES: list[float] = []
"""When each batch was fetched (after a device synchronisation)."""
LOSS = re.compile(r"step:\s*(\d+).*?loss:\s*([-+0-9.eE]+|nan|inf)")
COLOR = re.compile(r"\x1b\[[0-9;]*m")


class VocabOnly(BaseTokenizer):
    """A tokenizer that knows only the vocabulary size: the tokens are made, not encoded."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab: int = 0

    def __init__(self, config: VocabOnly.Config, **_: object):
        super().__init__()
        self.vocab = config.vocab

    def encode(self, *args: object, **kwargs: object) -> list[int]:
        raise NotImplementedError("synthetic tokens: nothing to encode")

    def decode(self, *args: object, **kwargs: object) -> str:
        raise NotImplementedError("synthetic tokens: nothing to decode")

    def get_vocab_size(self) -> int:
        return self.vocab


class Tokens(BaseDataLoader):
    """ljperf's synthetic token stream as torchtitan's (input, labels) batches; each fetch synchronises and is timed."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0

    def __init__(
        self, config: Tokens.Config, *, tokenizer: BaseTokenizer, seq_len: int, local_batch_size: int, **_: object
    ):
        self.data = SyntheticTokens(
            vocab=tokenizer.get_vocab_size(),
            seq_len=seq_len + 1,
            micro_batch=local_batch_size,
            grad_accum=1,
            world=1,
            seed=config.seed,
        )
        self.step = 0

    def __iter__(self):
        while True:
            torch.cuda.synchronize()
            FETCHES.append(time.perf_counter())
            if self.step == 1:  # memory from the second step on, as the other peers measure it
                torch.cuda.reset_peak_memory_stats()
            tokens = self.data.micro_batches(self.step, 0, torch.device("cpu"))[0]
            self.step += 1
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]


def same_dims(spec: ModelSpec) -> str:
    """The torchtitan Llama 3 flavor with the model's width, depth, vocabulary and parameter count."""
    for flavor, make in llama3_configs.items():
        config = make(attn_backend="flex")
        if (config.dim, len(config.layers), config.vocab_size) != (spec.hidden, spec.layers, spec.vocab):
            continue
        with torch.device("meta"):
            params = sum(p.numel() for p in config.build().parameters())
        if params == spec.params.total:
            return flavor
    raise SystemExit(f"torchtitan has no Llama 3 flavor of {spec.name}'s dims and {spec.params.total:,} parameters")


def ljperf_peer() -> Trainer.Config:
    """torchtitan's config of the run (see the module's docstring)."""
    args = json.loads(os.environ[SETTINGS])
    spec = resolve(name=args["model"])
    config = llama3_debugmodel()
    config.model_spec = model_registry(same_dims(spec), attn_backend="flex")
    for _, _, parent, attr in config.model_spec.model.traverse(FlexAttention.Config):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.hf_assets_path = args["dump"]
    config.dump_folder = args["dump"]
    config.tokenizer = VocabOnly.Config(vocab=spec.vocab)
    config.dataloader = Tokens.Config(seed=args["seed"])
    config.optimizer = default_adamw(lr=LEARNING_RATE)
    config.training = TrainingConfig(
        local_batch_size=args["micro_batch"],
        seq_len=args["seq_len"],
        steps=args["warmup"] + args["steps"] + 1,  # the last timed step ends at the next fetch
        mixed_precision_param="bfloat16" if args["precision"] == "bf16-mixed" else "float32",
    )
    config.parallelism = ParallelismConfig()
    config.activation_checkpoint = None
    config.compile = CompileConfig(enable=args["compile"])
    config.validator = Validator.Config(enable=False)
    config.metrics.log_freq = 1
    config.debug.seed = args["seed"]
    return config


class Losses(logging.Filter):
    """The losses of torchtitan's metrics lines, by step (a filter of its logger: ``init_logger()`` replaces the
    handlers, not the filters)."""

    def __init__(self):
        super().__init__()
        self.by_step: dict[int, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if found := LOSS.search(COLOR.sub("", record.getMessage())):
            self.by_step[int(found[1])] = float(found[2])
        return True


def train(args: argparse.Namespace) -> dict:
    """One torchtitan run through its own entry point; its figures."""
    from torchtitan import train as titan
    from torchtitan.tools.logging import logger

    dump = Path(args.out).resolve().parent / "torchtitan-output"
    os.environ[SETTINGS] = json.dumps(vars(args) | {"dump": str(dump)})
    # One process without torchrun: the variables torchrun would set
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):  # fmt: skip
        os.environ.setdefault(key, value)
    losses = Losses()
    logger.addFilter(losses)
    sys.argv = [titan.__file__, "--module", "peers_titan", "--config", "ljperf_peer"]
    titan.main()
    steps = [b - a for a, b in itertools.pairwise(FETCHES)][args.warmup : args.warmup + args.steps]
    return {
        "step_s": statistics.median(steps),
        "device": torch.cuda.get_device_name(),
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "final_loss": losses.by_step[max(losses.by_step)] if losses.by_step else None,
        "losses": [losses.by_step[s] for s in sorted(losses.by_step)],
        "step_times_s": steps,
    }


if __name__ == "__main__":
    runner_main(__doc__, train, devices=("cuda",), compiled="torchtitan's per-block torch.compile")
