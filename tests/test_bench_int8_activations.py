"""``benchmarks/bench_int8_activations.py``: the int8 GEMV on int16 and on int8 activations and the bf16 GEMV, timed
in turns, each round's ratios from one set of times."""
from __future__ import annotations

import pytest
import torch

from splice import native

from .benchmark_scripts import load_benchmark

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


@needs_native
def test_kernel_ratios_are_taken_per_round_for_every_pair():
    bench = load_benchmark("bench_int8_activations")
    matrices = bench.weights(((64, 256), (32, 512)), layers=1)
    found = bench.ratios(matrices, rows=3, rounds=3)
    assert set(found) == set(bench.RATIOS) and all(len(v) == 3 and min(v) > 0 for v in found.values())
    # each round's ratios come from one set of times: int8 / int16 = (bf16 / int16) / (bf16 / int8)
    for i in range(3):
        a = found[("int8 activations", "int16 activations")][i]
        b = found[("bf16", "int16 activations")][i] / found[("bf16", "int8 activations")][i]
        assert a == pytest.approx(b)
    x = torch.randn(2, 256).bfloat16()
    w8, scales, _ = matrices[0]
    assert torch.equal(bench.call("int16 activations", x, *matrices[0]),
                       torch.ops.splice_kernels.int8_dot16_gemv(x, w8, scales))
