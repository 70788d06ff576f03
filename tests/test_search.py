"""``ljperf plan --search``: every ranked recipe fits by its own exact forecast, the ranking is by predicted speed, a
flag given fixes its axis, the global batch is held, the pruning skips only what cannot fit, and bad input (nothing
fits, an impossible global batch) exits 2 with one line."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from ljperf.core.cache import SIGNATURE
from ljperf.core.choices import EngineName
from ljperf.forecast import Recipe, forecast
from ljperf.forecast.api import all_patterns, trace_ahead
from ljperf.models.catalog import read_config_dict
from ljperf.models.spec import resolve
from ljperf.plan.search import Setting, losses, solve_auto, states_bound
from ljperf.plan.search_report import distinct
from ljperf.plan.search_space import Axes, Candidate, Layout
from ljperf.speed.api import speed_for
from ljperf.speed.rates import Cluster

from conftest import read_record, run_ljperf, run_main

CPU = ["plan", "--model", "llama-tiny", "--gpus", "2", "--device", "cpu", "--seq-len", "64", "--search"]
ONE_LOSS = ["--loss", "plain", "--optimizer-impl", "single"]  # fewer axes: fewer traces on 2 shared cores


def searched(capsys, *argv: str) -> dict:
    code, out, err = run_main(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def recipe_of(entry: dict, record: dict) -> Recipe:
    """The recipe a search record's entry is, rebuilt from its choices alone."""
    c, layout = entry["candidate"], entry["candidate"]["layout"]
    plan = tuple(c["plan"]) or ((c["recompute"],) * 4 if c["recompute"] != "none" else ())
    return Recipe(
        engine=layout["engine"],
        zero_stage=layout["zero_stage"] or 3,
        world=record["world"],
        tp=layout["tp"],
        pp=layout["pp"],
        dp_replicate=layout["dp_replicate"],
        reshard_after_forward=layout["reshard_after_forward"],
        device=record["device"],
        precision=record["precision"],
        micro_batch=c["micro_batch"],
        seq_len=record["seq_len"],
        grad_accum=c["grad_accum"],
        recompute=plan,
        loss=c["loss"],
        optimizer=c["optimizer"],
    )


@pytest.fixture(scope="module")
def cpu_search() -> dict:
    """A search on 2 CPU ranks whose budget no recompute fits at the larger micro batches, so auto is solved (a top
    as large as the search: auto is solved wherever it is a recipe of its own)."""
    code, out, err = run_main(None, *CPU, *ONE_LOSS, "--gpu-memory", "48MiB", "--top", "1000", "--json")
    assert code == 0, err
    return json.loads(out)


def test_every_ranked_recipe_fits_its_budget_by_its_own_forecast(cpu_search):
    spec, record = resolve(name="llama-tiny"), cpu_search
    assert record["ranked"], "nothing ranked"
    budget = record["memory_budget_bytes"]
    assert budget == 48 * 2**20
    for entry in record["ranked"]:
        result = forecast(spec, recipe_of(entry, record), device_name="cpu")
        assert result.device_bytes == entry["peak_bytes"] <= budget
        assert entry["headroom_bytes"] == budget - entry["peak_bytes"]
    assert all(not e["fits"] for e in record["evaluated"] if e["rank"] is None)
    assert record["counts"]["evaluated"] == len(record["evaluated"])
    assert record["counts"]["fit"] == len(record["ranked"])


def test_pipeline_stages_are_searched_with_as_many_micro_batches_as_stages(cpu_search):
    """llama-tiny splits (untied Llama): on 2 ranks, ``--pp 2`` layouts are forecast per stage and ranked with the
    rest; 1F1B keeps 2 micro-batches in flight, so each has an accumulation of 2 or more."""
    piped = [e for e in cpu_search["evaluated"] if e["candidate"]["layout"]["pp"] == 2]
    assert piped and all(e["candidate"]["grad_accum"] >= 2 for e in piped)
    ranked = [e for e in cpu_search["ranked"] if e["candidate"]["layout"]["pp"] == 2]
    assert ranked and all("--pp 2" in " ".join(e["argv"]) for e in ranked)
    assert all(e["speed"]["breakdown"]["bubble"] > 0 for e in ranked)


