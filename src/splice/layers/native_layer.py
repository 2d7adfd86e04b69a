"""A decode step's fused blocks as native calls (``splice_kernels.decode_layers``): a run of consecutive blocks in one.

A pre-norm block (Llama's and its relatives', with or without Qwen3's qk-norm; RMSNorms or LayerNorms; a gated MLP or a
plain one with SiLU, GELU or ReLU; a sequential residual or a parallel one, as GPT-NeoX, Phi, Falcon and GPT-J have)
makes a dozen calls a decode step through its modules: norms, four GEMVs, rotary, the cache writes, attention, residual
adds, the activation. Each has its dispatch, allocations and threads to wake, and in a small model those, and the Python
around them, cost more than reading the weights. ``decode_layers`` does the same work for every block of a run in one
call, with the same GEMVs and attention kernel, rounding each elementwise result to bf16 where the block's eager ops
round it.

:func:`unfit_reason` says whether a block's structure and layers allow it (the kernels step asks once per block);
:func:`step_takes_calls` and :func:`layer_call` whether a given step does (one new token per row, bf16, every linear on
a native GEMV that takes its rows, as :func:`layer_gemv` finds them) and what the call takes of the block;
:func:`step_plan` puts a step's blocks into runs (the last with the model's head where :func:`head_call` allows: the
final norm and the lm_head's GEMV join the call), and :func:`decode_layers` runs a run's call.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import nn
from transformers.activations import SiLUActivation

from .. import native
from ..quant.layers import Int4WeightOnlyLinear, Int8DynamicLinear, Int8WeightOnlyLinear
from ..quant.qmath import ACTIVATION_BLOCK
from .native_linear import NativeLinear
from .norm import HeadRMSNorm, RMSNorm

#: decode_layers' GEMV kinds (gemv.cpp's LayerGemv)
(GEMV_BF16, GEMV_INT8, GEMV_INT8_DOT, GEMV_INT8_DOT16, GEMV_INT4, GEMV_INT4_DOT, GEMV_INT8_GROUPED,
 GEMV_INT8_GROUPED16) = range(8)
#: the block's linears, in decode_layers' order
LINEARS = ("qkv", "o", "gate_up", "down")
#: the activation modules transformers gives an experts module for "silu" ("swish")
SILU_CLASSES = (nn.SiLU, SiLUActivation)
#: decode_layers' norm kinds (gemv.cpp's NormKind): RMSNorm, LayerNorm, RMSNorm with a float32 weight
NORM_RMS, NORM_LAYER, NORM_RMS_FLOAT = 0, 1, 2
#: decode_layers' MLP activations (gemv.cpp's MlpActivation) by the fused block's activation names
LAYER_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu": 1, "gelu_python": 1, "gelu_pytorch_tanh": 2, "gelu_new": 2,
                     "gelu_fast": 2, "gelu_python_tanh": 2, "relu": 3}


class LayerGemv(NamedTuple):
    """The native GEMV one linear runs for decode rows: its kind, where the linear keeps the GEMV's tensors (attribute
    names of the weight, the scales and the bias; "" for none), its group (int4: columns per group; grouped int8:
    inputs per group, which the native call zero-pads to whole blocks as the layer does) and its row-limit key
    (``native.MAX_ROWS``)."""

    kind: int
    tensors: tuple[str, str, str]
    group: int
    rows: str


#: the GEMVs of the float and int8 linears that run one (layer_gemv), made once: a step looks each linear's up
BF16_GEMV = LayerGemv(GEMV_BF16, ("weight", "", "bias"), 0, "bf16")
W8A8_GEMV = LayerGemv(GEMV_INT8_DOT, ("qweight", "scales", "bias"), 0, "w8a8")
INT8_GEMVS = {products: LayerGemv(kind, ("qweight", "scales", "bias"), 0, rows)
              for products, kind, rows in ((16, GEMV_INT8_DOT16, "int8_dot"), (8, GEMV_INT8_DOT, "int8_dot"),
                                           (0, GEMV_INT8, "int8"))}


def layer_gemv(linear: nn.Module) -> LayerGemv | None:
    """The native GEMV ``linear`` computes decode rows with, as its own forward picks it; None where it runs none (or
    where its forward does more, such as padding an int4 weight's input)."""
    if isinstance(linear, NativeLinear):
        return BF16_GEMV
    if isinstance(linear, Int4WeightOnlyLinear):
        if not linear.use_native or linear.padded_shape != (linear.out_features, linear.in_features):
            return None
        if linear.use_dot_products:
            return LayerGemv(GEMV_INT4_DOT, ("packed", "", "bias"), linear.group, "int4_dot")
        return LayerGemv(GEMV_INT4, ("packed", "", "bias"), linear.group, "int4")
    if isinstance(linear, Int8DynamicLinear):
        if not linear.use_native or linear.in_features % ACTIVATION_BLOCK:
            return None
        return W8A8_GEMV
    if isinstance(linear, Int8WeightOnlyLinear):
        if not linear.use_native:
            return None
        if linear.native_grouped:  # K zero-padded to whole groups pads x too, which the native call does not
            kind = GEMV_INT8_GROUPED16 if linear.use_dot_products == 16 else GEMV_INT8_GROUPED
            return None if linear.in_features % linear.group else LayerGemv(
                kind, ("qweight", "scales", "bias"), linear.group, "int8_dot")
        return INT8_GEMVS.get(linear.use_dot_products, INT8_GEMVS[0])
    return None


def unfit_reason(block: nn.Module) -> str | None:
    """Why ``block`` (a :class:`~splice.layers.block.SpliceBlock`) cannot step in a native call, or None if it can."""
    layout, shape = block.layout, block.shape
    if block.moe is not None:
        return f"its MLP is the model's own {type(block.moe).__name__} (a mixture of experts)"
    if not (layout.causal and layout.norm_before):
        return "its layout is not a causal pre-norm block"
    if shape.activation not in LAYER_ACTIVATIONS:
        return f"its MLP's activation is {shape.activation}, not one of {', '.join(LAYER_ACTIVATIONS)}"
    return attention_unfit_reason(block, whole_layer=True) or linears_unfit_reason(block, ("gate_up", "down"))


def attention_unfit_reason(block: nn.Module, whole_layer: bool = False) -> str | None:
    """Why ``block``'s attention half (its norm, qkv, rotary, attention, o and residual add, and its MLP's norm) cannot
    step in a native call (``decode_attention_half``; RMSNorms and a sequential residual), or None if it can;
    ``whole_layer``: as part of the whole layer's call (:func:`unfit_reason`: any residual, and the norms
    :func:`norms_unfit_reason` takes there)."""
    layout, shape = block.layout, block.shape
    if not (layout.causal and layout.norm_before and (whole_layer or not layout.parallel)):
        return "its layout is not a causal pre-norm block with a sequential residual"
    extras = ["alibi_slopes"] + ([] if whole_layer else ["attn_out_norm", "mlp_out_norm"])
    extras = [name for name in extras if getattr(block, name) is not None]
    if extras or layout.softcap is not None:
        return f"it has {', '.join(extras or ['soft-capped scores'])}"
    if block.sinks is not None:
        return "its attention has sinks (a learned logit per head in the softmax)"
    if layout.clip_qkv is not None:
        return "it clamps q, k and v (clip_qkv)"
    if layout.rotary_float:
        return "it rotates q and k in float32, rounding once (rotary_float)"
    qk_norm = block.qk_norm
    if qk_norm is not None and not isinstance(qk_norm, HeadRMSNorm):
        return "its qk-norm spans each whole projection, not one head"
    if qk_norm is not None and qk_norm.weight.dtype != (torch.float32 if qk_norm.offset else torch.bfloat16):
        return "its qk-norm's weight is not float32 with an offset (Gemma 3's) or bf16 without one"
    norms_reason = norms_unfit_reason(block, whole_layer)
    if norms_reason:
        return norms_reason
    if shape.head_dim % 16 or shape.head_dim > 256:
        return f"its head_dim {shape.head_dim} is not a multiple of 16 up to 256"
    return linears_unfit_reason(block, ("qkv", "o"))


def norm_kind(norm: nn.Module | None, hidden: int) -> int | None:
    """The norm's kind for the native calls (``NORM_RMS``: splice's RMSNorm with a bf16 weight; ``NORM_RMS_FLOAT``:
    with a float32 one, Gemma's folded ``1 + w`` or a weight scaled in float32; ``NORM_LAYER``: torch's own
    ``nn.LayerNorm`` over ``hidden`` features with a bf16 weight and a bf16 bias or none), else None."""
    if isinstance(norm, RMSNorm) and norm.weight.dtype in (torch.bfloat16, torch.float32):
        return NORM_RMS if norm.weight.dtype == torch.bfloat16 else NORM_RMS_FLOAT
    if type(norm) is nn.LayerNorm and norm.normalized_shape == (hidden,) and norm.weight is not None \
            and norm.weight.dtype == torch.bfloat16 and (norm.bias is None or norm.bias.dtype == torch.bfloat16):
        return NORM_LAYER
    return None


def norms_unfit_reason(block: nn.Module, whole_layer: bool) -> str | None:
    """Why the block's norms keep it out of the native calls: RMSNorms with bf16 weights, or in a whole layer's call
    also RMSNorms with float32 weights and torch's LayerNorms with bf16 weights and biases, both of one kind (a
    parallel block's MLP norm may be absent: its MLP reads the attention's), or None if they fit."""
    hidden = block.attn_norm.weight.shape[-1] if getattr(block.attn_norm, "weight", None) is not None else -1
    norms = [block.attn_norm] + ([block.mlp_norm] if block.mlp_norm is not None or not block.layout.parallel else [])
    norms += [norm for norm in (block.attn_out_norm, block.mlp_out_norm) if norm is not None]
    kinds = {norm_kind(norm, hidden) for norm in norms}
    allowed = {NORM_RMS, NORM_LAYER, NORM_RMS_FLOAT} if whole_layer else {NORM_RMS}
    if len(kinds) != 1 or not kinds <= allowed:
        return ("its norms are not RMSNorms or LayerNorms of one kind (bf16 weights, or float32 ones for RMSNorms)"
                if whole_layer else "its norms are not RMSNorm with bf16 weights")
    return None


def linears_unfit_reason(block: nn.Module, names: tuple[str, ...]) -> str | None:
    for name in names:
        if layer_gemv(getattr(block, name)) is None:
            return f"its {name} linear ({type(getattr(block, name)).__name__}) runs no native GEMV for decode rows"
    return None


def mask_takes_calls(mask: torch.Tensor | None) -> bool:
    """Whether a step's mask is one the native calls take: none, or boolean (a float mask sends its block to its own
    ops)."""
    return mask is None or mask.dtype == torch.bool


def step_takes_calls(x: torch.Tensor) -> bool:
    """Whether a step on ``x [batch, seq, hidden]`` may run blocks in native calls: one token per row, bf16 on CPU.
    Shapes only, so ``torch.compile`` traces it."""
    return x.shape[1] == 1 and x.dtype == torch.bfloat16 and x.device.type == "cpu"


class LayerCall(NamedTuple):
    """What ``decode_layers`` takes of one block, besides a step's mask and rotary rows: its cache layer, its norms'
    tensors (the attention's weight, the MLP's or None where a parallel block's MLP reads the attention's norm, the
    qk-norm's or None, the attention's and the MLP's LayerNorm biases or None, the weights of the norms on the
    attention's and the MLP's outputs or None) and eps (the attention's, the MLP's, the qk-norm's, the two output
    norms'; 0.0 for none), its linears' tensors (weight, scales, bias each), GEMV kinds and groups
    (:class:`LayerGemv`), its query and KV heads, its attention scale, its residual scale (each branch's output times
    it before the residual add; 1.0: none) and its layout (:func:`layer_layout`)."""

    layer: int
    norms: tuple[torch.Tensor | None, ...]
    eps: tuple[float, ...]
    tensors: list[torch.Tensor | None]
    kinds: list[int]
    groups: list[int]
    heads: tuple[int, int]
    scale: float
    residual_scale: float
    layout: tuple[int, int, int, int] | None  # None: the attention half's (decode_attention_half takes no layout)


def layer_layout(block: nn.Module) -> tuple[int, int, int, int]:
    """The block's layout as ``decode_layers`` takes it: its norms' kind (:func:`norm_kind`), its MLP's
    activation (:data:`LAYER_ACTIVATIONS`), 1 for a gated MLP (else plain, act(up)), 1 for a parallel residual."""
    hidden = block.attn_norm.weight.shape[-1]
    return (norm_kind(block.attn_norm, hidden), LAYER_ACTIVATIONS[block.shape.activation], int(block.layout.gated),
            int(block.layout.parallel))


def layer_call(block: nn.Module, rows: int, read=getattr) -> LayerCall | None:
    """The block's part of a ``decode_layers`` call for steps of ``rows`` rows that take calls
    (:func:`step_takes_calls`), or None where it runs its own ops: not chosen by the kernels step, or a linear without a
    native GEMV that takes these rows. The linears are read as they are now (one replaced since the kernels step, say
    by loading a quantized checkpoint into a float engine, gives its own GEMV or None); ``read`` reads attributes
    (:func:`held` in eager steps, ``getattr`` in a compiled step's trace)."""
    if not block.native_layer:
        return None
    call = linears_call(block, LINEARS, rows, read)
    return None if call is None else call._replace(layout=layer_layout(block))


def attention_call(block: nn.Module, rows: int) -> LayerCall | None:
    """The block's part of a ``decode_attention_half`` call (a :class:`LayerCall` of its qkv and o linears) for a step
    of ``rows`` rows that takes calls (:func:`step_takes_calls`), or None where it runs its own ops: not chosen by the
    kernels step (``native_attention_half``), or its qkv or o linear without a native GEMV that takes these rows."""
    if not block.native_attention_half:
        return None
    return linears_call(block, ("qkv", "o"), rows, getattr)


def linears_call(block: nn.Module, names: tuple[str, ...], rows: int, read) -> LayerCall | None:
    """The block's :class:`LayerCall` with its linears ``names``, or None where one runs no native GEMV that takes
    ``rows`` rows."""
    linears = [read(block, name) for name in names]
    gemvs = [layer_gemv(linear) for linear in linears]
    if not all(gemv is not None and rows <= native.MAX_ROWS[gemv.rows] for gemv in gemvs):
        return None
    tensors = [read(linear, name) if name else None for linear, gemv in zip(linears, gemvs) for name in gemv.tensors]
    attn_norm, mlp_norm, qk_norm = read(block, "attn_norm"), read(block, "mlp_norm"), read(block, "qk_norm")
    shape = block.shape
    qk = (read(qk_norm, "weight"), qk_norm.eps) if qk_norm is not None else (None, 0.0)
    outs = [read(block, name) for name in ("attn_out_norm", "mlp_out_norm")]
    norms = (read(attn_norm, "weight"), None if mlp_norm is None else read(mlp_norm, "weight"), qk[0],
             norm_bias(attn_norm, read), norm_bias(mlp_norm, read),
             *(None if norm is None else read(norm, "weight") for norm in outs))
    eps = (attn_norm.eps, 0.0 if mlp_norm is None else mlp_norm.eps, qk[1],
           *(0.0 if norm is None else norm.eps for norm in outs))
    return LayerCall(block.layer_idx, norms, eps,
                     tensors, [gemv.kind for gemv in gemvs], [gemv.group for gemv in gemvs],
                     (shape.n_heads, shape.n_kv_heads), block.scale,
                     1.0 if block.layout.residual_scale is None else block.layout.residual_scale, None)


def norm_bias(norm: nn.Module | None, read=getattr) -> torch.Tensor | None:
    """A LayerNorm's bias (None for none, and for an RMSNorm)."""
    return read(norm, "bias") if isinstance(norm, nn.LayerNorm) and norm.bias is not None else None


def decode_attention_half(call: LayerCall, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          slots: torch.Tensor, mask: torch.Tensor | None, kv_len: int, cos: torch.Tensor | None,
                          sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's attention half for decode rows ``x`` in one native call (its keys and values written into its layer
    of ``keys, values``, the cache, at ``slots``): the rows after the attention's residual add and their MLP norm."""
    return torch.ops.splice_kernels.decode_attention_half(
        x.contiguous(), keys, values, call.layer, slots, mask, kv_len, cos, sin, call.norms, call.eps, call.tensors,
        call.kinds, call.groups, call.heads, call.scale, call.residual_scale)


class ExpertsCall(NamedTuple):
    """What ``experts_decode`` takes of an experts module besides the rows and their routing: the experts the rows
    were routed to (ascending), how many the module has, and each chosen expert's gate_up and down linears' tensors
    (weight, scales, bias each), GEMV kinds and groups, expert by expert."""

    chosen: list[int]
    experts: int
    tensors: list[torch.Tensor | None]
    kinds: list[int]
    groups: list[int]


def experts_call(experts: nn.Module, x: torch.Tensor, index: torch.Tensor) -> ExpertsCall | None:
    """An experts module's part of an ``experts_decode`` call for rows ``x [rows, hidden]`` routed by ``index [rows,
    k]``, or None where its own forward runs: a module of one linear per expert and matrix
    (:func:`~splice.layers.experts.experts_of_linears`), gated by SiLU the way transformers' default gate does it,
    without biases, the chosen experts' linears all on native GEMVs that take these rows, and ``x`` bf16 on CPU."""
    from transformers.integrations.moe import _default_apply_gate

    if not (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
            and x.shape[0] <= max(native.MAX_ROWS.values()) and experts.has_gate and not experts.has_bias
            and isinstance(experts.act_fn, SILU_CLASSES)
            and getattr(type(experts), "_apply_gate", None) is _default_apply_gate):
        return None
    count = len(experts.down_proj)
    chosen = sorted({e for e in index.flatten().tolist() if 0 <= e < count})  # past the last: "none here"
    linears = [linear for e in chosen for linear in (experts.gate_up_proj[e], experts.down_proj[e])]
    gemvs = [layer_gemv(linear) for linear in linears]
    if not all(gemv is not None and x.shape[0] <= native.MAX_ROWS[gemv.rows] for gemv in gemvs):
        return None
    tensors = [getattr(linear, name) if name else None for linear, gemv in zip(linears, gemvs) for name in gemv.tensors]
    return ExpertsCall(chosen, count, tensors, [gemv.kind for gemv in gemvs], [gemv.group for gemv in gemvs])


class HeadCall(NamedTuple):
    """What ``decode_layers`` takes of the model's head when a step's last run ends with it: the final norm's weight,
    its LayerNorm bias (or None), its kind (:func:`norm_kind`) and eps, the lm_head's tensors (weight, scales, bias),
    GEMV kind and int4 group."""

    norm: torch.Tensor
    norm_bias: torch.Tensor | None
    norm_kind: int
    eps: float
    tensors: list[torch.Tensor | None]
    kind: int
    group: int


def head_call(norm: nn.Module | None, lm_head: nn.Module, rows: int, read=getattr) -> HeadCall | None:
    """The head's part of a ``decode_layers`` call for steps of ``rows`` rows (the final norm, then the lm_head), or
    None where it runs its own modules: a final norm the calls do not take (:func:`norm_kind`: RMSNorm with a bf16 or
    float32 weight, torch's LayerNorm with bf16 ones), or an lm_head without a native GEMV that takes these rows (a
    vocab-parallel one, say). ``read`` as for :func:`layer_call`."""
    kind = None if norm is None or getattr(norm, "weight", None) is None else norm_kind(norm, norm.weight.shape[-1])
    if kind is None:
        return None
    gemv = layer_gemv(lm_head)
    if gemv is None or rows > native.MAX_ROWS[gemv.rows]:
        return None
    tensors = [read(lm_head, name) if name else None for name in gemv.tensors]
    return HeadCall(read(norm, "weight"), norm_bias(norm, read), kind, norm.eps, tensors, gemv.kind, gemv.group)


class Registered:
    """A run's unchanging arguments (its blocks' and head's tensors, kinds, heads...) kept by the native library
    (``register_layers``), so that each step hands over only what changes (``decode_registered``): a model's hundreds
    of tensors cost more to pass from Python every step than a small model's layers take to run. Registered at the
    run's first step (which gives the hidden and head sizes they are checked against), released when this object
    goes."""

    def __init__(self):
        self.number: int | None = None
        self.windows: list[int | None] = []  # the step's masks the run takes, by window
        self.ropes: list[int | None] = []  # the step's rotary tables the run takes (None: none)

    def step(self, run: "NativeRun", x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
             masks: dict, kv_len: int, rotary: list) -> torch.Tensor:
        return torch.ops.splice_kernels.decode_registered(
            x.contiguous(), keys, values, self.registered(run, x.shape[-1], keys.shape[-1]), slots,
            [masks[window] for window in self.windows], kv_len, *rotary_rows(rotary, self.ropes))

    def registered(self, run: "NativeRun", hidden: int, head_dim: int) -> int:
        """The run's number with the native library, registering it first (rows of ``hidden``, heads of
        ``head_dim``) where it is not yet."""
        if self.number is None:
            self._register(run, hidden, head_dim)
        return self.number

    def _register(self, run: "NativeRun", hidden: int, head_dim: int) -> None:
        self.windows, self.ropes = list(dict.fromkeys(run.windows)), list(dict.fromkeys(run.ropes))
        number = torch.ops.splice_kernels.register_layers(
            run.layers, run.norms, run.eps, run.tensors, run.kinds, run.groups, run.heads, run.scales, run.layouts,
            *head_arguments(run.head), hidden, head_dim, [self.windows.index(window) for window in run.windows],
            [self.ropes.index(rope) for rope in run.ropes])
        finalizer = weakref.finalize(self, torch.ops.splice_kernels.release_layers, number)
        finalizer.atexit = False  # at exit the process's memory goes anyway
        self.number = number


class NativeRun(NamedTuple):
    """Consecutive blocks that step in one ``decode_layers`` call: each one's window and rotary table (which pick its
    mask and rotary rows at each step), their calls' lists as the op takes them, the model's head where the run
    ends the step with it (the call then returns the logits), and, in an eager step's plan, the run's arguments kept
    by the native library (:class:`Registered`)."""

    windows: list[int | None]
    ropes: list[int | None]
    layers: list[int]
    norms: list[torch.Tensor | None]
    eps: list[float]
    tensors: list[torch.Tensor | None]
    kinds: list[int]
    groups: list[int]
    heads: list[int]
    scales: list[float]
    layouts: list[int]
    head: HeadCall | None = None
    registered: Registered | None = None


def block_rope(block: nn.Module) -> int | None:
    """The rotary table the block's step takes, or None for a block without positions (learned positions added to
    the embeddings, as GPT-2's; Cohere 2's full-attention layers in a rotary model): its call rotates nothing."""
    return block.layout.rope_index if block.layout.rotary else None


def native_run(blocks: list[nn.Module], calls: list[LayerCall]) -> NativeRun:
    return NativeRun([block.window for block in blocks], [block_rope(block) for block in blocks],
                     [call.layer for call in calls], [t for call in calls for t in call.norms],
                     [e for call in calls for e in call.eps], [t for call in calls for t in call.tensors],
                     [k for call in calls for k in call.kinds], [g for call in calls for g in call.groups],
                     [h for call in calls for h in call.heads],
                     [s for call in calls for s in (call.scale, call.residual_scale)],
                     [entry for call in calls for entry in call.layout])


def step_plan(blocks, rows: int, masks: dict, read=getattr, head: HeadCall | None = None) -> list:
    """A decode step's blocks in the order it runs them (``rows`` rows, a step that takes calls): each run of
    consecutive blocks that step in one native call as a :class:`NativeRun`, each other block itself (a float mask,
    ``masks[block.window]``, sends its block to its own ops). ``head`` (:func:`head_call`) joins the last run where
    the last block is in it."""
    plan, run, calls = [], [], []
    for block in blocks:
        mask = masks[block.window]
        call = layer_call(block, rows, read) if mask_takes_calls(mask) else None
        if call is not None:
            run.append(block)
            calls.append(call)
            continue
        if run:
            plan.append(native_run(run, calls))
            run, calls = [], []
        plan.append(block)
    if run:
        plan.append(native_run(run, calls)._replace(head=head))
    return plan


def registered_plan(plan: list) -> list:
    """An eager step's plan with each run's arguments to be kept by the native library from its first step."""
    return [item._replace(registered=Registered()) if isinstance(item, NativeRun) else item for item in plan]


def decode_layers(run: NativeRun, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                  masks: dict, kv_len: int, rotary: list) -> torch.Tensor:
    """The decode step of the blocks of ``run`` on ``x``: each block's keys and values written into its layer of
    ``keys, values [layers, batch, kv_heads, L, head_dim]`` (the cache) at ``slots``, attending under its window's
    mask (``masks``) with its table's rotary rows (``rotary``: cos and sin of each table; empty without rotary);
    returns the last block's hidden states, or with the run's head its logits ``[batch, vocab]`` (``x`` is left as it
    is). A registered run hands over only what changes."""
    if run.registered is not None:
        return run.registered.step(run, x, keys, values, slots, masks, kv_len, rotary)
    return torch.ops.splice_kernels.decode_layers(
        x.contiguous(), keys, values, run.layers, slots, [masks[window] for window in run.windows], kv_len,
        *rotary_rows(rotary, run.ropes), run.norms, run.eps, run.tensors, run.kinds, run.groups, run.heads,
        run.scales, run.layouts, *head_arguments(run.head))


def rotary_rows(rotary: list, tables: list[int | None]) -> tuple[list, list]:
    """The cos and sin lists the ops take for rotary ``tables`` (indices into ``rotary``, each table's (cos, sin)
    rows; None for a table where the blocks take no positions, and each None where the model has no rotary)."""
    rows = [rotary[index] if rotary and index is not None else (None, None) for index in tables]
    return [cos for cos, _ in rows], [sin for _, sin in rows]


def head_arguments(head: HeadCall | None) -> tuple:
    """The ops' head arguments: the final norm's weight and bias and the lm_head's tensors, the norm's eps and kind,
    the GEMV kind and group; an empty list and zeros without a head."""
    if head is None:
        return [], 0.0, 0, 0, 0
    return [head.norm, head.norm_bias, *head.tensors], head.eps, head.norm_kind, head.kind, head.group


def held(module: nn.Module, name: str):
    """``getattr(module, name)`` for a parameter, buffer, submodule or attribute, read from the module's own
    tables."""
    own = module.__dict__
    for table in (own["_parameters"], own["_buffers"], own["_modules"]):
        if name in table:  # registering a name takes it out of the plain attributes: no name is in both
            return table[name]
    return own[name] if name in own else getattr(module, name)
