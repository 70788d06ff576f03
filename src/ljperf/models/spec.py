"""A model as ljperf reads it (``ModelSpec``): its HF config, the facts the forecast needs, parameter counts and
FLOPs, and its meta-device build.

Run: ``resolve(name="llama3-8b").params.total``; ``--model-config PATH`` takes any local HF ``config.json``
(never with remote code).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ljperf.core.cache import cache_root, cached, digest
from ljperf.core.choices import Attention
from ljperf.core.errors import UsageError, describe
from ljperf.models.catalog import read_config_dict
from ljperf.models.layout import decoder_layers, embeddings, weight

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
MOST_LAYERS = 10_000
"""Decoder layers a config may have (the largest models have about 130): more is refused before any build."""
MOST_PARAMS = 10**13
"""Parameters a config may have, by ``rough_params`` (the largest models have about 2·10^12)."""


def hf_config(data: dict, *, source: str) -> PretrainedConfig:
    """Build a transformers config from a dict; unknown or incomplete configs are usage errors."""
    from transformers import AutoConfig

    if "model_type" not in data:
        raise UsageError(f"{source}: config is missing model_type (an HF causal-LM config.json has it)")
    fields = {k: v for k, v in data.items() if k not in ("model_type", "auto_map", "architectures")}
    for key in (*_REQUIRED, *SIZES):  # before transformers, whose typed fields word it otherwise (or accept 0)
        _check_count(source, key, data.get(key), required=False)
    try:
        config = AutoConfig.for_model(data["model_type"], **fields)
    except Exception as exc:  # unknown types, and transformers 5's validation of the values (any error class)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        reason = lines[-1] if len(lines[-1]) <= 200 else lines[-1][:200] + "…"  # the last line names the cause
        raise UsageError(f"{source}: transformers cannot build model_type {data['model_type']!r}: {reason}") from None
    # The file must give them (the config class has defaults); its attribute map knows other names (GPT-2's n_embd).
    missing = [k for k in _REQUIRED if k not in data and config.attribute_map.get(k) not in data]
    if missing:
        raise UsageError(f"{source}: config is missing {', '.join(missing)} (an HF causal-LM config.json has them)")
    for key in _REQUIRED:
        _check_count(source, key, getattr(config, key), required=True)
    for key in SIZES:  # as the file writes them (GPT-2's n_positions); not a class's own stand-in (XLNet's -1)
        if (alias := config.attribute_map.get(key)) is not None:
            _check_count(source, alias, data.get(alias), required=False)
    check_size(config, source=source)
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or heads % kv):
        # transformers does not check it; attention then fails at the first step with a shape mismatch
        raise UsageError(f"{source}: num_key_value_heads ({kv!r}) must divide num_attention_heads ({heads})")
    from transformers import AutoModelForCausalLM

    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise UsageError(f"{source}: model_type {data['model_type']!r} has no causal-LM class in transformers")
    return config


SIZES = (
    "max_position_embeddings",
    "intermediate_size",
    "moe_intermediate_size",
    "head_dim",
    "num_key_value_heads",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
"""Sizes a config may leave out (None: the architecture has none) but never set to zero, a negative or a fraction:
``max_position_embeddings: 0`` was taken as 4096 by the plan, ``intermediate_size: 0`` built a model without MLP.
Not ``sliding_window``: transformers' own Qwen2-MoE config writes 0 for no window."""