def test_the_ranking_is_by_predicted_tokens_per_second_per_device(cpu_search):
    spec, record = resolve(name="llama-tiny"), cpu_search
    rates = [e["speed"]["tokens_per_s_per_device"] for e in record["ranked"]]
    assert rates == sorted(rates, reverse=True) and len(rates) >= 5
    for entry in record["ranked"][:3]:  # the speed model's own answer for the recipe
        speed = speed_for(spec, recipe_of(entry, record), device_name="cpu", cluster=Cluster(), threads=None)
        assert speed is not None and speed.tokens_per_s_per_device == pytest.approx(rates[entry["rank"] - 1])


def test_the_search_covers_every_engine_and_recompute_choice(cpu_search):
    layouts = {(e["candidate"]["layout"]["engine"], e["candidate"]["layout"]["tp"]) for e in cpu_search["evaluated"]}
    assert layouts == {("torch", 1), ("fsdp", 1), ("fsdp", 2)}  # --optimizer-impl leaves DeepSpeed out
    recompute = {e["candidate"]["recompute"] for e in cpu_search["evaluated"]}
    assert recompute == {"none", "selective", "full", "auto"}
    solved = [e for e in cpu_search["evaluated"] if e["candidate"]["recompute"] == "auto"]
    assert all(set(e["candidate"]["plan"]) != {"none"} for e in solved)  # auto where no recompute does not fit


def test_auto_is_not_solved_where_even_no_recompute_cannot_beat_the_tables_last(cpu_search):
    """Where no recompute does not fit and full does, auto is solved unless the recipe without any recompute (no
    plan is faster) predicts no more than the table's last so far: then it is pruned as one that cannot win."""
    spec, budget = resolve(name="llama-tiny"), 48 * 2**20
    base = Recipe(world=2, device="cpu", precision="fp32", seq_len=64)
    setting = Setting(
        spec=spec, base=base, axes=Axes(engines=("fsdp",)), budget=budget, memory=budget, memory_budget=None,
        device_name="cpu", cluster=Cluster(), threads=None, per_node=2,
    )  # fmt: skip
    auto = Candidate(layout=Layout(engine="fsdp"), micro_batch=16, grad_accum=1, recompute="auto", loss="plain",
                     optimizer="single")  # fmt: skip

    def forecast_of(recipe: Recipe):
        return forecast(spec, recipe, device_name="cpu")

    assert forecast_of(replace(auto, recompute="none").recipe(base, spec)).device_bytes > budget
    solved = solve_auto(setting, auto, forecast_of, floor=None)
    assert isinstance(solved, Candidate) and "full" in solved.plan
    assert forecast_of(solved.recipe(base, spec)).device_bytes <= budget
    assert solve_auto(setting, auto, forecast_of, floor=1e12) == "cannot_win"
    assert cpu_search["counts"]["pruned_by"]["cannot_win"] == 0  # a table as large as the search: none pruned so


@pytest.mark.slow  # the exhaustive search solves auto wherever it is a recipe: minutes on 2 shared cores
def test_the_search_pruned_by_speed_ranks_the_same_table_as_forecasting_every_recipe(capsys):
    """Under a held global batch the search forecasts only what could still enter the top K (branch and bound on
    predicted speed): its table (ranks, recipes, peaks, speeds, ties left out) is the one a search as large as
    every recipe (a top no search fills: nothing pruned by speed) ranks."""
    argv = [*CPU, *ONE_LOSS, "--gpu-memory", "48MiB", "--global-batch", "16"]
    pruned, every = searched(capsys, *argv, "--top", "3"), searched(capsys, *argv, "--top", "100000")
    assert pruned["counts"]["pruned_by"]["cannot_win"] > 0 and every["counts"]["pruned_by"]["cannot_win"] == 0
    assert pruned["counts"]["evaluated"] < every["counts"]["evaluated"]

    def table(record: dict) -> tuple[list, int]:
        shown, ties = distinct(record["ranked"], 3)
        return [(r["rank"], r["recipe"], r["peak_bytes"], r["speed"]["tokens_per_s_per_device"]) for r in shown], ties

    assert len(table(every)[0]) == 3 and table(pruned) == table(every)


