"""StepClock's summary line: the prefill time and decode rate it can measure, and a plain word where it cannot."""
from __future__ import annotations

from splice.streaming import StepClock


def clock_with(arrivals: list[float]) -> StepClock:
    clock = StepClock()
    clock.started = 0.0
    clock.arrivals = arrivals
    return clock


def test_summary_gives_prefill_and_decode_rate():
    assert clock_with([0.5, 1.0, 1.5]).summary() == "[prefill 500.0 ms | decode 2.0 tokens/s | 3 new tokens]"


def test_one_new_token_has_no_decode_rate_to_give():
    """``--max-new-tokens 1``: the prompt's forward only, no decode step (the line printed 'decode nan tokens/s')."""
    assert clock_with([0.25]).summary() == "[prefill 250.0 ms | no decode step | 1 new tokens]"
    assert clock_with([]).summary() == "[no new token | no decode step | 0 new tokens]"
