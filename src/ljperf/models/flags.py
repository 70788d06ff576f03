"""The model flags shared by ``benchmark``, ``plan`` and ``compile-report``: ``--model ENGINE/NAME`` or
``--model-config PATH`` with ``--engine``, checked without reading the model.

Run: ``ljperf benchmark --help`` (group "model").
"""

from __future__ import annotations

import argparse
import os

from ljperf.core.choices import EngineName
from ljperf.core.errors import UsageError
from ljperf.models.catalog import ENGINES, split_model_arg
from ljperf.models.spec import ModelSpec, resolve


def add_model_arguments(parser: argparse.ArgumentParser, *, engines: tuple[EngineName, ...] = ENGINES) -> None:
    """``--model ENGINE/NAME`` or ``--model-config PATH`` with ``--engine`` (one of ``engines``): shared by
    benchmark, plan and compile-report."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", metavar="ENGINE/NAME", help="engine and catalog model, e.g. torch/llama-tiny")
    group.add_argument("--model-config", metavar="PATH", help="a local HF config.json (instead of a catalog name)")
    group.add_argument(
        "--engine",
        choices=engines,
        help="engine for --model-config (default: torch); --model names it",
    )


def engine_from_args(args: argparse.Namespace) -> EngineName:
    """The engine of ``--model`` or ``--model-config``/``--engine``, checked without reading the model (a
    command checks its other flags before the model's seconds of transformers)."""
    if bool(args.model) == bool(args.model_config):
        raise UsageError("give exactly one of --model ENGINE/NAME or --model-config PATH")
    if not args.model:
        return args.engine or "torch"
    engine, _ = split_model_arg(args.model)
    if args.engine and args.engine != engine:
        raise UsageError(f"--engine {args.engine} contradicts --model {args.model}; drop one")
    return engine


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    """The model of flags ``engine_from_args`` has checked."""
    if args.model:
        return resolve(name=split_model_arg(args.model)[1])
    return resolve(path=args.model_config)


def model_from_args(args: argparse.Namespace) -> tuple[EngineName, ModelSpec]:
    """(engine, model) from ``--model`` or ``--model-config``/``--engine``."""
    return engine_from_args(args), spec_from_args(args)


def model_files(model_config: str | None) -> tuple[str, ...]:
    """The file ``--model-config`` names: itself, or the ``config.json`` of the folder it names."""
    if model_config is None:
        return ()
    return (os.path.join(model_config, "config.json") if os.path.isdir(model_config) else model_config,)
