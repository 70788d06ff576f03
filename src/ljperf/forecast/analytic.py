"""Closed-form activation bytes (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", adapted to RMSNorm, RoPE, GQA and SwiGLU as HF Llama-style code saves them).

Used when tracing fails and as a cross-check of the traced coefficients (tests compare the two).
Per token and layer, with ``a`` the matmul activation width (2 bytes under bf16 autocast, 4 in fp32):
two RMSNorms keep input, output and the per-token rsqrt in fp32 (2·4h + 4 each; with bf16 parameters the
fp32 upcast of the input and the rsqrt, 4h + 4); Q/K/V outputs and their rotated copies 2a(h + 2·kv·d);
attention output a·h plus the fp32 log-sum-exp per head; SwiGLU keeps gate, up, SiLU(gate) and their
product (4a·ffn); under autocast the bf16 casts of both norm outputs (2a·h) and, per layer, where the
parameters are fp32 (DDP), the bf16 weight copies its matmuls save (2 bytes per parameter, not per token).
Eager attention keeps the fp32 softmax and, under bf16, its cast (heads·s·4, or heads·s·(4 + a)), and its
output in place of the log-sum-exp (a·heads·d − 4·heads). Qwen3's per-head RMSNorms of Q
and K keep the fp32 upcast of their input, the normalised output in the activation width and a per-head
rsqrt, (4 + a)(heads + kv)·d + 4(heads + kv). Full recompute keeps only the layer input (4h). ``d`` is the
query·key width for Q and K and the value width for V and the output, where they differ (MLA).
"""

from __future__ import annotations

from ljperf.forecast.recipe import Recipe
from ljperf.models.spec import ModelSpec

QK_NORM = ("qwen3",)
"""Architectures whose attention normalises Q and K per head (HF ``q_norm``/``k_norm``)."""


def layer_bytes(spec: ModelSpec, recipe: Recipe, mode: str) -> int:
    """Activation bytes one decoder layer keeps for its backward."""
    tokens = recipe.micro_batch * recipe.seq_len
    h, heads, kv = spec.hidden, spec.heads, spec.kv_heads
    qk, v = spec.attention_widths
    if mode == "full":  # the layer's input: the residual stream, bf16 with bf16 parameters
        return (2 if recipe.trace_precision == "bf16-params" else 4) * h * tokens
    a = 2 if recipe.precision != "fp32" else 4
    ffn = spec.fact("intermediate_size", 4 * h)
    # bf16 parameters (FSDP2, DeepSpeed): each RMSNorm keeps its fp32 upcast of the input and the rsqrt instead
    per_token = 2 * (4 * h + 4) if recipe.trace_precision == "bf16-params" else 2 * (2 * 4 * h + 4)
    per_token += 2 * a * (heads * qk + kv * (qk + v)) + a * heads * v + 4 * heads
    per_token += expert_bytes(spec, a=a, ffn=ffn) if _experts(spec) > 1 else 4 * a * ffn
    weights = 0
    if a == 2:
        per_token += 2 * a * h
    if recipe.trace_precision == "bf16-mixed":  # fp32 parameters under autocast (DDP): per-op weight copies
        weights = 2 * ((heads + kv) * h * (qk + v) + 3 * h * ffn)
    if spec.fact("model_type") in QK_NORM:
        per_token += (4 + a) * (heads + kv) * qk + 4 * (heads + kv)
    if recipe.attn_implementation == "eager":
        probs = 4 + (a if a < 4 else 0)  # the fp32 softmax, and its cast when the matmuls run narrower
        per_token += heads * recipe.seq_len * probs + a * heads * v - 4 * heads
    return per_token * tokens + weights


def _experts(spec: ModelSpec) -> int:
    return spec.fact("num_local_experts") or spec.fact("num_experts") or 1


def expert_bytes(spec: ModelSpec, *, a: int, ffn: int) -> int:
    """Per token, what a mixture of experts keeps in place of the SwiGLU MLP, as transformers' experts loop keeps
    it (counted with saved-tensor hooks on mixtral-tiny): the router's fp32 softmax (E·4), its top-k indices and
    normalised values (k·(8 + 4)) and their sum; and for each of the k experts a token goes to, three hidden-wide
    tensors (the gathered input, the down projection's output and its product with the routing weight), the
    gate-up output, SiLU(gate) and its product with up (a·(3h + 4·ffn)), the token's index and its weight (8 + 4)."""
    k = getattr(spec.config, "num_experts_per_tok", 1)
    router = 4 * _experts(spec) + k * (8 + 4) + 4
    return router + k * (a * (3 * spec.hidden + 4 * ffn) + 12)


def head_bytes(spec: ModelSpec, recipe: Recipe) -> int:
    """Logits (in the autocast width), their fp32 copy and log-softmax, kept until the loss backward (none under
    the chunked loss, which recomputes each chunk's there)."""
    tokens = recipe.micro_batch * recipe.seq_len
    if recipe.loss == "chunked":
        return 4 * spec.hidden * tokens
    a = 2 if recipe.precision != "fp32" else 4
    return tokens * spec.vocab * (a + 4 + (4 if a == 2 else 0)) + 4 * spec.hidden * tokens


def activation_bytes(spec: ModelSpec, recipe: Recipe) -> int:
    """All activations of one micro-step at the end of the forward (embedding output, layers, head)."""
    layers = sum(layer_bytes(spec, recipe, mode) for mode in recipe.layer_modes(spec.layers))
    return 4 * spec.hidden * recipe.micro_batch * recipe.seq_len + layers + head_bytes(spec, recipe)
