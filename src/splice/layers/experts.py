"""transformers' experts interface, read: a mixture of experts' experts module and its matrices.

transformers holds a mixture of experts' weights in one experts module (``use_experts_implementation``: Mixtral,
Qwen2-MoE, GPT-OSS, ...), flagged ``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``:
``gate_up_proj`` (or ``up_proj`` without a gate) and ``down_proj``, ``[experts, out, in]`` (``[experts, in, out]``
where ``is_transposed``), biases ``gate_up_proj_bias`` / ``down_proj_bias`` where ``has_bias``. Tensor parallelism
(``splice.tp``) and quantization (``splice.quant.experts``) both read it here.
"""
from __future__ import annotations

import torch
from torch import nn

#: Flags transformers' experts interface sets on an experts module.
EXPERTS_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def is_experts(module: nn.Module) -> bool:
    """``module`` carries the experts interface's flags."""
    return all(isinstance(getattr(module, flag, None), bool) for flag in EXPERTS_FLAGS)


def up_name(module: nn.Module) -> str:
    """The name of an experts module's first matrix: ``gate_up_proj``, or ``up_proj`` without a gate."""
    return "gate_up_proj" if module.has_gate else "up_proj"


def experts_matrices(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None:
    """``{name: (weight [experts, out, in], bias [experts, out] or None)}`` of an experts module's matrices, detached;
    None for any other module, and for one whose matrices are not 3-D tensors (already quantized, say)."""
    if not is_experts(module):
        return None
    found = {}
    for name in (up_name(module), "down_proj"):
        weight = getattr(module, name, None)
        bias = getattr(module, f"{name}_bias", None) if module.has_bias else None
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or (module.has_bias and bias is None):
            return None
        weight, bias = weight.detach(), None if bias is None else bias.detach()  # a model may still need gradients
        found[name] = (weight.transpose(1, 2) if module.is_transposed else weight, bias)
    return found


def experts_features(module: nn.Module) -> int:
    """An experts module's intermediate features (per expert): its down projection's inputs."""
    return module.down_proj.shape[1 if module.is_transposed else 2]
