"""Per-layer recompute plans: gradients unchanged, the chosen layers really recompute, memory ordered."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ljperf.checkpoint.apply import apply_plan, current_plan, find_blocks
from ljperf.core.errors import UsageError
from ljperf.core.plans import fixed_plan, parse_recompute, summary
from ljperf.distributed import memory
from ljperf.models.build import materialize
from ljperf.models.spec import build_meta, resolve

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
    apply_plan(model, plan)
    assert current_plan(model) == plan
    got = grads(model)
    for name, grad in reference.items():
        assert torch.equal(got[name], grad), name


def test_chosen_layers_recompute_their_forward():
    model = tiny_model()
    plan = ("full", "selective", "none", "full")
    apply_plan(model, plan)
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
        apply_plan(model, (mode,) * 4)
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
        apply_plan(model, (mode,) * 4)
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
        apply_plan(model, (mode,) * 4)
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
        apply_plan(model, plan)
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
