"""Tensor parallelism over torch.distributed."""
from __future__ import annotations


def check(model, config, ctx) -> None:
    if config.tensor_parallel.tp_size > 1:
        raise NotImplementedError(
            f"tensor_parallel.tp_size={config.tensor_parallel.tp_size} is not available yet in this splice version; "
            "allowed: 1"
        )


def shard_model(model, config, ctx):
    ctx.record("tensor_parallel", "skipped (tp_size=1)")
    return model
