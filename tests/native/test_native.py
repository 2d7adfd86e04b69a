"""splice's native CPU GEMV kernels against float32 products, their int4 layout, huge pages and the fallback."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from splice import native
from splice.quant import qmath

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
ROWS = (1, 2, 4, 5, 9)
SHAPES = ((64, 128), (37, 100), (5, 33), (130, 576))  # (N, K): tails in both


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).abs().max() / expected.abs().max()).item()


@needs_native
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_bf16_gemv_matches_the_float_product(rows, n, k):
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    assert relative_error(torch.ops.splice_kernels.bf16_gemv(x, w), x.float() @ w.float().T) < 1e-2


@needs_native
@pytest.mark.parametrize("rows", ROWS + (16,))  # AMX (where present): 5 to 16 rows
@pytest.mark.parametrize("n, k", SHAPES)
def test_int8_gemv_matches_the_float_product(rows, n, k):
    x = torch.randn(rows, k).bfloat16()
    w, scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16()
    expected = (x.float() @ w.float().T) * scales.float()
    assert relative_error(torch.ops.splice_kernels.int8_gemv(x, w, scales), expected) < 1e-2


@needs_native
@pytest.mark.parametrize("rows", ROWS + (16, 17, 40))  # AMX (where present): from 3 rows; over 16 rows x is padded
@pytest.mark.parametrize("n, k, group", [(64, 128, 32), (32, 576, 64), (16, 256, 128), (48, 64, 64), (32, 120, 24)])
def test_int4_gemv_matches_the_dequantized_product(rows, n, k, group):
    x = torch.randn(rows, k).bfloat16()
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales_and_zeros = torch.randn(k // group, n, 2).bfloat16()
    expected = x.float() @ qmath.dequantize_int4(q, scales_and_zeros).T
    got = torch.ops.splice_kernels.int4_gemv(x, native.int4_tile_pack(q), native.int4_tile_scales(scales_and_zeros),
                                             group)
    assert relative_error(got, expected) < 1e-2


@needs_native
@pytest.mark.parametrize("shape", [(37, 100), (256, 2048), (3, 5)])
def test_int8_linear_converts_the_codes_exactly(shape):
    """Bit for bit torch's own composition: the native int8 -> bf16 conversion is exact, then the same GEMM."""
    q, scales = torch.randint(-128, 128, shape, dtype=torch.int8), torch.rand(shape[0]).bfloat16()
    x = torch.randn(40, shape[1]).bfloat16()
    expected = torch.nn.functional.linear(x, q.to(torch.bfloat16)) * scales
    torch.testing.assert_close(torch.ops.splice_kernels.int8_linear(x, q, scales), expected, rtol=0, atol=0)


@needs_native
@pytest.mark.parametrize("n, k, group", [(48, 96, 32), (80, 160, 32), (112, 192, 64), (16, 384, 128), (208, 640, 128),
                                         (32, 120, 24), (48, 40, 8)])
