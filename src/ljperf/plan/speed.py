"""The plan's speed: its record (``--json``'s ``speed``) and its lines under the memory table.

Run: ``speed_lines(speed_record(spec, recipe, device_name="H100", cluster=Cluster(), threads=None), device="H100")``.
"""

from __future__ import annotations

from typing import Any

from ljperf.core.options import ClusterConfig
from ljperf.forecast.recipe import Recipe
from ljperf.forecast.segments import TraceError
from ljperf.models.spec import ModelSpec
from ljperf.speed.api import speed_for
from ljperf.speed.rates import Cluster, gpu_rates

LABELS = {"exposed_comm": "exposed communication", "tp": "tensor parallel", "pp_send": "pipeline sends"}


def cluster_of(config: ClusterConfig) -> Cluster:
    intra, inter = config.links_gbps()
    return Cluster(gpus_per_node=config.gpus_per_node, intra_gbps=intra, inter_gbps=inter)


def speed_record(
    spec: ModelSpec, recipe: Recipe, *, device_name: str | None, cluster: Cluster, threads: int | None
) -> dict[str, Any] | None:
    """The plan record's ``speed`` (None: the device has no known rates, and the model gives no guess; a step the
    census cannot trace gives ``{"unavailable": why}``)."""
    try:
        speed = speed_for(spec, recipe, device_name=device_name, cluster=cluster, threads=threads)
    except TraceError as exc:
        return {"unavailable": str(exc)}
    return None if speed is None else speed.record()


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


def speed_lines(speed: dict[str, Any] | None, *, device: str | None) -> list[str]:
    """The plan's lines on its speed: the step, tokens/s per device and MFU; where the time goes; the rates."""
    if speed is None:
        if device and gpu_rates(device) is not None:
            return ["speed: none predicted: the training step does not run on fake tensors, so its ops are not counted"]
        named = f"the device {device!r}" if device else "a device named by --gpu-memory alone"
        return [f"speed: none predicted: no rates are known for {named} (name a known one with --gpu)"]
    if "unavailable" in speed:
        return [f"speed: none predicted: {speed['unavailable']}"]
    mfu = f", MFU {100 * speed['mfu']:.1f}%" if speed["mfu"] is not None else ""
    rates = speed["rates"]
    how = "calibrated" if speed["calibrated"] else "uncalibrated: run ljperf plan --calibrate on benchmark records"
    parts = speed["breakdown"]
    compute = ("forward", "backward", "recompute", "optimizer", "exposed_comm", "bubble")
    where = " · ".join(f"{LABELS.get(k, k)} {_seconds(parts[k])}" for k in compute if parts[k])
    moved = [k for k in parts if k not in compute and parts[k]]
    lines = [
        f"speed: {_seconds(speed['step_time_s'])} a step, {speed['tokens_per_s_per_device']:,.0f} tokens/s per"
        f" device{mfu} ({how})",
        f"  step: {where}",
    ]
    if moved:
        lines.append(
            "  communication (hidden or not): " + " · ".join(f"{LABELS.get(k, k)} {_seconds(parts[k])}" for k in moved)
        )
    links, peak, memory = rates["links"], rates["flops_per_s"] / 1e12, rates["bytes_per_s"] / 1e9
    lines.append(
        f"  rates of {rates['device']}: {peak:.3g} TFLOP/s, {memory:.3g} GB/s;"
        f" links {links['intra_bytes_per_s'] / 1e9:.3g} GB/s within a node of {links['gpus_per_node']},"
        f" {links['inter_bytes_per_s'] / 1e9:.3g} GB/s between"
    )
    return lines
