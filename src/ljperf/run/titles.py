"""Titles of a run's tables: ``engine/model · where · mb × seq × accum · precision``.

Run: ``shape_title("torch", "llama-tiny", where="1 process(es)", shape=record["config"]["train"])``.
"""

from __future__ import annotations

from ljperf.core.mesh import MeshShape
from ljperf.models.catalog import catalog_names


def shape_title(engine: str, model: str, *, where: str, shape: dict) -> str:
    """``engine/model · where · mb × seq × accum · precision``, the title of a run's or a forecast's table, from
    ``shape``'s ``micro_batch``, ``seq_len``, ``grad_accum`` and ``precision`` (a record's train or a recipe).
    A ``--model-config`` path is ``engine · path`` (``torch//abs/config.json`` read as neither)."""
    subject = f"{engine}/{model}" if model in catalog_names() else f"{engine} · {model}"
    sizes = f"mb {shape['micro_batch']} × seq {shape['seq_len']} × accum {shape['grad_accum']}"
    return f"{subject} · {where} · {sizes} · {shape['precision']}"


def strategy(engine: str, *, zero_stage: int | str | None, mesh: dict, reshard_after_forward: bool) -> str:
    """How the engine splits the model, for a title: ``ZeRO-2``; ``FSDP2 over 4 shards, reshard after forward``
    (``FSDP2, ...`` where the title shows a mesh beyond one dimension); empty for the torch engine, or where the
    record does not say. A ``--deepspeed-config``'s stage shows here, so a user sees it was honoured."""
    if engine == "deepspeed" and zero_stage is not None:
        return f"ZeRO-{zero_stage}"
    if engine != "fsdp" or not mesh:
        return ""
    shape = MeshShape(**mesh)
    over = "" if shape.beyond_fsdp else f" over {shape.dp_shard} shard{'s' if shape.dp_shard > 1 else ''}"
    return f"FSDP2{over}, {'' if reshard_after_forward else 'no '}reshard after forward"


def run_title(cfg: dict) -> str:
    """The table title of a benchmark record's ``config``: ``shape_title`` with ``N process(es)`` (their CPU
    threads on a CPU, and the mesh beyond FSDP2's one dimension) and the engine's ``strategy``."""
    where = f"{cfg['launch']['world_size']} process(es)"
    if cfg["train"].get("device") == "cpu" and cfg["train"].get("threads"):
        where += f" × {cfg['train']['threads']} thread(s)"
    if mesh := MeshShape(**cfg.get("mesh", {})).describe():
        where += f" ({mesh})"
    engine = cfg["engine"]
    how = strategy(
        engine["name"],
        zero_stage=engine.get("zero_stage"),
        mesh=cfg.get("mesh") or engine.get("mesh") or {},
        reshard_after_forward=engine.get("reshard_after_forward", True),
    )
    return shape_title(
        engine["name"], cfg["model"]["name"], where=where + (f" · {how}" if how else ""), shape=cfg["train"]
    )
