"""A linear layer whose weight is pre-packed for oneDNN (CPU, bf16/fp16).

On CPU, ``F.linear`` with a bf16 weight reorders the weight into oneDNN's blocked layout on every call, which halves
the bandwidth a batch-1 decode step gets from the weights. Packing once at injection removes that. The packed weight
replaces the plain one (no second copy). It is opaque, so pickling and deep-copying go through the plain weight
(unpacked for the copy and packed again in it); it cannot be moved to another device or saved with safetensors.
"""
from __future__ import annotations

import torch
from torch import nn

from ..native import onednn_computes_in
from .compiled import packed_linear

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Packing pays off on CPU for 16-bit weights when oneDNN computes in that dtype on this CPU (without it oneDNN
    refuses to pack the weight)."""
    return torch.device(device).type == "cpu" and dtype in PACKABLE_DTYPES and onednn_computes_in(dtype)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` through ``mkldnn._linear_pointwise`` on a weight packed for oneDNN."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        linear.weight = None  # release the plain weight now

    def __getstate__(self) -> dict:
        """The state with the plain weight: an opaque oneDNN tensor has no storage to pickle or copy."""
        state = self.__dict__.copy()
        state["_parameters"] = {**self._parameters,
                                "weight": nn.Parameter(self.weight.to_dense(), requires_grad=False)}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor cannot lower the op on a weight it did not pack itself
            return packed_linear(x, self.weight, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"
