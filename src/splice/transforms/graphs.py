"""Graph capture: CUDA graphs on GPU (validated here; capture itself is its own issue), a compiled static decode step
(``compile_decode``) on CPU.

Only the decode step is compiled: one token per row at a tensor position, attending over the whole static KV cache
(the cache's mask hides the empty slots), so its shapes never change and it compiles once per batch size. Prefill and
everything else stay eager. Compiling happens lazily, on the first decode step of the first ``generate`` call. Under
tensor parallelism each rank compiles its own step; dynamo traces the row-parallel all-reduces and the vocab-parallel
all-gather into the graph as functional collectives (no graph breaks).
"""
from __future__ import annotations

import torch

from .inject import runtime_of


def check(model, config, ctx) -> None:
    if config.compile_decode:
        check_compile(config, ctx)
    if not config.enable_cuda_graph:
        return
    if config.tensor_parallel.tp_size > 1:
        raise ValueError(
            f"enable_cuda_graph=True cannot be combined with tensor_parallel.tp_size={config.tensor_parallel.tp_size}; "
            "allowed: enable_cuda_graph=True with tp_size=1, or enable_cuda_graph=False"
        )
    if ctx.device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            f"enable_cuda_graph=True needs a CUDA device, but the model runs on {ctx.device}; "
            "allowed: enable_cuda_graph=False on CPU"
        )
    raise NotImplementedError("enable_cuda_graph=True is not available yet in this splice version; use False")


def check_compile(config, ctx) -> None:
    if not config.replace_with_kernel_inject:
        raise ValueError("compile_decode=True compiles splice's own decode step, which needs "
                         "replace_with_kernel_inject=True; allowed: replace_with_kernel_inject=True, or "
                         "compile_decode=False")
    if config.enable_cuda_graph:
        raise ValueError("compile_decode=True and enable_cuda_graph=True both capture the decode step; "
                         "allowed: one of them")


def prepare_graphs(model, config, ctx):
    if config.compile_decode:
        runtime_of(model).compile_decode()
        ctx.record("graphs", "decode step compiled with torch.compile (static shapes; compiles on the first decode "
                             "step, cached by torch's inductor cache)")
        return model
    ctx.record("graphs", "no graph capture (enable_cuda_graph=False)")
    return model
