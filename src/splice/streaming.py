"""A streamer that prints tokens as they come and times prefill and decode."""
from __future__ import annotations

import time

from transformers import TextStreamer


class TimingStreamer(TextStreamer):
    """``TextStreamer`` that records when each new token arrives.

    Prefill time is from ``start()`` to the first new token; decode speed counts the tokens after the first.
    """

    def __init__(self, tokenizer, skip_prompt: bool = False, **decode_kwargs):
        super().__init__(tokenizer, skip_prompt=skip_prompt, **decode_kwargs)
        self.start()

    def start(self) -> None:
        """(Re)start the clock: call it right before ``generate``."""
        self.started = time.perf_counter()
        self.arrivals: list[float] = []
        self._seen_prompt = not self.skip_prompt

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
        else:
            self.arrivals.extend([time.perf_counter()] * _new_token_count(value))
        super().put(value)

    @property
    def prefill_ms(self) -> float:
        return (self.arrivals[0] - self.started) * 1e3 if self.arrivals else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        if len(self.arrivals) < 2:
            return float("nan")
        return (len(self.arrivals) - 1) / (self.arrivals[-1] - self.arrivals[0])

    def summary(self) -> str:
        return (f"[prefill {self.prefill_ms:.1f} ms | decode {self.decode_tokens_per_s:.1f} tokens/s "
                f"| {len(self.arrivals)} new tokens]")


def _new_token_count(value) -> int:
    return 1 if value.dim() <= 1 else value.shape[-1]
