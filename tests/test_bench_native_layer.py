"""``benchmarks/bench_native_layer.py``: decode steps with the blocks in one native call against the blocks' own ops."""
from __future__ import annotations

import pytest
import torch

from splice import native

from .arch.tiny_models import build_family
from .benchmark_scripts import load_benchmark

pytestmark = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


def test_both_engines_step_in_turns_and_only_one_runs_native_calls():
    script = load_benchmark("bench_native_layer")
    engines = {native_layers: script.engine_of(build_family("llama", dtype=torch.bfloat16), "int4-sym",
                                               native_layers, compiled=False, max_out_tokens=96)
               for native_layers in (False, True)}
    assert all(block.native_layer for block in engines[True].runtime.blocks)
    assert not any(block.native_layer for block in engines[False].runtime.blocks)
    prompt = torch.randint(3, 128, (1, script.PROMPT))
    tokens, steps = zip(*(script.decode_step(engines[flag], prompt) for flag in (False, True)))
    assert torch.equal(tokens[0], tokens[1])
    with torch.inference_mode():
        assert torch.equal(steps[0]().argmax(-1), steps[1]().argmax(-1))
    times = script.in_turns({"own": steps[0], "native": steps[1]}, rounds=3, calls=2)
    assert [len(t) for t in times.values()] == [3, 3] and all(ms > 0 for t in times.values() for ms in t)
