"""The ordered list of transforms that ``init_inference`` applies.

Each transform is one function ``(model, config, ctx) -> model`` with one job. Before any of them changes the model,
every transform's optional ``check`` runs, so bad input raises while the user's model is still untouched.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .config import InferenceConfig
from .distributed import SINGLE_PROCESS, ParallelContext
from .native import release_freed_memory
from .transforms import dtype, graphs, inject, placement, quantize, tensor_parallel

log = logging.getLogger("splice")

Transform = Callable[[nn.Module, InferenceConfig, "PipelineContext"], nn.Module]


@dataclass
class Step:
    name: str
    apply: Transform
    check: Callable[[nn.Module, InferenceConfig, "PipelineContext"], None] | None = None


#: The pipeline, in order. A newcomer reads this list and knows every step.
PIPELINE: list[Step] = [
    Step("dtype", dtype.convert_dtype, dtype.check),
    Step("tensor_parallel", tensor_parallel.shard_model, tensor_parallel.check),
    Step("inject", inject.inject_kernels, inject.check),
    Step("quantize", quantize.quantize_model, quantize.check),
    Step("placement", placement.place_model, placement.check),
    Step("graphs", graphs.prepare_graphs, graphs.check),
]


@dataclass
class PipelineContext:
    """What the transforms share: the target device, the parallel state, and a report of what each did."""

    device: torch.device
    parallel: ParallelContext = SINGLE_PROCESS
    report: list[tuple[str, str]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)

    def record(self, step: str, what: str) -> None:
        self.report.append((step, what))
        log.info("splice %s: %s", step, what)


def resolve_device(config: InferenceConfig) -> torch.device:
    """The device the model runs on: the configured one, else CUDA if present, else CPU."""
    if config.device is not None:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={config.device!r} was asked for but CUDA is not available; allowed: 'cpu'")
        return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def run_pipeline(model: nn.Module, config: InferenceConfig, ctx: PipelineContext) -> nn.Module:
    """Check every step, then apply them in order; then hand the memory the steps freed back to the OS."""
    for step in PIPELINE:
        if step.check is not None:
            step.check(model, config, ctx)
    for step in PIPELINE:
        model = step.apply(model, config, ctx)
    release_freed_memory()
    return model