def test_pruned_micro_batches_would_not_have_fit(capsys):
    """Under a held global batch a micro batch that does not fit ends the larger ones: each pruned one, forecast
    after all, does not fit either."""
    record = searched(capsys, *CPU, *ONE_LOSS, "--recompute", "none", "--gpu-memory", "24MiB", "--global-batch", "32")
    assert record["counts"]["pruned_by"]["micro_batch"] > 0
    spec, budget = resolve(name="llama-tiny"), record["memory_budget_bytes"]
    seen = {(json.dumps(e["candidate"]["layout"]), e["candidate"]["micro_batch"]) for e in record["evaluated"]}
    failed = [e for e in record["evaluated"] if not e["fits"] and e["candidate"]["grad_accum"] > 1]
    assert failed
    for entry in failed:
        dp = record["world"] // entry["candidate"]["layout"]["tp"]
        for mb in (m for m in range(entry["candidate"]["micro_batch"] + 1, 32 // dp) if (32 // dp) % m == 0):
            assert (json.dumps(entry["candidate"]["layout"]), mb) not in seen
            pruned = dict(entry, candidate=dict(entry["candidate"], micro_batch=mb, grad_accum=32 // dp // mb))
            assert forecast(spec, recipe_of(pruned, record), device_name="cpu").device_bytes > budget


def test_a_held_global_batch_is_micro_batch_times_accumulation_times_data_parallel_ranks(capsys):
    argv = ["--recompute", "none", "--gpu-memory", "200MiB", "--global-batch", "8", "--top", "100000"]
    record = searched(capsys, *CPU, *ONE_LOSS, *argv)  # a top no search fills: every split forecast, none cut by speed
    assert record["global_batch"] == 8
    for entry in record["evaluated"]:
        c = entry["candidate"]
        assert c["micro_batch"] * c["grad_accum"] * record["world"] // (c["layout"]["tp"] * c["layout"]["pp"]) == 8
    splits = {(e["candidate"]["micro_batch"], e["candidate"]["grad_accum"]) for e in record["evaluated"]}
    assert {(1, 4), (2, 2), (4, 1), (1, 8), (8, 1)} <= splits  # DDP's and tensor parallel's (one data rank)


def test_flags_given_fix_their_axes(capsys):
    argv = ["--micro-batch", "2", "--recompute", "full", "--no-reshard-after-forward", *ONE_LOSS]
    record = searched(capsys, *CPU, *argv, "--gpu-memory", "200MiB")
    assert record["evaluated"]
    for entry in record["evaluated"]:
        c = entry["candidate"]
        assert c["layout"]["engine"] == "fsdp" and not c["layout"]["reshard_after_forward"]
        assert (c["micro_batch"], c["recompute"], c["loss"], c["optimizer"]) == (2, "full", "plain", "single")
        assert entry["argv"][:3] == ["benchmark", "--model", "fsdp/llama-tiny"]
        assert "--no-reshard-after-forward" in entry["argv"] and "--recompute" in entry["argv"]


def test_an_engine_in_the_model_name_fixes_the_engine_and_zero_stages_are_searched(capsys):
    argv = ["plan", "--model", "deepspeed/llama-tiny", *CPU[3:], "--recompute", "none", "--loss", "plain"]
    record = searched(capsys, *argv, "--gpu-memory", "200MiB", "--micro-batch", "2")
    stages = sorted(e["candidate"]["layout"]["zero_stage"] for e in record["evaluated"])
    assert stages == [1, 2, 3]
    assert all("--zero-stage" in e["argv"] for e in record["evaluated"])


def test_bf16_weights_leave_deepspeed_out_of_the_engines_searched(capsys):
    """ZeRO keeps fp32 master weights: under --precision bf16 the search tries DDP and FSDP2 only."""
    argv = ["--precision", "bf16", "--micro-batch", "2", "--recompute", "none", "--loss", "plain"]
    record = searched(capsys, *CPU, *argv, "--gpu-memory", "200MiB")
    assert {e["candidate"]["layout"]["engine"] for e in record["evaluated"]} == {"torch", "fsdp"}


def test_a_gpu_cluster_search_prices_mfu_and_gives_each_node_its_command(capsys):
    argv = ["plan", "--model", "llama-tiny", "--gpus", "16", "--gpu", "H100", "--seq-len", "256", "--search"]
    extra = ["--micro-batch", "4", "--recompute", "none", "--loss", "plain", "--optimizer-impl", "fused"]
    record = searched(capsys, *argv, *extra)
    best = record["ranked"][0]
    assert best["speed"]["mfu"] is not None and 0 < best["speed"]["mfu"] < 1
    assert record["memory_budget_bytes"] == int(0.9 * record["gpu_memory_bytes"])  # the default budget's margin
    assert best["argv"][best["argv"].index("--nproc-per-node") + 1] == "8"
    assert best["argv"][best["argv"].index("--nnodes") + 1] == "2"
    assert best["command"].endswith("--node-rank RANK --rdzv-endpoint HOST:PORT")
    assert {e["candidate"]["layout"]["tp"] for e in record["evaluated"]} == {1, 2}  # heads 4, K/V heads 2


def test_the_table_shows_the_top_k_their_commands_and_why_the_first_wins(capsys):
    code, out, err = run_main(capsys, *CPU, *ONE_LOSS, "--recompute", "none", "--gpu-memory", "200MiB", "--top", "3")
    assert code == 0, err
    assert "tokens/s/device" in out and "headroom" in out
    commands = [line for line in out.splitlines() if re.match(r"\d+: ljperf benchmark --model ", line)]
    assert len(commands) == 3 and commands[0].startswith("1: ")
    assert any(re.match(r"why 1 over \d+ \(.+\): .*more tokens/s per device", line) for line in out.splitlines())
    assert any(line.startswith("searched: ") for line in out.splitlines())


def test_the_states_bound_never_exceeds_the_exact_forecast():
    """The bound that prunes without a trace is at most the forecast of every recipe it stands for."""
    spec = resolve(name="llama-tiny")
    engines: list[tuple[EngineName, int | None, int]] = [
        ("torch", None, 1), ("fsdp", None, 1), ("fsdp", None, 2), ("deepspeed", 1, 1), ("deepspeed", 2, 1),
        ("deepspeed", 3, 1),
    ]  # fmt: skip
    for engine, stage, tp in engines:
        for precision, device in (("fp32", "cpu"), ("bf16-mixed", "cuda")):
            base = Recipe(world=4, device=device, precision=precision, seq_len=64)
            setting = Setting(
                spec=spec, base=base, axes=Axes(engines=(engine,)), budget=0, memory=0, memory_budget=None,
                device_name="cpu" if device == "cpu" else "H100", cluster=Cluster(), threads=None, per_node=8,
            )  # fmt: skip
            layout = Layout(engine=engine, zero_stage=stage, tp=tp)
            for mb, recompute in ((1, "full"), (1, "none"), (4, "selective")):
                c = Candidate(layout=layout, micro_batch=mb, grad_accum=1, recompute=recompute, loss="plain",
                              optimizer=None)  # fmt: skip
                recipe = c.recipe(base, spec)
                exact = forecast(spec, recipe, device_name=setting.device_name).device_bytes
                assert states_bound(setting, recipe) <= exact, (engine, stage, tp, precision, mb, recompute)


@pytest.mark.parametrize(
    ("memory", "need"),
    [("10MiB", "needs 10.64 MiB (658.78 KiB over)"), ("8MiB", "needs at least 9.63 MiB (1.63 MiB over)")],
)
def test_nothing_fits_exits_2_with_one_line_naming_the_least_memory_and_the_recipe(memory, need, capsys):
    """The least a recipe forecast needs; where the states bound pruned every one, the least bound."""
    code, out, err = run_main(capsys, *CPU, *ONE_LOSS, "--gpu-memory", memory)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert f"nothing fits the budget {memory[:-3]}.00 MiB" in line and "the closest recipe" in line and need in line


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "torch/llama-tiny", "--global-batch", "3"], "--global-batch 3: no micro batch × accumulation"),
        (["--global-batch", "8", "--micro-batch", "3"], "--global-batch 8: no micro batch × accumulation"),
        (["--global-batch", "0"], "--global-batch must be larger than zero"),
        (["--tp", "2", "--zero-stage", "2"], "flags given are of different engines"),
        (["--plot", "x.png"], "--plot draws the memory of one plan"),
        (["--gpu-memory", "1GiB", "--memory-budget", "lots"], "--memory-budget 'lots' is not a size"),
    ],
)
def test_search_bad_input_exits_2_with_one_line(extra, message, capsys):
    model = [] if "--model" in extra else CPU[1:3]  # a model given replaces llama-tiny
    argv = ["plan", *model, *CPU[3:], "--gpu-memory", "200MiB", *extra]
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert message in line


