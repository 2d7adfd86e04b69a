"""Plans for step tests: resolve a config against a model on one CPU process, as init_inference does."""
from __future__ import annotations

import torch

from splice.config import resolve_config
from splice.distributed import SINGLE_PROCESS, ParallelContext
from splice.plan import Plan, resolve
from splice.steps import Stage


def plan_for(model, parallel: ParallelContext = SINGLE_PROCESS, device: str = "cpu", **config) -> Plan:
    return resolve(resolve_config(config), model, parallel, torch.device(device))


def run_step(step, model, **config):
    """Resolve ``config`` for ``model`` and apply one step; returns (stage, report)."""
    return step(Stage(model), plan_for(model, **config))
