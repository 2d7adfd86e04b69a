"""Per-layer accuracy of the quantized linears: kernel vs de-quantized weights, and SQNR vs the float layer."""
from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splice import native
from splice.quant import HANDLERS, Int4WeightOnlyLinear, QuantConfig, sqnr_db
from splice.quant import kernels, qmath
from splice.quant.layers import padded_group

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")

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


def test_native_kernels_are_refused_where_they_do_not_run():
    with mock.patch.object(native, "available", lambda: False):
        with pytest.raises(ValueError, match="native=True"):
            HANDLERS["int8_weight_only"].from_float(torch.randn(16, 32), None, SCHEMES["int8"], native=True)


def _layer(scheme: str, out_features: int = 200, in_features: int = 320, bias: bool = True, use_native: bool = True):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    config = SCHEMES[scheme]
    return linear, HANDLERS[config.kind].from_float(linear.weight.detach(), linear.bias, config,
                                                    native=use_native and native.available())


def _empty_like(layer, config: QuantConfig, use_native: bool):
    return type(layer).empty(layer.in_features, layer.out_features, layer.bias is not None, config, "cpu",
                             native=use_native and native.available())


def _reference_input(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """What the kernel multiplies: bf16 activations; for W8A8 each row's blocks of 32 rounded to int8 steps of
    (block's absolute max / 127), written out block by block."""
    x = x.to(torch.bfloat16).float()
    if scheme != "w8a8":
        return x
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], 32):
        block = x[:, start:start + 32].double()
        step = block.abs().amax(dim=1, keepdim=True) / 127
        out[:, start:start + 32] = (torch.round(block / step) * step).float()
    return out


def test_w8a8_rounds_each_block_of_a_row_on_its_own_scale():
    """One outlier channel (as real models have) sets only its own block's scale: the rest of the row keeps its
    resolution. The weights of the outlier's block are zero here, so the product is what the other blocks give: close
    to the float product with a scale per block, flattened to nothing by one scale per row."""
    torch.manual_seed(0)
    weight = torch.randn(64, 256)
    weight[:, :32] = 0
    layer = HANDLERS["int8_dynamic"].from_float(weight, None, SCHEMES["w8a8"])
    x = torch.randn(4, 256) * 0.1
    x[:, 3] = 200.0
    expected = F.linear(x.bfloat16().float(), layer.dequantize())
    blocks_sqnr = qmath.sqnr_db(expected, layer(x))
    per_row = x.abs().amax(dim=1, keepdim=True) / 127
    row_sqnr = qmath.sqnr_db(expected, F.linear(torch.round(x / per_row) * per_row, layer.dequantize()))
    assert blocks_sqnr > 30 and row_sqnr < 5, (blocks_sqnr, row_sqnr)


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_kernel_matches_dequantized_weights(scheme, rows, use_native):
    linear, layer = _layer(scheme, use_native=use_native)
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
    _, layer = _layer("int4-g32", use_native=False)
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
    fresh = HANDLERS[config.kind].empty(linear.in_features, linear.out_features, True, config, torch.device("cpu"),
                                        native=layer.use_native)
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(3, linear.in_features)
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)


def test_state_dict_of_another_scheme_is_refused():
    _, layer = _layer("int4-g32")
    other = Int4WeightOnlyLinear.empty(320, 200, True, SCHEMES["int4-g128"], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="scales_and_zeros|qweight"):
        other.load_state_dict(layer.state_dict())


