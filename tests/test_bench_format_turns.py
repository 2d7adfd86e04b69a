"""``benchmarks/bench_format_turns.py``: several formats of one model decoding in turns in one process."""
from __future__ import annotations

import argparse

import pytest
import torch

from splice import native

from .arch.tiny_models import build_family
from .benchmark_scripts import load_benchmark

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


@needs_native
def test_every_engine_takes_every_round_in_turns(monkeypatch):
    bench = load_benchmark("bench_format_turns")
    monkeypatch.setattr(bench, "load_model", lambda name, dtype: build_family("llama", dtype=torch.bfloat16))
    engines = {fmt: bench.engine_for("tiny", fmt, 16) for fmt in ("bf16", "int8")}
    order = []

    def noting(name: str, generate):
        def noted(*args, **kwargs):
            order.append(name)
            return generate(*args, **kwargs)
        return noted

    for name, engine in engines.items():
        monkeypatch.setattr(engine, "generate", noting(name, engine.generate))
    prompt = torch.randint(0, 100, (2, 5))
    times = bench.turns(engines, prompt, new=4, rounds=3)
    assert order == ["bf16", "int8"] + ["bf16", "int8", "int8", "bf16", "bf16", "int8"]  # warm-up, then in turns
    assert all(len(ms) == 3 and min(ms) > 0 for ms in times.values())
    assert engines["bf16"].module is not engines["int8"].module  # each format on a model of its own


def test_the_summary_gives_medians_and_the_rounds_ratios_to_the_first_format():
    bench = load_benchmark("bench_format_turns")
    rows = bench.summary({"bf16": [10.0, 20.0, 12.0], "int8": [5.0, 20.0, 8.0]}, batch=8)
    assert rows[0] == ("bf16", 12.0, pytest.approx(8e3 / 12.0), 1.0, 1.0, 1.0)
    name, ms, tok_s, ratio, low, high = rows[1]
    assert (name, ms, ratio, low, high) == ("int8", 8.0, 1.5, 1.0, 2.0) and tok_s == pytest.approx(1e3)


@pytest.mark.parametrize("text", ["bf16", "bf16,bf16", "bf16,int9", ""])
def test_formats_that_cannot_be_compared_are_refused_by_name(text):
    bench = load_benchmark("bench_format_turns")
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
        bench.formats_of(text)
    assert bench.formats_of("bf16,int4-sym") == ["bf16", "int4-sym"]


@needs_native
def test_the_deepspeed_q_groups_format_builds_grouped_int8(monkeypatch):
    bench = load_benchmark("bench_format_turns")
    monkeypatch.setattr(bench, "load_model", lambda name, dtype: build_family("llama", dtype=torch.bfloat16))
    assert bench.formats_of("int8,int8-q64") == ["int8", "int8-q64"]
    engine = bench.engine_for("tiny", "int8-q64", 16)
    downs = [block.down for block in engine.runtime.blocks]
    assert all(down.grouped and down.group == 2 for down in downs)  # the tiny model's 128 inputs in 64 groups
