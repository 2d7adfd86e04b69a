"""Quantized mixture-of-experts weights: an experts module's 3-D weights as one quantized linear per expert.

An experts module (transformers' experts interface, :mod:`splice.layers.experts`) holds every expert's weights in
3-D tensors. Quantizing it replaces it by :func:`~splice.layers.experts.experts_of_linears`' copy whose weights are
``nn.ModuleList`` s of quantized linears under the same names (``experts.gate_up_proj.3`` is expert 3's), each on the
same kernels as any quantized linear of the model; this module says which experts modules stay in float.
"""
from __future__ import annotations

from torch import nn


def reason_experts_stay_float(module: nn.Module) -> str | None:
    """Why an experts module's weights cannot be quantized here (None: they can)."""
    if getattr(module, "has_post_expert_norm", False):
        return "experts with a norm after each expert; splice quantizes experts without one"
    return None