@pytest.mark.parametrize("use_native", [False, True])
@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g64-asym"])
def test_int4_state_dict_padded_for_cuda_loads_on_the_cpu_and_back(scheme, use_native):
    """CPU and CUDA pad N and K differently: a saved form padded as CUDA's kernels pad it (N to 8, K to 128 here)
    loads into a CPU layer, and the CPU layer's saved form cut to that padding loads back, the weights unchanged."""
    linear, layer = _layer(scheme, use_native=use_native)
    config = SCHEMES[scheme]
    saved = layer.state_dict()
    n_multiple, k_multiple = kernels.int4_padding(torch.device("cuda"), config.group_for(linear.in_features))
    n, k = -(-linear.out_features // n_multiple) * n_multiple, -(-linear.in_features // k_multiple) * k_multiple
    group = config.group_for(linear.in_features)
    as_cuda = {**saved, "qweight": qmath.fit_to(saved["qweight"], (n, k // 2)),
               "scales_and_zeros": qmath.fit_to(saved["scales_and_zeros"], (k // group, n, 2))}
    assert as_cuda["qweight"].shape != saved["qweight"].shape
    fresh = _empty_like(layer, config, use_native)
    fresh.load_state_dict(as_cuda)
    torch.testing.assert_close(fresh.dequantize(), layer.dequantize(), rtol=0, atol=0)
    x = torch.randn(3, linear.in_features)
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)
    assert fresh.state_dict()["qweight"].shape == saved["qweight"].shape  # saved again in this device's padding


def test_int4_state_dict_of_another_group_size_is_refused_whatever_its_padding():
    _, layer = _layer("int4-g32")
    other = Int4WeightOnlyLinear.empty(320, 200, True, QuantConfig(bits=4, group_size=64), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="scales_and_zeros"):
        other.load_state_dict(layer.state_dict())


def test_fit_to_cuts_and_zero_pads_each_dim():
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(qmath.fit_to(x, (3, 2)), torch.tensor([[0.0, 1.0], [3.0, 4.0], [0.0, 0.0]]))
    assert qmath.fit_to(x, (2, 3)) is x


def test_conv1d_is_quantized_like_a_linear():
    from transformers.pytorch_utils import Conv1D

    from splice.quant.api import float_weight

    torch.manual_seed(0)
    conv = Conv1D(96, 64)  # nf=96 outputs, nx=64 inputs, weight stored [64, 96]
    weight, bias = float_weight(conv)
    layer = HANDLERS["int8_weight_only"].from_float(weight, bias, QuantConfig())
    x = torch.randn(4, 64)
    assert sqnr_db(conv(x), layer(x)) >= 30


# ---- splice's native kernels (splice.native) ------------------------------------------------------------------------
NATIVE_SCHEMES = ("int8", "w8a8", "int4-g32", "int4-g64-asym", "int4-g128")
DECODE_OP = {"int8": "int8_gemv", "w8a8": "int8_dot_gemv"}  # int4: int4_gemv
NATIVE_ROWS = (1, 3, 8, 12, 20)  # both sides of native.MAX_ROWS["int8_dot"] (8 with AMX, else 16) and ["int8"] (16)


@contextmanager
def _spy(op_name: str):
    """Counts the calls of ``torch.ops.splice_kernels.<op_name>``."""
    op = getattr(torch.ops.splice_kernels, op_name)
    with mock.patch.object(torch.ops.splice_kernels, op_name, mock.Mock(wraps=op)) as calls:
        yield calls


@needs_native
@pytest.mark.parametrize("rows", NATIVE_ROWS)
@pytest.mark.parametrize("scheme", NATIVE_SCHEMES)
def test_native_kernel_matches_dequantized_weights(scheme, rows):
    linear, layer = _layer(scheme)
    assert layer.use_native
    x = torch.randn(rows, linear.in_features)
    expected = F.linear(_reference_input(x, scheme), layer.dequantize(), linear.bias)
    is_int8 = scheme in DECODE_OP
    with _spy(DECODE_OP.get(scheme, "int4_gemv")) as calls, _spy("int8_linear") as conversions:
        out = layer(x)
    # int8: torch's kernel up to 16 rows above native.MAX_ROWS, then the native int8 -> bf16 conversion + F.linear;
    # W8A8: the dot products up to MAX_ROWS["w8a8"] (prompts too at the avx512 level); int4: de-quantise + F.linear
    # above native.MAX_ROWS["int4"]
    limit = native.MAX_ROWS[scheme if is_int8 else "int4"]
    assert calls.call_count == (rows <= limit)
    assert conversions.call_count == (is_int8 and rows > max(limit, kernels.INT8_KERNEL_MAX_ROWS))
    assert (out - expected).norm() / expected.norm() < 1e-2


@needs_native
@pytest.mark.parametrize("widened", [False, True], ids=["bf16-gemm", "widened"])
@pytest.mark.parametrize("scheme", ["int8", "w8a8", "int4-g32", "int4-g64-asym"])
def test_native_prefill_widens_where_the_cpu_has_no_bf16_arithmetic(monkeypatch, scheme, widened):
    """Layers built where ``native.prompts_widened`` (no bf16 GEMM in oneDNN) pass ``widen`` to the prefill op, and
    multiply the same weights either way."""
    monkeypatch.setattr(native, "prompts_widened", lambda: widened)
    linear, layer = _layer(scheme)
    assert layer.widen_prompts == widened
    rows = max(native.MAX_ROWS.values()) + 8  # a prompt at this level: more rows than any GEMV takes (AMX: int4 64)
    x = torch.randn(rows, linear.in_features)
    expected = F.linear(_reference_input(x, scheme), layer.dequantize(), linear.bias)
    op = "int8_linear" if scheme in DECODE_OP else "int4_linear"
    with _spy(op) as prefill:
        out = layer(x)
    assert prefill.call_count == 1 and prefill.call_args.args[-1] is widened
    assert (out - expected).norm() / expected.norm() < 1e-2


@needs_native
@pytest.mark.parametrize("rows", NATIVE_ROWS)
def test_int8_decode_rows_on_dot_products_round_activations_per_block(rows):
    """``dot_products`` (the kernel choice where the CPU has VNNI): decode rows are rounded per block of 32 and summed
    in integers, as W8A8's; prefill rows keep bf16 activations."""
    torch.manual_seed(0)
    linear = nn.Linear(320, 200)
    layer = HANDLERS["int8_weight_only"].from_float(linear.weight.detach(), linear.bias, SCHEMES["int8"], native=True,
                                                    dot_products=True)
    assert layer.use_dot_products
    x = torch.randn(rows, 320)
    decode = rows <= native.MAX_ROWS["int8_dot"]  # more rows: int8_gemv (AMX tiles where present), or prefill
    expected = F.linear(_reference_input(x, "w8a8" if decode else "int8"), layer.dequantize(), linear.bias)
    with _spy("int8_dot_gemv") as calls, _spy("int8_gemv") as float_calls:
        out = layer(x)
    assert calls.call_count == decode
    assert float_calls.call_count == (native.MAX_ROWS["int8_dot"] < rows <= native.MAX_ROWS["int8"])
    assert (out - expected).norm() / expected.norm() < (5e-3 if decode else 1e-2)
    odd = HANDLERS["int8_weight_only"].from_float(torch.randn(8, 48), None, SCHEMES["int8"], native=True,
                                                  dot_products=True)
    assert not odd.use_dot_products  # 48 inputs: not whole blocks of 32


needs_int8_tiles = pytest.mark.skipif(
    not native.int8_tiles_ready(),
    reason="int8 layers keep tiles only at the avx512 level on a CPU with avx512_vnni and without AMX tiles")


def _int8_layer(scheme: str, use_native: bool = True) -> tuple[nn.Linear, nn.Module]:
    """A 200 x 320 layer of ``scheme`` whose decode rows run integer dot products (where native)."""
    torch.manual_seed(0)
    linear = nn.Linear(320, 200)
    config = SCHEMES[scheme]
    return linear, HANDLERS[config.kind].from_float(linear.weight.detach(), linear.bias, config, native=use_native,
                                                    dot_products=use_native)


@needs_int8_tiles
@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
def test_int8_layers_keep_one_copy_in_tiles_and_save_int8_rows(monkeypatch, scheme):
    """Where the dot products serve every decode row the layer holds its weight only as their tiles (uint8, the
    weight's shape); state_dict() holds the int8 rows torch's layer holds, a fresh layer loads them into tiles again,
    and a weight of another shape is refused, not cast. Prefill rows (past ``MAX_ROWS["int8_dot"]``) read the tiles
    through ``int8_linear``."""
    _, layer = _int8_layer(scheme)
    _, torch_layer = _int8_layer(scheme, use_native=False)
    assert layer.tiled and layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (200, 320)
    assert layer.weight_nbytes() == torch_layer.weight_nbytes()
    saved = layer.state_dict()
    assert saved["qweight"].dtype == torch.int8 and torch.equal(saved["qweight"], torch_layer.state_dict()["qweight"])
    torch.testing.assert_close(layer.dequantize(), torch_layer.dequantize(), rtol=0, atol=0)
    fresh = HANDLERS[SCHEMES[scheme].kind].empty(320, 200, True, SCHEMES[scheme], "cpu", native=True,
                                                 dot_products=True)
    assert fresh.tiled
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.qweight, layer.qweight)
    for rows in (1, 3, 20):
        x = torch.randn(rows, 320)
        torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)
    wrong = {**saved, "qweight": saved["qweight"][:, :288].contiguous()}
    with pytest.raises(RuntimeError, match="qweight: saved \\(200, 288\\) torch.int8 does not fit"):
        fresh.load_state_dict(wrong)
    assert torch.equal(fresh.qweight, layer.qweight)
    for key in ("int8_dot", "int8", "w8a8"):
        monkeypatch.setitem(native.MAX_ROWS, key, 4)
    x = torch.randn(20, 320)
    with _spy("int8_linear") as prefill:
        out = layer(x)
    assert prefill.call_count == 1
    expected = torch_layer(qmath.round_activations(x) if scheme == "w8a8" else x)
    assert (out - expected).norm() / expected.norm() < 1e-2


def _grouped_int8_layer(linear: nn.Linear, group: int, use_native: bool) -> nn.Module:
    return HANDLERS["int8_weight_only"].from_float(linear.weight.detach(), linear.bias, QuantConfig(group_size=group),
                                                   native=use_native, dot_products=use_native)


def _rounded_in_groups(x: torch.Tensor, group: int, kept: int, wide: bool = False) -> torch.Tensor:
    """x as the grouped GEMV rounds it: per block of 32 (``wide``: to int16 per block of 256) of each group
    zero-padded to ``kept`` columns (K first padded to whole groups)."""
    spread = F.pad(qmath.pad_to(x, 1, group).view(x.shape[0], -1, group), (0, kept - group)).flatten(1)
    if wide:
        rounded = qmath.round_activations(spread.bfloat16().float(), qmath.WIDE_ACTIVATION_BLOCK,
                                          qmath.WIDE_ACTIVATION_LEVELS)
    else:
        rounded = _reference_input(spread, "w8a8")
    return rounded.view(x.shape[0], -1, kept)[..., :group].flatten(1)[:, : x.shape[1]]


# 160: five blocks, so a 64-column step straddles two groups; 48 and 88 zero-padded to 64 and 96 columns (88 is
# DeepSpeed's q_groups=64 on 5632 inputs); 48 and 88 also leave K short of whole groups (7 x 48 = 336, 4 x 88 = 352)
@needs_native
@pytest.mark.parametrize("group, kept", [(32, 32), (64, 64), (160, 160), (48, 64), (88, 96)])
def test_grouped_int8_runs_the_grouped_gemv_keeps_one_copy_and_saves_the_groups(monkeypatch, fresh_compiles, group,
                                                                                  kept):
    """Grouped int8 on the native kernels: decode rows on ``int8_dot_gemv_grouped`` (x rounded per block of 32), the
    weight kept once, as int8 rows of groups zero-padded to whole blocks, or (where
    ``native.int8_grouped_tiles_ready``) tiles; state_dict() holds the groups torch's layer holds, a fresh layer
    loads them back and a weight of another shape is refused, not cast; rows past ``MAX_ROWS["int8_dot"]`` multiply
    the de-quantised weight."""
    torch.manual_seed(0)
    linear = nn.Linear(320, 200)
    groups = -(-320 // group)
    layer, torch_layer = _grouped_int8_layer(linear, group, True), _grouped_int8_layer(linear, group, False)
    assert layer.native_grouped and layer.use_native and layer.group == group and not torch_layer.use_native
    assert layer.kept_group == kept and layer.groups_padded == (groups * kept != 320)
    assert layer.tiled == native.int8_grouped_tiles_ready()
    assert layer.qweight.shape == (200, groups * kept)
    assert layer.qweight.dtype == (torch.uint8 if layer.tiled else torch.int8)
    assert layer.scales.shape == (13, groups, 16)  # native.int8_group_scales_pack: 200 rows in 13 tiles of 16
    padding = 8 * groups * 2 + 200 * groups * (kept - group)  # the last tile's 8 rows' scales; the groups' padding
    assert layer.weight_nbytes() == torch_layer.weight_nbytes() + padding
    saved = layer.state_dict()
    assert all(torch.equal(saved[key], torch_layer.state_dict()[key]) for key in torch_layer.state_dict())
    torch.testing.assert_close(layer.dequantize(), torch_layer.dequantize(), rtol=0, atol=0)
    for rows in (1, 3, 20):  # 20: past the amx level's 8 rows, a prompt there
        x = torch.randn(rows, 320)
        decode = rows <= native.MAX_ROWS["int8_dot"]
        rounded = _rounded_in_groups(x, group, kept) if decode else _reference_input(x, "int8")
        expected = F.linear(rounded, layer.dequantize(), linear.bias)
        with _spy("int8_dot_gemv_grouped") as calls:
            out = layer(x)
        assert calls.call_count == decode
        assert (out - expected).norm() / expected.norm() < (5e-3 if decode else 1e-2)
    fresh = HANDLERS["int8_weight_only"].empty(320, 200, True, QuantConfig(group_size=group), "cpu", native=True,
                                               dot_products=True)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.qweight, layer.qweight) and torch.equal(fresh.scales, layer.scales)
    x = torch.randn(3, 320)
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="scales: saved \\(200, 4\\) torch.bfloat16 does not fit"):
        fresh.load_state_dict({**saved, "scales": torch.ones(200, 4).bfloat16()})
    wrong = {**saved, "qweight": saved["qweight"][:, :100].contiguous()}
    shape = f"\\({groups}, 100, {group}\\)"
    with pytest.raises(RuntimeError, match=f"qweight: saved {shape} torch.int8 does not fit"):
        fresh.load_state_dict(wrong)
    assert torch.equal(fresh.qweight, layer.qweight)
    decode = torch.randn(2, 320, dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)  # the op traces (its fake), so a compiled step holds it
    torch.testing.assert_close(compiled(decode), layer(decode), rtol=1.6e-2, atol=1e-3)  # Inductor fuses the bias add
    monkeypatch.setitem(native.MAX_ROWS, "int8_dot", 4)
    x = torch.randn(20, 320)
    expected = F.linear(x.bfloat16().float(), layer.dequantize(), linear.bias)
    widens_here = native.prompts_widened()  # what the layer above was built with: True where oneDNN has no bf16
    monkeypatch.setattr(native, "prompts_widened", lambda: True)  # a CPU without bf16 arithmetic: float32 slabs
    widened = _grouped_int8_layer(linear, group, True)
    for built, widens in ((layer, widens_here), (widened, True)):
        assert built.widen_prompts == widens
        with _spy("int8_dot_gemv_grouped") as calls, _spy("widened_linear") as slabs:
            out = built(x)
        assert calls.call_count == 0 and slabs.call_count == widens
        assert (out - expected).norm() / expected.norm() < 1e-2


@needs_native
@pytest.mark.parametrize("in_features, group", [(320, 16), (300, 40)])  # padded to 32 and 64: more than half again
def test_grouped_int8_that_padding_would_grow_by_more_than_half_stays_on_torch_s_kernel(in_features, group):
    linear = nn.Linear(in_features, 64)
    layer = _grouped_int8_layer(linear, group, True)
    assert not layer.native_grouped and not layer.use_native and layer.group == group and layer.kept_group == 0
    assert layer.qweight.shape == (-(-in_features // group), 64, group)
    x = torch.randn(2, in_features)
    expected = F.linear(x.bfloat16().float(), layer.dequantize(), linear.bias)
    assert (layer(x) - expected).norm() / expected.norm() < 1e-2


def test_padded_group_is_whole_blocks_adding_at_most_half():
    groups = [0, 16, 21, 22, 32, 33, 42, 43, 64, 65, 88, 176]
    assert [padded_group(g) for g in groups] == [0, 0, 0, 32, 32, 0, 0, 64, 64, 96, 96, 192]


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_int8_decode_rows_on_int16_dot_products_at_the_avx2_level(rows):
    """``dot_products=16`` (the kernel choice at the avx2 level without AVX-VNNI): decode rows are rounded to int16 per
    block of 256 and summed in integers (``int8_dot16_gemv``), whatever level runs the layer later; prefill rows
    keep bf16 activations. in_features off the block of 256 (the last block shorter)."""
    torch.manual_seed(0)
    linear = nn.Linear(320, 200)
    with native.use_isa("avx2"):
        layer = HANDLERS["int8_weight_only"].from_float(linear.weight.detach(), linear.bias, SCHEMES["int8"],
                                                        native=True, dot_products=16)
    assert layer.use_dot_products == 16
    x = torch.randn(rows, 320)
    decode = rows <= native.MAX_ROWS["int8_dot"]
    rounded = qmath.round_activations(x.bfloat16().float(), qmath.WIDE_ACTIVATION_BLOCK, qmath.WIDE_ACTIVATION_LEVELS)
    expected = F.linear(rounded if decode else _reference_input(x, "int8"), layer.dequantize(), linear.bias)
    with _spy("int8_dot16_gemv") as calls, _spy("int8_dot_gemv") as int8_calls:
        out = layer(x)
    assert calls.call_count == decode and int8_calls.call_count == 0
    assert (out - expected).norm() / expected.norm() < 5e-3


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("group, kept", [(64, 64), (160, 160), (88, 96)])
def test_grouped_int8_decode_rows_on_int16_dot_products_at_the_avx2_level(rows, group, kept):
    """``dot_products=16`` on a grouped weight (the kernel choice at the avx2 level without AVX-VNNI): the weight kept
    in tiles (which ``int8_dot16_gemv_grouped`` reads best), decode rows rounded to int16 per block of 256 of the
    zero-padded groups' columns and summed in integers, whatever level runs the layer later; state_dict() holds the
    groups a layer on int8 activations holds."""
    torch.manual_seed(0)
    linear = nn.Linear(320, 200)
    with native.use_isa("avx2"):
        layer = HANDLERS["int8_weight_only"].from_float(linear.weight.detach(), linear.bias,
                                                        QuantConfig(group_size=group), native=True, dot_products=16)
    int8_layer = _grouped_int8_layer(linear, group, True)
    assert layer.use_dot_products == 16 and layer.native_grouped and layer.kept_group == kept
    assert layer.tiled and layer.qweight.dtype == torch.uint8
    saved, int8_saved = layer.state_dict(), int8_layer.state_dict()
    assert saved.keys() == int8_saved.keys() and all(torch.equal(saved[key], int8_saved[key]) for key in saved)
    x = torch.randn(rows, 320)
    expected = F.linear(_rounded_in_groups(x, group, kept, wide=True), layer.dequantize(), linear.bias)
    with _spy("int8_dot16_gemv_grouped") as calls, _spy("int8_dot_gemv_grouped") as int8_calls:
        out = layer(x)
    assert calls.call_count == 1 and int8_calls.call_count == 0
    assert (out - expected).norm() / expected.norm() < 5e-3


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 40])
@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g128"])
def test_int4_decode_rows_on_dot_products_round_activations_per_block(scheme, rows):
    """``dot_products``: decode rows go to ``int4_dot_gemv`` (rounded per block of 32 where the CPU has VNNI, and
    below the AMX rows); prefill rows de-quantise as before."""
    torch.manual_seed(0)
    linear = nn.Linear(320, 200)
    layer = HANDLERS["int4_weight_only"].from_float(linear.weight.detach(), linear.bias, SCHEMES[scheme], native=True,
                                                    dot_products=True)
    assert layer.use_dot_products
    x = torch.randn(rows, 320)
    decode = rows <= native.MAX_ROWS["int4_dot"]
    rounded = decode and torch.ops.splice_kernels.int4_dot_ready() and not (rows >= 3 and native.amx_ready())
    expected = F.linear(_reference_input(x, "w8a8" if rounded else scheme), layer.dequantize(), linear.bias)
    with _spy("int4_dot_gemv") as calls:
        out = layer(x)
    assert calls.call_count == decode
    assert (out - expected).norm() / expected.norm() < (5e-3 if rounded else 1e-2)


@needs_native
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g64-asym", "int4-g128"])
def test_int4_decode_rows_on_dot_products_at_the_avx2_level(scheme, rows):
    """On an AVX2-only CPU too (the avx2 level, vpmaddubsw) int4 decode rows are rounded per block of 32 and summed in
    integers; out_features odd and in_features off the group (both padded)."""
    torch.manual_seed(0)
    linear = nn.Linear(328, 37)
    with native.use_isa("avx2"):
        layer = HANDLERS["int4_weight_only"].from_float(linear.weight.detach(), linear.bias, SCHEMES[scheme],
                                                        native=True, dot_products=True)
        x = torch.randn(rows, 328)
        expected = F.linear(_reference_input(x, "w8a8"), layer.dequantize(), linear.bias)
        with _spy("int4_dot_gemv") as calls:
            out = layer(x)
    assert calls.call_count == 1 and out.shape == (rows, 37)
    assert (out - expected).norm() / expected.norm() < 5e-3


@needs_native
@pytest.mark.parametrize("rows", [40, 130])
@pytest.mark.parametrize("scheme, op", [("int8", "int8_dot16_gemv"), ("w8a8", "int8_dot_gemv"),
                                        ("int4-g32", "int4_dot_gemv"), ("int8-g64", "int8_dot16_gemv_grouped")])
def test_prompt_rows_take_the_dot_products_at_the_avx2_level(scheme, op, rows):
    """At the avx2 level prompts past the float GEMVs' 32 rows take the integer dot products, as at the avx512 level
    (they beat the widened float32 GEMMs there): activations rounded as decode rows are (int8 weight-only: int16 per
    block of 256; the others int8 per block of 32), one call, the rounded product; no de-quantised GEMM."""
    torch.manual_seed(0)
    linear = nn.Linear(320, 200)
    kind = {"int8": "int8_weight_only", "int8-g64": "int8_weight_only", "w8a8": "int8_dynamic"}.get(
        scheme, "int4_weight_only")
    with native.use_isa("avx2"):
        assert rows > native.MAX_ROWS["int8"] and rows <= native.MAX_ROWS["int8_dot"]
        dots = 16 if scheme.startswith("int8") else True
        layer = HANDLERS[kind].from_float(linear.weight.detach(), linear.bias, SCHEMES[scheme], native=True,
                                          dot_products=dots)
        x = torch.randn(rows, 320)
        with _spy(op) as calls, _spy("int8_linear") as int8_prompts, _spy("int4_linear") as int4_prompts:
            out = layer(x)
    if scheme.startswith("int8"):
        rounded = qmath.round_activations(x.bfloat16().float(), qmath.WIDE_ACTIVATION_BLOCK,
                                          qmath.WIDE_ACTIVATION_LEVELS)
    else:
        rounded = _reference_input(x, "w8a8")
    expected = F.linear(rounded, layer.dequantize(), linear.bias)
    assert calls.call_count == 1 and int8_prompts.call_count == int4_prompts.call_count == 0
    assert (out - expected).norm() / expected.norm() < 5e-3


@needs_native
@pytest.mark.parametrize("rows", [1, 8, 40, 130])
@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g64-asym", "int4-g128"])
def test_native_int4_runs_the_gemv_for_few_rows_and_dequantizes_for_more(scheme, rows):
    linear, layer = _layer(scheme, out_features=200, in_features=328)  # N and K padded (to 256 and the group)
    x = torch.randn(rows, linear.in_features)
    expected = F.linear(_reference_input(x, scheme), layer.dequantize(), linear.bias)
    with _spy("int4_gemv") as gemv_calls, _spy("int4_linear") as dequantize_calls:
        out = layer(x)
    few = rows <= native.MAX_ROWS["int4"]
    assert (gemv_calls.call_count, dequantize_calls.call_count) == ((1, 0) if few else (0, 1))
    assert (out - expected).norm() / expected.norm() < 1e-2


@needs_native
@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g64-asym", "int4-g128"])
def test_native_int4_holds_one_copy_in_the_tile_layout(scheme):
    """One copy in tiles, each group's scales beside its weight words (nothing in ``packed_scales``); a symmetric
    scheme (zeros 0) keeps its scales alone: half the scale bytes of torch's (scale, zero) layout."""
    linear, layer = _layer(scheme, out_features=256, bias=False)
    _, torch_layer = _layer(scheme, out_features=256, bias=False, use_native=False)
    n, k = layer.padded_shape
    symmetric = SCHEMES[scheme].symmetric
    words = 2 * layer.group + (8 if symmetric else 16)  # the group's chunk words, then its scales (and zeros)
    assert layer.packed.shape == (n // 16, k // layer.group, words) and layer.packed.dtype == torch.int32
    assert layer.packed_scales.numel() == 0
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    scale_bytes = n * (k // layer.group) * 2
    assert layer.weight_nbytes() == stored == torch_layer.weight_nbytes() - (scale_bytes if symmetric else 0)
    assert stored <= (0.29 if symmetric and layer.group == 32 else 0.33) * linear.weight.numel() * 2


@needs_native
@pytest.mark.parametrize("out_features, in_features", [(200, 320), (72, 200)])  # (72, 200): N and K padded
@pytest.mark.parametrize("scheme", NATIVE_SCHEMES)
def test_native_and_torch_layouts_load_each_other(scheme, out_features, in_features):
    _, layer = _layer(scheme, out_features, in_features)
    _, torch_layer = _layer(scheme, out_features, in_features, use_native=False)
    saved = layer.state_dict()
    assert saved.keys() == torch_layer.state_dict().keys()
    assert all(torch.equal(saved[key], torch_layer.state_dict()[key]) for key in saved)  # one saved form
    into_torch = _empty_like(layer, SCHEMES[scheme], use_native=False)
    into_torch.load_state_dict(saved)
    back = _empty_like(layer, SCHEMES[scheme], use_native=True)
    back.load_state_dict(into_torch.state_dict())
    assert layer.use_native and back.use_native and not into_torch.use_native
    x = torch.randn(3, in_features)
    torch.testing.assert_close(back(x), layer(x), rtol=0, atol=0)
    torch.testing.assert_close(into_torch(x), torch_layer(x), rtol=0, atol=0)
    assert (into_torch(x) - layer(x)).norm() / layer(x).norm() < 1e-2


@needs_native
@pytest.mark.parametrize("scheme", ["int8", "w8a8", "int4-g32"])
def test_native_layers_compile_in_one_graph(scheme):
    _, layer = _layer(scheme)
    x = torch.randn(2, layer.in_features, dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=1.6e-2, atol=1e-3)  # Inductor fuses the bias add


@needs_native
@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_native_prefill_compiles_in_one_graph(scheme):
    """Above the GEMVs' rows the graph holds the ``int8_linear`` / ``int4_linear`` prefill ops."""
    _, layer = _layer(scheme)
    rows = (native.MAX_ROWS["int8"] if scheme == "int8" else native.MAX_ROWS["int4"]) + 24
    x = torch.randn(rows, layer.in_features, dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    # bf16 tolerance, and some absolute slack: Inductor adds the bias to the float32 product before rounding, which
    # moves outputs that nearly cancel by more than 1.6 % of themselves
    torch.testing.assert_close(compiled(x), layer(x), rtol=1.6e-2, atol=1e-3)


@needs_native
@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_native_prefill_buffer_is_not_shared_between_results(scheme):
    """Prefill de-quantises every layer into one kept buffer: layers of the same shape, called in turn (also after a
    larger one grew the buffer), each get their own product."""
    torch.manual_seed(0)
    handler = HANDLERS[SCHEMES[scheme].kind]
    layers = [handler.from_float(torch.randn(256, 128), None, SCHEMES[scheme], native=True) for _ in range(2)]
    bigger = handler.from_float(torch.randn(512, 256), None, SCHEMES[scheme], native=True)
    x = torch.randn(80, 128, dtype=torch.bfloat16)
    expected = [F.linear(x.float(), layer.dequantize()) for layer in layers]
    outs = [layers[0](x), layers[1](x), bigger(torch.randn(80, 256, dtype=torch.bfloat16)), layers[0](x)]
    for out, want in zip((outs[0], outs[1], outs[3]), (expected[0], expected[1], expected[0])):
        assert (out.float() - want).norm() / want.norm() < 1e-2
    assert native.release_prefill_buffer() >= 512 * 256 * 2  # the largest weight's bf16 copy
    assert torch.ops.splice_kernels.prefill_buffer_bytes() == 0
    assert (layers[1](x).float() - expected[1]).norm() / expected[1].norm() < 1e-2  # made again


@pytest.mark.parametrize("group", [None, 20])
@pytest.mark.parametrize("rows", [1, 12])
def test_int8_torch_kernels_take_any_in_features(group, rows):
    """torch's CPU ``_weight_int8pack_mm`` needs K a multiple of 16 (wrong sums or a crash otherwise)."""
    torch.manual_seed(0)
    linear = nn.Linear(200, 72)
    layer = HANDLERS["int8_weight_only"].from_float(linear.weight.detach(), linear.bias, QuantConfig(group_size=group))
    x = torch.randn(rows, 200)
    expected = F.linear(_reference_input(x, "int8"), layer.dequantize(), linear.bias)
    assert (layer(x) - expected).norm() / expected.norm() < 1e-2


EMPTY_ROW_SCHEMES = {**SCHEMES, "int8-g48": QuantConfig(group_size=48), "int8-g20": QuantConfig(group_size=20),
                     "int4-g64-padded-k": QuantConfig(bits=4, group_size=64)}


@pytest.mark.parametrize("shape", [(0, 200), (3, 0, 200)], ids=["0xK", "Bx0xK"])
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("scheme", list(EMPTY_ROW_SCHEMES))
def test_no_rows_give_an_empty_output_as_nn_linear_does(scheme, use_native, shape):
    """A batch with no rows (an empty prompt, an empty micro-batch): every layer kind on every kernel path returns
    nn.Linear's empty output (in_features 200: padded groups of 48 and 20, K padded for int4 g64)."""
    torch.manual_seed(0)
    linear = nn.Linear(200, 72)
    config = EMPTY_ROW_SCHEMES[scheme]
    on_native = use_native and native.available()
    layer = HANDLERS[config.kind].from_float(linear.weight.detach(), linear.bias, config, native=on_native,
                                             dot_products=on_native)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, dtype=dtype)
        out = layer(x)
        assert out.shape == linear(x.float()).shape and out.dtype == dtype
