"""Hugging Face's ``Conv1D`` (GPT-2 style): a linear layer whose weight is stored ``[in, out]``. One place that
recognises it and reads its weight the ``nn.Linear`` way round."""
from __future__ import annotations

from functools import cache

import torch
from torch import nn


@cache
def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional for plain torch models
        return None
    return Conv1D


def is_conv1d(module: nn.Module, exact: bool = False) -> bool:
    """Whether ``module`` is a ``Conv1D`` (``exact``: that class itself, not a subclass that may add behaviour)."""
    cls = _conv1d_class()
    if cls is None:
        return False
    return type(module) is cls if exact else isinstance(module, cls)


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [out, in], bias)`` of an ``nn.Linear`` or a ``Conv1D`` (detached; a ``Conv1D`` weight transposed)."""
    weight = module.weight.detach()
    return (weight.t() if is_conv1d(module) else weight), module.bias


def in_out_features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``, from its weight."""
    rows, columns = module.weight.shape
    return (rows, columns) if is_conv1d(module) else (columns, rows)
