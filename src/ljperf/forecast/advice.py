"""The buffer or setting that dominates a forecast peak, and the setting that shrinks it (``dominant_term``).

Use: ``dominant_term(spec, recipe, forecast(spec, recipe))`` → ``"DeepSpeed's gradient bucket
(zero_optimization.reduce_bucket_size 500,000,000 elements) is 1.87 GiB of the 1.88 GiB peak (99%): lower
reduce_bucket_size in --deepspeed-config (hidden², 16,384 elements, ljperf's "auto": forecast 19.33 MiB)"`` (a
llama-tiny on 2 CPU ranks at ZeRO-2, DeepSpeed's default bucket), or None. ``ljperf plan`` (a note), the
recompute solver's advice (the benchmark's and the startup hook's planning line) and the benchmark's memory check
all say it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ljperf.core.units import format_bytes
from ljperf.forecast.api import forecast
from ljperf.forecast.recipe import Forecast, Recipe
from ljperf.models.spec import ModelSpec

DOMINANT_SHARE = 0.40
"""A term dominates the peak from this share of it on."""

Knob = Callable[[ModelSpec, Recipe, bool, str | None], tuple[str, str] | None]
"""(spec, recipe, flags, device name) → (what the term is, the setting that shrinks it), None when no setting
does; ``flags``: ljperf's."""


def dominant_term(
    spec: ModelSpec, recipe: Recipe, result: Forecast, *, device_name: str | None = None, flags: bool = True
) -> str | None:
    """One line naming the term of ``result``'s peak that dominates it and the setting that shrinks it; None when
    none does. The rule: the single largest named term of ``result.breakdown`` (``temporaries``, what is left of
    the peak once the terms are counted, is not one) is at least ``DOMINANT_SHARE`` (40%) of the peak allocated
    bytes, and it is a buffer or setting with a knob of its own (``KNOBS``: DeepSpeed's gradient bucket and
    ZeRO-3's gathered parameters, FSDP2's gathered parameters and its fp32 reduce-scatter buffers; DDP's buckets,
    a quarter of the model states at most, never reach the share). Activations and the model states are left to
    the other advice (recompute, smaller micro-steps, sharding, more ranks). ``flags``: the settings as ljperf's
    flags, else in words (a user's script)."""
    terms = {name: size for name, size in result.breakdown.items() if name != "temporaries"}
    peak = result.peak_allocated_bytes
    if not terms or peak <= 0:
        return None
    name, size = max(terms.items(), key=lambda kv: kv[1])
    knob = KNOBS.get((recipe.engine, name))
    if size < DOMINANT_SHARE * peak or knob is None or (named := knob(spec, recipe, flags, device_name)) is None:
        return None
    what, fix = named
    return f"{what} is {format_bytes(size)} of the {format_bytes(peak)} peak ({size / peak:.0%}): {fix}"


def _config(flags: bool) -> str:
    return "--deepspeed-config" if flags else "the DeepSpeed config"


def _reduce_bucket(spec: ModelSpec, recipe: Recipe, flags: bool, device_name: str | None) -> tuple[str, str]:
    zero = recipe.zero
    bucket, auto = zero.reduce_bucket_elements(spec.hidden), spec.hidden * spec.hidden
    twice = ", two of them: overlap_comm" if recipe.zero_stage < 3 and zero.ipg_buffers() == 2 else ""
    what = f"DeepSpeed's gradient bucket (zero_optimization.reduce_bucket_size {bucket:,} elements{twice})"
    fix = f"lower reduce_bucket_size in {_config(flags)}"
    if bucket > auto:
        smaller = recipe.with_(zero=replace(zero, reduce_bucket_size=auto))
        peak = forecast(spec, smaller, device_name=device_name).device_bytes
        fix += f' (hidden², {auto:,} elements, ljperf\'s "auto": forecast {format_bytes(peak)})'
    return what, fix


def _zero3_gathered(spec: ModelSpec, recipe: Recipe, flags: bool, device_name: str | None) -> tuple[str, str]:
    zero = recipe.zero  # only ZeRO-3 gathers
    what = (
        f"ZeRO-3's gathered parameters (stage3_prefetch_bucket_size {zero.prefetch_bucket_size:,},"
        f" stage3_max_live_parameters {zero.max_live_parameters:,} elements)"
    )
    fix = (
        f"lower stage3_max_live_parameters and stage3_prefetch_bucket_size in {_config(flags)}, and"
        " stage3_max_reuse_distance (a layer used again within it stays gathered until its backward)"
    )
    return what, fix


def _fsdp_gathered(spec: ModelSpec, recipe: Recipe, flags: bool, device_name: str | None) -> tuple[str, str]:
    if not recipe.reshard_after_forward:
        flag = "--reshard-after-forward (the default)" if flags else "fully_shard(reshard_after_forward=True)"
        return "FSDP2's gathered parameters (kept from each layer's forward to its backward)", f"{flag} frees them"
    what = (
        "FSDP2's gathered parameters (the root's embedding, final norm and LM head from forward to backward; a"
        " layer's with the next one prefetched)"
    )
    fix = (
        "fully_shard the embedding and the LM head as groups of their own, or prefetch fewer layers"
        " (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch)"
    )
    return what, fix


def _fsdp_reduce(spec: ModelSpec, recipe: Recipe, flags: bool, device_name: str | None) -> tuple[str, str] | None:
    if recipe.precision == "bf16":  # bf16 weights: the gradients are reduced in bf16 already
        return None
    copied = ", and gloo's copy of each on CPU" if recipe.device == "cpu" else ""
    what = f"FSDP2's reduce-scatter buffers (a layer's gradients in fp32{copied})"
    policy = "MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)"
    if flags:  # ljperf's fsdp engine reduces in the master weights' dtype
        return what, f"--precision bf16 (bf16 weights) reduces in bf16; a script of its own can set {policy}"
    return what, f"reduce in bf16: {policy} halves them"


KNOBS: dict[tuple[str, str], Knob] = {
    ("deepspeed", "comm_buffers"): _reduce_bucket,
    ("deepspeed", "gathered_parameters"): _zero3_gathered,
    ("fsdp", "gathered_parameters"): _fsdp_gathered,
    ("fsdp", "comm_buffers"): _fsdp_reduce,
}
"""By (engine, breakdown term): what the term is and the setting that shrinks it."""
