"""``benchmarks/bench_row_limits.py``: whole-model steps and prefills with a native row limit at two values in turns."""
from __future__ import annotations

import argparse

import pytest
import torch

from splice import native

from .arch.tiny_models import build_family
from .benchmark_scripts import load_benchmark

pytestmark = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


def test_each_limit_sends_the_rows_where_it_says_and_is_put_back():
    script = load_benchmark("bench_row_limits")
    engine = script.engine_of(build_family("llama", dtype=torch.bfloat16), "int4-sym", True, compiled=False,
                              max_out_tokens=96)
    _, step = script.decode_step(engine, script.token_ids(engine, (3, script.PROMPT)))
    before = native.MAX_ROWS["int4_dot"]
    calls = {}
    for limit in (2, 8):  # 3 rows: past the first limit (de-quantise + GEMM), within the second (the GEMV)
        with script.row_limit("int4_dot", limit), torch.profiler.profile() as profile:
            assert native.MAX_ROWS["int4_dot"] == limit
            with torch.inference_mode():
                step()
        calls[limit] = {event.name for event in profile.events()}
    assert native.MAX_ROWS["int4_dot"] == before
    assert "splice_kernels::int4_linear" in calls[2] and "splice_kernels::decode_registered" not in calls[2]
    assert "splice_kernels::decode_registered" in calls[8] and "splice_kernels::int4_linear" not in calls[8]
    times = script.in_turns("int4_dot", [2, 8], lambda: script.ms(step, 1), rounds=3)
    assert [len(t) for t in times.values()] == [3, 3] and all(ms > 0 for t in times.values() for ms in t)
    assert "limit 2 " in script.line("decode step, batch 3", times)


@pytest.mark.parametrize("text", ["", "4,x", "0,8", "-1"])
def test_a_bad_list_is_refused_naming_it(text):
    script = load_benchmark("bench_row_limits")
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text).replace("(", "\\(")):
        script.positive_list(text)
    assert script.positive_list("15,2048") == [15, 2048]
