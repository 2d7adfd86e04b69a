"""``benchmarks/bench_setting_turns.py``: kernel settings compared a token apart within one streamed ``generate``."""
from __future__ import annotations

import math

import pytest
import torch

import splice
from splice import native

from .arch.tiny_models import build_family
from .benchmark_scripts import load_benchmark


class RecordingOps:
    """Stands in for the kernel ops: records every setter call."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda value: self.calls.append((name, value))


def test_the_settings_take_turns_after_each_token_and_are_put_back_at_the_end():
    script = load_benchmark("bench_setting_turns")
    ops = RecordingOps()
    turns = script.SettingTurns(ops, ({"weight_streams": 2}, {"weight_streams": 4}))
    for _ in range(5):  # the prompt's token, then four new ones
        turns.put(None)
    turns.end()
    assert [value for _, value in ops.calls] == [2, 4, 2, 4, 2, 2]
    assert {name for name, _ in ops.calls} == {"set_weight_streams"}
    # the prompt at 0, the prefill's token at 1; the step after it ran changed (2 s), then as they were (1 s), ...
    turns.arrivals = [0.0, 1.0, 3.0, 4.0, 7.0, 8.0]
    assert turns.step_times() == ([1.0, 1.0], [3.0])  # the first step (a call's own warm-up) left out


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_a_round_times_both_settings_gives_the_loop_s_tokens_and_restores_the_settings():
    script = load_benchmark("bench_setting_turns")
    engine = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, max_out_tokens=64,
                                   dtype=torch.bfloat16)
    ops = torch.ops.splice_kernels
    before = ops.weight_streams()
    other = 4 if before != 4 else 2
    prompt = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    base, changed, tokens = script.one_round(engine, prompt, 12, ops, {"weight_streams": other})
    assert math.isfinite(base) and math.isfinite(changed) and base > 0 and changed > 0
    assert ops.weight_streams() == before
    with torch.inference_mode():
        assert torch.equal(tokens, engine.generate(prompt, max_new_tokens=12, do_sample=False))


def test_a_bad_setting_is_named_before_a_model_is_loaded(monkeypatch):
    script = load_benchmark("bench_setting_turns")
    monkeypatch.setattr("sys.argv", ["bench_setting_turns.py", "--set", "streams=4"])
    monkeypatch.setattr(script, "load_model", lambda *args: pytest.fail("loaded a model before the options' check"))
    with pytest.raises(SystemExit):
        script.main()
