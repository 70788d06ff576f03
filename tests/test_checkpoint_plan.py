"""The recompute solver's search and ``ljperf plan --recompute auto``: the plan it prints is the cheapest that
fits, an impossible budget exits 2 with what would fit, and an optimizer-bound peak says checkpointing cannot
help."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

from ljperf.cli import main
from ljperf.core.errors import EXIT_DOES_NOT_FIT
from ljperf.core.plans import Plan
from ljperf.core.units import format_bytes
from ljperf.forecast import Recipe, forecast
from ljperf.models.spec import resolve
from ljperf.recompute import cost
from ljperf.recompute.closed_loop import corrected_scale
from ljperf.recompute.cost import Rates, RecomputeCost, layer_cost, run_rates, timed_layer
from ljperf.recompute.solver import TIE_SHARE, activation_bytes, advice, ordered_plan, solve, solve_recipe

RATES = Rates(flops_per_s=1e12, bytes_per_s=1e11)
COST = RecomputeCost(tokens=1, saved_flops=3e9, pointwise_bytes=1e9)  # full 13 ms, selective 10 ms per layer


def synthetic_peak(saved: dict[str, int], base: int):
    """A monotone forecast: the base plus every layer's kept activations, or the last backward's recompute."""
    return lambda plan: (base + max(sum(saved[m] for m in plan), saved["none"] + saved["full"]), "backward")


@pytest.mark.parametrize("layers", [1, 4, 9, 32])
def test_solver_finds_the_exhaustive_optimum_with_few_forecasts(layers):
    saved = {"none": 100, "selective": 45, "full": 10}
    peak = synthetic_peak(saved, base=50)
    for budget in range(0, 50 + layers * saved["none"] + 200, 37):
        calls: list = []
        decision = solve(
            layers=layers,
            budget=budget,
            peak=lambda plan, calls=calls: calls.append(plan) or peak(plan),
            cost=COST,
            rates=RATES,
            advise=lambda: ["more"],
        )
        plans = [
            (f * COST.seconds("full", RATES) + s * COST.seconds("selective", RATES), f + s, ordered_plan(layers, f, s))
            for f, s in itertools.product(range(layers + 1), repeat=2)
            if f + s <= layers
        ]
        fitting = [p for p in plans if peak(p[2])[0] <= budget]
        if not fitting:  # the cheapest plan at the lowest peak (none when recompute saves under 2%)
            lowest = min(peak(p[2])[0] for p in plans)
            at_lowest = min(p for p in plans if peak(p[2])[0] == lowest)[2]
            useless = peak(("none",) * layers)[0] - lowest < 0.02 * peak(("none",) * layers)[0]
            assert decision.fits is False and decision.advice[-1] == "more"
            assert decision.plan == (("none",) * layers if useless else at_lowest), budget
            continue
        assert decision.fits and decision.plan == near_tie_pick(fitting, layers), budget
        assert decision.forecast_bytes == peak(decision.plan)[0] <= budget
        assert len(calls) == len(set(calls)) <= 2 * layers + 4  # a walk, not the (L+1)(L+2)/2 pairs


def near_tie_pick(fitting: list[tuple[float, int, Plan]], layers: int) -> Plan:
    """Of the fewest selective layers that fit with each number of full layers, those within ``TIE_SHARE`` of a
    step (three forwards of every layer) of the fastest, the one of the fewest layers recomputed, then full."""
    if fitting[0][1] == 0:  # nothing recomputed fits
        return fitting[0][2]
    fewest = {}
    for seconds, _, plan in sorted(fitting, reverse=True):
        fewest[plan.count("full")] = (seconds, plan)
    fastest = min(seconds for seconds, _ in fewest.values())
    band = TIE_SHARE * 3 * layers * COST.seconds("full", RATES)
    near = [plan for seconds, plan in fewest.values() if seconds <= fastest + band]
    return min(near, key=lambda plan: (len(plan) - plan.count("none"), plan.count("full")))


def test_near_ties_are_decided_alike_under_rates_10_percent_off():
    """Selective 3 and full 2 are estimated alike (30 ms): with either rate 10% off, the cheapest flips between
    them, the solver's plan does not; and a second solve gives the same plan."""
    cost = RecomputeCost(tokens=1, saved_flops=5e9, pointwise_bytes=1e9)  # full 15 ms, selective 10 ms a layer
    peak = synthetic_peak({"none": 100, "selective": 45, "full": 10}, base=50)
    layers, budget = 8, 690
    cheapest, chosen = set(), set()
    for flops, bandwidth in itertools.product((0.9, 1, 1.1), repeat=2):
        rates = Rates(flops_per_s=1e12 * flops, bytes_per_s=1e11 * bandwidth)
        plans = [ordered_plan(layers, f, s) for f in range(layers + 1) for s in range(layers + 1 - f)]
        seconds = {p: sum(cost.seconds(m, rates) for m in p) for p in plans if peak(p)[0] <= budget}
        cheapest.add(min(seconds, key=seconds.get))
        for _ in range(2):
            chosen.add(solve(layers=layers, budget=budget, peak=peak, cost=cost, rates=rates, advise=list).plan)
    assert cheapest == {ordered_plan(layers, 0, 3), ordered_plan(layers, 2, 0)}
    assert chosen == {ordered_plan(layers, 2, 0)}


