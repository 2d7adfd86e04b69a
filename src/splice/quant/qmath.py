"""Pure quantization arithmetic on plain tensors: no modules, no kernels.

Conventions: a weight is ``[out, in]`` (``N x K``); a group is ``group`` consecutive input elements of one output row;
``group=None`` means one group per row (per output channel). Scales are computed in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_EPS = 1e-12


def fit_to(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` cut, or zero-padded, at the end of each dim to ``shape`` (itself where it has that shape)."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    cut = tensor[tuple(slice(0, size) for size in shape)]
    pad = [amount for dim in reversed(range(len(shape))) for amount in (0, shape[dim] - cut.shape[dim])]
    return F.pad(cut, pad) if any(pad) else cut


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

    Returns ``(q [N, K] uint8 values 0..15, scales_and_zeros [K / group, N, 2] float32)`` with the scales and zeros
    :func:`int4_params` fits, symmetric ones (``zero = 0``) searched per group, so they may be negative (see there).
    """
    grouped = _grouped(weight, group)
    scales, zeros = int4_params(grouped, symmetric, refits, search=True)
    q = _round_int4(grouped, scales, zeros)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return q.to(torch.uint8).reshape(weight.shape), scales_and_zeros


#: Symmetric search candidates: ``|peak| / scale`` for the group's largest-magnitude value ``peak``. 8 puts the peak
#: on code -8 and up to 8.5 it still rounds there; below 8 leaves headroom. None clips the peak by more than a rounding
#: step (candidates that do scored no better on the default model). The plain ``amax / 7.5`` is tried as well.
SYMMETRIC_DIVISORS = (7.0, 7.25, 7.5, 7.75, 8.0, 8.25, 8.5)
#: Elements per chunk of the fit: its temporaries are then reused from the allocator instead of faulting in fresh
#: pages for every whole-weight temporary.
_CHUNK = 1 << 20


def int4_params(grouped: torch.Tensor, symmetric: bool, refits: int = 2,
                search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, zeros)`` of shape ``grouped.shape[:-1]`` for float32 ``grouped [..., group]``: a start, then
    ``refits`` rounds of re-rounding and a least-squares fit of scale (and zero) to the codes, each of which keeps or
    lowers the group's (weighted) squared error.

    Symmetric (``zero = 0``) with ``search``, as llama.cpp's quantizers do: the start is the best of candidate scales
    (:data:`SYMMETRIC_DIVISORS`), each replaced by the least-squares scale of the codes it rounds to and scored by its
    squared error weighted by :func:`importance`, which the refits then minimise too; so that error never exceeds the
    plain ``amax / 7.5`` rounding's. A scale may be negative: the group's largest-magnitude value then lands on code -8
    whatever its sign, and the longer half of -8..7 serves the group's longer side (as in llama.cpp's Q4_0).
    Without ``search`` (GPTQ's choice: it fixes scales before spreading rounding errors, and this start served it
    better): the start is ``amax / 7.5``, the refits minimise the plain squared error, and every scale is positive.

    Asymmetric (``search`` changes nothing): the start maps the group's [min, max] onto 0..15 and the refits minimise
    the plain squared error. (A search like the symmetric one lowered the squared error but raised SmolLM2-135M's
    perplexity.)
    """
    rows = max(1, _CHUNK // max(1, grouped[0].numel()))
    if grouped.dim() > 1 and grouped.shape[0] > rows:
        parts = [int4_params(part, symmetric, refits, search) for part in grouped.split(rows)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    if not symmetric:
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=_EPS)
        zeros = low + 8 * scales
        for _ in range(refits):
            scales, zeros = _fit_asymmetric(grouped, _round_int4(grouped, scales, zeros).sub_(8), scales, zeros)
        return scales, zeros
    weights = importance(grouped) if search else None
    if search:
        scales = _search_symmetric(grouped, weights)
    else:
        scales = grouped.abs().amax(dim=-1).clamp(min=_EPS) / 7.5
    zeros = torch.zeros_like(scales)
    for _ in range(refits):
        scales = _fit_symmetric(grouped, weights, _round_int4(grouped, scales, zeros).sub_(8), scales)
    return scales, zeros


def importance(grouped: torch.Tensor) -> torch.Tensor:
    """Per-element weights of the symmetric int4 search: ``sqrt(mean(w^2) + w^2)`` over each group (llama.cpp's
    choice without an importance matrix), so a group's largest weights are reproduced more closely than its smallest."""
    squares = grouped * grouped
    return squares.add_(squares.mean(-1, keepdim=True)).sqrt_()


