"""An engine's real training step at full size on fake tensors, measured by PyTorch's ``MemTracker``.

Run: ``fake_step_peak(models.resolve(name="llama3-8b"), Recipe(device="cpu", seq_len=8192))``, or
``python benchmarks/forecast_fake.py`` for the table. It checks ``forecast`` at sizes that real tensors cannot
afford here (1B–8B models, thousands of tokens, 8 ranks): nothing is allocated, and the measurement shares
nothing with the forecast's 3-layer trace and its composition but the model code. The torch engine runs in one
process; FSDP2 runs rank 0 of ``recipe.world`` ranks on torch's fake process group, whose collectives move no
data but fill the buffers FSDP2 allocates, and whose reduce-scatter copies its input for the length of the call
as gloo's does (a CPU run's collectives are gloo's). CPU kernels only.
FSDP2 needs torch 2.13 or newer: in 2.11 DTensor's sharding propagation makes global-shape tensors under the fake
mode in every optimizer op, which MemTracker counts as optimizer states.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch

from ljperf.core.hardware import DeviceInfo
from ljperf.core.options import EngineConfig, OptimizationConfig, TrainConfig
from ljperf.distributed.runtime import Process
from ljperf.engines import Engine
from ljperf.engines.fsdp_engine import FSDPEngine
from ljperf.engines.torch_engine import TorchEngine
from ljperf.forecast.live_bytes import fake_device
from ljperf.forecast.patches import real_code_paths, swapped
from ljperf.forecast.recipe import Recipe
from ljperf.forecast.trace import fake_buffers, fake_model
from ljperf.models.build import cast_parameters
from ljperf.models.spec import ModelSpec, build_meta
from ljperf.run.config import RunConfig
from ljperf.run.context import RunContext

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.distributed._tools.mem_tracker import MemTracker, _State
    from torch.distributed.device_mesh import DeviceMesh

FSDP_TORCH = (2, 13)
"""The first torch whose DTensor sharding propagation makes no fake tensors the measurement would count."""


def torch_version() -> tuple[int, int]:
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return major, minor


def fake_step_peak(spec: ModelSpec, recipe: Recipe) -> int:
    """Peak bytes ``MemTracker`` counts over step 2 (the steady state: optimizer states exist) of ``recipe``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if recipe.device != "cpu" or (recipe.optimizer or "single") != "single":
        raise ValueError("fake_step_peak runs CPU kernels with single-tensor AdamW")
    if recipe.engine not in ("torch", "fsdp") or (recipe.engine == "torch" and recipe.world != 1):
        raise ValueError("fake_step_peak runs the torch engine in one process, or FSDP2")
    if recipe.engine == "fsdp" and torch_version() < FSDP_TORCH:
        raise ValueError(f"fake_step_peak runs FSDP2 on torch {'.'.join(map(str, FSDP_TORCH))} or newer")
    if recipe.grad_accum != 1:
        raise ValueError("fake_step_peak measures one micro-step a step (MemTracker follows one forward a module)")
    train = TrainConfig(
        micro_batch=recipe.micro_batch,
        seq_len=recipe.seq_len,
        precision=recipe.precision,
        attn_implementation=recipe.attn_implementation,
        device="cpu",
    )
    engine_opts = EngineConfig(reshard_after_forward=recipe.reshard_after_forward)
    run = RunContext(
        config=RunConfig(
            engine=recipe.engine,
            model=spec,
            train=train,
            engine_opts=engine_opts,
            optim=OptimizationConfig(loss=recipe.loss),
        ),
        process=Process(world=recipe.world, device=DeviceInfo(type="cpu", index=None, name="fake")),
        plan=recipe.layer_modes(spec.layers),
    )
    # FSDP2 shards the parameters while they are still on the meta device: those inputs are not fake.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=recipe.engine == "fsdp")
    with contextlib.ExitStack() as stack:
        mesh = stack.enter_context(_fake_world(recipe.world if recipe.engine == "fsdp" else 0))
        stack.enter_context(real_code_paths())
        engine: Engine
        if recipe.engine == "fsdp":
            # A device mesh cannot be made on fake tensors: the engine gets the one made before.
            engine = FSDPEngine(run, mesh=mesh)
            # Built and cast outside the fake mode: accelerate's meta-device init cannot wrap fake parameters
            # (torch 2.11), and bf16 casts made under it were counted at the peak (+18% at 2 ranks).
            model = build_meta(spec, attn_implementation=recipe.attn_implementation)
            model = fake_buffers(cast_parameters(model, run.weight_dtype), fake_mode)
            with fake_mode:
                engine.setup(model)
        else:
            # The engine's weights, made fake: ``setup`` keeps parameters that are already off the meta device.
            engine = TorchEngine(run)
            engine.setup(fake_model(spec, attn=recipe.attn_implementation, fake_mode=fake_mode, dtype=run.weight_dtype))
        stack.enter_context(fake_mode)
        tokens = torch.zeros(recipe.micro_batch, recipe.seq_len, dtype=torch.long)
        engine.train_step([tokens])
        tracker = _peak_tracker()
        tracker.track_external(*engine.state_tensors(), tokens)
        with tracker:
            engine.train_step([tokens])
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _peak_tracker() -> MemTracker:
    """PyTorch's ``MemTracker``, keeping its peak over the whole step only. After every operation it also walks
    every module it has seen to raise the peaks of those running (per module: not read here), which took half of
    a 16-layer model's fake step (9 of 18 CPU-s): those module records are set aside while it updates its own.
    And a fake tensor's device, two of three ops a fake step dispatches, is answered without its walk (8.1 -> 6.4
    CPU-s for llama3.2-1b at 2048 tokens, the same peak)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    class PeakTracker(MemTracker):
        def __torch_dispatch__(
            self, func: OpOverload, types: object, args: tuple[Any, ...] = (), kwargs: dict | None = None
        ) -> object:
            if (device := fake_device(func, args)) is not None:
                return device
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state: _State) -> None:
            modules, self.memory_tracking = self.memory_tracking, WeakIdKeyDictionary()
            try:
                super()._update_peak_stats(peak_state)
            finally:
                self.memory_tracking = modules

    return PeakTracker()


@contextlib.contextmanager
def _fake_world(world: int) -> Generator[DeviceMesh | None]:
    """``world`` ranks on torch's fake process group, this process rank 0 (and their device mesh); none for 0 (the
    torch engine's one process)."""
    if world == 0:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_step_peak needs a process without a process group")
    excepthook = sys.excepthook  # init_process_group prefixes every later traceback with "[rank0]:"
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with swapped(dist, "reduce_scatter_single", _copying(dist.reduce_scatter_single)):
            yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


def _copying(reduce_scatter: Callable[..., object]) -> Callable[..., object]:
    """``reduce_scatter`` with gloo's copy of its input alive while it runs."""

    def reduce_scatter_as_gloo(output: torch.Tensor, input: torch.Tensor, *args: object, **kwargs: object) -> object:
        copy = torch.empty_like(input)
        try:
            return reduce_scatter(output, input, *args, **kwargs)
        finally:
            del copy

    return reduce_scatter_as_gloo
