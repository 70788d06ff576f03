"""The step-time model (``ljperf.speed``): its arithmetic on synthetic work, calibration recovering known terms,
answers that move the right way on real traces, bad records refused in one line, and its speed once traced.

Run: ``.venv/bin/python -m pytest -q -n 0 tests/test_speed.py`` (about half a minute: a few tiny fake traces).
"""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ljperf.cli import main
from ljperf.core.records import SCHEMA_VERSION
from ljperf.forecast.recipe import Recipe
from ljperf.models.spec import resolve
from ljperf.speed import calibrate
from ljperf.speed.api import speed_for
from ljperf.speed.census import OP_CLASSES
from ljperf.speed.collectives import Collective, Links
from ljperf.speed.overlap import StepTimes, exposed
from ljperf.speed.rates import Cluster, SpeedRates, gpu_rates
from ljperf.speed.step_time import StepWork, Work, load_work, predict, price
from ljperf.speed.traffic import Traffic, ipg_calls, step_traffic

RECORD = Path(__file__).resolve().parents[1] / "benchmarks/ablation-llama-tiny-cpu-quiet/runs/local/base.r1.json"
LINKS = Links(intra_bytes_per_s=100e9, inter_bytes_per_s=10e9, latency_s=1e-5, gpus_per_node=8)
RATES = SpeedRates(
    device="synthetic",
    flops_per_s=1e12,
    bytes_per_s=1e11,
    efficiency=dict.fromkeys(OP_CLASSES, 1.0),
    links=LINKS,
)
NOTHING = Work(roofline_s=dict.fromkeys(OP_CLASSES, 0.0), ops=0.0)


def work(*, layers: int = 3, layer: Work = NOTHING, optimizer: Work = NOTHING, modes: tuple[str, ...] | None = None,
         traffic: Traffic | None = None, micro_steps: int = 1, rest: Work = NOTHING) -> StepWork:  # fmt: skip
    return StepWork(
        layer_forward=layer,
        layer_backward=layer.scaled(2, ops=2),
        recompute={"full": layer, "selective": layer.scaled(0.25, ops=0.25)},
        rest_forward=rest,
        rest_backward=rest,
        optimizer=optimizer,
        modes=modes or ("none",) * layers,
        micro_steps=micro_steps,
        traffic=traffic or Traffic(style="none"),
        tokens=1000,
        model_flops=6e12,
    )


def test_known_flops_and_rates_give_a_known_time():
    # a matmul of 2 TFLOPs (compute-bound at 1 TFLOP/s) and three pointwise ops of 40 GB (memory-bound at 100 GB/s)
    layer = price((("matmul", 2e12, 1e9, 1), ("elementwise", 0.0, 4e10, 3)), flops_per_s=1e12, bytes_per_s=1e11)
    assert layer.roofline_s["matmul"] == pytest.approx(2.0) and layer.roofline_s["elementwise"] == pytest.approx(1.2)
    assert layer.ops == 4
    rates = replace(RATES, efficiency=RATES.efficiency | {"matmul": 0.5, "elementwise": 0.6}, op_overhead_s=0.01)
    layer_s = 2.0 / 0.5 + 1.2 / 0.6 + 4 * 0.01  # 6.04 s
    speed = predict(work(layer=layer, modes=("none", "full", "selective")), rates)
    b = speed.breakdown
    assert b["forward"] == pytest.approx(3 * layer_s) and b["backward"] == pytest.approx(3 * 2 * layer_s)
    # full recomputes a layer's forward; selective its memory-bound quarter (this synthetic work's)
    assert b["recompute"] == pytest.approx(layer_s + layer_s / 4)
    assert speed.step_time_s == pytest.approx(9 * layer_s + 1.25 * layer_s)
    assert speed.tokens_per_s_per_device == pytest.approx(1000 / speed.step_time_s)
    assert speed.mfu == pytest.approx(6e12 / speed.step_time_s / 1e12)
    assert b["exposed_comm"] == b["bubble"] == b["pp_send"] == 0.0


