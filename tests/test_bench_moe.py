"""``benchmarks/bench_moe.py``: a mixture of experts in bf16 and with quantized experts, plain and kernel-injected,
decoding in turns."""
from __future__ import annotations

import argparse

import pytest
import torch

from splice import native
from splice.layers.native_linear import NativeLinear
from splice.quant import QuantizedLinear

from .benchmark_scripts import load_benchmark


@pytest.mark.parametrize("mode, mlp", [("plain", "mlp"), ("inject", "moe")])
def test_each_format_decodes_on_a_model_of_its_own_with_its_experts_quantized(mode, mlp):
    bench = load_benchmark("bench_moe")
    engines = {fmt: bench.engine_for(bench.build(64, 64, 4, 1, 128), mode, fmt) for fmt in ("bf16", "int8")}
    assert all((engine.runtime is not None) == (mode == "inject") for engine in engines.values())
    experts = {fmt: getattr(engine.module.model.layers[0], mlp).experts for fmt, engine in engines.items()}
    if mode == "inject" and native.available():  # each expert on splice's bf16 GEMV
        assert isinstance(experts["bf16"].down_proj[0], NativeLinear)
    else:
        assert isinstance(experts["bf16"].down_proj, torch.nn.Parameter)
    assert isinstance(experts["int8"].down_proj[0], QuantizedLinear)
    assert bench.weight_mib(engines["int8"]) < bench.weight_mib(engines["bf16"])
    times = bench.turns(engines, torch.randint(0, 128, (1, 5)), new=4, rounds=2)
    assert [len(ms) for ms in times.values()] == [2, 2] and min(map(min, times.values())) > 0
    rows = bench.summary(times, batch=1)
    assert [row[0] for row in rows] == ["bf16", "int8"] and rows[0][3] == 1.0


@pytest.mark.parametrize("text", ["inject,inject", "plain,fused", ""])
def test_the_modes_are_distinct_known_ones(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected distinct modes of plain, inject"):
        load_benchmark("bench_moe").modes_of(text)


@pytest.mark.parametrize("text", ["bf16", "bf16,bf16", "bf16,fp8"])
def test_the_formats_are_two_or_more_known_ones(text):
    with pytest.raises(argparse.ArgumentTypeError, match="two or more different formats"):
        load_benchmark("bench_moe").formats_of(text)  # bench_format_turns' formats
