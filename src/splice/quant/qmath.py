"""Pure quantization arithmetic on plain tensors: no modules, no kernels.

Conventions: a weight is ``[out, in]`` (``N x K``); a group is ``group`` consecutive input elements of one output row;
``group=None`` means one group per row (per output channel). Scales are computed in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_EPS = 1e-12


def pad_to(tensor: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """``tensor`` zero-padded at the end of ``dim`` up to a multiple of ``multiple`` (unchanged if it already is)."""
    extra = -tensor.shape[dim] % multiple
    if extra == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, extra]
    return F.pad(tensor, pad)


def _grouped(weight: torch.Tensor, group: int | None) -> torch.Tensor:
    """``[N, K]`` -> ``[N, K / group, group]`` in float32."""
    n, k = weight.shape
    return weight.float().contiguous().reshape(n, 1 if group is None else k // group, -1)


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: ``(q [N, K] int8, scales [N, K / group] float32)``, ``weight ~= q * scale``."""
    grouped = _grouped(weight, group)
    scales = grouped.abs().amax(dim=-1).clamp(min=_EPS) / 127
    q = torch.round(grouped / scales[..., None]).clamp(-127, 127).to(torch.int8)
    # a tensor of its own, not a view: a view keeps its base alive, so moving the view's storage elsewhere (as
    # native.memory does) would leave the base's memory behind
    return q.reshape(weight.shape).clone(), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, K]`` from :func:`quantize_int8`'s output."""
    n, k = q.shape
    return (q.float().reshape(n, scales.shape[1], -1) * scales.float()[..., None]).reshape(n, k)


def quantize_int4(weight: torch.Tensor, group: int, symmetric: bool,
                  refits: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 in the form torch's int4 kernels use: ``w ~= (q - 8) * scale + zero`` with ``q`` in 0..15.

    Returns ``(q [N, K] uint8 values 0..15, scales_and_zeros [K / group, N, 2] float32)``. Starts from the group's
    range (symmetric: ``zero = 0``, ``q - 8`` spans -8..7; asymmetric: [min, max] maps onto 0..15), then alternates
    ``refits`` times between a least-squares fit of scale (and zero) to the codes and re-rounding, which only lowers
    the squared error (on SmolLM2-135M, g64 asymmetric: +59 % -> +26.5 % perplexity).
    """
    grouped = _grouped(weight, group)
    scales, zeros = int4_params(grouped, symmetric, refits)
    q = _round_int4(grouped, scales, zeros)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return q.to(torch.uint8).reshape(weight.shape), scales_and_zeros


def int4_params(grouped: torch.Tensor, symmetric: bool, refits: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, zeros)`` of shape ``grouped.shape[:-1]`` for float32 ``grouped [..., group]``, as
    :func:`quantize_int4` fits them (range, then ``refits`` least-squares refits)."""
    if symmetric:
        scales = grouped.abs().amax(dim=-1).clamp(min=_EPS) / 7.5
        zeros = torch.zeros_like(scales)
    else:
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=_EPS)
        zeros = low + 8 * scales
    if refits:
        sum_w = grouped.sum(-1)
        for _ in range(refits):
            q = _round_int4(grouped, scales, zeros)
            scales, zeros = _fit_int4(grouped, sum_w, q - 8, scales, zeros, symmetric)
    return scales, zeros


def _round_int4(grouped: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    return ((grouped - zeros[..., None]) / scales[..., None]).add_(8).round_().clamp_(0, 15)


def _fit_int4(grouped: torch.Tensor, sum_w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares ``scale`` (and ``zero``) for ``grouped ~= codes * scale + zero``; degenerate groups keep theirs."""
    sum_cc, sum_wc = (codes * codes).sum(-1), (grouped * codes).sum(-1)
    if symmetric:
        fitted = sum_wc / sum_cc.clamp(min=_EPS)
        return torch.where(fitted > _EPS, fitted, scales), zeros
    n, sum_c = codes.shape[-1], codes.sum(-1)
    det = n * sum_cc - sum_c * sum_c
    fitted = (n * sum_wc - sum_c * sum_w) / det.clamp(min=_EPS)
    ok = (det > 0.5) & (fitted > _EPS)
    scales = torch.where(ok, fitted, scales)
    return scales, torch.where(ok, (sum_w - scales * sum_c) / n, zeros)


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, K]`` from :func:`quantize_int4`'s output (any float dtype of ``scales_and_zeros``)."""
    n, k = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, G, 2]
    grouped = q.float().reshape(n, sz.shape[1], -1)
    return ((grouped - 8) * sz[..., 0:1] + sz[..., 1:2]).reshape(n, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values 0..15 -> ``[N, K / 2]`` uint8, even columns in the high nibble (torch's CUDA input order)."""
    q = q.to(torch.uint8)
    return (q[:, ::2] << 4) | q[:, 1::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.shape[0], -1)


ACTIVATION_BLOCK = 32  # input elements per activation scale in W8A8 (llama.cpp's Q8_0 block)


def round_activations(x: torch.Tensor, block: int = ACTIVATION_BLOCK) -> torch.Tensor:
    """``x [M, K]`` rounded to symmetric int8 per row and block of ``block`` input elements (``K`` zero-padded): each
    block's values become ``q * scale`` with ``q`` in -127..127 and ``scale`` = the block's absolute max / 127, returned
    in ``x``'s dtype."""
    rows, k = x.shape
    blocks = pad_to(x.float(), 1, block).reshape(rows, -1, block)
    scales = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=_EPS) / 127
    q = torch.round(blocks / scales).clamp_(-127, 127)
    return (q * scales).reshape(rows, -1)[:, :k].to(x.dtype)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20 log10(|ref| / |ref - approx|)``."""
    reference, approx = reference.detach().float(), approx.detach().float()
    noise = (reference - approx).norm().clamp(min=_EPS)
    return float(20 * torch.log10(reference.norm() / noise))
