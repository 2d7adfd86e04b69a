"""The int4 scale fit (``qmath.int4_params``) on synthetic weights: the symmetric search beats plain ``amax / 7.5``
rounding, no step of the fit raises the error it minimises, and edge cases stay finite and exact."""
from __future__ import annotations

import pytest
import torch

from splice.quant import qmath


def _weight(rows: int = 128, cols: int = 512) -> torch.Tensor:
    """Heavy-tailed rows of different scales, like a transformer's linears."""
    gen = torch.Generator().manual_seed(0)
    tails = torch.distributions.StudentT(4.0).sample((rows, cols))
    return tails * (0.5 + torch.rand(rows, 1, generator=gen)) * 0.02


def _plain_symmetric(grouped: torch.Tensor) -> torch.Tensor:
    """``amax / 7.5`` rounding to -8..7, de-quantized."""
    scales = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 7.5
    return (grouped / scales).round().clamp(-8, 7) * scales


def _dequantized(grouped: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    return (qmath._round_int4(grouped, scales, zeros) - 8) * scales[..., None] + zeros[..., None]


def _group_errors(grouped: torch.Tensor, approx: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    squares = (grouped - approx) ** 2
    return (squares if weights is None else weights * squares).sum(-1)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_symmetric_search_lowers_the_error_of_plain_rounding(group):
    torch.manual_seed(0)
    weight = _weight()
    grouped = weight.reshape(weight.shape[0], -1, group)
    plain = (_plain_symmetric(grouped) - grouped).norm()
    q, scales_and_zeros = qmath.quantize_int4(weight, group, symmetric=True)
    searched = (qmath.dequantize_int4(q, scales_and_zeros) - weight).norm()
    assert searched < 0.95 * plain
    assert torch.all(scales_and_zeros[..., 1] == 0)  # symmetric: no zero point


@pytest.mark.parametrize("search", [True, False])
def test_symmetric_fit_never_raises_the_error_it_minimises(search):
    """Per group: the start is no worse than plain rounding and each refit no worse than the step before, in the
    squared error the fit minimises (weighted by ``importance`` with the search, plain without)."""
    grouped = _weight().reshape(128, -1, 32)
    weights = qmath.importance(grouped) if search else None
    zeros = torch.zeros(grouped.shape[:-1])
    previous = _group_errors(grouped, _plain_symmetric(grouped), weights)
    for refits in range(4):
        scales, _ = qmath.int4_params(grouped, True, refits=refits, search=search)
        error = _group_errors(grouped, _dequantized(grouped, scales, zeros), weights)
        assert torch.all(error <= previous * (1 + 1e-5) + 1e-12), f"refits={refits}"
        previous = error


def test_asymmetric_refits_never_raise_the_error():
    grouped = _weight().reshape(128, -1, 64)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = (high - low) / 15
    previous = _group_errors(grouped, _dequantized(grouped, scales, low + 8 * scales))
    for refits in range(4):
        scales, zeros = qmath.int4_params(grouped, False, refits=refits)
        error = _group_errors(grouped, _dequantized(grouped, scales, zeros))
        assert torch.all(error <= previous * (1 + 1e-5) + 1e-12), f"refits={refits}"
        previous = error


def test_searched_scales_turn_negative_only_for_a_positive_peak():
    """A negative scale puts a positive peak on code -8 (the longer half of -8..7): only such groups take one, and the
    weighted error drops below the plain fit's; without the search every scale is positive (GPTQ relies on it)."""
    grouped = _weight().reshape(128, -1, 32)
    weights, zeros = qmath.importance(grouped), torch.zeros(grouped.shape[:-1])
    searched, _ = qmath.int4_params(grouped, True, search=True)
    plain, _ = qmath.int4_params(grouped, True, search=False)
    peak = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.all(plain > 0)
    assert (searched < 0).float().mean() > 0.25 and torch.all(peak[searched < 0] > 0)
    errors = [_group_errors(grouped, _dequantized(grouped, s, zeros), weights).sum() for s in (searched, plain)]
    assert errors[0] < 0.95 * errors[1]


def test_asymmetric_reproduces_a_q4_1_grid_exactly():
    """Weights already on an asymmetric 4-bit grid of the same groups (what a GGUF Q4_1 checkpoint holds)."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 16, 32), generator=gen).float()
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 maps each group's min and max onto 0 and 15
    weight = (codes * (0.01 + 0.05 * torch.rand(64, 16, 1, generator=gen))
              - torch.rand(64, 16, 1, generator=gen)).reshape(64, 512)
    q, scales_and_zeros = qmath.quantize_int4(weight, 32, symmetric=False)
    assert (qmath.dequantize_int4(q, scales_and_zeros) - weight).norm() <= 1e-6 * weight.norm()


@pytest.mark.parametrize("symmetric", [True, False])
def test_zero_and_constant_groups_stay_finite_and_exact(symmetric):
    weight = torch.zeros(64, 128)
    weight[1] = 3.0
    weight[2, :32] = -0.5
    q, scales_and_zeros = qmath.quantize_int4(weight, 32, symmetric)
    assert torch.isfinite(scales_and_zeros).all()
    torch.testing.assert_close(qmath.dequantize_int4(q, scales_and_zeros), weight, rtol=0, atol=1e-5)


@pytest.mark.parametrize("symmetric", [True, False])
def test_chunked_fit_equals_whole(symmetric, monkeypatch):
    grouped = _weight().reshape(128, -1, 32)
    whole = qmath.int4_params(grouped, symmetric, search=True)
    monkeypatch.setattr(qmath, "_CHUNK", 1000)  # 1000 // 512 = one row per chunk
    chunked = qmath.int4_params(grouped, symmetric, search=True)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
