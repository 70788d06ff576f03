"""The model catalog: HF causal-LM configs shipped in ``ljperf/models/catalog``, named ``ENGINE/NAME`` on the CLI.

Run: ``ljperf models``; ``split_model_arg("torch/llama-tiny")`` → ("torch", "llama-tiny").
"""

from __future__ import annotations

import difflib
import json
from importlib import resources
from pathlib import Path

from ljperf.core.choices import EngineName, values_of
from ljperf.core.errors import UsageError
from ljperf.core.records import read_json_object

ENGINES: tuple[EngineName, ...] = values_of(EngineName)


def catalog_names() -> list[str]:
    """Names of the shipped model configs, sorted."""
    files = resources.files("ljperf.models").joinpath("catalog").iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def split_model_arg(text: str) -> tuple[EngineName, str]:
    """``ENGINE/NAME`` → (engine, name), with exit-2 errors that name the closest valid choice."""
    engine, sep, name = text.partition("/")
    if not sep and text not in catalog_names():  # a mistyped name is the likelier slip than a missing engine
        raise UsageError(f"unknown model {text!r}{_did_you_mean(text)}; `ljperf models` lists the catalog")
    if not sep or not name:
        example = f"torch/{text}" if not sep else "torch/llama-tiny"
        raise UsageError(f"--model {text!r} must be ENGINE/NAME, e.g. {example} or deepspeed/llama3-8b")
    if engine not in ENGINES:
        raise UsageError(f"unknown engine {engine!r} in --model {text!r}; choose one of {', '.join(ENGINES)}")
    if name not in catalog_names():
        raise UsageError(f"unknown model {name!r}{_did_you_mean(name)}; `ljperf models` lists the catalog")
    return engine, name


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, catalog_names(), n=3, cutoff=0.4)
    return f" (closest: {', '.join(close)})" if close else ""


def read_config_dict(*, name: str | None = None, path: str | Path | None = None) -> dict:
    """The raw config dict of a catalog model or of a local ``config.json`` (file or its folder)."""
    if name is not None:
        text = resources.files("ljperf.models").joinpath("catalog", f"{name}.json").read_text()
        return json.loads(text)
    assert path is not None
    p, what = Path(path), f"--model-config {str(path)!r}"
    if p.is_dir():
        p, what = p / "config.json", f"{what} is a folder, and its config.json"
    return read_json_object(p, what=what)
