"""``OnDevice``: build a model's tensors on a device (usually ``meta``: no memory) in a dtype, as DeepSpeed's
``deepspeed.OnDevice`` does, so its big-model snippets (build on meta, then ``init_inference(checkpoint=...)``) run with
``import splice as deepspeed``."""
from __future__ import annotations

from typing import Any

import torch


class OnDevice:
    """``with OnDevice(dtype=torch.bfloat16, device="meta"): model = AutoModelForCausalLM.from_config(config)``.

    Inside the block new tensors are made on ``device`` and floating ones default to ``dtype`` (None: unchanged);
    ``enabled=False`` makes it do nothing. Both are restored on exit.
    """

    def __init__(self, dtype: torch.dtype | None = None, device: Any = "meta", enabled: bool = True):
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"OnDevice(dtype={dtype!r}): allowed: a floating torch dtype or None")
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._device_context: torch.device | None = None
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._saved_dtype = torch.get_default_dtype()
            if self.dtype is not None:
                torch.set_default_dtype(self.dtype)
            self._device_context = torch.device(self.device)
            self._device_context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._device_context.__exit__(*exc)
            torch.set_default_dtype(self._saved_dtype)
