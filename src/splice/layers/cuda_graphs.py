"""CUDA graph replay (``enable_cuda_graph=True``): a call is captured once per input signature, after a warm-up on a
side stream, and later calls of that signature copy their inputs into the captured (static) buffers and replay it.

Two users: the decode step of the native generate loop (one graph per batch size and attended length, over the static
KV cache, whose buffers the graph reads and writes in place) and ``engine(...)`` calls (one graph per signature of
their arguments). What comes back is a copy of the graph's output, so a later replay never overwrites what a caller
holds. A call that cannot be captured (a host synchronisation inside it, an output that is not made of tensors, more
signatures than ``max_graphs``) runs eagerly, and the log says so once per signature. One call at a time copies into
a replayer's static inputs and replays its graphs (they share their static buffers and one memory pool, which PyTorch
allows only for graphs never replayed concurrently): calls from several threads wait for each other.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch

log = logging.getLogger("splice")

#: graphs kept per replayer; further signatures run eagerly
MAX_GRAPHS = 16
#: eager runs on a side stream before a capture (cuBLAS workspaces, lazy initialisation, a compiled step's compile)
WARMUP_RUNS = 2


@dataclass
class Captured:
    """One captured call: its graph, the static inputs it reads and the static output it writes."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    output: Any
    keep_alive: tuple = ()  # tensors the graph reads or writes that the caller does not pass each time (the KV cache)


class GraphReplayer:
    """Captures ``fn(*tensors)`` per signature (shapes, dtypes, devices of the tensor arguments and the values of the
    others) and replays it. ``fn`` must read its tensor arguments only through the tensors it is given, as the static
    buffers replace them."""

    def __init__(self, fn: Callable[..., Any], name: str, max_graphs: int = MAX_GRAPHS):
        self.fn = fn
        self.name = name
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, Captured] = {}
        self.eager: set[tuple] = set()  # signatures that run eagerly (said once in the log)
        self.said_unhashable = False
        self.pool = None
        self.lock = threading.Lock()  # held from a call's capture or copy into the static inputs to its copy out

    def __call__(self, *args: Any, keep_alive: tuple = ()) -> Any:
        key = signature(args)
        try:
            hash(key)
        except TypeError:  # an argument that cannot tell graphs apart (a list, a cache object): never captured
            if not self.said_unhashable:
                log.info("splice: %s with an unhashable argument runs eagerly, not from a CUDA graph", self.name)
                self.said_unhashable = True
            return self.fn(*args)
        with self.lock:
            captured = self.graphs.get(key)
            if captured is None and key not in self.eager:
                captured = self.capture(key, args, keep_alive)
            if captured is not None:
                return self.replay(captured, args)
        return self.fn(*args)

    @staticmethod
    def replay(captured: Captured, args: tuple) -> Any:
        for static, value in zip(captured.inputs, tensors_in(args)):
            static.copy_(value)  # the static buffers are the graph's own: every call's inputs are copied in
        captured.graph.replay()
        return copy_out(captured.output)

    def capture(self, key: tuple, args: tuple, keep_alive: tuple) -> Captured | None:
        """Warm up on a side stream, then capture; None (and a log line) where the call cannot be captured."""
        if len(self.graphs) >= self.max_graphs:
            return self.run_eagerly(key, f"{self.max_graphs} graphs are captured already")
        static_args = static_copies(args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                output = self.fn(*static_args)
        torch.cuda.current_stream().wait_stream(side)
        if not made_of_tensors(output):
            return self.run_eagerly(key, f"its output holds a {type_not_tensor(output)}, which a graph cannot give "
                                         "back")
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        generator = default_generator()
        generator_before = generator.clone_state()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.fn(*static_args)
        except RuntimeError as error:
            # torch.cuda.graph leaves its capture stream current when ending the capture raises: back to the caller's
            torch.cuda.set_stream(stream)
            # and the device's default generator, which every capture enlists, stays in its capture phase, so every
            # later random operator on the device would raise: it gets back its state from before the capture
            generator.graphsafe_set_state(generator_before)
            torch.cuda.synchronize()
            cause = error.__context__ or error  # the error inside the capture, before the one ending it
            return self.run_eagerly(key, f"capture failed ({str(cause).splitlines()[0]})")
        captured = Captured(graph, tensors_in(static_args), output, keep_alive)
        self.graphs[key] = captured
        log.info("splice: captured a CUDA graph of %s for %s", self.name, describe(key))
        return captured

    def run_eagerly(self, key: tuple, why: str) -> None:
        self.eager.add(key)
        log.info("splice: %s for %s runs eagerly, not from a CUDA graph: %s", self.name, describe(key), why)
        return None

    def clear(self) -> None:
        """Forget every graph and every signature that ran eagerly (their memory, and what they and the signatures
        kept alive, such as a KV cache, goes back once nothing else holds it)."""
        with self.lock:
            self.graphs = {}
            self.eager = set()
            # the pool goes with its last graph: a capture into its handle afterwards fails torch's allocator check
            self.pool = None


def default_generator() -> torch.Generator:
    """The current device's default random generator: a capture enlists it, whatever the captured call draws."""
    return torch.cuda.default_generators[torch.cuda.current_device()]


def signature(args: tuple) -> tuple:
    """What tells graphs apart: each tensor's shape, dtype and device; every other argument's value."""
    return tuple(("tensor", tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else ("value", a)
                 for a in args)


def static_copies(args: tuple) -> tuple:
    """``args`` with each tensor cloned into a static buffer of the graph. The clones are ordinary tensors, made
    outside inference mode, so that calls in and out of inference mode can copy their inputs into them (an inference
    tensor takes no in-place copy outside inference mode)."""
    with torch.inference_mode(False):
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def describe(key: tuple) -> str:
    return ", ".join(f"{tuple(item[1])} {str(item[2]).removeprefix('torch.')}" if item[0] == "tensor"
                     else repr(item[1]) for item in key)


def tensors_in(args: tuple) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def made_of_tensors(value: Any) -> bool:
    return type_not_tensor(value) is None


def type_not_tensor(value: Any) -> str | None:
    """The name of the first thing in ``value`` that is neither a tensor, None, a number, nor a tuple, list, dict or
    dataclass (Hugging Face's ModelOutput) of those; None when there is none."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float)):
        return None
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (tuple, list)):
        items = list(value)
    elif is_dataclass(value):
        items = [getattr(value, f.name) for f in fields(value)]
    else:
        return type(value).__name__
    return next((found for found in map(type_not_tensor, items) if found is not None), None)


def copy_out(value: Any) -> Any:
    """``value`` with every tensor cloned (a ModelOutput keeps its class and fields)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict) and not is_dataclass(value):
        return {k: copy_out(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple takes its fields as arguments
        return type(value)(*map(copy_out, value))
    if isinstance(value, (tuple, list)):
        return type(value)(copy_out(v) for v in value)
    if is_dataclass(value):
        return type(value)(**{f.name: copy_out(getattr(value, f.name)) for f in fields(value)})
    return value