def test_rates_are_measured_once_per_device_and_kept(tmp_path, monkeypatch):
    """The second call (and a later process: the cache folder's entry) gets the first one's numbers, not a new
    measurement of a machine that may be busier now."""
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(tmp_path))
    cost._kept.cache_clear()
    cpu = torch.device("cpu")
    first = Rates.measure(cpu)
    assert Rates.measure(cpu) is first
    (entry,) = (tmp_path / "rates").iterdir()
    assert f"{torch.get_num_threads()}_threads" in entry.name and torch.__version__ in entry.name
    cost._kept.cache_clear()  # as a new process finds it
    assert Rates.measure(cpu) == first
    assert 1e8 < first.bytes_per_s < first.flops_per_s


def test_a_real_layer_times_the_recompute_auto_ranks_by():
    """``run_rates``: the rates that make the traced layer's cost what recomputing a real llama-tiny layer took
    here (full, and selective where it was the cheaper); the second call reads the cache folder."""
    spec, cpu = resolve(name="llama-tiny"), torch.device("cpu")
    shape = {"micro_batch": 2, "seq_len": 128, "attn": "sdpa"}
    traced = layer_cost(spec, **shape)
    full, selective = timed_layer(spec, **shape, device=cpu, bf16=False)
    assert full > 0 and selective > 0  # a step of each mode minus one without recompute
    rates = run_rates(spec, traced, **shape, device=cpu, bf16=False)
    assert traced.seconds("selective", rates) == pytest.approx(min(selective, full))
    assert traced.seconds("full", rates) == pytest.approx(min(selective, full) + max(full - selective, full / 100))
    start = time.perf_counter()
    assert timed_layer(spec, **shape, device=cpu, bf16=False) == (full, selective)
    assert time.perf_counter() - start < 0.5


def plan_json(capsys, *argv: str) -> tuple[int, dict, str]:
    rc = main(["plan", *argv, "--recompute", "auto", "--json"])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out), captured.err


TINY = ("--model", "torch/llama-tiny", "--device", "cpu", "--micro-batch", "2", "--seq-len", "512")


