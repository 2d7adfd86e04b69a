"""Per-forward latencies as DeepSpeed's ``profile_model_time`` / ``model_times`` record them.

DeepSpeed times every forward of the wrapped model with a pre- and a post-forward hook: CUDA events when asked
(``use_cuda_events=True``), else the wall clock with the device synchronised on both ends; one entry in milliseconds
per forward, so a ``generate`` of N new tokens gives N entries (the prefill, then one per decode step: Hugging Face's
loop calls the model once per new token). :class:`ForwardTimer` does the same for the hooks on the model and for
splice's native decode loop, which calls its runtime instead of the model's forward and measures each call with
:meth:`ForwardTimer.measure`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn


class ForwardTimer:
    """The latency of each forward of ``module`` (through hooks on it) or of each block run under :meth:`measure`.

    ``use_cuda_events`` times a model on a GPU with CUDA events (read when :meth:`take` is called, so no step waits
    for the device); on the CPU, or with ``use_cuda_events=False``, the wall clock times it, the device synchronised
    before and after.
    """

    def __init__(self, module: nn.Module, use_cuda_events: bool = True):
        self.module = module
        self.use_cuda_events = use_cuda_events
        self.pending: list[Any] = []  # milliseconds, or (start, end) CUDA events not read yet
        self._start: Any = None
        module.register_forward_pre_hook(lambda _module, _args: self.start())
        module.register_forward_hook(lambda _module, _args, _output: self.stop())

    def start(self) -> None:
        if self._events():
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._synchronize()
            self._start = time.perf_counter()

    def stop(self) -> None:
        if isinstance(self._start, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self._start, end))
        else:
            self._synchronize()
            self.pending.append((time.perf_counter() - self._start) * 1e3)

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Time the block as one forward."""
        self.start()
        yield
        self.stop()

    def take(self) -> list[float]:
        """The latencies (ms) recorded since the last call, oldest first; clears them."""
        if any(isinstance(entry, tuple) for entry in self.pending):
            torch.cuda.synchronize()
        times = [entry[0].elapsed_time(entry[1]) if isinstance(entry, tuple) else entry for entry in self.pending]
        self.pending = []
        return times

    def _events(self) -> bool:
        return self.use_cuda_events and _on_cuda(self.module)

    def _synchronize(self) -> None:
        if _on_cuda(self.module):
            torch.cuda.synchronize()


def _on_cuda(module: nn.Module) -> bool:
    param = next(module.parameters(), None)
    return param is not None and param.device.type == "cuda"
