"""Quantization: integer weight (and activation) kernels, after sharding and kernel injection.

Reads ``config.dtype == torch.int8`` and ``config.quant`` through ``QuantConfig.from_inference_config`` (the mapping is
documented in ``splice/quant/scheme.py``) and hands the model to ``splice.quant.quantize``. Runs after tensor
parallelism, so each rank quantizes its own shard, and after kernel injection, so fused q/k/v and gate/up linears are
quantized as one matrix each. Packs for ``ctx.device``, where placement will put the model. With
``quant.weight.calibration_ids`` (int4), GPTQ calibrates on the model's own forward over those ids (on every rank, on
its shard, when sharded: all ranks must pass the same ids). On a kernel-injected model the linears it leaves in float
(the lm_head by default) then go on splice's native bf16 GEMV, as injection puts them without quantization.
"""
from __future__ import annotations

import torch
from torch import nn

from ..quant import QuantConfig, plan, quantize
from ..quant.api import check_calibration_ids
from .inject import RUNTIME_ATTR, wrap_float_linears


def check(model: nn.Module, config, ctx) -> None:
    """Raise on an unsupported scheme, or one that cannot fit the model's linears, before anything changes."""
    qconfig = QuantConfig.from_inference_config(config)
    if qconfig is not None:
        plan(model, qconfig)
        if config.quant.weight.calibration_ids is not None:
            check_calibration_ids(config.quant.weight.calibration_ids, qconfig)


def quantize_model(model: nn.Module, config, ctx) -> nn.Module:
    qconfig = QuantConfig.from_inference_config(config)
    if qconfig is None:
        ctx.record("quantize", "skipped (no quantization asked for)")
        return model
    ids = config.quant.weight.calibration_ids if config.quant.enabled else None
    report = quantize(model, qconfig, device=ctx.device,
                      calibration_ids=None if ids is None else torch.tensor(ids, dtype=torch.long))
    ctx.extras["quant_config"] = qconfig
    wrapped = ""
    runtime = getattr(model, RUNTIME_ATTR, None)
    if runtime is not None:  # kernel-injected
        runtime.lm_head = model.get_output_embeddings()  # the quantized head, with quantize_lm_head
        wrapped = wrap_float_linears(model, runtime, ctx.device)  # what stays float runs on the fastest kernel too
    ctx.record("quantize", report.summary() + wrapped)
    return model
