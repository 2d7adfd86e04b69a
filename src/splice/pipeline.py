"""The pipeline: resolve once (``splice.plan.resolve``), then apply the steps in this order.

A newcomer reads :data:`STEPS` and knows every step. dtype comes first, so a model on the meta device is loaded
straight into the target dtype; the checkpoint is then loaded whole (tp_size 1) or as each rank's slices by the shard
step; fusing, quantizing and picking kernels work on real weights; placement moves the result home; the decode step is
compiled last.
"""
from __future__ import annotations

import logging
from typing import Callable

from torch import nn

from .native import release_freed_memory
from .plan import Plan
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
    """Apply every step to ``model`` by ``plan``; then hand the memory the steps freed back to the OS."""
    stage, reports = Stage(model), []
    for step in STEPS:
        stage, report = step(stage, plan)
        reports.append(report)
        log.info("splice %s: %s", report.step, report.summary())
    release_freed_memory()
    return stage, reports
