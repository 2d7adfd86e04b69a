"""Placement: put the model's weights on the target device, loading them from a checkpoint when one is given.

A model built on the meta device is materialised straight on the target and filled from the checkpoint tensor by
tensor, so the weights are never held twice.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import check_checkpoint, has_meta_tensors, load_checkpoint, load_policy_files, parameter_bytes


def check(model: nn.Module, config, ctx) -> None:
    """A meta model needs a checkpoint; a given checkpoint must fit the model (headers only, nothing loaded)."""
    if _tensor_parallel_loads(ctx):
        return
    source = checkpoint_source(config)
    if source is None:
        if has_meta_tensors(model):
            raise ValueError("the model has tensors on the meta device (no weights) and no checkpoint was given; "
                             "pass checkpoint=<safetensors folder, file or index JSON> so splice can load them, "
                             "or give a model with real weights")
        return
    check_checkpoint(model, source)


def place_model(model: nn.Module, config, ctx) -> nn.Module:
    """Move the model to ``ctx.device`` (CPU with ``keep_module_on_host``), loading the checkpoint if one is given."""
    target = torch.device("cpu") if config.keep_module_on_host else torch.device(ctx.device)
    source = None if _tensor_parallel_loads(ctx) else checkpoint_source(config)
    if source is not None:
        was_meta = has_meta_tensors(model)
        model = load_checkpoint(model, source, target)
        how = f"{'materialised from meta and ' if was_meta else ''}weights loaded from checkpoint {_name(source)}"
    else:
        model = model.to(target)
        how = "moved (no checkpoint)"
    host = " (keep_module_on_host)" if config.keep_module_on_host else ""
    ctx.record("placement", f"on {target}{host}; {how}; {parameter_bytes(model) / 2**20:.1f} MiB of parameters")
    return model


def checkpoint_source(config) -> Path | list[Path] | None:
    """What to load: ``config.checkpoint``, else ``config.checkpoint_config.checkpoint_dir``; None if neither is set.

    A relative path is resolved against ``config.base_dir``; a DeepSpeed load-policy dict (``{"checkpoints": [...]}``)
    becomes its list of safetensors files.
    """
    checkpoint = getattr(config, "checkpoint", None)
    checkpoint_config = getattr(config, "checkpoint_config", None)
    base_dir = getattr(config, "base_dir", "") or ""
    if checkpoint is None and getattr(checkpoint_config, "checkpoint_dir", None) is not None:
        checkpoint = checkpoint_config.checkpoint_dir
        base_dir = base_dir or getattr(checkpoint_config, "base_dir", None) or ""
    if checkpoint is None:
        return None
    if isinstance(checkpoint, dict):
        return load_policy_files(checkpoint, base_dir)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a path or a load-policy dict, got {type(checkpoint).__name__}: "
                        f"{checkpoint!r}")
    path = Path(checkpoint).expanduser()
    return path if path.is_absolute() or not base_dir else Path(base_dir).expanduser() / path


def _tensor_parallel_loads(ctx) -> bool:
    """With tp_size > 1 the tensor-parallel step loads each rank's checkpoint slices; placement only moves the model."""
    return ctx.extras.get("checkpoint_owner") == "tensor_parallel"


def _name(source: Path | list[Path]) -> str:
    if isinstance(source, list):
        return f"{source[0]}" if len(source) == 1 else f"{source[0].parent} ({len(source)} files)"
    return str(source)

