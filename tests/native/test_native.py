"""splice's native CPU GEMV kernels against float32 products, their int4 layout, huge pages and the fallback."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from splice import native
from splice.quant import qmath

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


@pytest.fixture(params=native.ISA_LEVELS)
def isa(request):
    """Each kernel test runs at every instruction-set level this CPU can execute; the others skip, naming the flags."""
    level = request.param
    if not native.available():
        pytest.skip("splice's native kernels are not available here")
    if level not in native.supported_isas():
        pytest.skip(f"the {level} kernels need CPU flags {', '.join(native.ISA_FLAGS[level])} (and, for amx, the "
                    f"tile state from Linux); this machine runs {', '.join(native.supported_isas())}")
    with native.use_isa(level):
        yield level
ROWS = (1, 2, 4, 5, 9)
SHAPES = ((64, 128), (37, 100), (5, 33), (130, 576))  # (N, K): tails in both


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).abs().max() / expected.abs().max()).item()


@needs_native
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_bf16_gemv_matches_the_float_product(isa, rows, n, k):
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    assert relative_error(torch.ops.splice_kernels.bf16_gemv(x, w), x.float() @ w.float().T) < 1e-2


@needs_native
@pytest.mark.parametrize("rows", ROWS + (16,))  # AMX (where present): 5 to 16 rows
@pytest.mark.parametrize("n, k", SHAPES)
def test_int8_gemv_matches_the_float_product(isa, rows, n, k):
    x = torch.randn(rows, k).bfloat16()
    w, scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16()
    expected = (x.float() @ w.float().T) * scales.float()
    assert relative_error(torch.ops.splice_kernels.int8_gemv(x, w, scales), expected) < 1e-2


@needs_native
@pytest.mark.parametrize("rows", ROWS + (16,))
@pytest.mark.parametrize("n, k", [(64, 128), (37, 96), (5, 32), (130, 576)])  # K: whole steps of 64 and a half step
def test_int8_dot_gemv_rounds_x_per_block_and_sums_exactly(isa, rows, n, k):
    """W8A8's decode op: x rounded as ``qmath.round_activations`` does, then the int8 product; the integer sums are
    exact, so the only difference left is the output's rounding to bf16."""
    x = torch.randn(rows, k).bfloat16() * torch.linspace(0.1, 10, k).bfloat16()  # blocks of different scales
    w, scales = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16()
    expected = (qmath.round_activations(x.float()) @ w.float().T) * scales.float()
    got = torch.ops.splice_kernels.int8_dot_gemv(x, w, scales)
    assert relative_error(got, expected) < 4e-3
    # integer products at every level: AVX512-VNNI where the level and CPU have it, else vpmaddubsw
    assert torch.ops.splice_kernels.int8_dot_ready() and torch.ops.splice_kernels.int4_dot_ready()
    assert torch.ops.splice_kernels.vnni_ready() == (isa != "avx2" and "avx512_vnni" in native._cpu_flags())


@needs_native
@pytest.mark.parametrize("rows", (3, 6, 8, 11))
def test_int8_dot_gemv_from_three_rows_is_within_one_rounding_of_the_exact_sums(isa, rows):
    """From three rows of x the VNNI level transposes 16 weight rows in registers and sums each block exactly in
    int32: every output is the exact product of the rounded activations and the weights, rounded to bf16 (half a
    bf16 step) after float32 sums over the blocks (their rounding bounded by the sum of the blocks' magnitudes); weight
    rows past the last 16 (here 9) and a half step of columns (k = 352) take the row kernels, as do fewer rows, which
    give the same outputs within those bounds."""
    torch.manual_seed(rows)
    n, k = 16 * 5 + 9, 352
    x = torch.randn(rows, k).bfloat16() * torch.linspace(0.1, 10, k).bfloat16()
    w, scales = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16() + 0.5
    rounded = qmath.round_activations(x.float()).double()
    exact = (rounded @ w.double().T) * scales.double()
    magnitude = (rounded.abs() @ w.double().abs().T) * scales.double()
    bound = exact.abs() * 2.0 ** -8 + magnitude * 2.0 ** -20
    got = torch.ops.splice_kernels.int8_dot_gemv(x, w, scales).double()
    assert ((got - exact).abs() <= bound).all(), ((got - exact).abs() / bound).max()
    one_at_a_time = torch.cat([torch.ops.splice_kernels.int8_dot_gemv(row[None], w, scales) for row in x]).double()
    assert ((got - one_at_a_time).abs() <= 2 * bound).all()


# (N, K) for int8 tiles: whole groups of 16 rows and a tail of 9, 5 or 1; K whole steps of 64 and a half step of 32
TILE_SHAPES = [(64, 128), (16 * 5 + 9, 352), (37, 96), (5, 32), (129, 576)]