def test_search_options_without_search_exit_2(capsys):
    code, _, err = run_main(capsys, "plan", "--model", "torch/llama-tiny", "--device", "cpu", "--global-batch", "8")
    assert code == 2 and "--global-batch and --top are options of --search" in err


def test_benchmark_recipe_runs_the_searchs_first_ranked_recipe(capsys, tmp_path):
    """``ljperf benchmark --recipe FILE`` runs the search's pick: the record's configuration is the recipe's."""
    argv = ["plan", "--model", "llama-tiny", "--gpus", "1", "--device", "cpu", "--seq-len", "64", "--search"]
    record = searched(capsys, *argv, "--micro-batch", "2", "--recompute", "none", "--loss", "plain",
                      "--optimizer-impl", "single", "--gpu-memory", "200MiB")  # fmt: skip
    search_file, out = tmp_path / "search.json", tmp_path / "run.json"
    search_file.write_text(json.dumps(record))
    best = record["ranked"][0]
    done = run_ljperf("benchmark", "--recipe", str(search_file), "--steps", "2", "--warmup", "1", "--output", str(out))
    assert done.returncode == 0, done.stderr
    run = read_record(out)
    assert run["args"][: len(best["argv"])] == best["argv"]
    assert run["config"]["train"]["micro_batch"] == 2 and run["results"]["status"] == "ok"


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("not json", [], "cannot read it as JSON"),
        (json.dumps({"kind": "search", "ranked": []}), [], "the search ranked no recipe"),
        (json.dumps({"argv": ["plan"]}), [], "not a recipe of ljperf plan --search --json"),
        (
            json.dumps({"argv": ["benchmark", "--model", "torch/llama-tiny", "--micro-batch", "2"]}),
            ["--micro-batch", "4"],
            "sets --micro-batch already",
        ),
    ],
)
def test_benchmark_recipe_bad_input_exits_2_with_one_line(content, extra, message, tmp_path, capsys):
    path = tmp_path / "recipe.json"
    path.write_text(content)
    code, _, err = run_main(capsys, "benchmark", "--recipe", str(path), *extra)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert message in line


