"""What a traced number depends on, as the keys of its on-disk cache entries (``$LJPERF_CACHE_DIR/forecast``).

Run: ``FamilyKey.of(spec, precision="fp32", attn="sdpa", mode="full", shapes="bn").file_name()`` names the entry
of one traced family (``patterns.traced_patterns``); ``architecture_key(spec, ...)`` keys the block counts and the
recompute costs. A key holds the config without its depth (a 3-layer copy stands for every depth), what changes the
traced code path, and the versions of torch, transformers and the trace: any of them changed is another entry.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ljperf.core.cache import cache_root, digest
from ljperf.core.options import LOSS_CHUNKS
from ljperf.models.spec import ModelSpec

TRACE_VERSION = 9
"""Bump when what a trace keeps changes (8: a functional collective's wait returns its output, as a real one does;
7: CUDA traces run autocast's fp32 ops in fp32, fp32 GQA on math)."""


def cache_dir() -> Path:
    return cache_root() / "forecast"


@dataclass(frozen=True, kw_only=True)
class FamilyKey:
    """One traced family's cache entry: the architecture, what changes the traced code path, the versions."""

    architecture: str
    """The model's transformers class (``ModelSpec.architecture``); it begins the entry's file name."""
    config: str
    """The model's config without its depth, as canonical JSON."""
    precision: str
    """The precision the code path is traced in (``Recipe.trace_precision``)."""
    attn: str
    """The attention implementation (``--attn``)."""
    mode: str
    """Every traced layer's recompute mode: none, full or selective."""
    shapes: str
    """The family of shapes traced (``patterns.FAMILIES``): b1 (micro batch 1) or bn."""
    seq_offset: int
    """Tokens added to each traced shape's sequence length (``trace.windowed``: a sliding window's)."""
    as_cuda: bool
    """Traced as CUDA runs it (``trace.trace_shape``)."""
    tp: int
    """The tensor-parallel ranks the traced rank is one of (1: none)."""
    loss: str
    """plain or chunked (``--loss``)."""
    loss_chunks: int | None
    """The chunks of the chunked loss (``LOSS_CHUNKS``); None for the plain one."""
    pick: tuple[int, ...] | None
    """The full model's layers the traced copy is made of (``trace.layer_picks``); None: the copy's own."""
    depth: int | None
    """The full model's depth, whose layers ``pick`` names; None without ``pick``."""
    first_only: bool
    """Traced up to the second micro-step's start: the first micro-step's segments alone."""
    torch_version: str
    transformers_version: str
    trace_version: int
    """``TRACE_VERSION``."""

    @classmethod
    def of(
        cls,
        spec: ModelSpec,
        *,
        precision: str,
        attn: str,
        mode: str,
        shapes: str,
        seq_offset: int = 0,
        as_cuda: bool = False,
        tp: int = 1,
        loss: str = "plain",
        pick: tuple[int, ...] | None = None,
        first_only: bool = False,
    ) -> FamilyKey:
        """The key of ``spec``'s family traced with these options (as ``patterns.traced_patterns`` takes them)."""
        return cls(
            architecture=spec.architecture,
            config=json.dumps(_config_without_depth(spec), sort_keys=True, separators=(",", ":"), default=str),
            precision=precision,
            attn=attn,
            mode=mode,
            shapes=shapes,
            seq_offset=seq_offset,
            as_cuda=as_cuda,
            tp=tp,
            loss=loss,
            loss_chunks=None if loss == "plain" else LOSS_CHUNKS,
            pick=pick,
            depth=None if pick is None else spec.layers,
            first_only=first_only,
            torch_version=_versions()["torch"],
            transformers_version=_versions()["transformers"],
            trace_version=TRACE_VERSION,
        )

    def to_json(self) -> dict[str, Any]:
        """The key as JSON values, which ``from_json`` reads back and ``digest`` hashes."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FamilyKey:
        return cls(**data | {"pick": None if data["pick"] is None else tuple(data["pick"])})

    def digest(self) -> str:
        """SHA-256 of the key as canonical JSON (``core.cache.digest``), its first 20 hex digits."""
        return digest(self.to_json())[:20]

    def file_name(self) -> str:
        return f"{self.architecture}-{self.mode}-{self.shapes}-{self.digest()}.json"


_ARCHITECTURE_KEYS: dict[tuple[str, str], str] = {}


def architecture_key(spec: ModelSpec, *extra: object) -> str:
    """The config without its depth, plus ``extra`` (as JSON, else as ``str``) and the package versions: what traced
    numbers depend on (once a config and ``extra``: the config's JSON is long)."""
    memo = (spec.digest, repr(extra))
    if memo not in _ARCHITECTURE_KEYS:
        parts = [_config_without_depth(spec), *extra, _versions(), TRACE_VERSION]
        blob = json.dumps(parts, sort_keys=True, default=str)
        _ARCHITECTURE_KEYS[memo] = hashlib.sha256(blob.encode()).hexdigest()[:20]
    return _ARCHITECTURE_KEYS[memo]


def _config_without_depth(spec: ModelSpec) -> dict[str, Any]:
    return {k: v for k, v in spec.facts.config_dict.items() if k not in ("num_hidden_layers", "layer_types")}


@functools.cache
def _versions() -> dict[str, str]:
    # Reading package metadata costs ~7 ms a call: most of a warm forecast, which solvers call hundreds of times.
    return {p: metadata.version(p) for p in ("torch", "transformers")}