@needs_native
@pytest.mark.parametrize("n, k", TILE_SHAPES)
def test_int8_tiles_hold_each_16_rows_words_side_by_side(n, k):
    """``int8_tile_pack``'s layout from its definition, byte by byte: in each group of 16 rows, step of 64 columns
    and 4-column word j, the 16 rows' words side by side (64 bytes); the rows past the last whole 16 as they are;
    every byte q + 128. ``int8_tile_unpack`` gives the rows back."""
    torch.manual_seed(n * k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    tiles = native.int8_tile_pack(q)
    assert tiles.dtype == torch.uint8 and tiles.shape == q.shape
    rows, columns = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    in_tiles = (rows // 16 * 16 * k + columns // 64 * 1024 + columns % 64 // 4 * 64 + rows % 16 * 4 + columns % 4)
    offset = torch.where(rows < n // 16 * 16, in_tiles, rows * k + columns)
    assert torch.equal(tiles.flatten()[offset], (q.view(torch.uint8) ^ 0x80))
    assert torch.equal(native.int8_tile_unpack(tiles), q)
    with pytest.raises(ValueError, match="K a multiple of 32, got torch.int8 \\(8, 48\\)"):
        native.int8_tile_pack(torch.zeros(8, 48, dtype=torch.int8))


@needs_native
@pytest.mark.parametrize("rows", (1, 2, 3, 8, 11, 17))
@pytest.mark.parametrize("n, k", TILE_SHAPES)
def test_int8_ops_take_tiles_and_give_what_they_give_on_rows(isa, rows, n, k):
    """``int8_dot_gemv`` on tiles sums every block exactly in int32, so each output is the exact product of the
    rounded activations, within one bf16 rounding and float32 sums over the blocks; from three rows (the transposed
    kernel on rows) and wherever the level reads the tiles back to rows (no AVX512-VNNI) the outputs are the rows'
    bit for bit. The other int8 ops read tiles as rows: the same outputs."""
    torch.manual_seed(rows * n + k)
    x = torch.randn(rows, k).bfloat16() * torch.linspace(0.1, 10, k).bfloat16()
    q, scales = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16() + 0.5
    tiles = native.int8_tile_pack(q)
    rounded = qmath.round_activations(x.float()).double()
    exact = (rounded @ q.double().T) * scales.double()
    bound = exact.abs() * 2.0 ** -8 + ((rounded.abs() @ q.double().abs().T) * scales.double()) * 2.0 ** -20
    ops = torch.ops.splice_kernels
    got = ops.int8_dot_gemv(x, tiles, scales)
    assert ((got.double() - exact).abs() <= bound).all(), ((got.double() - exact).abs() / bound).max()
    if rows >= 3 or not ops.vnni_ready():
        assert torch.equal(got, ops.int8_dot_gemv(x, q, scales))
    assert torch.equal(ops.int8_gemv(x, tiles, scales), ops.int8_gemv(x, q, scales))
    assert torch.equal(ops.int8_linear(x, tiles, scales), ops.int8_linear(x, q, scales))
    assert torch.equal(ops.int8_linear(x, tiles, scales, True), ops.int8_linear(x, q, scales, True))
    assert torch.equal(ops.int8_dot16_gemv(x, tiles, scales), ops.int8_dot16_gemv(x, q, scales))


@needs_native
def test_int8_tiles_need_whole_blocks_of_32_columns(isa):
    with pytest.raises(RuntimeError, match="int8 tiles need K a multiple of 32, got 48"):
        torch.ops.splice_kernels.int8_gemv(torch.randn(1, 48).bfloat16(), torch.zeros(8, 48, dtype=torch.uint8),
                                           torch.ones(8).bfloat16())
    with pytest.raises(RuntimeError, match="int8 or uint8 \\(tiles of splice.native.int8_tile_pack\\), got Int"):
        torch.ops.splice_kernels.int8_dot_gemv(torch.randn(1, 64).bfloat16(), torch.zeros(8, 64, dtype=torch.int32),
                                               torch.ones(8).bfloat16())
    # where the level keeps int8 layers in tiles: the avx512 level's VNNI dot products, not on AMX
    assert native.int8_tiles_ready() == (isa == "avx512" and torch.ops.splice_kernels.vnni_ready())


def round16(x: torch.Tensor) -> torch.Tensor:
    """x rounded as ``int8_dot16_gemv`` rounds it (int16 per row and block of 256), in float64."""
    return qmath.round_activations(x.float(), qmath.WIDE_ACTIVATION_BLOCK, qmath.WIDE_ACTIVATION_LEVELS).double()


@needs_native
@pytest.mark.parametrize("rows", (1, 2, 3, 8, 11, 17))  # chunks of two rows, passes of eight
# K: whole and part blocks; N: groups of four weight rows, and tails of 1, 2 and 3
@pytest.mark.parametrize("n, k", [(64, 256), (37, 96), (5, 32), (130, 576), (70, 2080), (67, 160)])
def test_int8_dot16_gemv_rounds_x_to_int16_per_block_and_sums_exactly(isa, rows, n, k):
    """int8 weight-only's decode op without VNNI: x rounded as ``qmath.round_activations`` does with int16's levels
    per block of 256 (the last block what is left of K), then the int8 product. Each block's integer sums are exact,
    so every output is the exact product of the rounded x, rounded once to bf16 after float32 sums over the blocks;
    a row's outputs do not depend on the rows beside it. The rounding's own error, against x as it is, is a small part
    of int8 rounding's (per block of 32)."""
    torch.manual_seed(rows * k)
    x = torch.randn(rows, k).bfloat16() * torch.linspace(0.1, 10, k).bfloat16()  # blocks of different scales
    w, scales = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16() + 0.5
    exact = (round16(x) @ w.double().T) * scales.double()
    magnitude = (round16(x).abs() @ w.double().abs().T) * scales.double()
    bound = exact.abs() * 2.0 ** -8 + magnitude * 2.0 ** -20
    got = torch.ops.splice_kernels.int8_dot16_gemv(x, w, scales).double()
    assert ((got - exact).abs() <= bound).all(), ((got - exact).abs() / bound).max()
    one_at_a_time = torch.cat([torch.ops.splice_kernels.int8_dot16_gemv(row[None], w, scales) for row in x]).double()
    assert torch.equal(got, one_at_a_time)
    as_is = ((x.double() @ w.double().T) * scales.double()).float()
    int8_rounded = (qmath.round_activations(x.float()).double() @ w.double().T) * scales.double()
    assert relative_error(exact, as_is) < relative_error(int8_rounded, as_is) / 20


@needs_native
def test_int8_dot16_gemv_rounds_x_exactly_as_the_reference(isa):
    """Through identity weights output j is the rounded activation ``q_j * d``, rounded once to bf16: the reference's
    codes in every block, a tiny block beside a large one, an all-zero row, blocks of 256 and the last of 64."""
    torch.manual_seed(0)
    k = 576
    x = torch.randn(3, k) * torch.logspace(-3, 3, k)
    x[1, :256] = torch.linspace(900, 1000, 256)
    x[1, 256:512] = torch.linspace(-3e-5, 2e-5, 256)  # a tiny block: its own scale
    x[2] = 0
    x = x.bfloat16()
    got = torch.ops.splice_kernels.int8_dot16_gemv(x, torch.eye(k, dtype=torch.int8), torch.ones(k).bfloat16())
    expected = qmath.round_activations(x.float(), qmath.WIDE_ACTIVATION_BLOCK, qmath.WIDE_ACTIVATION_LEVELS)
    torch.testing.assert_close(got.float(), expected.bfloat16().float(), rtol=0, atol=0)
    assert not torch.equal(expected, x.float())  # the rounding is there to see


@needs_native
def test_dot_products_round_x_exactly_as_the_reference(isa):
    """Through identity weights (int8: 1 on the diagonal; int4: code 9 there, 8 elsewhere, scale 1, zero 0) output j
    is the rounded activation ``q_j * d``: every level's rounding, byte order and block sums give
    ``qmath.round_activations``' codes, including ties to even, a tiny block, a tiny block beside a large one and
    all-zero blocks. int8's block sums are exact integers, so its outputs are those values rounded once to bf16; int4
    takes its zero point off per group in float, within a quarter of the block's step."""
    k = 96
    x = torch.zeros(4, k)
    x[0, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, 126.5, -126.5, 64.5, -0.25] + [7.0] * 20)
    x[1, :32] = torch.linspace(900, 1000, 32)  # a large block beside a tiny one
    x[1, 32:64] = torch.linspace(-3e-5, 2e-5, 32)  # a tiny block: its own scale
    x[2, 64:] = torch.arange(32) - 15.5  # d = 15.5 / 127: codes at and between halves; row 3 all zeros
    x = x.bfloat16()
    blocks = x.float().reshape(4, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    expected = torch.round(blocks / d).clamp(-127, 127) * d
    assert torch.equal(expected.reshape(4, k), qmath.round_activations(x.float()))  # the reference's codes
    got8 = torch.ops.splice_kernels.int8_dot_gemv(x, torch.eye(k, dtype=torch.int8), torch.ones(k).bfloat16())
    torch.testing.assert_close(got8.float(), expected.reshape(4, k).bfloat16().float(), rtol=0, atol=0)
    codes = torch.full((k, k), 8, dtype=torch.uint8).fill_diagonal_(9)
    sz = torch.zeros(k // 32, k, 2).bfloat16()
    sz[..., 0] = 1
    got4 = torch.ops.splice_kernels.int4_dot_gemv(x, native.int4_tile_pack(codes, sz), 32)
    error = (got4.float().reshape(4, -1, 32) - expected).abs()
    assert (error <= d / 4).all(), error.amax()


def _int4_operands(rows: int, n: int, k: int, group: int, symmetric: bool, seed: int = 0):
    """x whose blocks of 32 each start with a large value (a coarse int8 step for the rest of the block: rounding x
    visibly changes the product) that meets the code 8 (weight = the zero, so it does not swamp the rest), random
    codes elsewhere, and scales and zeros (zeros 0 when ``symmetric``) in the kernel's tiles."""
    torch.manual_seed(seed)
    x = torch.randn(rows, k) * torch.linspace(0.1, 5, k)
    x[:, ::32] *= 40
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    q[:, ::32] = 8
    scales_and_zeros = torch.randn(k // group, n, 2)
    if symmetric:
        scales_and_zeros[..., 1] = 0
    scales_and_zeros = scales_and_zeros.bfloat16()
    return x.bfloat16(), q, scales_and_zeros, native.int4_tile_pack(q, scales_and_zeros)


INT4_DOT_SHAPES = [(64, 128, 32), (32, 576, 64), (16, 256, 128), (48, 2048, 128), (32, 120, 24)]


@needs_native
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("rows", (1, 2, 3, 4, 5, 8, 40))
@pytest.mark.parametrize("n, k, group", INT4_DOT_SHAPES)
def test_int4_dot_gemv_rounds_x_per_block_where_it_can(isa, rows, n, k, group, symmetric):
    """Integer dot products (AVX512-VNNI, or vpmaddubsw at the avx2 level) where the group is whole blocks of 32 and
    AMX does not take the rows: the product of x rounded as ``qmath.round_activations`` does, not of x itself;
    otherwise exactly ``int4_gemv``."""
    x, q, scales_and_zeros, w = _int4_operands(rows, n, k, group, symmetric)
    got = torch.ops.splice_kernels.int4_dot_gemv(x, w, group)
    amx = native.amx_ready() and rows >= native.amx_thresholds()["int4_dot_min_rows"] and group % 32 == 0
    if torch.ops.splice_kernels.int4_dot_ready() and group % 32 == 0 and not amx:
        weight = qmath.dequantize_int4(q, scales_and_zeros).double()
        expected = qmath.round_activations(x.float()).double() @ weight.T
        error = relative_error(got, expected)
        assert error < 4e-3 and relative_error(x.double() @ weight.T, expected) > 4 * error  # not x's own product
    else:
        torch.testing.assert_close(got, torch.ops.splice_kernels.int4_gemv(x, w, group), rtol=0, atol=0)


@needs_native
@pytest.mark.parametrize("rows", (1, 2, 4, 8))
@pytest.mark.parametrize("n, k, group", INT4_DOT_SHAPES[:4])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_dot_gemv_gives_the_same_result_at_every_level(rows, n, k, group, symmetric):
    """The avx2 kernel (vpmaddubsw) and the AVX512-VNNI one sum the same int8 rows in exact integers and apply the
    scales in the same float steps: bit for bit the same output."""
    if "avx512" not in native.supported_isas() or "avx512_vnni" not in native._cpu_flags():
        pytest.skip("this CPU has no AVX512-VNNI kernel to compare the avx2 one with")
    x, _, _, w = _int4_operands(rows, n, k, group, symmetric, seed=rows)
    results = {}
    for level in ("avx2", "avx512"):
        with native.use_isa(level):
            results[level] = torch.ops.splice_kernels.int4_dot_gemv(x, w, group)
    assert torch.equal(results["avx2"], results["avx512"])


@contextlib.contextmanager
def _threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_native
@pytest.mark.parametrize("rows", (1, 2, 3, 5))
# int4: 7 tiles (odd: one left over), 37 (four streams and some left over a thread); int8: a row tail
@pytest.mark.parametrize("n", (16 * 7, 16 * 8 + 4 * 3 + 2, 16 * 37 + 2))
def test_weight_streams_give_the_same_output_as_one(isa, rows, n):
    """Walking two or four parts of each thread's weights side by side changes the order of the reads, not the
    arithmetic: bit for bit the same outputs (int4 and int8 on integer dot products, int8 and bf16 on float ones), at
    every level, with tiles or row blocks left over by the streams and a tail of rows, one thread and two; int4 in
    groups of 64 and of one block (32, a loop of its own), with and without zeros."""
    k = 256
    x, _, _, w4 = _int4_operands(rows, n // 16 * 16, k, 64, symmetric=rows % 2 == 1, seed=rows)
    _, _, _, w32 = _int4_operands(rows, n // 16 * 16, k, 32, symmetric=rows % 2 == 0, seed=rows)
    x8, w8, s8 = torch.randn(rows, k).bfloat16(), torch.randint(-127, 128, (n, k), dtype=torch.int8), \
        torch.rand(n).bfloat16()
    wb = torch.randn(n, k).bfloat16()
    assert native.weight_streams() == native.initial_weight_streams()
    for threads in (1, 2):
        with _threads(threads):
            results = {}
            for streams in (1, 2, 4):
                with native.use_weight_streams(streams):
                    results[streams] = (torch.ops.splice_kernels.int4_dot_gemv(x, w4, 64),
                                        torch.ops.splice_kernels.int4_dot_gemv(x, w32, 32),
                                        torch.ops.splice_kernels.int8_dot_gemv(x8, w8, s8),
                                        torch.ops.splice_kernels.int8_gemv(x8, w8, s8),
                                        torch.ops.splice_kernels.bf16_gemv(x8, wb))
            for streams in (2, 4):
                assert all(torch.equal(a, b) for a, b in zip(results[1], results[streams])), streams


@needs_native
@pytest.mark.parametrize("rows", (1, 2, 3))
@pytest.mark.parametrize("streams", (1, 2, 4))
def test_threads_taking_each_others_pieces_give_the_same_output(isa, rows, streams):
    """Work stealing changes which thread computes a tile or row block, not what it computes: bit for bit the outputs
    of static shares, with enough tiles and blocks for many pieces a thread, two and three threads, and equal to the
    float product within bf16 rounding (no unit skipped, none computed twice into a wrong place)."""
    k, n = 256, 16 * 41
    x, _, _, w4 = _int4_operands(rows, n, k, 64, symmetric=False, seed=rows)
    x8, w8, s8 = torch.randn(rows, k).bfloat16(), torch.randint(-127, 128, (n + 2, k), dtype=torch.int8), \
        torch.rand(n + 2).bfloat16()
    wb = torch.randn(n + 2, k).bfloat16()
    assert native.work_stealing()  # the default
    for threads in (2, 3):
        with _threads(threads), native.use_weight_streams(streams):
            results = {}
            for stealing in (False, True):
                with native.use_work_stealing(stealing):
                    results[stealing] = (torch.ops.splice_kernels.int4_dot_gemv(x, w4, 64),
                                         torch.ops.splice_kernels.int8_dot_gemv(x8, w8, s8),
                                         torch.ops.splice_kernels.int8_gemv(x8, w8, s8),
                                         torch.ops.splice_kernels.bf16_gemv(x8, wb))
            assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))
    expected = x8.float() @ (w8.float() * s8.float()[:, None]).T
    torch.testing.assert_close(results[True][2].float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    torch.testing.assert_close(results[True][3].float(), x8.float() @ wb.float().T, rtol=2e-2, atol=0.3)
    assert native.work_stealing()


def test_weight_streams_refuse_other_counts():
    if not native.available():
        pytest.skip("splice's native kernels are not available here")
    with pytest.raises(RuntimeError, match="3 streams; allowed: 1, 2 or 4"):
        with native.use_weight_streams(3):
            pass
    assert native.weight_streams() == native.initial_weight_streams()


@pytest.mark.parametrize("vendor, streams", (("GenuineIntel", 4), ("AuthenticAMD", 2), (None, 2)))
def test_default_weight_streams_follow_the_cpu_vendor(monkeypatch, vendor, streams):
    """Four streams where they were measured to read faster (Intel), two on every other CPU and where /proc/cpuinfo
    names no vendor."""
    monkeypatch.setattr(native, "_cpu_vendor", lambda: vendor)
    monkeypatch.delenv("SPLICE_WEIGHT_STREAMS", raising=False)
    assert native.default_weight_streams() == native.initial_weight_streams() == streams


def test_weight_streams_from_the_environment(monkeypatch):
    """SPLICE_WEIGHT_STREAMS overrides the CPU's default with 1, 2 or 4 (spaces ignored) and refuses anything else,
    naming what it takes."""
    monkeypatch.setenv("SPLICE_WEIGHT_STREAMS", " 1 ")
    assert native.initial_weight_streams() == 1
    monkeypatch.setenv("SPLICE_WEIGHT_STREAMS", "")
    assert native.initial_weight_streams() == native.default_weight_streams()
    for bad in ("3", "four", "8"):
        monkeypatch.setenv("SPLICE_WEIGHT_STREAMS", bad)
        with pytest.raises(ValueError, match=f"SPLICE_WEIGHT_STREAMS='{bad}' is not a stream count; allowed: 1, 2, 4"):
            native.initial_weight_streams()


@needs_native
@pytest.mark.parametrize("rows", (1, 2, 3, 8))
@pytest.mark.parametrize("streams", (1, 2, 4))
def test_software_prefetch_gives_the_same_output(isa, rows, streams):
    """Prefetching a weight stream in software or not changes when its lines arrive, not what is computed: bit for
    bit the same outputs from every GEMV (int4 on integer and float products, AMX tiles included where the level has
    them; int8 on both; bf16) with every kind's prefetch on, off, each alone, and each from more rows of x than the
    call has and from as many; int4 in groups of 64 and 32."""
    k, n = 256, 16 * 9 + 2
    x, _, _, w4 = _int4_operands(rows, 16 * 9, k, 64, symmetric=False, seed=rows)
    _, _, _, w32 = _int4_operands(rows, 16 * 9, k, 32, symmetric=rows % 2 == 1, seed=rows)
    x8, w8, s8 = torch.randn(rows, k).bfloat16(), torch.randint(-127, 128, (n, k), dtype=torch.int8), \
        torch.rand(n).bfloat16()
    wb = torch.randn(n, k).bfloat16()
    before = native.software_prefetch()
    results = []
    settings = (True, False, ("bf16",), ("int8",), ("int4",), dict.fromkeys(native.PREFETCH_KINDS, rows + 1),
                dict.fromkeys(native.PREFETCH_KINDS, rows))
    with _threads(2), native.use_weight_streams(streams):
        for kinds in settings:
            with native.use_software_prefetch(kinds):
                expected = (dict.fromkeys(native.PREFETCH_KINDS, 1) if kinds is True else {} if kinds is False
                            else kinds if isinstance(kinds, dict) else dict.fromkeys(kinds, 1))
                assert native.software_prefetch() == expected
                results.append((torch.ops.splice_kernels.int4_dot_gemv(x, w4, 64),
                                torch.ops.splice_kernels.int4_dot_gemv(x, w32, 32),
                                torch.ops.splice_kernels.int4_gemv(x, w4, 64),
                                torch.ops.splice_kernels.int8_dot_gemv(x8, w8, s8),
                                torch.ops.splice_kernels.int8_gemv(x8, w8, s8),
                                torch.ops.splice_kernels.bf16_gemv(x8, wb)))
    assert native.software_prefetch() == before
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_software_prefetch_refuses_unknown_kinds_and_row_counts():
    if not native.available():
        pytest.skip("splice's native kernels are not available here")
    before = native.software_prefetch()
    with native.use_software_prefetch("int4"):  # one name, not its letters
        assert native.software_prefetch() == {"int4": 1}
        assert torch.ops.splice_kernels.software_prefetch() == 4  # the kinds prefetched in every pass, as a mask
    with native.use_software_prefetch({"int4": 3, "bf16": 2}):
        assert native.software_prefetch() == {"bf16": 2, "int4": 3}
        assert torch.ops.splice_kernels.software_prefetch_rows() == [2, 0, 3]
        assert torch.ops.splice_kernels.software_prefetch() == 0
    assert native.software_prefetch() == before
    with pytest.raises(ValueError, match="'fp8' is not a kind of weight; allowed: bf16, int8, int4"):
        with native.use_software_prefetch(["int4", "fp8"]):
            pass
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"kinds: \{'int4': .*\} is not a row count per kind; allowed: whole "):
            with native.use_software_prefetch({"int4": bad}):
                pass
    assert native.software_prefetch() == before
    with pytest.raises(RuntimeError, match="is not a mask of PREFETCH_BF16"):
        torch.ops.splice_kernels.set_software_prefetch(8)
    for bad in ([1, 1], [1, -1, 1]):
        with pytest.raises(RuntimeError, match="set_software_prefetch_rows: expected 3 row counts"):
            torch.ops.splice_kernels.set_software_prefetch_rows(bad)
    assert native.software_prefetch() == before


@pytest.mark.parametrize("vendor, kinds", (("GenuineIntel", {"bf16": 1, "int8": 1, "int4": 1}),
                                           ("AuthenticAMD", {"bf16": 3, "int8": 3, "int4": 3}),
                                           (None, {"bf16": 1, "int8": 1, "int4": 1})))
def test_default_software_prefetch_follows_the_cpu_vendor(monkeypatch, vendor, kinds):
    """On AMD the GEMVs prefetch in software from three rows of x a pass (every kind's GEMVs of one or two rows read as
    fast or faster on the hardware prefetcher alone there); every kind in every pass elsewhere and where
    /proc/cpuinfo names no vendor."""
    monkeypatch.setattr(native, "_cpu_vendor", lambda: vendor)
    monkeypatch.delenv("SPLICE_SOFTWARE_PREFETCH", raising=False)
    assert native.default_software_prefetch() == native.initial_software_prefetch() == kinds


def test_software_prefetch_from_the_environment(monkeypatch):
    """SPLICE_SOFTWARE_PREFETCH overrides the CPU's default with all, none or kinds (any case and order, spaces
    ignored), each in every pass or from a number of rows of x, and refuses anything else, naming what it takes."""
    every = {"bf16": 1, "int8": 1, "int4": 1}
    for value, kinds in ((" ALL ", every), ("none", {}), ("int4, bf16", {"bf16": 1, "int4": 1}), ("int8", {"int8": 1}),
                         ("int4:3", {"int4": 3}), ("int4 : 4, bf16", {"bf16": 1, "int4": 4})):
        monkeypatch.setenv("SPLICE_SOFTWARE_PREFETCH", value)
        assert native.initial_software_prefetch() == kinds, value
    monkeypatch.setenv("SPLICE_SOFTWARE_PREFETCH", "")
    assert native.initial_software_prefetch() == native.default_software_prefetch()
    for bad in ("yes", "int4,fp16", "0"):
        monkeypatch.setenv("SPLICE_SOFTWARE_PREFETCH", bad)
        with pytest.raises(ValueError, match=f"SPLICE_SOFTWARE_PREFETCH='{bad}'.* is not a kind of weight; allowed: "
                                             "bf16, int8, int4 \\(or, in the variable, all or none\\)"):
            native.initial_software_prefetch()
    for bad, message in (("int4:", "'' after int4: is not a row count"), ("int4:x", "'x' after int4: is not a row"),
                         ("int4:0", r"\{'int4': 0\} is not a row count per kind")):
        monkeypatch.setenv("SPLICE_SOFTWARE_PREFETCH", bad)
        with pytest.raises(ValueError, match=f"SPLICE_SOFTWARE_PREFETCH='{bad}': {message}"):
            native.initial_software_prefetch()


@needs_native
@pytest.mark.parametrize("rows", (1, 2, 4, 5))
def test_avx2_dot_products_are_the_same_with_and_without_avx_vnni(rows):
    """At the avx2 level AVX-VNNI's vpdpbusd replaces vpmaddubsw + vpmaddwd: the same integer sums, bit for bit the
    same outputs (int4 and int8, one row and batches, a tail of weight rows)."""
    if "avx2" not in native.supported_isas() or "avx_vnni" not in native._cpu_flags():
        pytest.skip("this CPU lacks AVX-VNNI (flag avx_vnni), so the avx2 kernels have one path only")
    x, _, _, w = _int4_operands(rows, 64, 256, 64, symmetric=False, seed=rows)
    x8 = torch.randn(rows, 256).bfloat16()
    w8, scales = torch.randint(-127, 128, (37, 256), dtype=torch.int8), torch.rand(37).bfloat16()
    results = {}
    with native.use_isa("avx2"):
        for on in (True, False):
            with native.use_avx_vnni(on):
                assert native.avx_vnni_ready() is on
                results[on] = (torch.ops.splice_kernels.int4_dot_gemv(x, w, 64),
                               torch.ops.splice_kernels.int8_dot_gemv(x8, w8, scales))
    assert native.avx_vnni_ready()  # restored
    for with_vnni, without in zip(results[True], results[False]):
        assert torch.equal(with_vnni, without)


ATTENTION_SHAPES = (  # (rows, query heads, KV heads, keys, head_dim): GQA, MHA, one KV head, parts, tails; groups of
    # 1-2 heads and of 3 or more (keys in lanes at the avx512 level: 8 heads at a time and the rest, part column chunks);
    # parts of several key blocks (the float scores' and the avx2 level's), a partial last one, 16-key blocks at 256;
    # 3 KV heads at one row, split in two parts on 2 threads so the units share out evenly (the last: too few keys)
    (1, 8, 2, 300, 64), (3, 6, 3, 1100, 32), (2, 4, 4, 17, 128), (1, 4, 1, 2600, 80), (2, 2, 1, 1, 16),
    (2, 9, 3, 40, 64), (1, 11, 1, 70, 16), (1, 6, 2, 33, 96), (1, 4, 2, 100, 256), (1, 9, 3, 130, 64),
    (1, 6, 3, 45, 32), (1, 3, 3, 20, 64))


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows, heads, kv_heads, keys, dim", ATTENTION_SHAPES)
def test_decode_attention_matches_float64_softmax_attention(isa, dtype, rows, heads, kv_heads, keys, dim):
    """One query per row over strided slices of a cache (as the KV cache hands them), a random mask with each row's
    first key visible, and no mask: against softmax attention in float64. Keys split into parts past 512, so the
    long cases check the merge; a fully masked part checks it adds nothing."""
    generator = torch.Generator().manual_seed(keys)
    cache = torch.randn(2, rows, kv_heads, keys + 40, dim, generator=generator).to(dtype)
    k, v = cache[0, :, :, :keys], cache[1, :, :, :keys]
    q = torch.randn(rows, 1, heads, dim, generator=generator).to(dtype).transpose(1, 2)  # [B, H, 1, D], strided
    mask = torch.rand(rows, 1, 1, keys, generator=generator) > 0.4
    mask[..., 0] = True
    mask[..., keys // 2:] &= keys < 1000  # long cases: the later parts fully masked
    for visible in (mask, None):
        got = torch.ops.splice_kernels.decode_attention(q, k, v, visible, 0.3)
        assert got.shape == (rows, heads, 1, dim) and got.dtype == dtype
        expected = _reference_attention(q, k, v, visible, 0.3)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("heads, dim", ((8, 64), (2, 32), (4, 128), (3, 80)))
def test_decode_attention_ignores_what_masked_keys_hold(isa, dtype, heads, dim):
    """Masked cache slots may hold anything (a static cache's unused rows): NaN and infinite keys and values there
    change nothing, whichever path the group size and head_dim take."""
    generator = torch.Generator().manual_seed(dim)
    keys = 45
    k, v = (torch.randn(1, 1, keys, dim, generator=generator) for _ in range(2))
    q = torch.randn(1, heads, 1, dim, generator=generator)
    mask = torch.rand(1, 1, 1, keys, generator=generator) > 0.5
    mask[..., 0] = True
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[..., ~mask[0, 0, 0], :] = float("nan")
    poisoned_v[..., ~mask[0, 0, 0], :] = float("inf")
    clean = torch.ops.splice_kernels.decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, 0.2)
    got = torch.ops.splice_kernels.decode_attention(q.to(dtype), poisoned_k.to(dtype), poisoned_v.to(dtype), mask, 0.2)
    assert torch.isfinite(got).all()
    assert torch.equal(got, clean)


def _reference_attention(q, k, v, mask, scale, sinks=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(-1) @ v
    sink = sinks.double().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1] @ v


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows, heads, kv_heads, keys, dim", ATTENTION_SHAPES[:4])
def test_decode_attention_with_sinks_matches_float64_attention(isa, dtype, rows, heads, kv_heads, keys, dim):
    """Attention sinks (GPT-OSS): a logit per query head that joins each row's softmax with no value, merged once
    over every part of the keys; sinks above and below the scores, and a row whose keys are all masked (its sink takes
    all the weight: zeros out)."""
    generator = torch.Generator().manual_seed(keys + 1)
    cache = torch.randn(2, rows, kv_heads, keys, dim, generator=generator).to(dtype)
    q = torch.randn(rows, heads, 1, dim, generator=generator).to(dtype)
    sinks = torch.randn(heads, generator=generator) * 4
    mask = torch.rand(rows, 1, 1, keys, generator=generator) > 0.4
    mask[..., 0] = True
    mask[-1] = False  # the last row sees no key
    for visible in (mask, None):
        got = torch.ops.splice_kernels.decode_attention_sinks(q, cache[0], cache[1], visible, 0.3, sinks)
        expected = _reference_attention(q, cache[0], cache[1], visible, 0.3, sinks)
        if visible is not None:
            expected[-1] = 0.0
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(RuntimeError, match=rf"sinks must be contiguous float32 \[{heads}\]"):
        torch.ops.splice_kernels.decode_attention_sinks(q, cache[0], cache[1], None, 0.3, sinks[:-1])
    with pytest.raises(RuntimeError, match="sinks must be contiguous float32"):
        torch.ops.splice_kernels.decode_attention_sinks(q, cache[0], cache[1], None, 0.3, sinks.bfloat16())


@needs_native
def test_decode_attention_refuses_what_it_cannot_compute():
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64)
    with pytest.raises(RuntimeError, match="q must be"):
        torch.ops.splice_kernels.decode_attention(torch.randn(1, 4, 2, 64), k, k, None, 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV"):
        torch.ops.splice_kernels.decode_attention(torch.randn(1, 3, 1, 64), k, k, None, 1.0)
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        torch.ops.splice_kernels.decode_attention(q, k.bfloat16(), k, None, 1.0)
    with pytest.raises(RuntimeError, match="head_dim 24 is not a multiple of 16"):
        torch.ops.splice_kernels.decode_attention(torch.randn(1, 4, 1, 24), torch.randn(1, 2, 10, 24),
                                                  torch.randn(1, 2, 10, 24), None, 1.0)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        torch.ops.splice_kernels.decode_attention(q, k, k, torch.ones(1, 1, 1, 10), 1.0)
    assert not native.attention_fits(torch.randn(1, 4, 2, 64), k) and native.attention_fits(q, k)


@needs_native
@pytest.mark.parametrize("columns", (1, 7, 15, 16, 17, 63, 64, 65, 100, 32000, 49152))
def test_argmax_rows_gives_torch_max_indices(isa, columns):
    """Greedy decoding's pick: the first of equal highest values, the first NaN where a row has one, -inf and signed
    zeros, the best in the vector part or in the tail, short rows."""
    generator = torch.Generator().manual_seed(columns)
    x = torch.randn(8, columns, generator=generator)
    x[1] = torch.randint(0, 3, (columns,), generator=generator).float()  # ties everywhere
    x[2] = float("-inf")
    x[3, columns // 2] = float("nan")
    x[3, -1] = float("nan")
    x[4, -1] = 100.0  # the best is the last column (the tail, for most widths)
    x[5] = 0.0
    x[5, 0] = -0.0  # -0.0 == 0.0: the first stays
    x[6, 0] = float("nan")
    x[7, :] = 5.0
    x[7, columns // 3] = float("inf")
    got = torch.ops.splice_kernels.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.max(dim=-1).indices)
    # bf16 scores: the indices of their float32 values (which the rounding makes equal more often)
    low = x.bfloat16()
    assert torch.equal(torch.ops.splice_kernels.argmax_rows(low), low.float().max(dim=-1).indices)
    assert native.argmax_fits(x) and native.argmax_fits(low) and not native.argmax_fits(x.half())
    assert not native.argmax_fits(torch.randn(4, 6).T)


@needs_native
def test_argmax_rows_refuses_what_it_cannot_pick_from():
    for bad, words in ((torch.randn(2, 3, 4), "float32 or bf16 \\[rows, columns\\]"),
                       (torch.randn(8, 2).T, "not contiguous"), (torch.randn(2, 8).half(), "Half"),
                       (torch.randn(2, 0), "columns > 0")):
        with pytest.raises(RuntimeError, match=words):
            torch.ops.splice_kernels.argmax_rows(bad)


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_greedy_next_does_what_generates_torch_steps_do(dtype):
    """The pick, a finished row's pad, the rows stopping at any eos id, the sequences' column and the rows left:
    against the torch steps generate takes without it, over several steps of 5 rows, with one or two eos ids or
    none."""
    generator = torch.Generator().manual_seed(0)
    for eos in (torch.tensor([3]), torch.tensor([3, 11]), None):
        sequences = torch.zeros(5, 8, dtype=torch.long)
        expected_sequences, unfinished = sequences.clone(), torch.ones(5, dtype=torch.long)
        expected_unfinished = unfinished.clone()
        for column in range(2, 8):
            logits = torch.randn(5, 16, generator=generator)
            logits[column % 5, 3] = logits[(column + 2) % 5, 11] = 9.0  # rows reaching an eos id
            logits = logits.to(dtype)
            tokens, running = torch.ops.splice_kernels.greedy_next(logits, sequences, column, unfinished, eos, 0)
            expected = logits.float().max(dim=-1).indices
            if eos is not None:
                expected = expected.masked_fill(expected_unfinished == 0, 0)
                expected_unfinished.masked_fill_(torch.isin(expected, eos), 0)
            expected_sequences[:, column] = expected
            assert torch.equal(tokens, expected) and torch.equal(sequences, expected_sequences)
            assert torch.equal(unfinished, expected_unfinished) and running == int(expected_unfinished.sum())
        assert (running < 5) == (eos is not None)


@needs_native
def test_greedy_next_names_what_it_cannot_take_before_writing():
    logits, sequences, unfinished = torch.randn(2, 6), torch.zeros(2, 4, dtype=torch.long), torch.ones(2).long()
    for args, words in (((logits, sequences, 4, unfinished, None, 0), "column 4 inside"),
                        ((logits, sequences.int(), 1, unfinished, None, 0), "sequences must be contiguous int64"),
                        ((logits, sequences, 1, unfinished[:1], None, 0), r"unfinished must be contiguous int64 \[2\]"),
                        ((logits, sequences, 1, unfinished, torch.tensor([1.0]), 0), "eos must be contiguous int64"),
                        ((logits.half(), sequences, 1, unfinished, None, 0), "float32 or bf16")):
        with pytest.raises(RuntimeError, match=words):
            torch.ops.splice_kernels.greedy_next(*args)
    assert not sequences.any() and unfinished.all()


@needs_native
@pytest.mark.parametrize("rows", (1, 2, 5, 9))
def test_dot_products_give_nan_where_x_has_a_nan(isa, rows):
    """A NaN in a row of x makes that row's outputs NaN, as ``qmath.round_activations`` (its block scale NaN) and the
    float products give; the other rows stay finite and match the reference."""
    torch.manual_seed(0)
    n, k, group = 32, 128, 32
    x = torch.randn(rows, k).bfloat16()
    x[0, 37] = float("nan")
    w8, scales = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16()
    q, sz = torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.randn(k // group, n, 2).bfloat16()
    rounded = qmath.round_activations(x.float())
    cases = ((torch.ops.splice_kernels.int8_dot_gemv(x, w8, scales), (rounded @ w8.float().T) * scales.float()),
             (torch.ops.splice_kernels.int8_dot16_gemv(x, w8, scales),
              (round16(x).float() @ w8.float().T) * scales.float()),
             (torch.ops.splice_kernels.int4_dot_gemv(x, native.int4_tile_pack(q, sz), group),
              rounded @ qmath.dequantize_int4(q, sz).T))
    for got, expected in cases:
        assert expected[0].isnan().all() and got[0].float().isnan().all()
        assert got[1:].float().isfinite().all()
        assert rows == 1 or relative_error(got[1:], expected[1:]) < 2e-2


@needs_native
def test_quant_kernels_dispatch_only_shapes_the_native_ops_take(isa):
    """No rows (an empty batch) give an empty product, as torch's kernels do, and int8 dot products with K off the
    block of 32 fall back to the float products: the wrappers never hand the native ops a shape they refuse."""
    from splice.quant import kernels

    w8, scales = torch.randint(-128, 128, (64, 40), dtype=torch.int8), torch.rand(64).bfloat16()
    q, sz = torch.randint(0, 16, (64, 64), dtype=torch.uint8), torch.randn(2, 64, 2).bfloat16()
    tiles, none = kernels.int4_pack(q, sz, use_native=True)
    for dot in (False, True):
        assert kernels.int8_weight_mm(torch.zeros(0, 40).bfloat16(), w8, scales, True, dot).shape == (0, 64)
        assert kernels.int4_mm(torch.zeros(0, 64).bfloat16(), tiles, 32, none, True, dot).shape == (0, 64)
    x = torch.randn(3, 40).bfloat16()
    expected = (x.float() @ w8.float().T) * scales.float()
    assert relative_error(kernels.int8_weight_mm(x, w8, scales, True, True), expected) < 1e-2


@needs_native
@pytest.mark.parametrize("op", ["int8_dot_gemv", "int8_dot16_gemv"])
def test_int8_dot_gemv_refuses_in_features_off_the_block(op):
    with pytest.raises(RuntimeError, match=f"{op}: in_features must be a multiple of 32, got 48"):
        getattr(torch.ops.splice_kernels, op)(torch.randn(1, 48).bfloat16(), torch.zeros(4, 48, dtype=torch.int8),
                                              torch.ones(4).bfloat16())



# (N, K, group) for grouped int8: tails of 9, 5 and 4 rows past the last 16; groups of one, two and three blocks (one
# and three: a 64-column step straddles two groups); K ending in a half step
GROUPED_SHAPES = [(64, 256, 64), (16 * 5 + 9, 352, 32), (37, 384, 96), (16, 128, 128), (132, 576, 64)]


@needs_native
@pytest.mark.parametrize("rows", (1, 2, 3, 5, 9))
@pytest.mark.parametrize("n, k, group", GROUPED_SHAPES)
def test_int8_dot_gemv_grouped_sums_each_block_exactly_and_scales_it_by_its_group(isa, rows, n, k, group):
    """Grouped int8's decode op: x rounded as ``qmath.round_activations`` does, each block of 32 summed exactly in
    integers, times its d and the weight row's scale of the block's group: every output is the exact product
    rounded to bf16 (half a bf16 step) after float32 sums (their rounding bounded by the blocks' magnitudes, the
    flipped bytes' excess included), on int8 rows and on the same weight in tiles (``native.int8_tile_pack``)."""
    torch.manual_seed(rows * n)
    x = torch.randn(rows, k).bfloat16() * torch.linspace(0.1, 10, k).bfloat16()
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(k // group, n) + 0.5).bfloat16()  # [groups, N]
    per_column = scales.double().t().repeat_interleave(group, dim=1)  # [N, K]: each column's scale
    rounded = qmath.round_activations(x.float()).double()
    exact = rounded @ (q.double() * per_column).T
    magnitude = rounded.abs() @ ((q.double().abs() + 256) * per_column).T
    bound = exact.abs() * 2.0 ** -8 + magnitude * 2.0 ** -20
    packed = native.int8_group_scales_pack(scales)  # [ceil(N / 16), groups, 16]
    assert torch.equal(native.int8_group_scales_unpack(packed, n), scales)
    last = (packed.shape[0] - 1) * 16  # the last tile's first row: its rows' scales of the first group side by side
    assert torch.equal(packed[-1, 0, :3], scales[0, last:last + 3])
    for weight in (q, native.int8_tile_pack(q)):
        got = torch.ops.splice_kernels.int8_dot_gemv_grouped(x, weight, packed).double()
        assert ((got - exact).abs() <= bound).all(), (weight.dtype, ((got - exact).abs() / bound).max())


# (N, K, group) on int16 activations besides: groups straddling x's blocks of 256 (96 and 160, the last block short)
# and one longer than a block
@needs_native
@pytest.mark.parametrize("rows", (1, 2, 3, 8, 11))  # pairs of rows of x and one alone, passes of eight
@pytest.mark.parametrize("n, k, group", GROUPED_SHAPES + [(48, 480, 160), (16 * 3 + 3, 640, 320)])
def test_int8_dot16_gemv_grouped_sums_each_segment_exactly_and_scales_it_by_group_and_block(isa, rows, n, k, group):
    """Grouped int8 on int16 activations (the avx2 level without AVX-VNNI): x rounded as ``int8_dot16_gemv`` rounds
    it (int16 per row and block of 256, the last block what is left), the columns a group and a block share summed
    exactly in integers, times the row's group scale, and each block times its d: every output is the exact product
    of the rounded x within float32's sums, rounded once to bf16, on int8 rows and in tiles (``native.int8_tile_pack``:
    the flipped bytes' excess taken off in integers); a row's outputs do not depend on the rows beside it."""
    torch.manual_seed(rows * n + group)
    x = torch.randn(rows, k).bfloat16() * torch.linspace(0.1, 10, k).bfloat16()
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(k // group, n) + 0.5).bfloat16()
    per_column = scales.double().t().repeat_interleave(group, dim=1)
    exact = round16(x) @ (q.double() * per_column).T
    magnitude = round16(x).abs() @ ((q.double().abs() + 256) * per_column).T
    bound = exact.abs() * 2.0 ** -8 + magnitude * 2.0 ** -20
    packed = native.int8_group_scales_pack(scales)
    op = torch.ops.splice_kernels.int8_dot16_gemv_grouped
    for weight in (q, native.int8_tile_pack(q)):
        got = op(x, weight, packed).double()
        assert ((got - exact).abs() <= bound).all(), (weight.dtype, ((got - exact).abs() / bound).max())
        assert torch.equal(got, torch.cat([op(row[None], weight, packed) for row in x]).double())
    int8_rounded = torch.ops.splice_kernels.int8_dot_gemv_grouped(x, q, packed).double()
    as_is = x.double() @ (q.double() * per_column).T
    assert relative_error(exact, as_is) < relative_error(int8_rounded, as_is) / 20


@needs_native
@pytest.mark.parametrize("op", ["int8_dot_gemv_grouped", "int8_dot16_gemv_grouped"])
@pytest.mark.parametrize("w, scales, message", [
    (torch.zeros(4, 96, dtype=torch.int8), torch.ones(1, 2, 16), "groups; each group must be a whole multiple of 32"),
    (torch.zeros(4, 96, dtype=torch.int8), torch.ones(3, 4), "scales must be a contiguous bf16 \\[1, groups, 16\\]"),
    (torch.zeros(20, 96, dtype=torch.int8), torch.ones(1, 3, 16), "scales must be a contiguous bf16 \\[2, groups"),
    (torch.zeros(4, 96), torch.ones(1, 3, 16), "w must be a contiguous CPU \\[N, K\\] tensor, int8 or uint8"),
])
def test_int8_grouped_gemvs_name_bad_inputs(op, w, scales, message):
    with pytest.raises(RuntimeError, match=f"{op}: .*{message}"):
        getattr(torch.ops.splice_kernels, op)(torch.randn(1, 96).bfloat16(), w, scales.bfloat16())


@needs_native
def test_gptq_columns_refuses_what_it_cannot_sweep_and_writes_nothing():
    w, h = torch.randn(8, 16), torch.eye(16)
    codes, errors, params = torch.zeros(8, 16), torch.zeros(8, 16), torch.ones(8, 1)
    before = w.clone()
    sweep = torch.ops.splice_kernels.gptq_columns
    with pytest.raises(RuntimeError, match=r"columns \[4, 20\) must lie in the block's 16"):
        sweep(w, h, 4, 20, params, params, codes, errors)
    with pytest.raises(RuntimeError, match=r"scales and zeros \[N, end - first\] or \[N, 1\]; got .*scales \[8, 3\]"):
        sweep(w, h, 0, 4, torch.ones(8, 3), torch.ones(8, 3), codes, errors)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        sweep(w.double(), h.double(), 0, 4, params, params, codes, errors)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        sweep(w.t(), h, 0, 4, params, params, codes, errors)
    with pytest.raises(RuntimeError, match=r"w must be a float32 matrix \[N, B\], got \[16\]"):
        sweep(torch.randn(16), h, 0, 4, params, params, codes, errors)
    assert torch.equal(w, before) and not codes.any() and not errors.any()
    sweep(w, h, 0, 16, params, params * 0, codes, errors)  # scale 1, zero 0, identity: codes are round(w) + 8
    assert torch.equal(codes, (before.round() + 8).clamp(0, 15))

@needs_native
@pytest.mark.parametrize("rows", ROWS + (16, 17, 40))  # AMX (where present): from 3 rows; over 16 rows x is padded
@pytest.mark.parametrize("n, k, group", [(64, 128, 32), (32, 576, 64), (16, 256, 128), (48, 64, 64), (32, 120, 24)])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_gemv_matches_the_dequantized_product(isa, rows, n, k, group, symmetric):
    """Symmetric weights (every zero 0) pass their scales alone, asymmetric ones (scale, zero) pairs."""
    x = torch.randn(rows, k).bfloat16()
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales_and_zeros = torch.randn(k // group, n, 2).bfloat16()
    if symmetric:
        scales_and_zeros[..., 1] = 0
    expected = x.float() @ qmath.dequantize_int4(q, scales_and_zeros).T
    got = torch.ops.splice_kernels.int4_gemv(x, native.int4_tile_pack(q, scales_and_zeros), group)
    assert relative_error(got, expected) < 1e-2


@needs_native
@pytest.mark.parametrize("shape", [(37, 100), (256, 2048), (3, 5)])
def test_int8_linear_converts_the_codes_exactly(isa, shape):
    """Bit for bit torch's own composition: the native int8 -> bf16 conversion is exact, then the same GEMM."""
    q, scales = torch.randint(-128, 128, shape, dtype=torch.int8), torch.rand(shape[0]).bfloat16()
    x = torch.randn(40, shape[1]).bfloat16()
    expected = torch.nn.functional.linear(x, q.to(torch.bfloat16)) * scales
    torch.testing.assert_close(torch.ops.splice_kernels.int8_linear(x, q, scales), expected, rtol=0, atol=0)


# Prefill on a CPU without bf16 arithmetic: float32 GEMMs a slab of widened weight rows at a time (2 MiB of float32
# per slab: 256 rows at K = 2048, so N = 600 takes two whole slabs and a part).
@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(600, 2048), (37, 100)])
def test_widened_linear_is_the_float32_product(isa, dtype, n, k):
    x, w = torch.randn(20, k), torch.randn(n, k).to(dtype)
    got = torch.ops.splice_kernels.widened_linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (20, n)
    torch.testing.assert_close(got, x @ w.float().T, rtol=1e-5, atol=1e-4)
    assert torch.ops.splice_kernels.widened_linear(x.to(dtype), w).dtype == dtype  # the output in x's dtype


@needs_native
def test_widened_slabs_made_in_inference_mode_serve_calls_outside_it():
    """The kept slab buffer may be made inside ``torch.inference_mode`` (generate) and written by a later call outside
    it, also with a weight that requires grad; the result is an ordinary tensor (not an inference one)."""
    native.release_prefill_buffer()
    x, w = torch.randn(8, 64), torch.randn(32, 64).bfloat16()
    with torch.inference_mode():
        torch.ops.splice_kernels.widened_linear(x, w)
    w.requires_grad_(True)
    got = torch.ops.splice_kernels.widened_linear(x, w)
    assert not got.is_inference()
    torch.testing.assert_close(got.detach(), x @ w.detach().float().T)
    with torch.no_grad():
        got = torch.ops.splice_kernels.widened_linear(x, w).add_(1)  # in place, outside inference mode
    torch.testing.assert_close(got, x @ w.detach().float().T + 1)


@needs_native
@pytest.mark.parametrize("n, k", [(600, 2048), (37, 100)])
def test_int8_linear_widened_is_the_float32_product_of_the_codes(isa, n, k):
    q, scales = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16()
    x = torch.randn(24, k).bfloat16()
    expected = (x.float() @ q.float().T) * scales.float()
    got = torch.ops.splice_kernels.int8_linear(x, q, scales, True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.bfloat16().float(), rtol=1e-2, atol=1e-2)
    bf16_gemm = torch.ops.splice_kernels.int8_linear(x, q, scales)
    assert relative_error(got, bf16_gemm.float()) < 1e-2  # the same product as the bf16 GEMM's


@needs_native
@pytest.mark.parametrize("n, k, group", [(640, 2048, 32), (48, 96, 32), (32, 120, 24)])
def test_int4_linear_widened_multiplies_the_bf16_dequantized_weight(isa, n, k, group):
    """The slabs hold the same bf16 weight ``int4_dequantize`` gives (rows a whole number of tiles), widened."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales_and_zeros = torch.randn(k // group, n, 2).bfloat16() * 0.05
    w = native.int4_tile_pack(q, scales_and_zeros)
    x = torch.randn(24, k).bfloat16()
    expected = x.float() @ torch.ops.splice_kernels.int4_dequantize(w, group).float().T
    got = torch.ops.splice_kernels.int4_linear(x, w, group, True)
    torch.testing.assert_close(got.float(), expected.bfloat16().float(), rtol=1e-2, atol=1e-2)


def test_prompts_are_widened_where_onednn_lacks_bf16_arithmetic():
    """Emulated with oneDNN capped at AVX2 (oneDNN then has no bf16 GEMM): the native layers take the widened path."""
    script = ("import torch; from splice import native; "
              "print(native.prompts_widened(), torch.ops.mkldnn._is_mkldnn_bf16_supported())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]
    assert native.prompts_widened() == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())  # this CPU as it is


@needs_native
@pytest.mark.parametrize("n, k, group", [(48, 96, 32), (80, 160, 32), (112, 192, 64), (16, 384, 128), (208, 640, 128),
                                         (32, 120, 24), (48, 40, 8)])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_dequantize_equals_the_reference_rounded_to_bf16(isa, n, k, group, symmetric):
    """Bit for bit: (q - 8) has at most 4 significant bits and a bf16 scale 8, so (q - 8) * scale is exact in float32
    and both sides round once there (the kernel's FMA, torch's add) and once to bf16 (round to nearest even: the
    kernel's cvtne2ps, torch's cast). Shapes: N and K not multiples of 64, and groups of 24 and 8 columns (not
    multiples of 32, the kernel's per-lane-shift path)."""
    torch.manual_seed(n + k + group)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales_and_zeros = torch.randn(k // group, n, 2).bfloat16()
    if symmetric:
        scales_and_zeros[..., 1] = 0
    got = torch.ops.splice_kernels.int4_dequantize(native.int4_tile_pack(q, scales_and_zeros), group)
    assert got.dtype == torch.bfloat16 and got.shape == (n, k)
    assert torch.equal(got, qmath.dequantize_int4(q, scales_and_zeros).bfloat16())


@needs_native
def test_int4_dequantize_traces_under_torch_compile():
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    tiles = native.int4_tile_pack(q, torch.randn(2, 32, 2).bfloat16())
    step = torch.compile(lambda x: x @ torch.ops.splice_kernels.int4_dequantize(tiles, 32).T, fullgraph=True)
    x = torch.randn(20, 64).bfloat16()
    torch.testing.assert_close(step(x), x @ torch.ops.splice_kernels.int4_dequantize(tiles, 32).T)


@pytest.mark.parametrize("group", [32, 24, 8])
def test_int4_tile_layout_round_trips(group):
    q = torch.randint(0, 16, (48, 96), dtype=torch.uint8)
    scales_and_zeros = torch.randn(96 // group, 48, 2).bfloat16()
    tiles = native.int4_tile_pack(q, scales_and_zeros)
    assert tiles.shape == (3, 96 // group, 2 * group + 16) and tiles.dtype == torch.int32
    assert native.int4_tile_group(tiles) == group
    assert torch.equal(native.int4_tile_unpack(tiles), q)
    assert torch.equal(native.int4_untile_scales(tiles), scales_and_zeros)


def test_int4_tiles_hold_each_group_before_its_scales():
    """Per tile and group, the group's chunk words (row r's columns 8c .. 8c + 7 in word 16c + r), then its 16 rows'
    bf16 (scale, zero) pairs: one sequential stream a tile, in the order the GEMVs read it."""
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    scales_and_zeros = torch.randn(2, 32, 2).bfloat16()
    tiles = native.int4_tile_pack(q, scales_and_zeros)
    tile, g, c, r = 1, 1, 2, 5
    word = int(tiles[tile, g, 16 * c + r]) & 0xFFFFFFFF
    columns = [32 * g + 8 * c + column for column in native.INT4_ORDER]
    assert [(word >> (4 * slot)) & 15 for slot in range(8)] == [int(q[16 * tile + r, k]) for k in columns]
    pairs = tiles[tile, g, 64:].view(torch.bfloat16).reshape(16, 2)
    assert torch.equal(pairs, scales_and_zeros[g, 16 * tile: 16 * tile + 16])


def test_int4_symmetric_scales_tile_alone_and_round_trip():
    """Every zero 0: the tiles hold the scales alone (8 words a group instead of 16), and untiling gives the zeros
    back."""
    q = torch.randint(0, 16, (48, 96), dtype=torch.uint8)
    scales_and_zeros = torch.randn(3, 48, 2).bfloat16()
    scales_and_zeros[..., 1] = 0
    tiles = native.int4_tile_pack(q, scales_and_zeros)
    assert tiles.shape == (3, 3, 2 * 32 + 8) and native.int4_tile_group(tiles) == 32
    assert torch.equal(native.int4_untile_scales(tiles), scales_and_zeros)
    assert torch.equal(native.int4_tile_unpack(tiles), q)


def test_int4_tile_pack_names_shapes_it_cannot_tile():
    with pytest.raises(ValueError, match=r"q \(40, 64\) and scales_and_zeros \(2, 40, 2\)"):
        native.int4_tile_pack(torch.zeros(40, 64, dtype=torch.uint8), torch.zeros(2, 40, 2))
    with pytest.raises(ValueError, match="group a multiple of 8"):
        native.int4_tile_pack(torch.zeros(32, 60, dtype=torch.uint8), torch.zeros(5, 32, 2))


@needs_native
def test_bad_shapes_name_the_value(isa):
    with pytest.raises(RuntimeError, match="must be \\[M, 64\\]"):
        torch.ops.splice_kernels.bf16_gemv(torch.randn(1, 32).bfloat16(), torch.randn(8, 64).bfloat16())
    with pytest.raises(RuntimeError, match="group 44 must be a positive multiple of 8"):
        torch.ops.splice_kernels.int4_gemv(torch.randn(1, 88).bfloat16(), torch.zeros(1, 2, 104, dtype=torch.int32),
                                           44)
    with pytest.raises(RuntimeError, match="scales must be a contiguous bf16 tensor of 8 elements, got Float \\[8\\]"):
        torch.ops.splice_kernels.int8_gemv(torch.randn(1, 64).bfloat16(), torch.zeros(8, 64, dtype=torch.int8),
                                           torch.ones(8))
    with pytest.raises(RuntimeError, match=r"int4 tiles \[N/16, K/32, 80\] \(scale and zero pairs\) or \[N/16, "
                                           r"K/32, 72\] \(scales alone, zero 0\) for group 32, got Int \[1, 8, 16\]"):
        torch.ops.splice_kernels.int4_dequantize(torch.zeros(1, 8, 16, dtype=torch.int32), 32)


@needs_native
def test_kernels_trace_under_torch_compile(isa):
    w = torch.randn(24, 64).bfloat16()
    step = torch.compile(lambda x: torch.ops.splice_kernels.bf16_gemv(x, w) * 2, dynamic=False)
    x = torch.randn(1, 64).bfloat16()
    torch.testing.assert_close(step(x), torch.ops.splice_kernels.bf16_gemv(x, w) * 2)


def test_fits_checks_rows_dtype_and_device():
    assert native.fits("bf16", torch.zeros(native.MAX_ROWS["bf16"], 8, dtype=torch.bfloat16))
    assert not native.fits("bf16", torch.zeros(native.MAX_ROWS["bf16"] + 1, 8, dtype=torch.bfloat16))
    assert not native.fits("int8", torch.zeros(2, 8))  # fp32 input
    assert native.fits("int4", torch.zeros(native.MAX_ROWS["int4"], 8, dtype=torch.bfloat16))
    assert not native.fits("int4", torch.zeros(native.MAX_ROWS["int4"] + 1, 8, dtype=torch.bfloat16))


def test_environment_switch_turns_them_off_without_a_warning():
    code = ("import warnings; warnings.simplefilter('error'); from splice import native; "
            "assert native.available() is False")
    env = {**os.environ, "SPLICE_NATIVE_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def _run_with_env(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python with ``env`` as the only level settings (the caller's own caps are dropped)."""
    base = {k: v for k, v in os.environ.items() if k not in ("SPLICE_NATIVE_ISA", "SPLICE_NATIVE_AMX")}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=300)


@needs_native
@pytest.mark.parametrize("variable, value", [("SPLICE_NATIVE_ISA", "avx2"), ("SPLICE_NATIVE_ISA", "avx512"),
                                             ("SPLICE_NATIVE_AMX", "0")])
def test_environment_caps_the_level_and_its_row_limits(variable, value):
    """``SPLICE_NATIVE_ISA`` caps the level (so the AVX2 kernels run on an AVX-512 machine), ``SPLICE_NATIVE_AMX=0``
    keeps AMX off; the row limits follow, and an 8-row int4 and int8 GEMV stays right on that level's path."""
    expected = "avx512" if variable == "SPLICE_NATIVE_AMX" else value
    if expected not in native.supported_isas():
        pytest.skip(f"this CPU cannot run the {expected} kernels (it runs {', '.join(native.supported_isas())})")
    code = (
        "import torch; from splice import native; from splice.quant import qmath\n"
        f"assert native.available() and native.isa() == {expected!r}, native.isa()\n"
        f"assert native.MAX_ROWS == native.ROW_LIMITS[{expected!r}]\n"
        "assert not native.amx_ready()\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(8, 256).bfloat16(); q = torch.randint(0, 16, (64, 256), dtype=torch.uint8)\n"
        "sz = torch.randn(256 // 32, 64, 2).bfloat16()\n"
        "expected = x.float() @ qmath.dequantize_int4(q, sz).T\n"
        "got = torch.ops.splice_kernels.int4_gemv(x, native.int4_tile_pack(q, sz), 32)\n"
        "assert ((got.float() - expected).abs().max() / expected.abs().max()).item() < 1e-2\n"
        "w8, s8 = torch.randint(-127, 128, (64, 256), dtype=torch.int8), torch.rand(64).bfloat16()\n"
        "expected = (x.float() @ w8.float().T) * s8.float()\n"
        "got = torch.ops.splice_kernels.int8_gemv(x, w8, s8)\n"
        "assert ((got.float() - expected).abs().max() / expected.abs().max()).item() < 1e-2\n")
    result = _run_with_env(code, **{variable: value})
    assert result.returncode == 0, result.stderr[-2000:]


@needs_native
def test_the_kernels_start_with_the_weight_streams_the_environment_names():
    result = _run_with_env("from splice import native; assert native.available(); print(native.weight_streams())",
                           SPLICE_WEIGHT_STREAMS="1")
    assert result.returncode == 0 and result.stdout.strip() == "1", result.stderr[-2000:]


@needs_native
def test_the_kernels_start_with_the_software_prefetch_the_environment_names():
    result = _run_with_env("from splice import native; assert native.available(); print(native.software_prefetch())",
                           SPLICE_SOFTWARE_PREFETCH="bf16,int4:3")
    assert result.returncode == 0 and result.stdout.strip() == "{'bf16': 1, 'int4': 3}", result.stderr[-2000:]


@needs_native
def test_an_unknown_or_unsupported_level_names_the_allowed_ones():
    result = _run_with_env("from splice import native; native.available()", SPLICE_NATIVE_ISA="sse9")
    assert result.returncode != 0 and "SPLICE_NATIVE_ISA='sse9' is not a level; allowed: avx2, avx512, amx" in result.stderr
    with pytest.raises(ValueError, match="allowed: " + ", ".join(native.supported_isas())):
        native.set_isa("avx1024")
    missing = [level for level in native.ISA_LEVELS if level not in native.supported_isas()]
    if missing:
        result = _run_with_env("from splice import native; native.available()", SPLICE_NATIVE_ISA=missing[0])
        assert f"allowed here: {', '.join(native.supported_isas())}" in result.stderr


@needs_native
@needs_native
def test_the_level_can_be_set_before_anything_loaded_the_kernels():
    """A fresh process whose first native call sets the level: the kernels load first, then run at that level."""
    result = _run_with_env("from splice import native; native.set_isa('avx2'); "
                           "print(native.isa(), native.MAX_ROWS['int8'])")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["avx2", str(native.ROW_LIMITS["avx2"]["int8"])]


@needs_native
@pytest.mark.parametrize("getter", ["weight_streams", "work_stealing", "layer_region", "software_prefetch"])
def test_the_settings_can_be_read_before_anything_loaded_the_kernels(getter):
    """A fresh process whose first native call reads a setting: the kernels load first (an AttributeError came from
    the op namespace)."""
    result = _run_with_env(f"from splice import native; print(native.{getter}() == native.{getter}())")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True"]


@pytest.mark.parametrize("call", ["native.set_isa('avx2')", "native.use_isa('avx2').__enter__()"])
def test_setting_a_level_without_the_kernels_says_they_are_not_available(call):
    result = _run_with_env(f"from splice import native; {call}", SPLICE_NATIVE_KERNELS="0")
    assert result.returncode != 0 and "ValueError: ISA level 'avx2' cannot be set" in result.stderr
    assert "not available here" in result.stderr


@needs_native
def test_use_isa_switches_the_level_and_the_row_limits_and_restores_them():
    before, limits = native.isa(), dict(native.MAX_ROWS)
    with native.use_isa("avx2"):
        assert native.isa() == "avx2" and native.MAX_ROWS == native.ROW_LIMITS["avx2"] and not native.amx_ready()
    assert native.isa() == before and native.MAX_ROWS == limits


@needs_native
def test_only_the_avx512_regions_hold_avx512_or_amx_instructions():
    """The library is built for baseline x86-64 and loaded on AVX2-only CPUs: an AVX-512 or AMX instruction anywhere
    outside the ``avx512`` namespace (the checks, the dispatch, the AVX2 kernels, code inlined from headers) would
    crash there. Read from the disassembly of the built library."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    library = native.library_path()
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", str(library)], capture_output=True, text=True,
                          check=True, timeout=300).stdout
    wide = re.compile(r"zmm|%k[0-7]\b|[xy]mm(1[6-9]|2[0-9]|3[01])\b|\{1to|vpternlog|\btile|vcvtne2ps2bf16|vdpbf16ps")
    offenders, checked = [], 0
    for function in re.split(r"\n(?=[0-9a-f]+ <)", text):
        header = re.match(r"[0-9a-f]+ <(.*)>:", function)
        if header is None or "avx512::" in header.group(1):
            continue
        checked += 1
        if any(wide.search(re.sub(r"<.*>", "", line)) for line in function.splitlines()[1:]):
            offenders.append(header.group(1))
    assert checked > 50 and "avx2::" in text
    assert not offenders, offenders[:5]


@needs_native
def test_amx_gemvs_and_onednn_take_turns_on_the_same_threads(isa):
    """The AMX GEMVs configure and release the tile state on every call; oneDNN's bf16 GEMM (AMX too, with its own
    tile configuration) then runs on the same threads: both stay right, round after round."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (256, 512), dtype=torch.uint8)
    scales_and_zeros = torch.randn(512 // 32, 256, 2).bfloat16()
    words = native.int4_tile_pack(q, scales_and_zeros)
    w8, s8 = torch.randint(-127, 128, (256, 512), dtype=torch.int8), torch.rand(256).bfloat16()
    dense = torch.randn(384, 512).bfloat16()
    for _ in range(3):
        x = torch.randn(8, 512).bfloat16()
        expected = x.float() @ qmath.dequantize_int4(q, scales_and_zeros).T
        assert relative_error(torch.ops.splice_kernels.int4_gemv(x, words, 32), expected) < 1e-2
        expected = (x.float() @ w8.float().T) * s8.float()
        assert relative_error(torch.ops.splice_kernels.int8_gemv(x, w8, s8), expected) < 1e-2
        rows = torch.randn(128, 512).bfloat16()
        assert relative_error(torch.nn.functional.linear(rows, dense), rows.float() @ dense.float().T) < 1e-2


def test_huge_page_advice_skips_what_it_cannot_cover():
    assert native.advise_huge_pages(torch.zeros(1000)) == 0  # smaller than a huge page
    big = torch.zeros(3 * native.HUGE_PAGE // 4)
    advised = native.advise_huge_pages(big)
    assert advised % native.HUGE_PAGE == 0 and advised <= big.numel() * 4