def _search_symmetric(grouped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The candidate whose least-squares scale removes the most weighted squared error (``scale * sum(u * w * c)``
    for weights ``u``, values ``w``, codes ``c``)."""
    peak = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True)).squeeze(-1)
    peak = torch.where(peak.abs() > _EPS, peak, torch.full_like(peak, -_EPS))
    weighted = weights * grouped
    best = peak.abs() / 7.5
    best_score = torch.full_like(best, -1.0)
    for inverse in [7.5 / peak.abs()] + [divisor / -peak for divisor in SYMMETRIC_DIVISORS]:
        codes = (grouped * inverse[..., None]).round_().clamp_(-8, 7)
        sum_wc, sum_cc = _dot(weighted, codes), _dot(weights * codes, codes)
        scales = sum_wc / sum_cc.clamp(min=_EPS)
        score = scales * sum_wc
        better = (score > best_score) & (scales.abs() > _EPS)
        best, best_score = torch.where(better, scales, best), torch.where(better, score, best_score)
    return best


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` without the product's temporary."""
    return torch.einsum("...i,...i->...", a, b)


def _round_int4(grouped: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    return ((grouped - zeros[..., None]) / scales[..., None]).add_(8).round_().clamp_(0, 15)


def _fit_symmetric(grouped: torch.Tensor, weights: torch.Tensor | None, codes: torch.Tensor,
                   scales: torch.Tensor) -> torch.Tensor:
    """Least-squares ``scale`` for ``grouped ~= codes * scale`` (weighted by ``weights`` unless None); groups without a
    nonzero fit keep theirs."""
    weighted_codes = codes if weights is None else weights * codes
    fitted = _dot(weighted_codes, grouped) / _dot(weighted_codes, codes).clamp(min=_EPS)
    return torch.where(fitted.abs() > _EPS, fitted, scales)


def _fit_asymmetric(grouped: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares ``scale`` and ``zero`` for ``grouped ~= codes * scale + zero``; degenerate groups keep theirs."""
    n, sum_c, sum_w = codes.shape[-1], codes.sum(-1), grouped.sum(-1)
    sum_cc, sum_wc = _dot(codes, codes), _dot(grouped, codes)
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
#: int8 weight-only's decode rows on AVX2 without VNNI (``int8_dot16_gemv``): activations rounded to int16 (this many
#: levels each side of zero) per row and block of this many input elements
WIDE_ACTIVATION_LEVELS, WIDE_ACTIVATION_BLOCK = 32767, 256


def round_activations(x: torch.Tensor, block: int = ACTIVATION_BLOCK, levels: int = 127) -> torch.Tensor:
    """``x [M, K]`` rounded to symmetric int8 per row and block of ``block`` input elements (``K`` zero-padded): each
    block's values become ``q * scale`` with ``q`` in -127..127 and ``scale`` = the block's absolute max / 127, returned
    in ``x``'s dtype. ``levels``: another range for ``q`` (-levels..levels; 32767 for int16)."""
    rows, k = x.shape
    padded = pad_to(x.float(), 1, block)
    blocks = padded.reshape(rows, padded.shape[1] // block, block)  # counted, not -1: x may have no rows
    scales = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=_EPS) / levels
    q = torch.round(blocks / scales).clamp_(-levels, levels)
    return (q * scales).reshape(rows, padded.shape[1])[:, :k].to(x.dtype)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20 log10(|ref| / |ref - approx|)``."""
    reference, approx = reference.detach().float(), approx.detach().float()
    noise = (reference - approx).norm().clamp(min=_EPS)
    return float(20 * torch.log10(reference.norm() / noise))
