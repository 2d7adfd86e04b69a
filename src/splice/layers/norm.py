"""RMSNorm through the fused ATen op, rounding like the Hugging Face modules at every dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


#: the most rows :class:`RMSNorm` gives its native call (a decode step's; a prompt's take the eager ops, in parallel)
NATIVE_ROWS = 16


class RMSNorm(nn.Module):
    """``y = norm(x) * w`` over the last ``weight.numel()`` features.

    ``offset`` is for checkpoints that store ``w - offset`` (Gemma: 1.0); the folded weight is kept in fp32 then, as
    Gemma computes ``norm(x) * (1 + w)`` in fp32. ``scale_float``: the weight kept in fp32 without an offset (OLMo 2
    scales in fp32 and rounds once). Takes the given weight over (moved, not copied) otherwise.
    ``native_rows`` (set by the kernels step where a decode step's small ops run on splice's kernels): bf16 rows on
    the CPU, up to :data:`NATIVE_ROWS` of them, take one native call (``splice_kernels.rms_norm``, rounded the same
    way) instead of the four ops of the eager form.
    """

    native_rows = False

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0, scale_float: bool = False):
        super().__init__()
        folded = weight.detach().float() + offset if offset or scale_float else weight.detach()
        self.weight = nn.Parameter(folded, requires_grad=False)
        self.eps = eps
        self.shape = (weight.shape[-1],)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, weight, self.eps)
        if self.native_rows and weight.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous() \
                and x.numel() <= NATIVE_ROWS * self.shape[0]:
            return torch.ops.splice_kernels.rms_norm(x, weight, self.eps)
        if weight.dtype == torch.float32:  # folded offset weight: scale in fp32, round once (as Gemma)
            return F.rms_norm(x.float(), self.shape, weight, self.eps).to(x.dtype)
        return F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype).mul_(weight)  # round, then scale (Llama)

    def extra_repr(self) -> str:
        return f"{self.shape[0]}, eps={self.eps}"


class HeadRMSNorm(nn.Module):
    """Per-head RMSNorm over ``head_dim`` for q and k at once (qk-norm).

    ``x`` is ``[..., q_heads + kv_heads, head_dim]``: the first ``q_heads`` rows are scaled by the q weight, the rest by
    the k weight. ``offset`` as in :class:`RMSNorm` (Gemma 3: the scale is applied in fp32, then rounded once)."""

    def __init__(self, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int, kv_heads: int, eps: float,
                 offset: float = 0.0):
        super().__init__()
        rows = torch.cat([q_weight.detach().expand(q_heads, -1), k_weight.detach().expand(kv_heads, -1)])
        if offset:
            rows = rows.float() + offset
        self.weight = nn.Parameter(rows, requires_grad=False)
        self.eps = eps
        self.offset = offset
        self.shape = (q_weight.shape[-1],)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return F.rms_norm(x.float(), self.shape, None, self.eps).mul_(self.weight).to(x.dtype)
        return F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype).mul_(self.weight)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over each whole projection for q and k at once (qk-norm over every head together: OLMo 2, OLMoE).

    ``x`` is ``[..., q_heads + kv_heads, head_dim]``: the first ``q_heads`` rows together are normalised by the q norm
    (its weight ``[q_heads * head_dim]``), the rest together by the k norm. ``scale_float`` as in :class:`RMSNorm`."""

    def __init__(self, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int, eps: float,
                 scale_float: bool = False):
        super().__init__()
        self.q_norm = RMSNorm(q_weight, eps, scale_float=scale_float)
        self.k_norm = RMSNorm(k_weight, eps, scale_float=scale_float)
        self.q_heads = q_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = x[..., : self.q_heads, :], x[..., self.q_heads:, :]
        return torch.cat([self.q_norm(q.flatten(-2)).view(q.shape), self.k_norm(k.flatten(-2)).view(k.shape)], dim=-2)
