"""``OnDevice``: build a model's tensors on a device (usually ``meta``: no memory) in a dtype, as DeepSpeed's
``deepspeed.OnDevice`` does, so its big-model snippets (build on meta, then ``init_inference(checkpoint=...)``) run with
``import splice as deepspeed``."""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# The constructors DeepSpeed's OnDevice makes floating tensors in its dtype with.
_CONSTRUCTORS = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor})


class _FloatsIn(TorchFunctionMode):
    """Floating tensors from ``_CONSTRUCTORS`` calls that name no dtype come out in ``dtype``, whatever the default
    dtype is then: transformers sets the default to the config's own dtype while it builds a model, which would
    otherwise win over the dtype the user gave ``OnDevice``."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if (func in _CONSTRUCTORS and kwargs.get("dtype") is None and isinstance(result, torch.Tensor)
                and result.is_floating_point() and result.dtype != self.dtype):
            result = result.to(self.dtype)
        return result


class OnDevice:
    """``with OnDevice(dtype=torch.bfloat16, device="meta"): model = AutoModelForCausalLM.from_config(config)``.

    Inside the block new tensors are made on ``device``; floating ones default to ``dtype`` (None: unchanged), also
    where a model's config names another dtype (as DeepSpeed's: its parameters and buffers are made in ``dtype``);
    ``enabled=False`` makes it do nothing. Both are restored on exit.
    """

    def __init__(self, dtype: torch.dtype | None = None, device: Any = "meta", enabled: bool = True):
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"OnDevice(dtype={dtype!r}): allowed: a floating torch dtype or None")
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._device_context: torch.device | None = None
        self._dtype_mode: _FloatsIn | None = None
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._saved_dtype = torch.get_default_dtype()
            if self.dtype is not None:
                torch.set_default_dtype(self.dtype)
            self._device_context = torch.device(self.device)
            self._device_context.__enter__()
            if self.dtype is not None:
                self._dtype_mode = _FloatsIn(self.dtype)
                self._dtype_mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            if self._dtype_mode is not None:
                self._dtype_mode.__exit__(*exc)
                self._dtype_mode = None
            self._device_context.__exit__(*exc)
            torch.set_default_dtype(self._saved_dtype)
