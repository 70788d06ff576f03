"""The walk of a step (``forecast.walk``): what it shortens is the walk of every block.

Run: ``pytest tests/test_walk.py``.
"""

import json

import pytest

from ljperf.forecast import walk as walk_module
from ljperf.forecast.api import all_patterns
from ljperf.forecast.pipeline import pipeline_split
from ljperf.forecast.recipe import Recipe, ZeroSettings
from ljperf.forecast.timeline import highest_walk
from ljperf.models.catalog import read_config_dict
from ljperf.models.spec import resolve

LAYERS = 12
MIXED = ("full",) * 3 + ("selective",) * 4 + ("none",) * 5
RECIPES = {
    "torch": {},
    "torch-accum": {"grad_accum": 3, "recompute": MIXED},
    "ddp-cuda": {"world": 2, "device": "cuda", "precision": "bf16-mixed", "recompute": MIXED},
    "fsdp": {"engine": "fsdp", "world": 2, "grad_accum": 2},
    "hsdp": {"engine": "fsdp", "world": 4, "dp_replicate": 2, "grad_accum": 2, "recompute": MIXED},
    "fsdp-tp": {"engine": "fsdp", "world": 4, "tp": 2, "recompute": ("full",) * LAYERS},
    "zero1": {"engine": "deepspeed", "world": 2, "zero_stage": 1, "grad_accum": 2},
    "zero2": {"engine": "deepspeed", "world": 2, "zero_stage": 2, "zero": ZeroSettings(reduce_bucket_size=500_000)},
    "zero3": {"engine": "deepspeed", "world": 2, "grad_accum": 2, "recompute": MIXED},
    "zero3-window": {
        "engine": "deepspeed",
        "world": 2,
        "zero": ZeroSettings(prefetch_bucket_size=50_000, max_live_parameters=400_000, max_reuse_distance=0),
    },
    "pp": {"engine": "fsdp", "world": 2, "pp": 2, "grad_accum": 8, "recompute": MIXED},
    "pp-fsdp": {"engine": "fsdp", "world": 4, "pp": 2, "grad_accum": 6},
}


@pytest.fixture(scope="module")
def deep_spec(tmp_path_factory):
    """llama-tiny at 12 layers: runs of alike middle layers long enough to shorten."""
    path = tmp_path_factory.mktemp("deep") / "config.json"
    path.write_text(json.dumps({**read_config_dict(name="llama-tiny"), "num_hidden_layers": LAYERS}))
    return resolve(path=path)


@pytest.mark.parametrize("name", list(RECIPES))
def test_runs_of_alike_layers_walked_at_three_peak_where_every_layer_walked_does(deep_spec, name):
    """A run of alike middle layers is walked at its first two and its last (``walk.walk_layers``); a recorded
    walk walks every layer: the peak, its phase and its parts are the same on every rank and stage."""
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=64).with_(**RECIPES[name])
    stages = [recipe]
    if recipe.pp > 1:
        split = pipeline_split(deep_spec, recipe)
        stages = [recipe.with_(pp_split=split, stage=i) for i in range(recipe.stages)]
    for stage in stages:
        patterns = all_patterns(deep_spec, stage)
        short, whole = (highest_walk(deep_spec, stage, patterns, record=r) for r in (False, True))
        assert (short.peak, short.phase, short.peak_parts) == (whole.peak, whole.phase, whole.peak_parts), stage.stage


@pytest.mark.parametrize("shards", [1, 2])
def test_warm_up_forwards_walked_at_four_peak_where_every_forward_walked_does(deep_spec, shards, monkeypatch):
    """1F1B's warm-up on six stages: up to six forwards before the first backward, alike after the first; walked
    at the first three and the last, each stage's peak, phase and parts are those of walking every one."""
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=64).with_(
        engine="fsdp", world=6 * shards, pp=6, grad_accum=12, recompute=MIXED
    )
    split = pipeline_split(deep_spec, recipe)
    stages = [recipe.with_(pp_split=split, stage=i) for i in range(recipe.stages)]
    short = [highest_walk(deep_spec, s, all_patterns(deep_spec, s)) for s in stages]

    def every_forward(walk, move, order, stop):
        for index in range(stop):
            move(index)

    monkeypatch.setattr(walk_module, "_warm_up", every_forward)
    whole = [highest_walk(deep_spec, s, all_patterns(deep_spec, s)) for s in stages]
    for i, (a, b) in enumerate(zip(short, whole, strict=True)):
        assert (a.peak, a.phase, a.peak_parts) == (b.peak, b.phase, b.peak_parts), i


def test_steady_state_repeated_ends_where_every_pair_walked_does(deep_spec, monkeypatch):
    """1F1B on four stages, twelve micro-batches: the first stage's last warm-up send keeps micro-batch 3's output
    until its steady state ends (``walk.outputs_let_go``), the second's micro-batch 2's, so one pair of each
    steady state lets go of less than the others. Walked on its own between repeated runs, each stage's peak,
    phase and parts, and its level and parts at the step's end, are those of walking every pair."""
    recipe = Recipe(device="cpu", precision="fp32", micro_batch=2, seq_len=64).with_(
        engine="fsdp", world=4, pp=4, grad_accum=12
    )
    split = pipeline_split(deep_spec, recipe)
    stages = [recipe.with_(pp_split=split, stage=i) for i in range(recipe.stages)]
    short = [highest_walk(deep_spec, s, all_patterns(deep_spec, s)) for s in stages]

    def every_pair(walk, move, order, *, odd):
        for index in range(len(order)):
            move(index)

    monkeypatch.setattr(walk_module, "_walk_steady", every_pair)
    whole = [highest_walk(deep_spec, s, all_patterns(deep_spec, s)) for s in stages]
    for i, (a, b) in enumerate(zip(short, whole, strict=True)):
        assert (a.peak, a.phase, a.peak_parts, a.level, a.parts) == (b.peak, b.phase, b.peak_parts, b.level, b.parts), i
