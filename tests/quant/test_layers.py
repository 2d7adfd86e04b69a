"""Per-layer accuracy of the quantized linears: kernel vs de-quantized weights, and SQNR vs the float layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splice.quant import HANDLERS, Int4WeightOnlyLinear, QuantConfig, sqnr_db
from splice.quant import kernels, qmath

SCHEMES = {
    "int8": QuantConfig(),
    "int8-g64": QuantConfig(group_size=64),
    "int4-g32": QuantConfig(bits=4, group_size=32),
    "int4-g64-asym": QuantConfig(bits=4, group_size=64, symmetric=False),
    "int4-g128": QuantConfig(bits=4, group_size=128),
    "w8a8": QuantConfig(activations=True),
}
MIN_SQNR = {"int8": 30, "int8-g64": 30, "int4-g32": 15, "int4-g64-asym": 15, "int4-g128": 14, "w8a8": 30}
ROWS = (1, 5, 40)  # both sides of kernels.INT8_KERNEL_MAX_ROWS


def _layer(scheme: str, out_features: int = 200, in_features: int = 320, bias: bool = True):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    config = SCHEMES[scheme]
    return linear, HANDLERS[config.kind].from_float(linear.weight.detach(), linear.bias, config)


def _reference_input(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """What the kernel multiplies: bf16 activations, also quantized per row for W8A8."""
    x = x.to(torch.bfloat16).float()
    if scheme == "w8a8":
        q, scales = qmath.quantize_activation_per_row(x)
        return q.float() * scales
    return x


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_kernel_matches_dequantized_weights(scheme, rows):
    linear, layer = _layer(scheme)
    x = torch.randn(rows, linear.in_features)
    expected = F.linear(_reference_input(x, scheme), layer.dequantize(), linear.bias)
    out = layer(x)
    assert (out - expected).norm() / expected.norm() < 1e-2


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_sqnr_against_float_layer(scheme):
    linear, layer = _layer(scheme)
    x = torch.randn(8, linear.in_features)
    assert sqnr_db(linear(x), layer(x)) >= MIN_SQNR[scheme]
    assert sqnr_db(linear.weight, layer.dequantize()) >= MIN_SQNR[scheme]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_holds_no_float_copy_of_the_weight(scheme):
    linear, layer = _layer(scheme, out_features=256, bias=False)  # 256: no padding of N
    floats = [t for t in layer.buffers() if t.is_floating_point()]
    assert all(t.numel() <= linear.weight.numel() // 8 for t in floats)
    assert not list(layer.parameters())
    bits = SCHEMES[scheme].bits
    assert layer.weight_nbytes() <= linear.weight.numel() * bits / 8 * 1.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_input_dtype_and_leading_dims(dtype):
    linear, layer = _layer("int8")
    out = layer(torch.randn(2, 3, linear.in_features, dtype=dtype))
    assert out.shape == (2, 3, linear.out_features) and out.dtype == dtype


def test_int4_pads_unaligned_shapes():
    linear, layer = _layer("int4-g64-asym", out_features=72, in_features=200)
    assert layer.padded_shape == (128, 256)
    x = torch.randn(3, 200)
    assert layer(x).shape == (3, 72)
    assert sqnr_db(linear(x), layer(x)) >= 15


def test_int4_unpack_by_kernel_matches_layout_reading():
    _, layer = _layer("int4-g32")
    n, k = layer.padded_shape
    if not layer.unpackable:
        pytest.skip("the int4 CPU layout read here is the AVX-512 one")
    by_kernel = kernels.int4_unpack_by_kernel(layer.packed, n, k, layer.group)
    assert torch.equal(by_kernel, kernels.int4_unpack_cpu_layout(layer.packed, k))


def test_int4_refit_lowers_the_error():
    torch.manual_seed(0)
    weight = torch.randn(64, 256)
    errors = []
    for refits in (0, 4):
        q, sz = qmath.quantize_int4(weight, 64, symmetric=False, refits=refits)
        errors.append((qmath.dequantize_int4(q, sz) - weight).norm())
    assert errors[1] < errors[0]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_state_dict_round_trip(scheme):
    linear, layer = _layer(scheme)
    config = SCHEMES[scheme]
    fresh = HANDLERS[config.kind].empty(linear.in_features, linear.out_features, True, config, torch.device("cpu"))
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(3, linear.in_features)
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)


def test_state_dict_of_another_scheme_is_refused():
    _, layer = _layer("int4-g32")
    other = Int4WeightOnlyLinear.empty(320, 200, True, SCHEMES["int4-g128"], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="scales_and_zeros|qweight"):
        other.load_state_dict(layer.state_dict())


def test_conv1d_is_quantized_like_a_linear():
    from transformers.pytorch_utils import Conv1D

    from splice.quant.api import float_weight

    torch.manual_seed(0)
    conv = Conv1D(96, 64)  # nf=96 outputs, nx=64 inputs, weight stored [64, 96]
    weight, bias = float_weight(conv)
    layer = HANDLERS["int8_weight_only"].from_float(weight, bias, QuantConfig())
    x = torch.randn(4, 64)
    assert sqnr_db(conv(x), layer(x)) >= 30
