"""Fault injection for reliability tests and drills: ``LJPERF_FAULT=KIND,step=S,rank=R[,seconds=T]``.

KIND is ``oom`` (raise torch.OutOfMemoryError), ``error`` (raise RuntimeError), ``sleep`` (stall T
seconds, a hung rank) or ``exit`` (the process dies with ``os._exit(1)``). The fault fires once, on
rank R (default 0) at the start of step S (default 1). Unset: nothing happens.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import torch

from ljperf.core.errors import UsageError

KINDS = ("oom", "error", "sleep", "exit")


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    step: int = 1
    rank: int = 0
    seconds: float = 3600.0

    @classmethod
    def from_env(cls) -> Fault | None:
        text = os.environ.get("LJPERF_FAULT")
        if not text:
            return None
        kind, *pairs = text.split(",")
        try:
            fault = cls(kind=kind)
            for key, value in (p.split("=", 1) for p in pairs):
                fault = replace(fault, **{key: float(value) if key == "seconds" else int(value)})
        except (ValueError, TypeError):
            raise UsageError(f"LJPERF_FAULT={text!r}: write KIND,step=S,rank=R[,seconds=T]") from None
        if kind not in KINDS:
            raise UsageError(f"LJPERF_FAULT kind {kind!r}: choose one of {', '.join(KINDS)}")
        return fault

    def maybe_fire(self, step: int, rank: int) -> None:
        if step != self.step or rank != self.rank:
            return
        if self.kind == "oom":
            raise torch.OutOfMemoryError("injected by LJPERF_FAULT")
        if self.kind == "error":
            raise RuntimeError("injected by LJPERF_FAULT")
        if self.kind == "sleep":
            time.sleep(self.seconds)
        if self.kind == "exit":
            os._exit(1)
