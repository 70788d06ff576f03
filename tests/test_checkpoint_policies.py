"""Activation checkpointing policies (none, selective, full, one mode per layer; ``auto`` resolved to a per-layer
plan): gradients unchanged, the chosen layers really recompute, memory ordered."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ljperf.checkpoint.policies import (
    FullRecompute,
    NoRecompute,
    PerLayerRecompute,
    SelectiveRecompute,
    current_plan,
    every_layer,
)
from ljperf.core.errors import UsageError
from ljperf.core.plans import fixed_plan, parse_recompute, summary
from ljperf.distributed import memory
from ljperf.forecast import Recipe, forecast
from ljperf.models.build import materialize
from ljperf.models.layout import find_blocks
from ljperf.models.spec import build_meta, resolve
from ljperf.recompute.cost import Rates
from ljperf.recompute.solver import solve_recipe

PLANS = [
    ("none",) * 4,
    ("full",) * 4,
    ("selective",) * 4,
    ("full", "selective", "none", "none"),
    ("none", "full", "none", "selective"),
]


def tiny_model(seed: int = 0, attn: str = "sdpa", name: str = "llama-tiny") -> torch.nn.Module:
    spec = resolve(name=name)
    model = materialize(build_meta(spec, attn_implementation=attn), device=torch.device("cpu"), seed=seed)
    return model.train()


def tokens() -> torch.Tensor:
    return torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model(input_ids=tokens(), labels=tokens(), use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


class CountOps(TorchDispatchMode):
    """Counts matmuls actually executed (selective recompute returns saved matmul outputs without running them)."""

    def __init__(self):
        super().__init__()
        self.mm = 0
        self.grouped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.mm += 1
        if func.overloadpacket is torch.ops.aten._grouped_mm:  # a mixture of experts' gate-up and down projections
            self.grouped += 1
        return func(*args, **(kwargs or {}))


CASES = [("llama-tiny", "sdpa", plan) for plan in PLANS] + [("llama-tiny", "eager", PLANS[-1])]
CASES += [("mixtral-tiny", "sdpa", PLANS[-1])]  # experts: the routing recomputed, their matmuls kept


@pytest.mark.parametrize(("name", "attn", "plan"), CASES, ids=[f"{n}-{a}-{'-'.join(p)}" for n, a, p in CASES])
def test_gradients_bitwise_equal_under_any_plan(name, attn, plan):
    reference = grads(tiny_model(attn=attn, name=name))
    model = tiny_model(attn=attn, name=name)
    PerLayerRecompute(plan).apply(model)
    assert current_plan(model) == plan
    got = grads(model)
    for name, grad in reference.items():
        assert torch.equal(got[name], grad), name


def test_chosen_layers_recompute_their_forward():
    model = tiny_model()
    plan = ("full", "selective", "none", "full")
    PerLayerRecompute(plan).apply(model)
    calls = [0] * 4
    # A pre-hook: non-reentrant recompute stops early, after the last saved tensor, before forward hooks fire.
    for i, block in enumerate(find_blocks(model)):
        block.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    grads(model)
    assert calls == [2, 2, 1, 2]


def test_selective_recomputes_no_matmul_and_full_recomputes_all():
    counts = {}
    for mode in ("none", "selective", "full"):
        model = tiny_model()
        PerLayerRecompute((mode,) * 4).apply(model)
        with CountOps() as counter:
            grads(model)
        counts[mode] = counter.mm
    # Full recompute repeats 6 of a layer's 7 projections: it stops early, after the last tensor backward
    # needs (down_proj's input), so down_proj itself is not rerun.
    assert counts["selective"] == counts["none"]
    assert counts["full"] == counts["none"] + 4 * 6


def test_selective_recomputes_no_expert_matmul():
    """A mixture of experts' grouped matmuls are most of its layer's FLOPs: selective keeps them (it recomputed
    them before, as full does)."""
    counts = {}
    for mode in ("none", "selective", "full"):
        model = tiny_model(name="mixtral-tiny")
        PerLayerRecompute((mode,) * 4).apply(model)
        with CountOps() as counter:
            grads(model)
        counts[mode] = (counter.mm, counter.grouped)
    assert counts["none"][1] > 0
    assert counts["selective"] == counts["none"]
    assert counts["full"][1] == counts["none"][1] + 4 * 2  # gate-up and down of each layer's experts again


def test_activation_memory_ordered_none_selective_full():
    held = {}
    for mode in ("none", "selective", "full"):
        model = tiny_model()
        PerLayerRecompute((mode,) * 4).apply(model)
        with memory.LiveTensorBytes(list(model.parameters())) as tracker:
            loss = model(input_ids=tokens(), labels=tokens(), use_cache=False).loss
            held[mode] = tracker.current - tracker.baseline  # what forward keeps for backward
        del loss
    assert held["none"] > held["selective"] > held["full"]


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(Block(16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_any_modulelist_model_checkpoints_and_replans():
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(4, 16)
    model(x).square().sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    calls = [0] * 3
    for i, block in enumerate(model.blocks):
        block.up.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    for plan, expected in ((("full", "none", "selective"), [2, 1, 2]), (("none", "none", "full"), [1, 1, 2])):
        PerLayerRecompute(plan).apply(model)
        model.zero_grad(set_to_none=True)
        calls[:] = [0, 0, 0]
        model(x).square().sum().backward()
        assert calls == expected
        for name, grad in reference.items():
            assert torch.equal(dict(model.named_parameters())[name].grad, grad), name
    assert list(model.state_dict()) == list(Stack().state_dict())  # parameter names unchanged


def test_recompute_flag_values():
    assert fixed_plan(parse_recompute("2"), 4) == ("full", "full", "none", "none")
    assert fixed_plan(parse_recompute("none"), 2) == ("none", "none")
    assert fixed_plan(parse_recompute("full"), 2) == ("full", "full")
    assert parse_recompute("auto") == "auto"
    for bad in ("some", "-1"):
        with pytest.raises(UsageError):
            parse_recompute(bad)
    with pytest.raises(UsageError, match="only 4 layers"):
        fixed_plan(5, 4)
    assert summary(("full", "selective", "none", "full")) == "3/4 layers (selective 1, full 2)"


POLICIES = [
    NoRecompute(),
    SelectiveRecompute(),
    FullRecompute(),
    PerLayerRecompute(("full", "selective", "none", "full", "none", "selective")),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
def test_each_policy_gives_the_gradients_of_no_recompute_bitwise(policy):
    """On the hook scripts' tiny HF Llama (6 layers): the gradients of a model no policy touched, and the plan
    the policy says."""
    from scripts.tiny_llama import batch, build

    ids = batch(0, 0)
    grads = []
    for applied in (False, True):
        model = build().train()
        if applied:
            assert policy.apply(model) == list(model.model.layers)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    expected = policy.plan if isinstance(policy, PerLayerRecompute) else (policy.mode,) * 6
    assert current_plan(model) == expected
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


def test_selective_policy_saves_the_matmuls_full_reruns_them():
    """Backward under ``SelectiveRecompute`` runs the matmuls backward runs with every activation kept (their
    outputs were saved); under ``FullRecompute`` each layer's forward projections run again."""
    counts = {}
    for policy in (NoRecompute(), SelectiveRecompute(), FullRecompute()):
        model = tiny_model()
        policy.apply(model)
        loss = model(input_ids=tokens(), labels=tokens(), use_cache=False).loss
        with CountOps() as counter:
            loss.backward()
        counts[policy.mode] = counter.mm
    assert counts["selective"] == counts["none"]
    assert counts["full"] == counts["none"] + 4 * 6  # of 7 projections: recompute stops after down_proj's input


