"""``COMPILE_OPTIMIZATION=true``: an HF Trainer with ``TrainingArguments(torch_compile=True)`` compiles per block.

Run: ``COMPILE_OPTIMIZATION=true python train.py`` (docs/compile.md). ``Trainer.__init__`` is patched when
``transformers.trainer`` is imported: with ``torch_compile=True`` it compiles the model's decoder blocks and
loss in place (``ljperf.compile.regional``, with the Trainer's backend and mode) and turns accelerate's whole-model
``torch.compile`` off; under DeepSpeed ZeRO-3 each block becomes one gathering unit. At the end of training
it logs one line on stderr: regions, graph breaks, recompiles, compile time, fallbacks. Without ``torch_compile`` (or
without the variable) the Trainer is untouched.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ljperf.compile.line import compile_line
from ljperf.startup_hooks.messages import log, warn
from ljperf.startup_hooks.post_import import when_imported

if TYPE_CHECKING:  # transformers is imported by the user's script, never by the hook
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments


PATCHED = "_ljperf_compile"
"""The attribute that marks ``Trainer.__init__`` as this hook's: a second registration leaves it."""


def register() -> None:
    when_imported("transformers.trainer", _patch_trainer)


def _patch_trainer(module: ModuleType) -> None:
    cls = module.Trainer
    original = cls.__init__
    if getattr(original, PATCHED, False):  # already patched (the hook was registered twice)
        return

    @functools.wraps(original)
    def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.args.torch_compile:
            try:
                regional_compile(self)
            except Exception as exc:  # the Trainer goes on with its own whole-model compile
                warn(f"COMPILE_OPTIMIZATION: regional compile not applied ({exc!r})")

    setattr(__init__, PATCHED, True)
    cls.__init__ = __init__


def regional_compile(trainer: Trainer) -> None:
    """Compile ``trainer.model`` per block instead of accelerate's whole-model ``torch.compile``."""
    from accelerate.utils import DynamoBackend
    from transformers import TrainerCallback

    from ljperf.compile.regional import compile_model, zero3_gather_per_block

    args, model = trainer.args, trainer.model
    if model is None:  # a model_init Trainer makes its model at train(): its torch_compile is accelerate's
        raise ValueError("the Trainer has no model yet (model_init): nothing to compile per block")
    ds = getattr(args, "hf_deepspeed_config", None)
    if ds is not None and ds.config.get("zero_optimization", {}).get("stage") == 3:
        zero3_gather_per_block(model)
    options = {"backend": args.torch_compile_backend or "inductor"}
    if args.torch_compile_mode:
        options["mode"] = args.torch_compile_mode
    session = compile_model(model, "regional", verbose=args.process_index == 0, **options)
    if (dynamo := trainer.accelerator.state.dynamo_plugin) is not None:  # torch_compile=True sets it
        dynamo.backend = DynamoBackend.NO

    class CompileSummary(TrainerCallback):
        def on_train_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
        ) -> None:
            log(compile_line(session.results()))

    trainer.add_callback(CompileSummary)
    blocks = len(session.regions) - ("loss" in session.regions)
    loss = " and the loss" if "loss" in session.regions else ""
    log(f"COMPILE_OPTIMIZATION: compiling {blocks} decoder blocks{loss} in place, one region each")
