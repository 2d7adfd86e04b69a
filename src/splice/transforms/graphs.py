"""Graph capture: CUDA graphs on GPU. This step validates the request; capture itself is its own issue."""
from __future__ import annotations

import torch


def check(model, config, ctx) -> None:
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


def prepare_graphs(model, config, ctx):
    ctx.record("graphs", "no graph capture (enable_cuda_graph=False)")
    return model