def test_plan_auto_prints_the_cheapest_plan_that_fits(capsys):
    spec = resolve(name="llama-tiny")
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=512)
    none, full = (forecast(spec, recipe.with_(recompute=(m,) * spec.layers)).device_bytes for m in ("none", "full"))
    budget = (none + full) // 2
    rc, out, _ = plan_json(capsys, *TINY, "--gpu-memory", str(budget))
    assert rc == 0
    plan = out["recompute"]["plan"]
    assert out["recompute"]["fits"] and out["recompute"]["budget_bytes"] == budget  # CPU: no margin
    assert set(plan) not in ({"none"}, {"full"})  # a partial plan: the test means something
    assert out["recipe"]["recompute"] == plan
    assert out["device_bytes"] == out["recompute"]["forecast_peak_bytes"] <= budget
    # Any cheaper plan of the same order (the last recomputed layer one step lighter) does not fit.
    last = max(i for i, m in enumerate(plan) if m != "none")
    lighter = [*plan[:last], {"full": "selective", "selective": "none"}[plan[last]], *plan[last + 1 :]]
    assert forecast(spec, recipe.with_(recompute=tuple(lighter))).device_bytes > budget
    # The same through the budget variable and the table output.
    assert main(["plan", *TINY, "--gpu-memory", "1GiB", "--recompute", "auto", "--memory-budget", str(budget)]) == 0
    out = capsys.readouterr().out
    assert (
        "recompute auto: " in out
        and f"(budget {format_bytes(budget)}: --memory-budget; rates: measured on this CPU)" in out
    ), out
    assert f"fits in the budget {format_bytes(budget)} (device 1.00 GiB): headroom " in out
    # A budget above the device's memory is its own risk: a note says so
    assert main(["plan", *TINY, "--gpu-memory", str(budget), "--recompute", "auto", "--memory-budget", "1GiB"]) == 0
    assert (
        f"note: the memory budget 1.00 GiB is more than the device's {format_bytes(budget)}" in capsys.readouterr().out
    )
    # ... and the largest micro batch is still what the device holds (it was what the budget would)
    device = ["--gpu-memory", str(budget), "--recompute", "auto", "--json"]
    largest = [
        plan_json(capsys, *TINY, *device, "--memory-budget", b)[1]["max_micro_batch"] for b in ("1GiB", str(budget))
    ]
    assert largest[0] == largest[1]


