"""A fused block's decode step as one native call (``splice_kernels.decode_layer``).

A pre-norm block with a gated SiLU MLP (Llama's and its relatives') makes a dozen calls a decode step through its
modules: norms, four GEMVs, rotary, the cache writes, attention, residual adds, the activation. Each has its dispatch,
allocations and threads to wake, and in a small model those cost more than reading the weights. ``decode_layer`` does
the same work in one call, with the same GEMVs and attention kernel, rounding each elementwise result to bf16 where the
block's eager ops round it.

:func:`unfit_reason` says whether a block's structure and layers allow it (the kernels step asks once per block);
:func:`takes_step` whether a given step does (one new token per row, bf16, every linear on a native GEMV that takes its
rows, as :func:`layer_gemvs` finds them at each step); :func:`decode_layer` runs it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .. import native
from ..quant.layers import Int4WeightOnlyLinear, Int8DynamicLinear, Int8WeightOnlyLinear
from ..quant.qmath import ACTIVATION_BLOCK
from .native_linear import NativeLinear
from .norm import RMSNorm

#: decode_layer's GEMV kinds (gemv.cpp's LayerGemv)
GEMV_BF16, GEMV_INT8, GEMV_INT8_DOT, GEMV_INT8_DOT16, GEMV_INT4, GEMV_INT4_DOT = range(6)
#: the block's linears, in decode_layer's order
LINEARS = ("qkv", "o", "gate_up", "down")


class LayerGemv(NamedTuple):
    """The native GEMV one linear runs for decode rows: its kind, where the linear keeps the GEMV's tensors (attribute
    names of the weight, the scales and the bias; "" for none), its int4 group and its row-limit key
    (``native.MAX_ROWS``)."""

    kind: int
    tensors: tuple[str, str, str]
    group: int
    rows: str


def layer_gemv(linear: nn.Module) -> LayerGemv | None:
    """The native GEMV ``linear`` computes decode rows with, as its own forward picks it; None where it runs none (or
    where its forward does more, such as padding an int4 weight's input)."""
    if isinstance(linear, NativeLinear):
        return LayerGemv(GEMV_BF16, ("weight", "", "bias"), 0, "bf16")
    if isinstance(linear, Int8DynamicLinear):
        if not linear.use_native or linear.in_features % ACTIVATION_BLOCK:
            return None
        return LayerGemv(GEMV_INT8_DOT, ("qweight", "scales", "bias"), 0, "int8")
    if isinstance(linear, Int8WeightOnlyLinear):
        if not linear.use_native or linear.grouped:
            return None
        kind = {16: GEMV_INT8_DOT16, 8: GEMV_INT8_DOT}.get(linear.use_dot_products, GEMV_INT8)
        return LayerGemv(kind, ("qweight", "scales", "bias"), 0, "int8_dot" if kind != GEMV_INT8 else "int8")
    if isinstance(linear, Int4WeightOnlyLinear):
        if not linear.use_native or linear.padded_shape != (linear.out_features, linear.in_features):
            return None
        kind = GEMV_INT4_DOT if linear.use_dot_products else GEMV_INT4
        return LayerGemv(kind, ("packed", "packed_scales", "bias"), linear.group, "int4")
    return None


def layer_gemvs(block: nn.Module) -> tuple[LayerGemv | None, ...]:
    """The GEMVs of the block's linears as they are now (a linear replaced since the kernels step, say by loading a
    quantized checkpoint into a float engine, gives its own, or None)."""
    return tuple(layer_gemv(held(block, name)) for name in LINEARS)


def unfit_reason(block: nn.Module) -> str | None:
    """Why ``block`` (a :class:`~splice.layers.block.SpliceBlock`) cannot step as one native call, or None if it can."""
    layout, shape = block.layout, block.shape
    if not (layout.causal and layout.norm_before and not layout.parallel and layout.gated):
        return "its layout is not a causal pre-norm block with a sequential residual and a gated MLP"
    if shape.activation not in ("silu", "swish"):
        return f"its MLP's activation is {shape.activation}, not SiLU"
    extras = [name for name in ("qk_norm", "attn_out_norm", "mlp_out_norm", "alibi_slopes")
              if getattr(block, name) is not None]
    if extras or layout.softcap is not None:
        return f"it has {', '.join(extras or ['soft-capped scores'])}"
    for norm in (block.attn_norm, block.mlp_norm):
        if not isinstance(norm, RMSNorm) or norm.weight.dtype != torch.bfloat16:
            return "its norms are not RMSNorm with bf16 weights"
    if shape.head_dim % 16 or shape.head_dim > 256:
        return f"its head_dim {shape.head_dim} is not a multiple of 16 up to 256"
    for name in LINEARS:
        if layer_gemv(getattr(block, name)) is None:
            return f"its {name} linear ({type(getattr(block, name)).__name__}) runs no native GEMV for decode rows"
    return None


def takes_step(x: torch.Tensor, mask: torch.Tensor | None, gemvs: tuple[LayerGemv | None, ...]) -> bool:
    """Whether this step (``x [batch, seq, hidden]``) runs as one native call: one token per row, bf16 on CPU, a
    boolean mask or none, and every linear on a native GEMV (``gemvs``: :func:`layer_gemvs`) that takes these rows.
    Shapes only, so ``torch.compile`` traces it."""
    if x.shape[1] != 1 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return False
    if mask is not None and mask.dtype != torch.bool:
        return False
    return all(gemv is not None and x.shape[0] <= native.MAX_ROWS[gemv.rows] for gemv in gemvs)


def decode_layer(block: nn.Module, gemvs: tuple[LayerGemv, ...], x: torch.Tensor, cos: torch.Tensor | None,
                 sin: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor | None, kv_len: int) -> torch.Tensor:
    """The block's decode step on its linears' ``gemvs`` (:func:`layer_gemvs`): keys and values written into ``keys,
    values [batch, kv_heads, L, head_dim]`` (the layer's cache) at ``slots``; returns the new hidden states (``x`` is
    left as it is)."""
    tensors = [held(linear, name) if name else None
               for linear, gemv in zip((held(block, name) for name in LINEARS), gemvs)
               for name in gemv.tensors]
    attn_norm, mlp_norm = held(block, "attn_norm"), held(block, "mlp_norm")
    return torch.ops.splice_kernels.decode_layer(
        x.contiguous(), keys, values, slots, mask, kv_len, cos, sin, held(attn_norm, "weight"), attn_norm.eps,
        held(mlp_norm, "weight"), mlp_norm.eps, tensors, [gemv.kind for gemv in gemvs], [gemv.group for gemv in gemvs],
        block.shape.n_heads, block.shape.n_kv_heads, block.scale)


MODULE_TABLES = ("_parameters", "_buffers", "_modules")


def held(module: nn.Module, name: str):
    """``getattr(module, name)`` for an attribute, parameter, buffer or submodule, read from the module's own tables
    in eager steps: ``nn.Module.__getattr__`` costs most of a microsecond a call, and a block's native call reads
    twenty. A compiled step traces ``getattr`` itself."""
    if torch.compiler.is_compiling():
        return getattr(module, name)
    own = vars(module)
    if name in own:  # a plain attribute comes first, as for getattr
        return own[name]
    for table in MODULE_TABLES:
        if name in own[table]:
            return own[table][name]
    return getattr(module, name)
