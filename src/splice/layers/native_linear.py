"""A bf16 linear layer on splice's native CPU GEMV (``splice.native``) for decode-sized inputs.

The weight stays a plain ``[out, in]`` tensor — the very tensor the model had, so a tied lm_head keeps sharing the
embedding table, nothing is copied, and the layer saves and deep-copies like ``nn.Linear``. Up to
``native.MAX_ROWS["bf16"]`` rows of input go to the native kernel (it streams the weight at memory speed); more rows
(prefill) go to ``F.linear``, whose oneDNN/AMX GEMM wins there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import native


def can_use_native(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 weights on CPU, and the native kernels built and loaded here."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and native.available()


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not native.fits("bf16", rows):
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.splice_kernels.bf16_gemv(rows.contiguous(), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                "native bf16 GEMV")


def gather_on_huge_pages(weights: list[nn.Parameter]) -> int:
    """Move ``weights`` (in place: each Parameter keeps its identity, so tied modules stay tied) into one buffer on
    2 MiB pages; returns the bytes moved (0 where huge pages are unavailable).

    A decode step streams every weight once; on 4 KiB pages each small matrix costs TLB misses the prefetcher cannot
    hide (measured on SmolLM2-135M bf16: the step's GEMVs 12.6 ms -> 10.5 ms). The buffer is reserved whole but its
    memory is committed as each weight is copied in, and each old tensor is released right after, so peak memory
    grows by one weight, not by the model.
    """
    weights = [w for w in dict.fromkeys(weights) if w.device.type == "cpu" and w.is_contiguous()]
    if not weights or not native.huge_pages_supported():
        return 0
    dtype = weights[0].dtype
    weights = [w for w in weights if w.dtype == dtype]
    align = native.HUGE_PAGE // dtype.itemsize
    total = sum(-(-w.numel() // 32) * 32 for w in weights)  # each weight starts 64-byte aligned
    buffer = torch.empty(total + align, dtype=dtype)
    start = (-buffer.data_ptr() % native.HUGE_PAGE) // dtype.itemsize
    arena = buffer[start:start + total]
    native.advise_huge_pages(arena, collapse=False)
    offset = 0
    for weight in weights:
        view = arena[offset:offset + weight.numel()].view(weight.shape)
        view.copy_(weight.detach())
        weight.data = view
        offset += -(-weight.numel() // 32) * 32
    return sum(w.numel() * dtype.itemsize for w in weights)