def test_a_plan_that_does_not_fit_says_what_full_recompute_would_peak_at(capsys):
    spec = resolve(name="llama-tiny")
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=512)
    none, full = (forecast(spec, recipe.with_(recompute=(m,) * spec.layers)).device_bytes for m in ("none", "full"))
    for memory, note in (
        ((none + full) // 2, "which fits; --recompute auto recomputes the fewest layers that fit"),
        (full - 1, "which does not fit either: fewer tokens per micro-step (--micro-batch, --seq-len) or a sharding"),
    ):
        assert main(["plan", *TINY, "--gpu-memory", str(memory), "--json"]) == EXIT_DOES_NOT_FIT
        out = json.loads(capsys.readouterr().out)
        assert not out["fits"] and out["recipe"]["recompute"] == ["none"] * spec.layers
        assert f"with --recompute full: {format_bytes(full)} on the device, {note}" in "\n".join(out["notes"])
    assert main(["plan", *TINY, "--gpu-memory", "1GiB", "--json"]) == 0  # it fits: no advice
    assert not any("--recompute full" in note for note in json.loads(capsys.readouterr().out)["notes"])


def test_plan_auto_nothing_fits_exits_4_with_what_would(capsys):
    spec = resolve(name="llama-tiny")
    half = Recipe(device="cpu", precision="fp32", micro_batch=1, seq_len=512, recompute=("full",) * spec.layers)
    rc, out, err = plan_json(capsys, *TINY, "--gpu-memory", str(forecast(spec, half).device_bytes))
    assert rc == EXIT_DOES_NOT_FIT
    assert out["recompute"]["fits"] is False and out["recompute"]["plan"] == ["full"] * 4
    assert out["fits"] is False and out["max_micro_batch"] == 1  # against the budget (it said true, and 7005)
    assert out["headroom_bytes"] == out["memory_budget_bytes"] - out["device_bytes"] < 0
    assert "would fit with --micro-batch 1" in err and err.count("\n") == 1


def test_plan_auto_optimizer_bound_says_checkpointing_cannot_help(capsys):
    rc, out, err = plan_json(capsys, "--model", "torch/llama-tiny", "--device", "cpu", "--seq-len", "16",
                             "--gpu-memory", "16MiB")  # fmt: skip
    assert rc == EXIT_DOES_NOT_FIT
    assert (
        out["recompute"]["advice"][0] == "the optimizer step, not activations, sets the peak: checkpointing cannot help"
    )
    assert "checkpointing cannot help" in err
    # Recompute would lower no peak worth having, so none is planned (the hook ran that; it recomputed every layer)
    assert out["recompute"]["plan"] == ["none"] * 4


def test_plan_auto_without_recompute_needed_and_bad_budget(capsys):
    rc, out, _ = plan_json(capsys, *TINY, "--gpu-memory", "1GiB")
    assert rc == 0 and set(out["recompute"]["plan"]) == {"none"}
    assert main(["plan", *TINY, "--gpu-memory", "1GiB", "--memory-budget", "10GiB"]) == 2  # not without auto
    assert "--memory-budget is the budget of --recompute auto" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_auto_70b_on_64_gpus_answers_in_seconds(capsys):
    argv = ("--model", "deepspeed/llama3.1-70b", "--gpus", "64", "--gpu-memory", "80GiB")
    plan_json(capsys, *argv)  # traces the architecture once (cached on disk for later runs)
    start = time.perf_counter()
    rc, out, _ = plan_json(capsys, *argv)
    elapsed = time.perf_counter() - start
    assert rc == 0 and elapsed < 5, elapsed
    r = out["recompute"]
    assert r["budget_bytes"] == int(80 * 1024**3 * 0.9) and r["fits"] and r["forecast_peak_bytes"] <= r["budget_bytes"]
    # A mixture: 48 full, 19 selective; without the near-tie rule 34 full and 46 selective, 4% less recompute
    # (0.72 vs 0.75 s), under 1% of the step, but 13 more layers checkpointed
    assert r["plan"].count("full") > r["plan"].count("selective") > 0
    assert r["rates"].startswith("H100 datasheet")


GiB = 1024**3


def test_closed_loop_correction_from_the_measured_peak():
    at = {"forecast": 60 * GiB, "activations": 30 * GiB, "budget": 64 * GiB}
    assert corrected_scale(measured=58 * GiB, **at) is None  # within [85% of the forecast, the budget]
    assert corrected_scale(measured=51 * GiB, **at) is None
    assert corrected_scale(measured=70 * GiB, **at) == pytest.approx(40 / 30)  # over budget: 10 GiB more activations
    assert corrected_scale(measured=45 * GiB, **at) == pytest.approx(15 / 30)  # far below the forecast
    assert corrected_scale(measured=20 * GiB, **at) == pytest.approx(0.1)  # at least a tenth
    assert corrected_scale(measured=70 * GiB, **at, scale=1.2) == pytest.approx(1.2 * 40 / 30)  # compounds
    assert corrected_scale(measured=70 * GiB, **(at | {"activations": 0})) is None  # nothing to correct
    # A plan that did not fit, measured as forecast: the forecast was right (it re-planned, activations × 8.8)
    assert corrected_scale(measured=60 * GiB, **(at | {"budget": 30 * GiB})) is None
    assert corrected_scale(measured=61 * GiB, **(at | {"budget": 30 * GiB})) == pytest.approx(31 / 30)


def test_replan_with_a_larger_activation_coefficient_recomputes_more():
    spec = resolve(name="llama-tiny")
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=512)
    none, full = (forecast(spec, recipe.with_(recompute=(m,) * spec.layers)).device_bytes for m in ("none", "full"))
    budget = (none + full) // 2
    first = solve_recipe(spec, recipe, budget=budget, rates=RATES)
    again = solve_recipe(spec, recipe, budget=budget, rates=RATES, activation_scale=1.3)
    assert first.fits and again.fits and again.forecast_bytes <= budget
    assert again.recompute_s > first.recompute_s
    plain = forecast(spec, recipe.with_(recompute=again.plan))
    assert again.forecast_bytes == plain.device_bytes + round(0.3 * activation_bytes(plain))


@pytest.mark.slow
def test_advice_names_the_least_change_of_each_kind():
    """The largest micro batch that fits (it said half of it), and on one GPU FSDP2 over the fewest GPUs that fit
    (it said only a larger budget would fit); in words for a user's script."""
    spec = resolve(name="llama-tiny")
    recipe = Recipe(device="cuda", precision="bf16-mixed", micro_batch=8, seq_len=1024)

    def full(r: Recipe) -> int:
        return forecast(spec, r.with_(recompute=("full",) * spec.layers)).device_bytes

    budget = full(recipe.with_(micro_batch=5))
    assert full(recipe.with_(micro_batch=6)) > budget
    assert advice(recipe, budget, full) == ["would fit with --micro-batch 5"]
    assert advice(recipe, budget, full, flags=False) == ["would fit with micro batch 5"]
    one = recipe.with_(micro_batch=1, seq_len=32)  # model states set the peak: sharding them is what helps
    assert full(one.with_(engine="fsdp", world=2)) < full(one)
    assert advice(one, full(one.with_(engine="fsdp", world=2)), full) == [
        "would fit with FSDP2 (engine fsdp) on 2 GPUs"
    ]