def test_collectives_cost_as_nccl_tests_defines_bus_bandwidth_on_the_tier_they_span():
    ring = Collective(kind="all_reduce", what="all_reduce", size_bytes=1e9, ranks=8, calls=2)
    assert ring.seconds(LINKS) == pytest.approx(2 * (1e-5 + 1e9 * 2 * 7 / 8 / 100e9))
    gather = Collective(kind="all_gather", what="all_gather", size_bytes=1e9, ranks=4, stride=4)  # 16 ranks apart
    assert gather.seconds(LINKS) == pytest.approx(1e-5 + 1e9 * 3 / 4 / 10e9)  # the network's
    assert Collective(kind="all_gather", what="all_gather", size_bytes=1e9, ranks=1).seconds(LINKS) == 0.0


def test_ddp_hides_its_buckets_behind_backward_but_the_last():
    bucket = Collective(kind="all_reduce", what="all_reduce", size_bytes=1e9, ranks=2, calls=4)
    c = bucket.seconds(LINKS)
    ddp = Traffic(style="ddp", bucketed=(bucket,))

    def waits(backward: float) -> float:
        times = StepTimes(
            layer_forward=(1.0,), layer_backward=(backward,), rest_forward=0, rest_backward=0, micro_steps=1
        )
        return exposed(ddp, seconds=lambda x: x.seconds(LINKS), times=times, overlap=1.0)["backward"]

    assert waits(100.0) == pytest.approx(c / 4)  # a long backward hides all but the last bucket
    assert waits(0.0) == pytest.approx(c)  # no backward to hide behind
    in_the_way = replace(ddp, overlapped_buckets=False)
    times = StepTimes(layer_forward=(1.0,), layer_backward=(100.0,), rest_forward=0, rest_backward=0, micro_steps=1)
    assert exposed(in_the_way, seconds=lambda x: x.seconds(LINKS), times=times, overlap=1.0)["backward"] == c


def test_fsdp_hides_prefetched_gathers_and_reduce_scatters_behind_the_layers():
    gather = Collective(kind="all_gather", what="all_gather", size_bytes=1e9, ranks=2)
    scatter = Collective(kind="reduce_scatter", what="reduce_scatter", size_bytes=1e9, ranks=2)
    traffic = Traffic(style="fsdp", layer_gather=gather, gather_in_backward=True, layer_reduce=(scatter,))
    g, r = gather.seconds(LINKS), scatter.seconds(LINKS)
    slow = work(layer=Work(roofline_s=dict.fromkeys(OP_CLASSES, 0.0) | {"matmul": 10.0}, ops=0), traffic=traffic)
    b = predict(slow, RATES).breakdown
    assert b["all_gather"] == pytest.approx(6 * g) and b["reduce_scatter"] == pytest.approx(3 * r)
    # long layers: only the first gather (forward) and the last reduce-scatter wait; backward's first gather hides
    # behind nothing here (no head), so it waits too
    assert b["exposed_comm"] == pytest.approx(g + g + r)
    idle = predict(work(traffic=traffic), RATES).breakdown  # no compute: every collective waits
    assert idle["exposed_comm"] == pytest.approx(6 * g + 3 * r)


def test_zero_1_and_2_all_reduce_each_ipg_bucket_as_deepspeed_fills_them(tiny):
    # a gradient that would overflow the bucket flushes it first; one larger than the bucket goes alone
    assert ipg_calls([10, 3, 3, 20, 5, 5, 6], bucket=10) == 5
    assert ipg_calls([], bucket=10) == 0
    for stage in (1, 2):
        recipe = Recipe(engine="deepspeed", zero_stage=stage, world=2, device="cpu", precision="fp32")
        (bucket,) = step_traffic(tiny, recipe).bucketed
        # DeepSpeed's profile of llama-tiny (reduce_bucket_size hidden² = 16,384) shows 31 gloo all-reduces a
        # step: these 30 and the gradient norm's
        assert (bucket.kind, bucket.calls) == ("all_reduce", 30)
        assert bucket.calls * bucket.size_bytes == pytest.approx(4 * 1_262_720)  # fp32: every parameter once


