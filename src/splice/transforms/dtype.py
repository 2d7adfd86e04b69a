"""dtype conversion: the first transform, before any structural change."""
from __future__ import annotations

import torch
from torch import nn

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(model: nn.Module, config, ctx) -> None:
    """Nothing to validate beyond the config: its dtype field already accepts only fp32, fp16, bf16 and int8."""


def convert_dtype(model: nn.Module, config, ctx) -> nn.Module:
    """Cast floating parameters and persistent buffers to ``config.dtype``.

    Non-persistent floating buffers (computed tables such as rotary frequencies) keep their precision, as they do when
    Hugging Face builds a model directly in a lower precision with ``from_pretrained(dtype=...)``.
    """
    target = activation_dtype(config.dtype, ctx.device)
    if target is None:
        ctx.record("dtype", f"kept the model's own dtype ({model_dtype(model)})")
        return model
    kept = _non_persistent_float_buffers(model)
    model.to(dtype=target)
    for module, name, tensor in kept:
        module._buffers[name] = tensor
    int8 = config.dtype == torch.int8
    why = " (int8 weights are made by the quantize step; activations run in this dtype)" if int8 else ""
    ctx.record("dtype", f"converted floating parameters and persistent buffers to {target}{why}")
    return model


def activation_dtype(dtype: torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """The float dtype to convert to: ``dtype`` itself, or for int8 the dtype its activations run in (bf16 where the
    device supports it: torch's int8 weight-only kernels are fast only with bf16 activations; else None = keep)."""
    if dtype != torch.int8:
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16


def model_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter (None for a model without one)."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return None


def _non_persistent_float_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    kept = []
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            tensor = module._buffers.get(name)
            if tensor is not None and tensor.is_floating_point():
                kept.append((module, name, tensor))
    return kept