def _check_count(source: str, key: str, value: Any, *, required: bool) -> None:
    """A size is a whole number of 1 or more (None: left out, where ``required`` allows)."""
    if (required or value is not None) and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise UsageError(f"{source}: {key} must be a whole number of 1 or more (got {_shown(value)})")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def rough_params(config: PretrainedConfig | _Written) -> int:
    """An upper estimate of a config's parameters from its sizes alone (nothing built): embedding and head, and per
    layer four hidden² attention projections, a dense MLP and an expert bank (three hidden × intermediate each)."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    dense = getattr(config, "intermediate_size", None) or 4 * h
    experts = max(getattr(config, name, 0) or 0 for name in ("num_local_experts", "num_experts", "n_routed_experts"))
    expert = getattr(config, "moe_intermediate_size", None) or dense
    return 2 * vocab * h + layers * (4 * h * h + 3 * h * (dense + expert * experts))


_WRITTEN_AS = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "vocab_size": ("vocab_size",),
}


class _Written:
    """A config file's sizes under transformers' usual names, where it writes them (GPT-2's ``n_layer``, ...);
    what ``check_size`` reads before the config class exists."""

    def __init__(self, data: dict):
        self.data = data

    def __getattr__(self, name: str) -> Any:
        for key in _WRITTEN_AS.get(name, (name,)):
            value = self.data.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return 0 if name in _WRITTEN_AS else None


def check_size(config: PretrainedConfig | _Written, *, source: str) -> None:
    """Refuse, before anything is built, a config deeper than ``MOST_LAYERS`` or larger than ``MOST_PARAMS``: a
    planned 100,000-layer model or a hidden size of 10^9 did not finish building in 300 s."""
    if config.num_hidden_layers > MOST_LAYERS:
        raise UsageError(
            f"{source}: num_hidden_layers {config.num_hidden_layers:,} is more than the {MOST_LAYERS:,} ljperf plans"
        )
    if (params := rough_params(config)) > MOST_PARAMS:
        raise UsageError(f"{source}: about {params:.1e} parameters, more than the {MOST_PARAMS:.0e} ljperf plans")


FACT_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "max_position_embeddings",
    "intermediate_size",
    "sliding_window",
    "num_local_experts",
    "num_experts",
    "model_type",
)
"""The config attributes the forecast reads (``ModelSpec.fact``), through the config class's attribute map
(GPT-2's ``n_embd`` is ``hidden_size``)."""


@dataclass(frozen=True, kw_only=True)
class ConfigFacts:
    """What ljperf reads of a transformers config, kept on disk per config file and transformers version so that
    a warm ``ljperf plan`` runs without importing transformers (seconds of its ~4 s of imports)."""

    architecture: str
    """The config class's name without ``Config`` (``Llama``)."""
    attributes: dict[str, Any]
    """``FACT_FIELDS`` as the config object answers them (None where it has no such attribute)."""
    config_dict: dict[str, Any]
    """``config.to_dict()``: with defaults filled in, what traced numbers depend on."""
    sdpa: bool
    """The model's transformers class has SDPA attention."""

    @classmethod
    def of(cls, config: PretrainedConfig) -> ConfigFacts:
        from transformers import AutoModelForCausalLM

        model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
        return cls(
            architecture=type(config).__name__.removesuffix("Config"),
            attributes={k: getattr(config, k, None) for k in FACT_FIELDS},
            # to_dict leaves out how the experts run (a load-time choice): eager's loop traces otherwise than grouped_mm
            config_dict=config.to_dict() | _experts_implementation(config),
            sdpa=bool(getattr(model_class, "_supports_sdpa", True)),
        )


def _experts_implementation(config: PretrainedConfig) -> dict[str, str]:
    impl = getattr(config, "_experts_implementation", None)
    return {"experts_implementation": impl} if isinstance(impl, str) else {}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A resolved model: its name, HF config and the arithmetic the metrics need. ``ModelSpec.of`` a config
    object; ``resolve`` gives one whose config object is built from the file when first asked for."""

    name: str
    """Catalog name, or the config path for ``--model-config``."""
    facts: ConfigFacts
    """What the forecast reads of the config."""
    data: dict[str, Any] | None = None
    """The config file's dict, the config object is built from (None: the object was given)."""

    @classmethod
    def of(cls, config: PretrainedConfig, *, name: str) -> ModelSpec:
        spec = cls(name=name, facts=ConfigFacts.of(config))
        spec.__dict__["config"] = config  # the cached property's value
        return spec

    @cached_property
    def config(self) -> PretrainedConfig:
        """The transformers config the model is built from (shared: a copy is changed, never this one)."""
        assert self.data is not None
        return hf_config(self.data, source=f"model {self.name!r}")

    def fact(self, name: str, default: Any = None) -> Any:
        """A ``FACT_FIELDS`` attribute of the config, or ``default`` where it is None."""
        value = self.facts.attributes[name]
        return default if value is None else value

    @property
    def architecture(self) -> str:
        return self.facts.architecture

    @cached_property
    def digest(self) -> str:
        """A hash of what ljperf reads of the config: tells one model from another in a memo, without hashing the
        config each time (a search asks thousands of times)."""
        return digest(asdict(self.facts))[:20]

    @property
    def layers(self) -> int:
        return self.fact("num_hidden_layers")

    @property
    def hidden(self) -> int:
        return self.fact("hidden_size")

    @property
    def vocab(self) -> int:
        return self.fact("vocab_size")

    @property
    def heads(self) -> int:
        return self.fact("num_attention_heads")

    @property
    def kv_heads(self) -> int:
        return self.fact("num_key_value_heads") or self.heads

    @property
    def head_dim(self) -> int:
        return self.fact("head_dim") or self.hidden // self.heads

    @property
    def attention_widths(self) -> tuple[int, int]:
        """Per head, the width of the query·key product and of the value: ``head_dim`` twice, except where
        they differ (DeepSeek's MLA: 128 + 64 rotary for query and key, 128 for the value; its config's
        ``head_dim`` is the rotary part alone)."""
        nope, rope = self.fact("qk_nope_head_dim"), self.fact("qk_rope_head_dim")
        return (nope + rope if nope and rope else self.head_dim), self.fact("v_head_dim") or self.head_dim

    @property
    def max_positions(self) -> int | None:
        return self.fact("max_position_embeddings")

    def seq_len(self, requested: int | None, *, flag: str = "--seq-len") -> int:
        """``requested``, or min(4096, the max positions) when None; one past the max positions is a usage error
        naming ``flag``."""
        seq_len = requested or min(4096, self.max_positions or 4096)
        if self.max_positions and seq_len > self.max_positions:
            raise UsageError(f"{flag} {seq_len} is longer than {self.name}'s {self.max_positions} max positions")
        return seq_len

    def attention(self, requested: Attention | None, *, flag: str = "--attn-implementation") -> Attention:
        """``requested``, or (None) sdpa where the model's transformers class has it and eager where not
        (Gemma 2), as transformers' own default picks; sdpa asked of a class without it is a usage error."""
        if requested == "sdpa" and not self.facts.sdpa:
            raise UsageError(f"{flag} sdpa: {self.name} ({self.architecture}) has no SDPA attention; use eager")
        return requested or ("sdpa" if self.facts.sdpa else "eager")

    @cached_property
    def params(self) -> ParamCounts:
        """Exact parameter counts, from a meta-device build (nothing allocated), kept on disk per config and
        transformers version: ``ljperf models`` lists the catalog without building anything once it has."""
        blob = json.dumps([self.facts.config_dict, metadata.version("transformers"), FACTS_VERSION], default=str)
        key = hashlib.sha256(blob.encode()).hexdigest()[:20]
        return cached(
            cache_root() / "models" / f"{key}-params.json",
            load=lambda data: ParamCounts(**data),
            make=self._count_params,
            dump=asdict,
        )

    def _count_params(self) -> ParamCounts:
        import torch

        model = build_meta(self, initialize=False)
        total = sum(p.numel() for p in model.parameters())
        embed, head = embeddings(model)
        if embed is None:
            raise ValueError(f"{type(model).__name__} has no input embedding")
        embedding = weight(embed).numel()
        tied_head = head is not None and weight(head) is weight(embed)
        # every lookup table, GPT-2's learned positions too, is a gather per token, not a matmul
        lookups = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
        unrouted = sum(bank.numel * (1 - bank.top_k / bank.experts) for bank in expert_banks(model))
        matmul = total - lookups + (embedding if tied_head else 0) - round(unrouted)
        return ParamCounts(total=total, embedding=embedding, matmul=matmul, active=total - round(unrouted))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM/torchtitan definition (see docs/metrics.md)."""
        counts = self.params
        qk, v = self.attention_widths
        return 6 * counts.matmul + 6 * self.layers * self.heads * (qk + v) * seq_len


@dataclass(frozen=True, kw_only=True)
class ExpertBank:
    """The experts of one mixture-of-experts layer: parameters stacked by expert, of which a token uses top-k."""

    numel: int
    """Parameters of the bank's own stacked tensors (weights and biases with the experts as first dimension)."""
    experts: int
    top_k: int


def expert_banks(model: torch.nn.Module) -> list[ExpertBank]:
    """Every mixture-of-experts layer's expert bank, as transformers 5 builds them: a module with ``num_experts``
    holding a 3-D parameter stacked by expert. Its top-k is the model code's own (an int ``top_k`` or
    ``num_experts_per_tok`` in the layer that holds the bank: its router's), which covers configs that name it
    otherwise (DBRX, Hunyuan); a bank with none found is counted whole, as a dense layer would be."""
    banks = []
    for parent in model.modules():
        for bank in parent.children():
            experts = getattr(bank, "num_experts", None)
            own = [p for p in bank.parameters(recurse=False) if p.dim() and p.shape[0] == experts]
            if not isinstance(experts, int) or not any(p.dim() == 3 for p in own):
                continue
            top_k = next((k for m in parent.modules() for k in _top_k(m) if 0 < k <= experts), experts)
            banks.append(ExpertBank(numel=sum(p.numel() for p in own), experts=experts, top_k=top_k))
    return banks


def _top_k(module: torch.nn.Module) -> Iterator[int]:
    for name in ("top_k", "num_experts_per_tok"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            yield value


@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    """Parameter counts of a model."""

    total: int
    """Unique parameters (a tied embedding counted once)."""
    embedding: int
    """Parameters of the input token embedding table."""
    matmul: int
    """Parameters that take part in a matmul per token: total - the embedding tables (token, and learned positions
    where a model has them), plus the LM head when tied; of a mixture of experts, the top-k experts a token is
    routed to (``expert_banks``), not all of them."""
    active: int
    """Parameters a token uses: total less the experts its routing skips (total for a dense model)."""


FACTS_VERSION = 3
"""Bump when ``ConfigFacts`` changes: older cached facts are then not read (3: the experts' implementation)."""


def resolve(*, name: str | None = None, path: str | Path | None = None) -> ModelSpec:
    """A ``ModelSpec`` from a catalog name or a local config path (whose layout is checked on a one-layer
    meta-device build: about 1 s, mostly importing the model's code, which a run imports anyway).

    A config file this transformers version has accepted before is not built again: its ``ConfigFacts`` are
    read from the cache and the config object is built when first asked for (a warm ``ljperf plan`` never is;
    transformers' warnings about the file show on its first build).
    """
    data = read_config_dict(name=name, path=path)
    source = f"model {name!r}" if name else f"--model-config {str(path)!r}"
    spec_name = name or str(path)
    check_size(_Written(data), source=source)  # before transformers is imported: the sizes as the file writes them

    def build() -> ModelSpec:
        with _warnings_only_if_accepted():
            spec = ModelSpec.of(hf_config(data, source=source), name=spec_name)
            if path is not None:
                try:
                    decoder_layers(build_meta(with_layers(spec, 1)))
                except UsageError as exc:
                    raise UsageError(f"{source}: {exc}") from None
                except Exception as exc:  # a value transformers' validation let through, e.g. an unknown rope type
                    raise UsageError(f"{source}: transformers cannot build the model: {describe(exc)}") from None
        return spec

    blob = json.dumps([data, metadata.version("transformers"), FACTS_VERSION], sort_keys=True, default=str)
    file = cache_root() / "models" / f"{hashlib.sha256(blob.encode()).hexdigest()[:20]}.json"
    return cached(
        file,
        load=lambda facts: ModelSpec(name=spec_name, facts=ConfigFacts(**facts), data=data),
        make=build,
        # JSON as the forecast's cache keys dump it (default=str), so a read dict keys the same traces
        dump=lambda spec: json.loads(json.dumps(asdict(spec.facts), default=str)),
    )


@contextlib.contextmanager
def _warnings_only_if_accepted() -> Generator[None, None, None]:
    """Hold transformers' warnings about a config; print them once it is accepted. When it is refused, the one
    error line says what is wrong (the warnings were about the same file, above that line)."""
    from transformers.utils import logging as hf_logging

    handlers = hf_logging.get_logger("transformers").handlers  # configures them on first use
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    for handler in handlers:
        handler.addFilter(hold)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(hold)
    for record in dict.fromkeys(held):  # each handler saw each record
        for handler in handlers:
            handler.handle(record)


PER_LAYER_LISTS = ("layer_types", "no_rope_layers")
"""Config lists with one entry per decoder layer (Gemma 3's sliding/full attention pattern, Llama 4's RoPE)."""
LAYER_INDEX_LISTS = ("mlp_only_layers", "moe_layers")
"""Config lists of layer indices (Qwen MoE's dense layers, Llama 4's mixture-of-experts layers)."""
LEADING_LAYER_COUNTS = ("first_k_dense_replace",)
"""Config counts of leading layers of one kind (DeepSeek's and GLM-4.5's dense layers before their experts)."""


def with_layers(spec: ModelSpec, layers: int, *, pick: Sequence[int] | None = None) -> ModelSpec:
    """The same architecture with ``layers`` decoder layers, fewer or more (the forecast traces 3- and 4-layer
    copies of a 2-layer model too): per-layer config lists are cut, or repeat their pattern, to match, and counts
    of leading layers follow (a 3-layer DeepSeek whose 3 layers are dense has a 4-layer copy with 4 dense, not a
    fourth of experts); with ``pick``, the entries of those of the full model's layers (``build_picked``)."""
    config = copy.deepcopy(spec.config)
    depth = config.num_hidden_layers
    config.num_hidden_layers = layers
    pick = range(layers) if pick is None else pick
    for name in PER_LAYER_LISTS:
        value = getattr(config, name, None)
        if isinstance(value, list) and value:
            setattr(config, name, [value[i % len(value)] for i in pick])
    for name in LAYER_INDEX_LISTS:
        value = getattr(config, name, None)
        if isinstance(value, list):
            setattr(config, name, [j for j, i in enumerate(pick) if i % depth in value])
    for name in LEADING_LAYER_COUNTS:  # the copy's leading run of layers the full model has of that kind
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            leading = [i % depth < value for i in pick] + [False]
            setattr(config, name, leading.index(False))
    return ModelSpec.of(config, name=f"{spec.name}[{layers} layers]")


def with_window(spec: ModelSpec, window: int) -> ModelSpec:
    """The same model with a sliding window of ``window`` tokens (``forecast.trace.windowed``)."""
    config = copy.deepcopy(spec.config)
    config.sliding_window = window
    return ModelSpec.of(config, name=spec.name)


LARGEST_REAL = 2**24
"""Elements of a ``torch.ones``/``zeros``/``full`` a meta build may still make for real: buffers (RoPE frequencies,
masks) are far smaller; a norm weight of a 10^9 hidden size (4 GB) is not."""


def _empty_on_meta() -> contextlib.AbstractContextManager:
    """``torch.empty``, and any larger than ``LARGEST_REAL`` ``torch.ones``/``zeros``/``full``, on the meta device:
    what parameters are made from before ``init_empty_weights`` moves them there on registration (DeepSeek-V3's
    experts, one 3-D tensor per layer, were 30 GB of real memory each; RMSNorm's ``torch.ones`` of an absurd hidden
    size, 4 GB)."""
    import math

    import torch
    from torch.overrides import TorchFunctionMode

    filled = (torch.ones, torch.zeros, torch.full)

    def elements(func: Callable, args: tuple, kwargs: dict) -> int:
        """Elements of ``torch.ones(*size)``, ``ones(size)``, ``ones(size=...)`` or ``full(size, value)``."""
        if "size" in kwargs:
            size = kwargs["size"]
        elif func is torch.full or (len(args) == 1 and isinstance(args[0], list | tuple | torch.Size)):
            size = args[0] if args else ()
        else:
            size = args
        try:
            return math.prod(int(d) for d in size)
        except (TypeError, ValueError):
            return 0

    class EmptyOnMeta(TorchFunctionMode):
        def __torch_function__(
            self, func: Callable, types: tuple[type, ...], args: tuple = (), kwargs: dict | None = None
        ) -> object:
            kwargs = kwargs or {}
            large = func in filled and elements(func, args, kwargs) > LARGEST_REAL
            if (func is torch.empty or large) and kwargs.get("device") in (None, "cpu"):
                kwargs = {**kwargs, "device": "meta"}
            return func(*args, **kwargs)

    return EmptyOnMeta()


def build_meta(spec: ModelSpec, *, attn_implementation: str | None = None, initialize: bool = True) -> PreTrainedModel:
    """The model with fp32 parameters on the meta device and real (CPU) buffers such as RoPE frequencies;
    ``initialize=False`` skips transformers' weight initialization, for a build whose sizes alone are read: on
    meta tensors it changes no value but still walks every module (most of a parameter count's time)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(spec.config)  # the spec's own is shared (its dict keys the forecast cache)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    config.use_cache = False
    # fp32 master weights whatever the config's dtype (the catalog's real models say bfloat16): every engine and
    # the forecast's trace take their dtype from here; bf16 compute is the engines' mixed precision.
    if initialize:
        skip_init = contextlib.nullcontext()
    else:
        from transformers.initialization import no_init_weights

        skip_init = no_init_weights()
    with init_empty_weights(include_buffers=False), _empty_on_meta(), skip_init:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    model.tie_weights()  # transformers 5 ties only in from_pretrained
    model._ljperf_built = True  # ljperf's runs plan recompute through --recompute; the startup hook keeps off
    return model


def format_params(n: int) -> str:
    """Parameters with two decimals in billions, e.g. ``8.03B``, or millions below 0.1B (``1.26M``)."""
    return f"{n / 1e9:.2f}B" if n >= 10**8 else f"{n / 1e6:.2f}M"
