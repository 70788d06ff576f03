"""Model catalog and model arithmetic against published and hand-computed figures; the listing, refusals of
unsupported layouts and absurd sizes, and meta builds that make nothing large for real."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from ljperf.core.errors import UsageError
from ljperf.models.build import materialize
from ljperf.models.catalog import catalog_names, read_config_dict, split_model_arg
from ljperf.models.layout import decoder_layers
from ljperf.models.spec import build_meta, format_params, resolve

from conftest import FORECAST_TOLERANCE, MOE, cli_env, run_ljperf, run_main

REQUIRED = [
    "llama3-8b",
    "llama3.1-8b",
    "llama3.1-70b",
    "llama3.2-1b",
    "llama3.2-3b",
    "qwen2.5-0.5b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "qwen3-8b",
    "mistral-7b",
    "llama-tiny",
    "qwen-tiny",
]


def test_catalog_has_the_required_models():
    assert set(REQUIRED) <= set(catalog_names())


@pytest.mark.parametrize(
    ("name", "published_billions", "digits"),
    [
        ("llama3-8b", 8.03, 2),
        ("llama3.1-70b", 70.6, 1),
        ("qwen2.5-7b", 7.62, 2),
        ("llama3.2-1b", 1.24, 2),
        ("qwen2.5-0.5b", 0.49, 2),
    ],
)
def test_parameter_counts_match_published(name, published_billions, digits):
    assert round(resolve(name=name).params.total / 1e9, digits) == published_billions


@pytest.mark.parametrize(
    ("name", "total_billions", "active_billions"),
    [("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.3), ("llama3-8b", 8.0, 8.0)],
)
def test_mixture_of_experts_counts_match_published(name, total_billions, active_billions):
    """Mistral's and Qwen's model cards: 46.7B parameters of which 12.9B used per token; 30.5B, 3.3B activated
    (3.35B here: the card rounds down)."""
    params = resolve(name=name).params
    assert round(params.total / 1e9, 1) == total_billions
    assert params.active / 1e9 == pytest.approx(active_billions, rel=0.02)


def _tiny_by_hand(*, vocab, hidden, inter, layers, heads, kv, head_dim, tied, qkv_bias):
    attn = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
    if qkv_bias:
        attn += heads * head_dim + 2 * kv * head_dim
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    embedding = vocab * hidden
    total = layers * per_layer + embedding + (0 if tied else embedding) + hidden
    return total, embedding


def test_llama_tiny_counts_and_flops_by_hand():
    spec = resolve(name="llama-tiny")
    total, emb = _tiny_by_hand(
        vocab=2048, hidden=128, inter=352, layers=4, heads=4, kv=2, head_dim=32, tied=False, qkv_bias=False
    )
    assert spec.params.total == total == 1_262_720
    assert spec.params.embedding == emb
    # 6·(N − N_embedding) + 12·L·H·Q·T with the untied LM head inside N.
    assert spec.flops_per_token(256) == 6 * (total - emb) + 12 * 4 * 4 * 32 * 256


def test_learned_positions_are_no_matmul(tmp_path):
    """GPT-2's position table is a lookup as the token table is: out of the 6·N of the FLOPs."""
    h, layers, vocab, positions = 64, 2, 512, 128
    path = tmp_path / "gpt2.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_embd": h,
                "n_layer": layers,
                "n_head": 2,
                "vocab_size": vocab,
                "n_positions": positions,
            }
        )
    )
    spec = resolve(path=path)
    per_layer = 12 * h * h + 13 * h  # qkv, out, 4h MLP in and out with biases; two layer norms
    assert spec.params.total == layers * per_layer + vocab * h + positions * h + 2 * h
    assert spec.params.matmul == layers * per_layer + 2 * h + vocab * h  # the tied head is a matmul


def test_tied_head_is_still_a_matmul():
    spec = resolve(name="qwen-tiny")
    total, _ = _tiny_by_hand(
        vocab=2048, hidden=128, inter=352, layers=4, heads=4, kv=2, head_dim=32, tied=True, qkv_bias=True
    )
    assert spec.params.total == total
    assert spec.params.matmul == total  # embedding table removed, tied LM head counted back
    assert spec.flops_per_token(128) == 6 * total + 12 * 4 * 4 * 32 * 128


