"""The pipeline: resolve once (``splice.plan.resolve``), then apply the steps in this order.

A newcomer reads :data:`STEPS` and knows every step. dtype comes first, so a model on the meta device is loaded
straight into the target dtype; the checkpoint is then loaded whole (tp_size 1) or as each rank's slices by the shard
step; fusing, quantizing and picking kernels work on real weights; placement moves the result home; the decode step is
compiled last.

Every check runs in ``resolve``, before any step; what can still fail in a step is the environment (memory, a file
read, another rank). Then the model is put back as it was (``splice.rollback``) and the step's error says so, or, where
memory did not allow keeping the original weights, says that the model was left partly converted.
"""
from __future__ import annotations

import logging
from typing import Callable

from torch import nn

from .native import release_freed_memory
from .plan import Plan
from .rollback import Rollback, affordable
from .steps import Stage, StepReport
from .steps.compile import compile_decode
from .steps.dtype import convert_dtype
from .steps.fuse import fuse
from .steps.kernels import select_kernels
from .steps.load import load_weights
from .steps.place import place
from .steps.quantize import quantize_weights
from .steps.shard import shard

log = logging.getLogger("splice")

Step = Callable[[Stage, Plan], tuple[Stage, StepReport]]

#: The steps, in order.
STEPS: list[Step] = [convert_dtype, load_weights, shard, fuse, quantize_weights, select_kernels, place, compile_decode]


def run_pipeline(model: nn.Module, plan: Plan) -> tuple[Stage, list[StepReport]]:
    """Apply every step to ``model`` by ``plan``; then hand the memory the steps freed back to the OS. If a step
    raises, the model is restored first (where memory allowed keeping its original weights) and the error gets a note
    saying in which step it failed and in what state it left the model."""
    keep, why = affordable(model)
    rollback = Rollback(model) if keep else None
    if rollback is None:
        log.warning("splice: no rollback if a step fails (%s)", why)
    stage, reports = Stage(model), []
    for step in STEPS:
        try:
            stage, report = step(stage, plan)
        except BaseException as error:
            error.add_note(failure_note(step, rollback, why))
            raise
        reports.append(report)
        log.info("splice %s: %s", report.step, report.summary())
    del rollback
    release_freed_memory()
    return stage, reports


def failure_note(step: Step, rollback: Rollback | None, why: str) -> str:
    """Restore the model (when it can be) and say what state it is in."""
    where = f"splice: init_inference failed in its {step.__name__} step"
    if rollback is None:
        return f"{where}; the model was left partly converted ({why}): load it again before using it"
    overwritten = rollback.restore()
    if overwritten:
        shown = ", ".join(overwritten[:3]) + (f" and {len(overwritten) - 3} more" if len(overwritten) > 3 else "")
        unsure = "" if rollback.counts_writes else \
            " (or may have: tensors made in inference mode keep no count of writes)"
        return (f"{where}; the model was put back as it was, except the values of {shown}, which a step overwrote in "
                f"place{unsure}: load it again before using it")
    return f"{where}; the model was put back as it was before the call"
