"""Titles of a run's tables: ``engine/model · where · mb × seq × accum · precision``.

Run: ``shape_title("torch", "llama-tiny", where="1 process(es)", shape=record["config"]["train"])``.
"""

from __future__ import annotations

from ljperf.models.catalog import catalog_names


def shape_title(engine: str, model: str, *, where: str, shape: dict) -> str:
    """``engine/model · where · mb × seq × accum · precision``, the title of a run's or a forecast's table, from
    ``shape``'s ``micro_batch``, ``seq_len``, ``grad_accum`` and ``precision`` (a record's train or a recipe).
    A ``--model-config`` path is ``engine · path`` (``torch//abs/config.json`` read as neither)."""
    subject = f"{engine}/{model}" if model in catalog_names() else f"{engine} · {model}"
    sizes = f"mb {shape['micro_batch']} × seq {shape['seq_len']} × accum {shape['grad_accum']}"
    return f"{subject} · {where} · {sizes} · {shape['precision']}"


def run_title(cfg: dict) -> str:
    """The table title of a benchmark record's ``config``: ``shape_title`` with ``N process(es)`` (and their CPU
    threads on a CPU)."""
    where = f"{cfg['launch']['world_size']} process(es)"
    if cfg["train"].get("device") == "cpu" and cfg["train"].get("threads"):
        where += f" × {cfg['train']['threads']} thread(s)"
    return shape_title(cfg["engine"]["name"], cfg["model"]["name"], where=where, shape=cfg["train"])