def test_llama3_8b_flops_per_token():
    spec = resolve(name="llama3-8b")
    n_emb = 128256 * 4096
    assert spec.flops_per_token(8192) == 6 * (8_030_261_248 - n_emb) + 12 * 32 * 32 * 128 * 8192


def test_mla_attention_flops_count_its_query_key_and_value_widths(tmp_path):
    """DeepSeek's MLA: query·key 128 + 64 wide per head, value 128; its config's head_dim (64) is the rotary
    part alone, so 12·L·H·head_dim·T counted 2.5× too few attention FLOPs (and MFU)."""
    mla = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2}
    mla |= {"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128, "first_k_dense_replace": 2}
    mla |= {"kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(mla | {"v_head_dim": 128}))
    spec = resolve(path=path)
    assert spec.head_dim == 64 and spec.attention_widths == (192, 128)
    assert spec.flops_per_token(1024) == 6 * spec.params.matmul + 6 * 2 * 4 * (192 + 128) * 1024


def test_70b_is_built_on_meta_without_allocating():
    start = time.perf_counter()
    model = build_meta(resolve(name="llama3.1-70b"))
    assert time.perf_counter() - start < 20
    assert all(p.device.type == "meta" for p in model.parameters())


def test_materialize_is_seeded_and_keeps_ties():
    spec = resolve(name="qwen-tiny")
    a = materialize(build_meta(spec), device=torch.device("cpu"), seed=3)
    b = materialize(build_meta(spec), device=torch.device("cpu"), seed=3)
    c = materialize(build_meta(spec), device=torch.device("cpu"), seed=4)
    assert a.lm_head.weight is a.model.embed_tokens.weight
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    assert torch.allclose(a.model.rotary_emb.inv_freq, b.model.rotary_emb.inv_freq)


def test_model_config_path(tmp_path):
    data = read_config_dict(name="llama-tiny")
    (tmp_path / "config.json").write_text(json.dumps(data))
    spec = resolve(path=tmp_path)
    assert spec.params.total == resolve(name="llama-tiny").params.total


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"model_type": "llama"}', "missing"),
        (
            '{"model_type": "no-such-arch", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, '
            '"num_attention_heads": 1}',
            "cannot build",
        ),
        (  # accepted by transformers' config validation, fails when the model is built
            '{"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, '
            '"num_attention_heads": 1, "rope_scaling": {"type": "bogus"}}',
            "cannot build the model: KeyError: 'bogus'",
        ),
    ],
)
def test_bad_model_configs_are_usage_errors(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        resolve(path=path)


@pytest.mark.slow
@pytest.mark.parametrize("refused", [True, False])
def test_transformers_warnings_show_only_for_an_accepted_config(tmp_path, refused):
    """eos_token_id outside the vocabulary (and an unknown rope type) make transformers warn; with a refused
    config only the error line is printed, with an accepted one the warning is."""
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 8, "num_hidden_layers": 1}
    config |= {"num_attention_heads": 2, "eos_token_id": 100} | ({"rope_scaling": {"type": "bogus"}} if refused else {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = run_ljperf("plan", "--model-config", str(tmp_path), "--device", "cpu", "--seq-len", "8", "--json")
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode == (2 if refused else 0), proc.stderr
    assert ("eos_token_id must be" in line) != refused and ("KeyError: 'bogus'" in line) == refused


def test_building_a_model_leaves_the_specs_config_alone():
    """build_meta sets use_cache and the attention on its model's config, not the spec's: the spec's keys the
    forecast cache, so ``plan`` and ``benchmark`` (which builds first) would trace the same model twice."""
    from ljperf.forecast.cache_key import architecture_key

    spec = resolve(name="llama-tiny")
    before = architecture_key(spec)
    model = build_meta(spec, attn_implementation="eager")
    assert model.config.use_cache is False and model.config._attn_implementation == "eager"
    assert architecture_key(spec) == before


def test_a_config_seen_before_is_read_from_the_cache_and_built_when_first_asked_for(tmp_path, monkeypatch):
    """A warm ``ljperf plan`` reads the config's facts from the cache instead of building it (seconds of
    transformers imports); what it reads must key the same traces, and the config object built later must be
    the one a cold resolve builds."""
    from ljperf.forecast.cache_key import architecture_key

    monkeypatch.setenv("LJPERF_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "config.json"  # GPT-2's attribute map: its n_embd is the hidden_size
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 2}))
    cold, warm = resolve(path=config), resolve(path=config)
    assert "config" in cold.__dict__ and "config" not in warm.__dict__
    facts = ("layers", "hidden", "vocab", "heads", "kv_heads", "head_dim", "max_positions", "architecture")
    assert [getattr(warm, f) for f in facts] == [getattr(cold, f) for f in facts]
    assert (warm.attention(None), architecture_key(warm)) == (cold.attention(None), architecture_key(cold))
    assert warm.config.to_dict() == cold.config.to_dict()
    assert (warm.hidden, warm.layers, warm.heads) == (16, 2, 2)
    (saved,) = (tmp_path / "cache" / "models").iterdir()
    saved.write_text("{")  # damaged: built again
    assert "config" in resolve(path=config).__dict__


