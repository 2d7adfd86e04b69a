"""A bf16 linear layer on splice's native CPU GEMV (``splice.native``) for decode-sized inputs.

The weight stays a plain ``[out, in]`` tensor — the very tensor the model had, so a tied lm_head keeps sharing the
embedding table, nothing is copied, and the layer saves and deep-copies like ``nn.Linear``. Up to
``native.MAX_ROWS["bf16"]`` rows of input go to the native kernel (it streams the weight at memory speed); more rows
(prefill) go to ``F.linear``, whose oneDNN GEMM wins there, or, on a CPU without bf16 arithmetic
(``native.prompts_widened``), to float32 GEMMs on slabs of the widened weight (``splice_kernels.widened_linear``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import native
from .widened_linear import widened_product


def can_use_native(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 weights on CPU, and the native kernels built and loaded here."""
    return dtype == torch.bfloat16 and native.available_on(device)


class NativeLinear(nn.Module):
    """``y = x @ W.T + b``: the native bf16 GEMV for a few rows, ``F.linear`` otherwise."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight
        if not weight.is_contiguous():
            weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.weight = weight
        self.bias = linear.bias
        self.widen_prompts = native.prompts_widened()  # fixed when built: a traced forward cannot ask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not native.fits("bf16", rows):
            if not self.widen_prompts or x.device.type != "cpu":
                return F.linear(x, self.weight, self.bias)
            return widened_product(x, self.weight, self.bias)
        out = torch.ops.splice_kernels.bf16_gemv(rows.contiguous(), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        prompts = "float32 GEMMs on widened slabs" if self.widen_prompts else "F.linear"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"native bf16 GEMV, prompts: {prompts}")

