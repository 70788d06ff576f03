"""The memory picture (``ljperf plan --plot``, ``ljperf benchmark --plot``): the forecast's memory over the step
(``forecast.over_step``) and its stacked areas, for the torch, fsdp and deepspeed recipes; forecasts only.

Run: ``.venv/bin/python -m pytest -q tests/test_memory_plot.py`` (a trace of llama-tiny, then milliseconds each).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from ljperf import cli
from ljperf.forecast.over_step import memory_over_step
from ljperf.forecast.recipe import Recipe
from ljperf.models.spec import resolve
from ljperf.plan.plot import memory_figure

# One trace serves them all (llama-tiny, fp32 on CPU, micro batch 1, no recompute), as it does the benchmarks'.
RECIPES = {
    "torch": Recipe(engine="torch", device="cpu", precision="fp32", micro_batch=1, seq_len=64, grad_accum=2),
    "fsdp": Recipe(engine="fsdp", world=2, device="cpu", precision="fp32", micro_batch=1, seq_len=64),
    "deepspeed": Recipe(engine="deepspeed", zero_stage=2, world=2, device="cpu", precision="fp32", seq_len=64),
}
PNG = b"\x89PNG\r\n\x1a\n"


def plan(*argv: str) -> tuple[int, str]:
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(shown):
        code = cli.main(["plan", *argv])
    return code, shown.getvalue()


@pytest.mark.parametrize("engine", RECIPES)
def test_the_moment_at_the_peak_holds_the_forecast_breakdown(engine):
    memory = memory_over_step(resolve(name="llama-tiny"), RECIPES[engine])
    peak = memory.points[memory.peak]
    assert peak.total == memory.forecast.peak_allocated_bytes == max(p.total for p in memory.points)
    assert peak.phase == memory.forecast.phase
    assert {k: v for k, v in peak.bytes.items() if v} == {k: v for k, v in memory.forecast.breakdown.items() if v}
    stages = [p.stage for p in memory.points]
    assert stages == sorted(stages, key=("forward", "backward", "optimizer step").index) or engine == "torch"
    assert stages[0] == "forward" and stages[-1] == "optimizer step" and "backward" in stages
    micro = {p.phase.split(", ")[1] for p in memory.points if p.stage == "forward"}
    assert micro == ({"micro-step 1", "micro-step 2"} if engine == "torch" else {"micro-step 1"})


@pytest.mark.parametrize("engine", RECIPES)
def test_the_stacked_areas_at_the_peak_are_the_forecast_breakdown(engine):
    memory = memory_over_step(resolve(name="llama-tiny"), RECIPES[engine])
    fig = memory_figure(memory, title="t", budget=30 * 2**20, capacity=64 * 2**20, measured=None)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "memory per rank (MiB)"
    areas = {c.get_label(): c for c in ax.collections if c.get_label() and not c.get_label().startswith("_")}
    drawn = {}
    for label, area in areas.items():
        vertices = area.get_paths()[0].vertices
        at_peak = vertices[vertices[:, 0] == memory.peak][:, 1]
        drawn[label] = round((at_peak.max() - at_peak.min()) * 2**20)
    shown = {k: v for k, v in memory.forecast.breakdown.items() if v}
    assert sum(drawn.values()) == pytest.approx(sum(shown.values()), abs=len(shown))
    assert len(drawn) >= len(shown)
    lines = {line.get_label().split(" ")[0]: line.get_ydata()[0] for line in ax.get_lines() if line.get_ydata()}
    assert lines["budget"] == 30 and lines["device"] == 64
    fig.canvas.draw()  # renders (Agg)
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plan_plot_writes_the_picture(tmp_path):
    path = tmp_path / "mem.png"
    argv = ["--model", "deepspeed/llama-tiny", "--zero-stage", "3", "--device", "cpu", "--precision", "fp32"]
    code, shown = plan(*argv, "--gpus", "2", "--seq-len", "64", "--gpu-memory", "1GiB", "--plot", str(path), "--json")
    assert code == 0, shown
    assert json.loads(shown)["kind"] == "plan"  # the picture's line stays off standard output's JSON
    assert path.read_bytes().startswith(PNG) and path.stat().st_size > 20_000


@pytest.mark.parametrize(
    ("plot", "message"),
    [("mem.txt", "--plot 'mem.txt': give a file ending in .png, .svg, .pdf"), ("/sys/mem.png", "not writable")],
)
def test_a_bad_plot_file_is_refused_before_planning(plot, message):
    code, shown = plan("--model", "torch/llama-tiny", "--device", "cpu", "--gpu-memory", "1GiB", "--plot", plot)
    assert code == 2 and message in shown and len(shown.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("engine", "not_run"),
    [
        ("torch", ("all-gather", "all-reduce", "reduce-scatter", "bucket", "partition")),  # one process
        ("fsdp", ("all-reduce", "bucket", "partition")),  # FSDP2 gathers and reduce-scatters
    ],
)
def test_the_moments_are_named_in_the_engines_own_collectives(engine, not_run):
    """FSDP2's picture named "gradient all-reduce", "last bucket", "gradients into the partition"; one process's
    a "root all-gather"."""
    phases = [p.phase for p in memory_over_step(resolve(name="llama-tiny"), RECIPES[engine]).points]
    assert [p for p in phases if any(word in p for word in not_run)] == []
    if engine == "fsdp":
        assert any("reduce-scatter" in p for p in phases) and any("all-gather" in p for p in phases)


@pytest.mark.slow
def test_the_picture_of_a_deep_model_reads_at_its_size(tmp_path):
    """80 blocks, as Llama 3 70B has: the picture of fsdp/llama3-8b was 2,771 × 651 px with a label per block
    (130) at 6 pt. A tiny model of that depth draws the same moments."""
    from PIL import Image

    from ljperf.models.catalog import read_config_dict

    config = tmp_path / "deep.json"
    config.write_text(json.dumps({**read_config_dict(name="llama-tiny"), "num_hidden_layers": 80}))
    png = tmp_path / "plan.png"
    code, out = plan("--model-config", str(config), "--engine", "fsdp", "--gpus", "8", "--device", "cpu",
                     "--seq-len", "64", "--plot", str(png))  # fmt: skip
    assert code in (0, 4), out
    width, height = Image.open(png).size
    assert width <= 1400 and height <= 700, (width, height)
    memory = memory_over_step(
        resolve(path=config), Recipe(engine="fsdp", world=8, device="cpu", precision="fp32", seq_len=64)
    )
    assert len(memory.points) > 160
    fig = memory_figure(memory, title="t", budget=None, capacity=None)
    ticks = fig.axes[0].get_xticklabels()
    assert 4 <= len(ticks) <= 14 and all(t.get_fontsize() >= 8 for t in ticks)
