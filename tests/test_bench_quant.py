"""``benchmarks/bench_quant.py``'s stacks: where int8 weight-only rounds its decode rows to int16, an ``int8-act8`` row
runs the same layers with int8 activations, so both are timed side by side."""
from __future__ import annotations

import pytest
import torch

from splice import native

from .benchmark_scripts import load_benchmark

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
SHAPES = {"qkv": (96, 2048), "down": (64, 5632)}  # (out, in): the inputs measure() makes


@needs_native
def test_int8_act8_row_shares_the_int8_layers_with_int8_activations():
    bench = load_benchmark("bench_quant")
    with native.use_isa("avx2"), native.use_avx_vnni(False):
        stacks = bench.build_stacks(1, ["int8"], SHAPES)
        assert [layer.use_dot_products for layer in stacks["int8"]] == [16, 16]
        assert [layer.use_dot_products for layer in stacks["int8-act8"]] == [8, 8]
        for wide, narrow in zip(stacks["int8"], stacks["int8-act8"]):
            assert narrow.qweight.data_ptr() == wide.qweight.data_ptr()
        medians = bench.measure(stacks, batch=2, rounds=1)
    assert set(medians) == {"bf16", "int8", "bf16-native", "int8-act8"} and all(t > 0 for t in medians.values())
    x = torch.randn(2, 2048).bfloat16()
    wide, narrow = stacks["int8"][0](x).float(), stacks["int8-act8"][0](x).float()
    assert not torch.equal(wide, narrow) and (wide - narrow).norm() / wide.norm() < 2e-2


@needs_native
def test_no_int8_act8_row_where_int8_activations_are_chosen_anyway():
    bench = load_benchmark("bench_quant")
    levels = native.supported_isas()
    if levels[-1] == "avx2" and not native.avx_vnni_ready():
        pytest.skip("this CPU's best level rounds int8 weight-only's decode rows to int16")
    with native.use_isa(levels[-1]):
        assert "int8-act8" not in bench.build_stacks(1, ["int8"], SHAPES)