def test_a_pipeline_runs_either_loss_and_tensor_parallel_the_plain_one():
    """The chunked loss runs in a pipeline's last stage (on its whole LM head); tensor parallel splits the head."""
    spec, axes = resolve(name="llama-tiny"), Axes(engines=("fsdp",))
    assert losses(axes, spec, Layout(engine="fsdp", pp=2)) == ["plain", "chunked"]
    assert losses(axes, spec, Layout(engine="fsdp", tp=2)) == ["plain"]


@pytest.mark.slow
def test_families_traced_ahead_in_processes_are_those_traced_in_process(tmp_path, monkeypatch):
    """A cold search first traces the shape families its recipes read, in several processes at once
    (``forecast.api.trace_ahead``): the cache entries they write are those a forecast traces in its own process,
    and a second call finds nothing left to trace."""
    config = tmp_path / "config.json"  # a config of its own: no family of it is in this process's memo yet
    config.write_text(json.dumps({**read_config_dict(name="llama-tiny"), "vocab_size": 1024}))
    spec = resolve(path=config)
    recipes = [
        Recipe(device="cpu", precision="fp32", micro_batch=micro_batch, seq_len=64, recompute=(mode,) * spec.layers)
        for micro_batch in (1, 2)
        for mode in ("none", "full")
    ]
    ahead, inline = tmp_path / "ahead", tmp_path / "inline"
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(ahead))
    assert trace_ahead(spec, recipes, jobs=2) == 4
    assert trace_ahead(spec, recipes, jobs=2) == 0
    monkeypatch.setenv("LJPERF_CACHE_DIR", str(inline))
    for recipe in recipes:
        all_patterns(spec, recipe)

    def entries(cache):
        files = sorted((cache / "forecast").glob("*-b?-*.json"))
        return {f.name: {k: v for k, v in json.loads(f.read_text()).items() if k != SIGNATURE} for f in files}

    assert len(entries(ahead)) == 4 and entries(ahead) == entries(inline)
