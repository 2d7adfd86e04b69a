"""``benchmarks/bench_gemv_rates.py``: the decode GEMVs alone, in the cache and from memory against the probe."""
from __future__ import annotations

import argparse

import pytest
import torch

from splice import native

from .benchmark_scripts import load_benchmark

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


@needs_native
def test_each_kind_calls_the_kernel_its_layers_call_at_the_level():
    bench = load_benchmark("bench_gemv_rates")
    x = torch.randn(2, 256).bfloat16()
    w8, scales = bench.operands("int8", 32, 256)
    with native.use_isa("avx2"), native.use_avx_vnni(False):  # int8 weight-only's int16 activations
        assert torch.equal(bench.call("int8", x, (w8, scales)), torch.ops.splice_kernels.int8_dot16_gemv(x, w8, scales))
    if native.supported_isas()[-1] != "avx2" or native.avx_vnni_ready():
        with native.use_isa(native.supported_isas()[-1]):
            assert torch.equal(bench.call("int8", x, (w8, scales)),
                               torch.ops.splice_kernels.int8_dot_gemv(x, w8, scales))
    x3 = torch.randn(3, 256).bfloat16()  # from three rows the tiles' outputs are the rows' bit for bit
    tiles8, scales8 = bench.operands("int8-tiles", 32, 256)
    assert tiles8.dtype == torch.uint8
    assert torch.equal(bench.call("int8-tiles", x3, (tiles8, scales8)),
                       bench.call("int8", x3, (native.int8_tile_unpack(tiles8), scales8)))
    with native.use_isa("avx2"), native.use_avx_vnni(False):  # grouped int8 on int16 activations, in tiles
        grouped, packed = bench.operands("int8-g64", 32, 256)
        assert grouped.dtype == torch.uint8 and packed.shape == (2, 4, 16)
        assert torch.equal(bench.call("int8-g64", x, (grouped, packed)),
                           torch.ops.splice_kernels.int8_dot16_gemv_grouped(x, grouped, packed))
    (tiles,) = bench.operands("int4", 32, 256)  # one tensor: the codes with each group's scales and zeros
    assert torch.equal(bench.call("int4", x, (tiles,)), torch.ops.splice_kernels.int4_dot_gemv(x, tiles, 32))
    (tiles_sym,) = bench.operands("int4-sym", 32, 256)
    codes = 32 * 256 // 2  # bytes of the nibbles themselves
    assert (tiles_sym.nbytes - codes) * 2 == tiles.nbytes - codes  # symmetric: the scales alone
    assert torch.equal(bench.call("int4-sym", x, (tiles_sym,)),
                       torch.ops.splice_kernels.int4_dot_gemv(x, tiles_sym, 32))
    assert bench.call("bf16", x, bench.operands("bf16", 32, 256)).shape == (2, 32)


@needs_native
def test_rates_in_cache_and_shares_of_the_probe_per_round():
    bench = load_benchmark("bench_gemv_rates")
    rates = bench.cache_rates([(32, 256), (16, 512)], rows=1, reps=2)
    assert set(rates) == {(shape, kind) for shape in ((32, 256), (16, 512)) for kind in bench.KINDS}
    assert all(rate > 0 for rate in rates.values())
    shares = bench.memory_shares(layers=1, rows=2, rounds=3, shapes=[(64, 512), (32, 256)])
    assert set(shares) == set(bench.KINDS)
    assert all(len(rounds) == 3 and all(speed > 0 and share > 0 for speed, share in rounds)
               for rounds in shares.values())


@pytest.mark.parametrize("text", ["1024x2048,5x512", "1024", "axb", "64x300", ""])
def test_bad_shapes_are_refused_naming_the_value(text):
    bench = load_benchmark("bench_gemv_rates")
    with pytest.raises(argparse.ArgumentTypeError, match="NxK"):
        bench.parse_shapes(text)
    assert bench.parse_shapes("1024x2048,16x256") == [(1024, 2048), (16, 256)]


@pytest.mark.parametrize("argv, named", [(["--rows", "0"], "'0'"), (["--rounds", "two"], "'two'"),
                                         (["--level", "amx"], "amx")])
def test_bad_arguments_are_refused_naming_the_value(argv, named, monkeypatch, capsys):
    bench = load_benchmark("bench_gemv_rates")
    if argv[0] == "--level" and "amx" in native.supported_isas():
        pytest.skip("this machine runs the amx level, so --level amx is allowed here")
    if argv[0] == "--level" and not native.available():
        pytest.skip("splice's native kernels are not available here")
    monkeypatch.setattr("sys.argv", ["bench_gemv_rates.py", *argv, "--memory-layers", "0"])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_merged_shapes_hold_the_blocks_bytes_in_one_matrix_per_input_width():
    bench = load_benchmark("bench_gemv_rates")
    per_layer = list(bench.FUSED.values()) * 3
    merged = bench.merged_shapes(3)
    assert sorted({k for _, k in merged}) == sorted({k for _, k in per_layer}) and len(merged) == len(set(merged))
    assert sum(n * k for n, k in merged) == sum(n * k for n, k in per_layer)
