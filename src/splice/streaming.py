"""Streamers that time generation: :class:`StepClock` notes when each step's tokens arrive; :class:`TimingStreamer`
also prints them as they come."""
from __future__ import annotations

import time

from transformers import TextStreamer


class StepClock:
    """A streamer that only notes when each decode step's tokens arrive. ``generate`` first puts the prompt, then one
    value per step (a token per row); prefill time is from :meth:`start` to the first step, decode speed counts the
    steps after the first."""

    def __init__(self):
        self.start()

    def start(self) -> None:
        """(Re)start the clock: call it right before ``generate``."""
        self.started = time.perf_counter()
        self.arrivals: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.arrivals.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass

    @property
    def prefill_ms(self) -> float:
        return (self.arrivals[0] - self.started) * 1e3 if self.arrivals else float("nan")

    @property
    def decode_steps_per_s(self) -> float:
        if len(self.arrivals) < 2:
            return float("nan")
        return (len(self.arrivals) - 1) / (self.arrivals[-1] - self.arrivals[0])

    def summary(self) -> str:
        """One line: the prefill time, the decode rate (where there were decode steps to time) and the new tokens."""
        prefill = f"prefill {self.prefill_ms:.1f} ms" if self.arrivals else "no new token"
        decode = f"decode {self.decode_steps_per_s:.1f} tokens/s" if len(self.arrivals) > 1 else "no decode step"
        return f"[{prefill} | {decode} | {len(self.arrivals)} new tokens]"


class TimingStreamer(StepClock, TextStreamer):
    """``TextStreamer`` (printing the new tokens of one row, the prompt skipped) that is also a :class:`StepClock`."""

    def __init__(self, tokenizer, **decode_kwargs):
        TextStreamer.__init__(self, tokenizer, skip_prompt=True, **decode_kwargs)
        StepClock.__init__(self)

    def put(self, value) -> None:
        StepClock.put(self, value)
        TextStreamer.put(self, value)

    def end(self) -> None:
        TextStreamer.end(self)