def _record(step_work: StepWork, base: SpeedRates, truth: SpeedRates) -> dict:
    speed = predict(step_work, truth, peak_mfu=False)
    return {
        "results": {
            "status": "ok",
            "step_times_s": [speed.step_time_s],
            "breakdown": {"ms": {p: 1e3 * s for p, s in speed.phases.items()}},
            "speed": {"work": step_work.record(), "rates": base.record()},
        }
    }


def test_calibration_recovers_known_efficiencies_overhead_and_link_from_synthetic_records():
    truth = replace(
        RATES,
        efficiency={"matmul": 0.6, "attention": 0.4, "elementwise": 0.8, "norm": 0.7, "optimizer": 0.5},
        op_overhead_s=4e-4,
        links=replace(LINKS, intra_bytes_per_s=30e9, latency_s=2e-4),
    )
    rng = random.Random(0)
    records = []
    for i in range(16):
        # one rank: compute of every kind, in varied mixes; two ranks: mostly waiting for gradient buckets, of
        # totals from latency-bound to bandwidth-bound
        scale, ops = (0.001, 1.0) if i % 2 else (1.0, rng.uniform(20, 2000))
        layer = Work(roofline_s={c: scale * rng.uniform(0.05, 1.0) for c in OP_CLASSES}, ops=ops)
        total, calls = 10 ** rng.uniform(7, 11), rng.choice((4, 64, 512))
        bucket = Collective(kind="all_reduce", what="all_reduce", size_bytes=total / calls, ranks=2, calls=calls)
        traffic = Traffic(style="zero12", bucketed=(bucket,), overlapped_buckets=False) if i % 2 else None
        opt = Work(roofline_s=dict.fromkeys(OP_CLASSES, 0.0) | {"optimizer": scale * rng.uniform(0.1, 1)}, ops=100)
        records.append(_record(work(layer=layer, optimizer=opt, traffic=traffic), RATES, truth))
    terms, links = calibrate.fit(records)
    fitted = terms["synthetic"]
    for cls, eff in truth.efficiency.items():
        assert fitted.efficiency[cls] == pytest.approx(eff, rel=0.05), cls
    assert fitted.op_overhead_s == pytest.approx(4e-4, rel=0.05) and fitted.samples == 16
    assert links["synthetic"].intra_bytes_per_s == pytest.approx(30e9, rel=0.05)
    assert links["synthetic"].latency_s == pytest.approx(2e-4, rel=0.05)


def test_calibration_on_records_that_cannot_tell_its_terms_apart_keeps_them_near_their_defaults():
    """Three records of one shape on one rank, each step 1.5x the default prediction: any mix of slower classes
    and dearer ops explains them, so the prior spreads the slowdown (the larger a term's share, the more it moves:
    none past 2x) and keeps what they say nothing of (links, hooks, overlap) at the defaults."""
    base = replace(RATES, op_overhead_s=1e-4)
    truth = replace(base, efficiency={c: e / 1.5 for c, e in base.efficiency.items()}, op_overhead_s=1.5e-4)
    layer = Work(roofline_s={c: 0.01 * (i + 1) for i, c in enumerate(OP_CLASSES)}, ops=400)
    one = work(layer=layer, optimizer=Work(roofline_s=dict.fromkeys(OP_CLASSES, 0.0) | {"optimizer": 0.02}, ops=50))
    terms, links = calibrate.fit([_record(one, base, truth)] * 3)
    fitted = terms["synthetic"]
    for cls, eff in base.efficiency.items():
        assert eff / 2 <= fitted.efficiency[cls] <= eff, (cls, fitted.efficiency)
    assert base.op_overhead_s <= fitted.op_overhead_s <= 2 * base.op_overhead_s
    assert fitted.overlap == pytest.approx(base.overlap) and not links  # one rank: no link fitted
    assert fitted.hook_s == pytest.approx(base.hook_s | dict.fromkeys(base.hook_s, 1e-6))  # a GPU's 0 starts at 1 µs
    rates = replace(base, efficiency=fitted.efficiency, op_overhead_s=fitted.op_overhead_s)
    assert predict(one, rates).step_time_s == pytest.approx(predict(one, truth).step_time_s, rel=0.05)


