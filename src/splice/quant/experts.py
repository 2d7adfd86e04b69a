"""Quantized mixture-of-experts weights: an experts module's 3-D weights as one quantized linear per expert.

An experts module (transformers' experts interface, :mod:`splice.layers.experts`) holds every expert's weights in
3-D tensors. :func:`quantized_experts` gives a copy of such a module whose weights are
``nn.ModuleList`` s of quantized linears under the same names (``experts.gate_up_proj.3`` is expert 3's), each on the
same kernels as any quantized linear of the model, and whose forward runs each routed token through its experts as
transformers' own eager forward does: gate/up, the module's own ``_apply_gate`` (or its activation without a gate),
down, times the routing weight, summed per token. The copy keeps the module's class, attributes and hooks (a
tensor-parallel all-reduce among them), so whatever the model's code reads of it stays as it was.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from types import MethodType

import torch
from torch import nn

from ..layers.experts import experts_matrices

def reason_experts_stay_float(module: nn.Module) -> str | None:
    """Why an experts module's weights cannot be quantized here (None: they can)."""
    if getattr(module, "has_post_expert_norm", False):
        return "experts with a norm after each expert; splice quantizes experts without one"
    return None


def quantized_experts(module: nn.Module, make_linear: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
                      ) -> nn.Module:
    """A copy of the experts ``module`` (see the module docstring) whose weights are quantized linears made by
    ``make_linear(weight [out, in], bias [out] or None)``, one per expert and matrix. ``module`` is not changed."""
    weights = experts_matrices(module)
    quantized = copy.copy(module)  # the same attributes; fresh tables of parameters, submodules, buffers and hooks
    for table in ("_parameters", "_modules", "_buffers", "_forward_hooks", "_forward_pre_hooks",
                  "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        if table in module.__dict__:
            quantized.__dict__[table] = OrderedDict(module.__dict__[table])
    for name, (weight, bias) in weights.items():
        layers = nn.ModuleList(make_linear(weight[e], None if bias is None else bias[e]) for e in range(len(weight)))
        delattr(quantized, name)
        if bias is not None:
            delattr(quantized, f"{name}_bias")
        setattr(quantized, name, layers)
    quantized.forward = MethodType(_routed_forward, quantized)
    return quantized


def _routed_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts forward on per-expert linears: each expert a token was routed to (an index past
    the last expert, which expert parallelism uses for "none here", is skipped), its output times the routing
    weight, added into the token's row."""
    up = self.gate_up_proj if self.has_gate else self.up_proj
    out = torch.zeros_like(hidden_states)
    for expert in torch.unique(top_k_index).tolist():
        if expert >= len(up):
            continue
        token, slot = torch.where(top_k_index == expert)
        every = len(token) == len(hidden_states)  # each token picks an expert once: then these are all, in order
        projected = up[expert](hidden_states if every else hidden_states[token])
        projected = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
        routed = (self.down_proj[expert](projected) * top_k_weights[token, slot, None]).to(out.dtype)
        if every:  # a decode step of one sequence, say: a plain add
            out.add_(routed)
        else:
            out.index_add_(0, token, routed)
    return out
