"""splice: an inference engine for PyTorch models.

``init_inference(model, config=None, **kwargs)`` applies splice's pipeline of transforms (see ``pipeline.PIPELINE``)
and returns an :class:`InferenceEngine`.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # splice never downloads from a model hub; set before transformers loads

from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from .config import InferenceConfig, resolve_config  # noqa: E402
from .distributed import build_parallel_context  # noqa: E402
from .engine import InferenceEngine  # noqa: E402
from .models import load  # noqa: E402
from .pipeline import PipelineContext, resolve_device, run_pipeline  # noqa: E402

__version__ = "0.1.0"
__all__ = ["init_inference", "InferenceEngine", "InferenceConfig", "load", "__version__"]


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Apply splice's transforms to ``model`` and return an :class:`InferenceEngine`.

    ``config`` is None, a dict, a path to a JSON file, or an :class:`InferenceConfig`; ``kwargs`` are merged on top
    (the same key with two different values raises). Keys and aliases are DeepSpeed's ``init_inference`` ones.
    Invalid input raises before the model is changed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_inference expects a torch.nn.Module, got {type(model).__name__}")
    resolved = resolve_config(config, **kwargs)
    parallel = build_parallel_context(resolved, _backend_device(resolved))  # before resolve_device: sets cuda:LOCAL_RANK
    ctx = PipelineContext(device=resolve_device(resolved), parallel=parallel)
    model = run_pipeline(model, resolved, ctx)
    return InferenceEngine(model, resolved, ctx.report, ctx.parallel)


def _backend_device(config: InferenceConfig) -> str:
    """The device type that picks the distributed backend (gloo on CPU, NCCL on CUDA)."""
    if config.device is not None:
        return config.device
    return "cuda" if torch.cuda.is_available() else "cpu"