def test_calibration_reads_the_links_of_a_comm_record():
    rows = [
        {"op": op, "size_bytes": size, "time_us": 1e6 * (3e-5 + size * factor / 5e9)}
        for op, factor in (("all_reduce", 1.0), ("all_gather", 0.5))
        for size in (2**20, 2**24, 2**28)
    ]
    record = {"kind": "comm", "env": {"world_size": 2, "devices": ["cpu"]}, "config": {"backend": "gloo"},
              "results": {"rows": rows}}  # fmt: skip
    name, link = calibrate.fit_links(record)
    assert name == "cpu" and link.intra_bytes_per_s == pytest.approx(5e9) and link.latency_s == pytest.approx(3e-5)


@pytest.fixture(scope="module")
def tiny():
    return resolve(name="llama-tiny")


def _speed(spec, **recipe):
    base = {"engine": "torch", "device": "cuda", "precision": "bf16-mixed", "micro_batch": 1, "seq_len": 64}
    found = speed_for(spec, Recipe(**base | recipe), device_name="H100", cluster=Cluster())
    assert found is not None
    return found


@pytest.mark.parametrize(
    "engine", [{"engine": "torch"}, {"engine": "fsdp", "world": 2}, {"engine": "deepspeed", "world": 2}]
)
def test_more_tokens_are_never_faster_and_more_recompute_never_faster(tiny, engine):
    """Never faster; slower where compute is not all hidden behind communication (a tiny model's sharded steps
    on an H100 wait for the collectives' latency alone)."""
    shapes = [(1, 64, 1), (2, 64, 1), (2, 128, 1), (2, 128, 2)]
    steps = [_speed(tiny, **engine, micro_batch=b, seq_len=s, grad_accum=a).step_time_s for b, s, a in shapes]
    assert all(later >= earlier * (1 - 1e-12) for earlier, later in itertools.pairwise(steps)), steps
    layers = tiny.layers
    plans = [(), ("selective",) * layers, ("full",) + ("selective",) * (layers - 1), ("full",) * layers]
    redone = [_speed(tiny, **engine, micro_batch=2, recompute=p).step_time_s for p in plans]
    assert all(later >= earlier * (1 - 1e-12) for earlier, later in itertools.pairwise(redone)), redone
    if engine["engine"] == "torch":  # one device: every op counts
        assert len(set(steps)) == len(steps) and len(set(redone)) == len(redone)


def test_an_unknown_device_gets_no_speed_and_the_plan_says_why(tiny, capsys):
    assert gpu_rates("NVIDIA Q9000") is None
    assert speed_for(tiny, Recipe(seq_len=64), device_name="NVIDIA Q9000", cluster=Cluster()) is None
    assert main(["plan", "--model", "torch/llama-tiny", "--seq-len", "64", "--gpu-memory", "80GiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    if report["device_name"] is None:  # no GPU here: nothing names the device
        assert report["speed"] is None


def test_a_step_that_does_not_run_on_fake_tensors_gets_no_speed_and_the_plan_still_answers(tmp_path, capsys):
    from ljperf.models.catalog import read_config_dict

    # experts that loop over nonzero()'s tokens: no shape on fake tensors (the plan was a traceback, exit 1)
    mixtral = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4}
    tiny = {k: v for k, v in read_config_dict(name="llama-tiny").items() if k not in mixtral}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny | mixtral | {"num_experts_per_tok": 2, "experts_implementation": "eager"}))
    args = ["plan", "--model-config", str(config), "--device", "cpu", "--precision", "fp32", "--seq-len", "64"]
    assert main([*args, "--json"]) == 0
    assert "does not run on fake tensors" in json.loads(capsys.readouterr().out)["speed"]["unavailable"]
    assert main(args) == 0
    assert "speed: none predicted: its training step does not run on fake tensors" in capsys.readouterr().out