def test_int4_dequantize_equals_the_reference_rounded_to_bf16(n, k, group):
    """Bit for bit: (q - 8) has at most 4 significant bits and a bf16 scale 8, so (q - 8) * scale is exact in float32
    and both sides round once there (the kernel's FMA, torch's add) and once to bf16 (round to nearest even: the
    kernel's cvtne2ps, torch's cast). Shapes: N and K not multiples of 64, and groups of 24 and 8 columns (not
    multiples of 32, the kernel's per-lane-shift path)."""
    torch.manual_seed(n + k + group)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales_and_zeros = torch.randn(k // group, n, 2).bfloat16()
    got = torch.ops.splice_kernels.int4_dequantize(native.int4_tile_pack(q), native.int4_tile_scales(scales_and_zeros),
                                                   group)
    assert got.dtype == torch.bfloat16 and got.shape == (n, k)
    assert torch.equal(got, qmath.dequantize_int4(q, scales_and_zeros).bfloat16())


@needs_native
def test_int4_dequantize_traces_under_torch_compile():
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    tiles, scales_and_zeros = native.int4_tile_pack(q), native.int4_tile_scales(torch.randn(2, 32, 2).bfloat16())
    step = torch.compile(lambda x: x @ torch.ops.splice_kernels.int4_dequantize(tiles, scales_and_zeros, 32).T,
                         fullgraph=True)
    x = torch.randn(20, 64).bfloat16()
    torch.testing.assert_close(step(x), x @ torch.ops.splice_kernels.int4_dequantize(tiles, scales_and_zeros, 32).T)


def test_int4_tile_layout_round_trips():
    q = torch.randint(0, 16, (48, 96), dtype=torch.uint8)
    scales_and_zeros = torch.randn(3, 48, 2).bfloat16()
    tiles = native.int4_tile_pack(q)
    assert tiles.shape == (3, 12, 16) and tiles.dtype == torch.int32
    assert torch.equal(native.int4_tile_unpack(tiles), q)
    assert torch.equal(native.int4_untile_scales(native.int4_tile_scales(scales_and_zeros)), scales_and_zeros)


@needs_native
def test_bad_shapes_name_the_value():
    with pytest.raises(RuntimeError, match="must be \\[M, 64\\]"):
        torch.ops.splice_kernels.bf16_gemv(torch.randn(1, 32).bfloat16(), torch.randn(8, 64).bfloat16())
    with pytest.raises(RuntimeError, match="group 48"):
        torch.ops.splice_kernels.int4_gemv(torch.randn(1, 64).bfloat16(), torch.zeros(1, 8, 16, dtype=torch.int32),
                                           torch.zeros(1, 1, 16, 2).bfloat16(), 48)
    with pytest.raises(RuntimeError, match="scales must be a contiguous bf16 tensor of 8 elements, got Float \\[8\\]"):
        torch.ops.splice_kernels.int8_gemv(torch.randn(1, 64).bfloat16(), torch.zeros(8, 64, dtype=torch.int8),
                                           torch.ones(8))
    with pytest.raises(RuntimeError, match="scales_and_zeros must be contiguous bf16 \\[1, 2, 16, 2\\]"):
        torch.ops.splice_kernels.int4_dequantize(torch.zeros(1, 8, 16, dtype=torch.int32),
                                                 torch.zeros(1, 1, 16, 2).bfloat16(), 32)


@needs_native
def test_kernels_trace_under_torch_compile():
    w = torch.randn(24, 64).bfloat16()
    step = torch.compile(lambda x: torch.ops.splice_kernels.bf16_gemv(x, w) * 2, dynamic=False)
    x = torch.randn(1, 64).bfloat16()
    torch.testing.assert_close(step(x), torch.ops.splice_kernels.bf16_gemv(x, w) * 2)


def test_fits_checks_rows_dtype_and_device():
    assert native.fits("bf16", torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not native.fits("bf16", torch.zeros(5, 8, dtype=torch.bfloat16))
    assert not native.fits("int8", torch.zeros(2, 8))  # fp32 input
    assert native.fits("int4", torch.zeros(512, 8, dtype=torch.bfloat16))


def test_environment_switch_turns_them_off_without_a_warning():
    code = ("import warnings; warnings.simplefilter('error'); from splice import native; "
            "assert native.available() is False")
    env = {**__import__("os").environ, "SPLICE_NATIVE_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@needs_native
def test_amx_switch_leaves_the_avx512_path_for_every_row_count():
    """``SPLICE_NATIVE_AMX=0``: ``int4_gemv`` and ``int8_gemv`` run their AVX-512 paths at 8 rows too (here checked
    against the float products), and quantized layers leave them at the AVX-512 thresholds."""
    code = (
        "import torch; from splice import native; from splice.quant import qmath\n"
        "assert native.available() and not native.amx_ready()\n"
        "assert native.int4_gemv_max_rows == native.INT4_GEMV_MAX_ROWS['avx512']\n"
        "assert native.MAX_ROWS['int8'] == native.INT8_MAX_ROWS['avx512']\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(8, 256).bfloat16(); q = torch.randint(0, 16, (64, 256), dtype=torch.uint8)\n"
        "sz = torch.randn(256 // 32, 64, 2).bfloat16()\n"
        "expected = x.float() @ qmath.dequantize_int4(q, sz).T\n"
        "got = torch.ops.splice_kernels.int4_gemv(x, native.int4_tile_pack(q), native.int4_tile_scales(sz), 32)\n"
        "assert ((got.float() - expected).abs().max() / expected.abs().max()).item() < 1e-2\n"
        "w8, s8 = torch.randint(-127, 128, (64, 256), dtype=torch.int8), torch.rand(64).bfloat16()\n"
        "expected = (x.float() @ w8.float().T) * s8.float()\n"
        "got = torch.ops.splice_kernels.int8_gemv(x, w8, s8)\n"
        "assert ((got.float() - expected).abs().max() / expected.abs().max()).item() < 1e-2\n")
    env = {**__import__("os").environ, "SPLICE_NATIVE_AMX": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


@needs_native
def test_row_thresholds_follow_amx():
    key = "amx" if native.amx_ready() else "avx512"
    assert native.int4_gemv_max_rows == native.INT4_GEMV_MAX_ROWS[key]
    assert native.MAX_ROWS["int8"] == native.INT8_MAX_ROWS[key]


@needs_native
def test_amx_gemvs_and_onednn_take_turns_on_the_same_threads():
    """The AMX GEMVs configure and release the tile state on every call; oneDNN's bf16 GEMM (AMX too, with its own
    tile configuration) then runs on the same threads: both stay right, round after round."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (256, 512), dtype=torch.uint8)
    scales_and_zeros = torch.randn(512 // 32, 256, 2).bfloat16()
    words, tiled = native.int4_tile_pack(q), native.int4_tile_scales(scales_and_zeros)
    w8, s8 = torch.randint(-127, 128, (256, 512), dtype=torch.int8), torch.rand(256).bfloat16()
    dense = torch.randn(384, 512).bfloat16()
    for _ in range(3):
        x = torch.randn(8, 512).bfloat16()
        expected = x.float() @ qmath.dequantize_int4(q, scales_and_zeros).T
        assert relative_error(torch.ops.splice_kernels.int4_gemv(x, words, tiled, 32), expected) < 1e-2
        expected = (x.float() @ w8.float().T) * s8.float()
        assert relative_error(torch.ops.splice_kernels.int8_gemv(x, w8, s8), expected) < 1e-2
        rows = torch.randn(128, 512).bfloat16()
        assert relative_error(torch.nn.functional.linear(rows, dense), rows.float() @ dense.float().T) < 1e-2


def test_huge_page_advice_skips_what_it_cannot_cover():
    assert native.advise_huge_pages(torch.zeros(1000)) == 0  # smaller than a huge page
    big = torch.zeros(3 * native.HUGE_PAGE // 4)
    advised = native.advise_huge_pages(big)
    assert advised % native.HUGE_PAGE == 0 and advised <= big.numel() * 4
