"""transformers' experts interface, read: a mixture of experts' experts module and its matrices.

transformers holds a mixture of experts' weights in one experts module (``use_experts_implementation``: Mixtral,
Qwen2-MoE, GPT-OSS, ...), flagged ``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``:
``gate_up_proj`` (or ``up_proj`` without a gate) and ``down_proj``, ``[experts, out, in]`` (``[experts, in, out]``
where ``is_transposed``), biases ``gate_up_proj_bias`` / ``down_proj_bias`` where ``has_bias``. Tensor parallelism
(``splice.tp``), quantization (``splice.quant``) and the kernels step read it here; :func:`experts_of_linears` gives
such a module with one linear per expert and matrix instead.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from types import MethodType

import torch
from torch import nn

#: Flags transformers' experts interface sets on an experts module.
EXPERTS_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def is_experts(module: nn.Module) -> bool:
    """``module`` carries the experts interface's flags."""
    return all(isinstance(getattr(module, flag, None), bool) for flag in EXPERTS_FLAGS)


def up_name(module: nn.Module) -> str:
    """The name of an experts module's first matrix: ``gate_up_proj``, or ``up_proj`` without a gate."""
    return "gate_up_proj" if module.has_gate else "up_proj"


def experts_matrices(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None:
    """``{name: (weight [experts, out, in], bias [experts, out] or None)}`` of an experts module's matrices, detached;
    None for any other module, and for one whose matrices are not 3-D tensors (already quantized, say)."""
    if not is_experts(module):
        return None
    found = {}
    for name in (up_name(module), "down_proj"):
        weight = getattr(module, name, None)
        bias = getattr(module, f"{name}_bias", None) if module.has_bias else None
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or (module.has_bias and bias is None):
            return None
        weight, bias = weight.detach(), None if bias is None else bias.detach()  # a model may still need gradients
        found[name] = (weight.transpose(1, 2) if module.is_transposed else weight, bias)
    return found


def experts_features(module: nn.Module) -> int:
    """An experts module's intermediate features (per expert): its down projection's inputs."""
    return module.down_proj.shape[1 if module.is_transposed else 2]


def experts_of_linears(module: nn.Module, make_linear: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
                       ) -> nn.Module:
    """A copy of the experts ``module`` whose weights are linears made by ``make_linear(weight [out, in], bias [out]
    or None)`` (quantized ones, or splice's native bf16 GEMV on a view of the weight), one per expert and matrix, as
    ``nn.ModuleList`` s under the matrices' names (``gate_up_proj.3`` is expert 3's). Its forward runs each routed
    token through its experts as transformers' own eager forward does: gate/up, the module's own ``_apply_gate`` (or
    its activation without a gate), down, times the routing weight, summed per token. The copy keeps the module's
    class, attributes and hooks (a tensor-parallel all-reduce among them), so whatever the model's code reads of it
    stays as it was. ``module`` is not changed."""
    weights = experts_matrices(module)
    copied = copy.copy(module)  # the same attributes; fresh tables of parameters, submodules, buffers and hooks
    for table in ("_parameters", "_modules", "_buffers", "_forward_hooks", "_forward_pre_hooks",
                  "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        if table in module.__dict__:
            copied.__dict__[table] = OrderedDict(module.__dict__[table])
    for name, (weight, bias) in weights.items():
        layers = nn.ModuleList(make_linear(weight[e], None if bias is None else bias[e]) for e in range(len(weight)))
        delattr(copied, name)
        if bias is not None:
            delattr(copied, f"{name}_bias")
        setattr(copied, name, layers)
    copied.forward = MethodType(_routed_forward, copied)
    return copied


@torch.compiler.disable  # which experts run is read from the routing on the host: a graph would keep the traced ones
def _routed_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts forward on per-expert linears: each expert a token was routed to (an index past
    the last expert, which expert parallelism uses for "none here", is skipped), its output times the routing
    weight, added into the token's row. Decode rows whose experts all run native GEMVs take one native call for every
    expert (``splice_kernels.experts_decode``, :func:`~splice.layers.native_layer.experts_call`). A compiled step runs
    it eagerly."""
    from .native_layer import experts_call

    call = experts_call(self, hidden_states, top_k_index)
    if call is not None:
        return torch.ops.splice_kernels.experts_decode(hidden_states, top_k_index, top_k_weights, *call)
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