@pytest.mark.slow
def test_a_warm_plan_imports_no_transformers(capsys):
    """``ljperf plan`` answers from cached facts and coefficients without transformers (70B: 8.7 s, now 3.7)."""
    argv = ["plan", "--model", "torch/llama-tiny", "--device", "cpu", "--precision", "fp32", "--micro-batch", "2"]
    argv += ["--seq-len", "64", "--recompute", "auto", "--memory-budget", "40MiB", "--json"]
    # This process fills the cache where the session's other tests have not; a fresh process then plans warm
    assert run_main(capsys, *argv)[0] == 0
    code = f"import sys; from ljperf.cli import main; code = main({argv!r}); print(sorted(sys.modules)); sys.exit(code)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "'transformers'" not in proc.stdout.splitlines()[-1]


def test_unknown_model_names_the_closest():
    with pytest.raises(UsageError, match="closest: llama3-8b"):
        split_model_arg("torch/llama3-8")
    with pytest.raises(UsageError, match="unknown engine"):
        split_model_arg("jax/llama-tiny")


def test_a_model_without_sdpa_runs_eager_by_default_and_refuses_sdpa(tmp_path, capsys):
    """A transformers class with no SDPA attention (BLOOM's; Gemma 2's in transformers 5.24, not 5.17): with
    ljperf's sdpa default Gemma 2's run failed after the model was built (ValueError, status error) and it got
    no forecast; transformers itself picks eager."""
    from transformers import AutoConfig

    bloom = AutoConfig.for_model("bloom", hidden_size=64, n_layer=2, n_head=4, vocab_size=1024).to_dict()
    config = tmp_path / "bloom.json"
    config.write_text(json.dumps(bloom | {"architectures": ["BloomForCausalLM"]}))
    spec = resolve(path=config)
    assert (spec.attention(None), spec.attention("eager"), resolve(name="llama-tiny").attention(None)) == (
        "eager",
        "eager",
        "sdpa",
    )
    with pytest.raises(UsageError, match=r"--attn-implementation sdpa: .*bloom.json \(Bloom\) has no SDPA"):
        spec.attention("sdpa")
    out = tmp_path / "r.json"
    args = ("--model-config", str(config), "--device", "cpu", "--seq-len", "32", "--steps", "1", "--warmup", "1")
    code, _, stderr = run_main(capsys, "benchmark", *args, "--output", str(out))
    assert code == 0, stderr
    record = json.loads(out.read_text())
    assert record["config"]["train"]["attn_implementation"] == "eager"
    assert abs(record["results"]["forecast"]["error_pct"]) < 100 * FORECAST_TOLERANCE, record["results"]["forecast"]


def test_llama4_text_decoder_layers_are_found(tmp_path):
    """Llama 4's causal LM is its own ``get_decoder()`` (its base-model prefix names the multimodal model's
    language part); its layers sit at ``model.layers``, where a --model-config of it had been refused."""
    from transformers import AutoConfig

    size = {"hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128, "num_hidden_layers": 2}
    size |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
    config = AutoConfig.for_model("llama4_text", **size, num_local_experts=2, pad_token_id=0, eos_token_id=1)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    spec = resolve(path=path)
    model = build_meta(spec)
    assert decoder_layers(model) is model.model.layers and len(model.model.layers) == 2


def test_a_671b_mixture_of_experts_is_built_on_the_meta_device(tmp_path):
    """DeepSeek-V3 at its real size (transformers' defaults): its experts are one 3-D tensor per layer, which
    ``init_empty_weights`` moved to meta only after ``torch.empty`` had made it (30 GB each: out of memory)."""
    from transformers import AutoConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(AutoConfig.for_model("deepseek_v3").to_dict()))
    assert format_params(resolve(path=path).params.total) == "671.03B"


