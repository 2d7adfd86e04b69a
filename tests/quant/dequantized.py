"""The float model a quantized one computes as: the tests' reference for what its kernels do."""
from __future__ import annotations

import copy

import torch
from torch import nn

from splice.quant import QuantizedLinear


def dequantized_copy(model: nn.Module) -> nn.Module:
    """``model`` with every quantized layer replaced by a float ``nn.Linear`` of the weight it computes with."""
    reference = copy.deepcopy(model)
    dtype = next(p for p in reference.parameters() if p.is_floating_point()).dtype
    for name, layer in list(reference.named_modules()):
        if isinstance(layer, QuantizedLinear):
            linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(layer.dequantize())
                if layer.bias is not None:
                    linear.bias.copy_(layer.bias.float())
            reference.set_submodule(name, linear.to(dtype))
    return reference
