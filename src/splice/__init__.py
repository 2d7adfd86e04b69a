"""splice: an inference engine for PyTorch models.

``init_inference(model, config=None, **kwargs)`` resolves every decision into one plan (``splice.plan``), applies
the pipeline's steps (``splice.pipeline.STEPS``) and returns an :class:`InferenceEngine`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import InferenceConfig, resolve_config
from .distributed import build_parallel_context
from .engine import InferenceEngine
from .models import load
from .ondevice import OnDevice
from .pipeline import run_pipeline
from .plan import resolve, resolve_device

__version__ = "0.1.0"
__all__ = ["init_inference", "InferenceEngine", "InferenceConfig", "OnDevice", "load", "__version__"]


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Apply splice's pipeline to ``model`` and return an :class:`InferenceEngine`.

    ``config`` is None, a dict, a path to a JSON file, or an :class:`InferenceConfig`; ``kwargs`` are merged on top
    (the same key with two different values raises). Keys and aliases are DeepSpeed's ``init_inference`` ones.
    Invalid input raises before the model is changed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_inference expects a torch.nn.Module, got {type(model).__name__}")
    resolved = resolve_config(config, **kwargs)
    parallel = build_parallel_context(resolved, _backend_device(resolved))  # before resolve_device: sets cuda:LOCAL_RANK
    plan = resolve(resolved, model, parallel, resolve_device(resolved))
    stage, reports = run_pipeline(model, plan)
    return InferenceEngine(stage.model, resolved, reports, parallel, stage.runtime)


def _backend_device(config: InferenceConfig) -> str:
    """The device type that picks the distributed backend (gloo on CPU, NCCL on CUDA)."""
    if config.device is not None:
        return config.device
    return "cuda" if torch.cuda.is_available() else "cpu"
