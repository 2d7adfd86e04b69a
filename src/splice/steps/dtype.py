"""dtype: convert floating weights to the plan's dtype, before any structural change (and before loading, so a meta
model is loaded straight into the target dtype)."""
from __future__ import annotations

import re
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
    kept_fp32: int = 0  # tensors the model's _keep_in_fp32_modules(_strict) keep in fp32

    def summary(self) -> str:
        if not self.converted:
            return f"kept the model's own dtype ({self.dtype})"
        why = " (int8 weights are made by the quantize step; activations run in this dtype)" if self.int8 else ""
        kept = f"; {self.kept_fp32} tensors kept in fp32 (the model's _keep_in_fp32_modules)" if self.kept_fp32 else ""
        return f"converted floating parameters and persistent buffers to {self.dtype}{why}{kept}"


def convert_dtype(stage: Stage, plan: Plan) -> tuple[Stage, DtypeReport]:
    """Cast floating parameters and persistent buffers to ``plan.dtype``.

    Non-persistent floating buffers (computed tables such as rotary frequencies) keep their precision, as they do when
    Hugging Face builds a model directly in a lower precision with ``from_pretrained(dtype=...)``; so do the tensors
    the model asks to keep in fp32 in that dtype (:func:`keep_in_fp32_pattern`), which are made fp32.
    """
    model = stage.model
    if plan.dtype is None:
        return stage, DtypeReport("dtype", str(model_dtype(model)), False, False)
    kept = _non_persistent_float_buffers(model)
    fp32 = _tensors_kept_in_fp32(model, plan.dtype)
    model.to(dtype=plan.dtype)
    for module, name, tensor in kept:
        module._buffers[name] = tensor
    for where, data in fp32:
        _set_fp32(where, data)
    return stage, DtypeReport("dtype", str(plan.dtype), True, plan.int8, len(fp32))


def model_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter (None for a model without one)."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return None


def keep_in_fp32_pattern(model: nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """What transformers' ``from_pretrained(dtype=dtype)`` loads in fp32: the names matching
    ``_keep_in_fp32_modules`` (in fp16) and ``_keep_in_fp32_modules_strict`` (in fp16 and bf16), each a glob searched
    in the tensor's full name; None when nothing is kept."""
    names = []
    if dtype == torch.float16:
        names += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        names += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not names:
        return None
    return re.compile("|".join(f"(?:{name.replace('*', '.*')})" for name in names))


Places = list[tuple[nn.Module, str]]  # the (module, attribute name) pairs holding one tensor


def _tensors_kept_in_fp32(model: nn.Module, dtype: torch.dtype) -> list[tuple[Places, torch.Tensor]]:
    """The floating parameters and persistent buffers kept in fp32 in ``dtype``: each as the (module, name) places
    holding it and its data before the conversion. A tied weight is judged by its first name, the one a checkpoint
    stores it under and ``from_pretrained`` loads (then ties), and stays tied."""
    pattern = keep_in_fp32_pattern(model, dtype)
    if pattern is None:
        return []
    places: dict[int, tuple[Places, torch.Tensor, bool]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        tensors = [*module._parameters.items(),
                   *((n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set)]
        for name, tensor in tensors:
            if tensor is None or not tensor.is_floating_point():
                continue
            if id(tensor) not in places:
                places[id(tensor)] = ([], tensor.detach(), bool(pattern.search(prefix + name)))
            places[id(tensor)][0].append((module, name))
    return [(where, data) for where, data, matched in places.values() if matched]


def _set_fp32(where: Places, data: torch.Tensor) -> None:
    """Put ``data`` (the tensor as it was before the conversion) in fp32 back at every place holding it."""
    module, name = where[0]
    original = module._parameters.get(name)
    value = data.float() if original is None else nn.Parameter(data.float(), requires_grad=original.requires_grad)
    for module, name in where:
        if name in module._parameters:
            module._parameters[name] = value
        else:
            module._buffers[name] = value


def _non_persistent_float_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    kept = []
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            tensor = module._buffers.get(name)
            if tensor is not None and tensor.is_floating_point():
                kept.append((module, name, tensor))
    return kept
