"""What compiling cost, in one line: ``regional compile: 5 regions, 1 graph breaks, 0 recompiles, 6.1 s compiling,
0 fallbacks``.

Run: ``compile_line(record["results"]["compile"])`` (the benchmark's table, the ablation's report and the startup
hook's Trainer summary print it).
"""

from __future__ import annotations

from typing import Any


def compile_line(compiled: dict[str, Any]) -> str:
    """``regional compile: 5 regions, 1 graph breaks, 0 recompiles, 6.1 s compiling, 0 fallbacks``: a result's
    ``compile`` part in one line (the startup hook's Trainer summary too)."""
    mode = compiled["mode"]
    if "deepcompile" in compiled:
        mode += f" (DeepCompile {'on' if compiled['deepcompile'] else 'off'})"
    return (
        f"{mode} compile: {compiled['regions']} regions, {compiled['graph_breaks']} graph breaks, "
        f"{compiled['recompiles']} recompiles, {compiled['time_s']:.1f} s compiling, "
        f"{len(compiled['fallbacks'])} fallbacks"
    )