@pytest.mark.parametrize("model", ["mixtral-tiny", "llama-tiny", "qwen2_moe", "deepseek_v3", "gpt_oss", "llama4_text"])
def test_flops_per_token_are_what_torch_counts_in_a_training_step(model, tmp_path):
    """The FLOPs behind TFLOPS and MFU against torch's own FLOP counter over a real forward and backward, with
    eager attention and eager experts (each expert a plain matmul over the tokens routed to it, which the counter
    sees). A mixture of experts counts the top-k experts a token is routed to: counting every expert made
    Mixtral's MFU 3.6× too high, DeepSeek-V3's 18×. Llama 4's transformers code runs every expert on every token
    (routing weights zero the others), so the counter sees the unrouted experts' work too; MFU counts the model's."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    if model in MOE:
        size = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1024}
        size |= {"intermediate_size": 256, "num_key_value_heads": 2, "head_dim": 32} | MOE[model]
        config = AutoConfig.for_model(model, **size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
        spec = resolve(path=tmp_path / "config.json")
    else:
        spec = resolve(name=model)
    net = AutoModelForCausalLM.from_config(spec.config, attn_implementation="eager", experts_implementation="eager")
    batch, seq = 2, 64
    ids = torch.randint(0, spec.vocab, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        net(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    counted = counter.get_total_flops() / (batch * seq)
    unrouted = spec.params.total - spec.params.active
    assert (unrouted > 0) == (model != "llama-tiny")
    expected = spec.flops_per_token(seq) + (6 * unrouted if model == "llama4_text" else 0)
    assert counted == pytest.approx(expected, rel=0.01)


# --- the listing, refusals of layouts and sizes, meta builds ----------------------------------------------------


def test_a_second_model_listing_builds_nothing_and_imports_no_torch(tmp_path):
    """``ljperf models`` took 13–17 s to print a static table: it built every catalog model on the meta device."""
    env = cli_env(LJPERF_CACHE_DIR=str(tmp_path))
    code = "import sys; from ljperf.cli import main; code = main(['models', '--json']); print('torch' in sys.modules)"
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert first.stdout.split()[-1] == "True" and second.stdout.split()[-1] == "False"
    assert first.stdout == second.stdout.replace("False", "True")


def test_an_unsupported_layout_is_said_in_a_whole_sentence():
    """BERT's refusal ended mid-sentence: "... or GPT-2 and Falcon (transformer.h) are"."""
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8))
    with pytest.raises(UsageError) as refused:
        decoder_layers(bert)
    assert str(refused.value).endswith("as Llama, Qwen, Gemma and OPT are (model.layers) or as GPT-2 and Falcon are"
                                       " (transformer.h)"), str(refused.value)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "text"),
    [
        ({"hidden_size": 10**9, "num_attention_heads": 1, "num_key_value_heads": 1}, "parameters, more than the 1e+13"),
        ({"num_hidden_layers": 100_000}, "num_hidden_layers 100,000 is more than the 10,000"),
    ],
)
def test_an_absurd_config_is_refused_before_anything_is_built(change, text, tmp_path, capsys):
    """A hidden size of 10^9 made ``plan`` allocate ~4 GB at a time and 100,000 layers built a 100k-layer model:
    neither finished in 300 s. Refused from the file's own numbers, before transformers is imported."""
    import ljperf.plan.record  # noqa: F401 - imported before the clock starts: the command's own imports
    from ljperf.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(read_config_dict(name="llama-tiny") | change))
    started = time.monotonic()
    assert main(["plan", "--model-config", str(config), "--gpu", "H100"]) == 2
    assert time.monotonic() - started < 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0], err


def test_a_meta_build_makes_no_large_filled_tensor_for_real():
    """``torch.ones`` of a norm weight is made for real and only then moved to the meta device."""
    from ljperf.models.spec import LARGEST_REAL, _empty_on_meta

    with _empty_on_meta():
        large = torch.ones(LARGEST_REAL + 1), torch.zeros((2, LARGEST_REAL)), torch.full((LARGEST_REAL + 1,), 2.0)
        small = torch.ones(8), torch.arange(4.0)
    assert [t.device.type for t in large] == ["meta"] * 3 and [t.device.type for t in small] == ["cpu"] * 2
