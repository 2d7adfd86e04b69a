"""splice: an inference engine for PyTorch models.

``init_inference(model, config=None, **kwargs)`` resolves every decision into one plan (``splice.plan``), applies
the pipeline's steps (``splice.pipeline.STEPS``) and returns an :class:`InferenceEngine`.

The public names are imported on first use (PEP 562): ``import splice`` or ``import splice.native`` stays light,
without the engine, transformers' generation stack or torch's compiler that ``splice.engine`` brings in.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from .config import InferenceConfig
    from .engine import InferenceEngine
    from .models import load
    from .ondevice import OnDevice

__version__ = "0.1.0"
__all__ = ["init_inference", "InferenceEngine", "InferenceConfig", "OnDevice", "load", "__version__"]

#: The names imported on first use, and the submodule each comes from.
_LAZY_NAMES = {"InferenceEngine": ".engine", "InferenceConfig": ".config", "OnDevice": ".ondevice", "load": ".models"}


def __getattr__(name: str) -> Any:
    """Import a public name from its submodule on first access, then keep it as a module global."""
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_NAMES[name], __name__), name)
    globals()[name] = value  # later lookups (and monkeypatching) see an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Apply splice's pipeline to ``model`` and return an :class:`InferenceEngine`.

    ``config`` is None, a dict, a path to a JSON file, or an :class:`InferenceConfig`; ``kwargs`` are merged on top
    (the same key with two different values raises). Keys and aliases are DeepSpeed's ``init_inference`` ones.
    Invalid input raises before the model is changed.
    """
    from torch import nn

    from .config import resolve_config
    from .distributed import build_parallel_context
    from .engine import InferenceEngine
    from .pipeline import run_pipeline
    from .plan import resolve, resolve_device

    if not isinstance(model, nn.Module):
        raise TypeError(f"init_inference expects a torch.nn.Module, got {type(model).__name__}")
    resolved = resolve_config(config, **kwargs)
    parallel = build_parallel_context(resolved, _backend_device(resolved))  # before resolve_device: sets cuda:LOCAL_RANK
    plan = resolve(resolved, model, parallel, resolve_device(resolved))
    stage, reports = run_pipeline(model, plan)
    return InferenceEngine(stage.model, resolved, reports, parallel, stage.runtime)


def _backend_device(config: InferenceConfig) -> str:
    """The device type that picks the distributed backend (gloo on CPU, NCCL on CUDA)."""
    import torch

    if config.device is not None:
        return config.device
    return "cuda" if torch.cuda.is_available() else "cpu"