def test_auto_resolves_through_the_solver_to_a_per_layer_plan():
    """``--recompute auto``'s decision under a budget between the forecasts with no and with full recompute is a
    ``PerLayerRecompute`` of its plan, which recomputes some layers and applies as that plan."""
    spec = resolve(name="llama-tiny")
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=64)
    none, full = (forecast(spec, recipe.with_(recompute=(m,) * spec.layers)).device_bytes for m in ("none", "full"))
    rates = Rates(flops_per_s=1e11, bytes_per_s=1e10)  # fixed: the plan depends on no timing
    decision = solve_recipe(spec, recipe, budget=(none + full) // 2, rates=rates)
    assert decision.fits and set(decision.plan) != {"none"}
    assert decision.policy == PerLayerRecompute(decision.plan)
    model = tiny_model()
    decision.policy.apply(model)
    assert current_plan(model) == decision.plan


def test_a_plan_of_an_unknown_mode_or_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="recompute mode 'some'"):
        PerLayerRecompute(("full", "some"))
    with pytest.raises(ValueError, match="recompute mode 'some'"):
        every_layer("some")
    with pytest.raises(ValueError, match="plan has 3 entries for 4 layers"):
        PerLayerRecompute(("full",) * 3).apply(tiny_model())
    assert every_layer("selective") == SelectiveRecompute()