def test_the_plan_prints_and_records_the_speed_of_a_known_gpu(capsys):
    args = ["plan", "--model", "fsdp/llama-tiny", "--gpus", "16", "--gpu", "H100", "--seq-len", "64"]
    assert main([*args, "--gpus-per-node", "4", "--link-bandwidth", "300,25", "--json"]) == 0
    speed = json.loads(capsys.readouterr().out)["speed"]
    assert set(speed) == {"step_time_s", "tokens_per_s_per_device", "mfu", "breakdown", "calibrated", "rates"}
    parts = {"forward", "backward", "recompute", "optimizer", "all_gather", "reduce_scatter", "all_reduce", "tp"}
    assert set(speed["breakdown"]) == parts | {"pp_send", "exposed_comm", "bubble"}
    links = speed["rates"]["links"]
    assert (links["gpus_per_node"], links["intra_bytes_per_s"], links["inter_bytes_per_s"]) == (4, 300e9, 25e9)
    assert speed["calibrated"] is False and speed["breakdown"]["all_gather"] > 0
    assert main(args) == 0
    assert "tokens/s per device, MFU" in capsys.readouterr().out
    assert main([*args, "--link-bandwidth", "fast"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_a_bad_records_file_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(tmp_path / "cache"))
    slow = replace(RATES, op_overhead_s=1e-3)
    damaged = {"schema_version": SCHEMA_VERSION, "kind": "speed"} | _record(
        work(layer=replace(NOTHING, ops=9)), slow, slow
    )
    damaged["results"]["speed"]["work"] = {"layer_forward": "fast"}
    benchmark = json.loads(RECORD.read_text())
    benchmark["results"]["speed"] = {"predicted_step_time_s": "fast", "measured_step_time_s": 1, "error_pct": 0}
    for name, content in (("damaged.json", damaged), ("schema.json", benchmark), ("text.json", "not json")):
        path = tmp_path / name
        path.write_text(json.dumps(content) if isinstance(content, dict) else content)
        assert main(["plan", "--calibrate", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "--calibrate" in err, err


def test_a_traced_recipe_is_priced_in_under_5_ms(tiny):
    engines = [{"engine": "torch", "world": w} for w in (1, 8)] + [
        {"engine": "fsdp", "world": 64, "tp": 8},
        {"engine": "fsdp", "world": 64, "dp_replicate": 4},
        *({"engine": "deepspeed", "world": 16, "zero_stage": z} for z in (1, 2, 3)),
    ]
    recipes = [
        e | {"grad_accum": a, "recompute": (m,) * tiny.layers}
        for e in engines
        for a in (1, 4)
        for m in ("none", "full")
    ]
    _speed(tiny)  # traced (or read from the cache) once
    best = float("inf")
    for _ in range(3):  # the best of three: a busy machine's other processes slow a round, never speed it up
        start = time.process_time()
        for recipe in recipes:
            _speed(tiny, **recipe)
        best = min(best, (time.process_time() - start) / len(recipes))
    assert best < 5e-3, f"{1e3 * best:.2f} ms a recipe"
    deep = work(layers=126, traffic=Traffic(style="fsdp", layer_gather=Collective(
        kind="all_gather", what="all_gather", size_bytes=1e9, ranks=8)))  # fmt: skip
    start = time.process_time()
    for _ in range(100):
        predict(deep, RATES)
    assert (time.process_time() - start) / 100 < 5e-3
    assert load_work(json.loads(json.dumps(deep.record()))) == deep


def test_the_report_shows_the_predicted_step_beside_the_measured_step_it_is_compared_with():
    from ljperf.ablation.report import rows
    from ljperf.ablation.stats import summarize

    def cell(measured: str) -> str:
        record = json.loads(RECORD.read_text())
        record["results"]["speed"] = {
            "predicted_step_time_s": 0.09,
            "measured_step_time_s": 0.1,
            "error_pct": -10.0,
            "measured": measured,
        }
        header, body = rows(summarize([record]))
        return body[0][header.index("predicted ms")]

    # on a CPU the step ms column is the wall's: the cell names the CPU step the error is against
    assert cell("process CPU time per thread") == "90.0 of 100.0 CPU (-10%)"
    assert cell("wall") == "90.0 (-10%)"
