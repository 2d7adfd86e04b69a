"""A 16-bit linear layer for a CPU without arithmetic in its dtype (fp16 on AMD Zen 4 or Intel before Sapphire
Rapids: no AVX512-FP16, no AVX-NE-CONVERT), where oneDNN cannot pack the weight and torch's own fp16 matmul converts
and multiplies one row of activations at a time.

Decode-sized inputs keep torch's fp16 GEMV (it converts the weight as it streams it and accumulates in fp32); from
``WIDEN_FROM_ROWS`` rows on (prompts) the weight is widened to fp32 once per call and one fp32 GEMM runs, which costs
one pass over the weight instead of one per row. The weight stays the plain 16-bit tensor the model had (nothing
kept in fp32, a tied lm_head keeps sharing the embedding table); the output is in the input's dtype.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .. import native
from ..native import onednn_computes_in

#: Rows of activations from which widening the weight beats torch's per-row conversions (docs/kernels.md).
WIDEN_FROM_ROWS = 8


def needs_widening(dtype: torch.dtype, device: torch.device) -> bool:
    """fp16 weights on a CPU whose oneDNN has no fp16 arithmetic."""
    return torch.device(device).type == "cpu" and dtype == torch.float16 and not onednn_computes_in(dtype)


class WidenedLinear(nn.Module):
    """``y = x @ W.T + b``: torch's fp16 GEMV for a few rows, float32 GEMMs on the widened weight otherwise
    (:func:`widened_product`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < WIDEN_FROM_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        return widened_product(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp32 GEMM on the widened weight from {WIDEN_FROM_ROWS} rows")


@contextlib.contextmanager
def prompts_in_float32(model: nn.Module) -> Iterator[int]:
    """Inside the block, each 16-bit ``nn.Linear`` of ``model`` on a CPU without arithmetic in its dtype (bf16 on
    AVX2-only CPUs, fp16 on most) multiplies in float32 on its widened weight, with the output in the input's dtype:
    the same products and float32 sums as a 16-bit GEMM, several times faster there. For passes of the plain model
    over many tokens (GPTQ's calibration). Yields how many linears it widened."""
    widened = [m for m in model.modules() if type(m) is nn.Linear and _widens(m.weight)]
    for module in widened:
        module.forward = _widened_forward(module)
    try:
        yield len(widened)
    finally:
        for module in widened:
            del module.forward  # the class's forward again


def _widens(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and not onednn_computes_in(weight.dtype))


def widened_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32 on the widened 16-bit weight, rounded once to ``x``'s dtype (as a 16-bit
    GEMM rounds): slab by slab with splice's native ``widened_linear`` (no float32 copy of the whole weight), else
    on a float32 copy."""
    rows = x.reshape(-1, weight.shape[1]).float()
    if native.available() and rows.shape[0] > 0:
        out = torch.ops.splice_kernels.widened_linear(rows.contiguous(), weight)
    else:
        out = F.linear(rows, weight.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _widened_forward(module: nn.Linear):
    return lambda x: widened_product(x, module.weight, module.bias)
