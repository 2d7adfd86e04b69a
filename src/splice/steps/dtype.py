"""dtype: convert floating weights to the plan's dtype, before any structural change (and before loading, so a meta
model is loaded straight into the target dtype)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..plan import Plan
from . import Stage, StepReport


@dataclass(frozen=True)
class DtypeReport(StepReport):
    dtype: str  # the model's floating dtype afterwards
    converted: bool
    int8: bool  # dtype=int8: the weights become int8 in the quantize step

    def summary(self) -> str:
        if not self.converted:
            return f"kept the model's own dtype ({self.dtype})"
        why = " (int8 weights are made by the quantize step; activations run in this dtype)" if self.int8 else ""
        return f"converted floating parameters and persistent buffers to {self.dtype}{why}"


def convert_dtype(stage: Stage, plan: Plan) -> tuple[Stage, DtypeReport]:
    """Cast floating parameters and persistent buffers to ``plan.dtype``.

    Non-persistent floating buffers (computed tables such as rotary frequencies) keep their precision, as they do when
    Hugging Face builds a model directly in a lower precision with ``from_pretrained(dtype=...)``.
    """
    model = stage.model
    if plan.dtype is None:
        return stage, DtypeReport("dtype", str(model_dtype(model)), False, False)
    kept = _non_persistent_float_buffers(model)
    model.to(dtype=plan.dtype)
    for module, name, tensor in kept:
        module._buffers[name] = tensor
    return stage, DtypeReport("dtype", str(plan.dtype), True, plan.int8)


def model_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter (None for a model without one)."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return None


def _non_persistent_float_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    kept = []
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            tensor = module._buffers.get(name)
            if tensor is not None and tensor.is_floating_point():
                kept.append((module, name, tensor))
    return kept
