"""The generic fused transformer block that replaces a model's decoder layers.

It knows nothing about any family's names: ``splice.steps.fuse`` builds it from an architecture record, and the variants
are data (:class:`BlockLayout`): causal or bidirectional (encoder) attention, pre- or post-norm, sequential or parallel
residual (one norm or two), norms on the branch outputs (with or without norms before the branches), gated or plain MLP,
rotary (applied to the first ``rotary_dim`` features; rounded per op, or computed in float32 and rounded once), ALiBi
(exact, or rounded as Falcon's HF model rounds it) or no positions inside the block, q/k/v clamping, the score scale and
soft-capping, branch outputs scaled before their residual adds. A mixture of experts keeps its layer's own MLP module
(``moe``: router, experts, any shared expert), which the block calls where it would compute its MLP. Two entry points
share the same fused code:

* ``forward`` has the Hugging Face decoder-layer interface, so the model's own forward and ``generate`` (any
  option, any HF cache) still run on the injected model;
* ``step`` is splice's native path over a :class:`~splice.layers.kv_cache.StaticKVCache` (decoders only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .. import native
from .kv_cache import StaticKVCache
from .norm import HeadRMSNorm
from .rotary import apply_rotary_, apply_rotary_float_, signed_sin

#: transformers' activation names (``ACT2FN``) -> the function; names of one function differ only in float rounding.
#: The tanh GELU: ``gelu_fast`` writes sqrt(2 / pi) as 0.7978845608 (relative error 4e-12, far below fp32's 6e-8);
#: ``gelu_python``: the exact (erf) GELU written out
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
    "gelu_python_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "relu": F.relu,
}

#: the names Hugging Face decoder layers give their cache argument
CACHE_ARGS = ("cache", "past_key_values", "layer_past", "past_key_value")


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported by the fused block; allowed: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@dataclass(frozen=True)
class BlockShape:
    """Per-rank head counts (after any tensor-parallel split), head size, sliding window and MLP activation."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    window: int | None
    activation: str


@dataclass(frozen=True)
class BlockLayout:
    """How one block computes, beyond its shape (see the module docstring); the defaults are Llama's."""

    causal: bool = True  # False: every position sees every other one the mask leaves visible (encoders)
    parallel: bool = False  # x + attn(n1(x)) + mlp(n2(x)), n2 = n1 when there is no MLP norm
    norm_before: bool = True  # False: x = n1(x + attn(x)); x = n2(x + mlp(x)) (post-norm)
    gated: bool = True  # down(act(gate) * up), else down(act(up))
    rotary: bool = True
    rope_index: int = 0  # which rotary table (Gemma 3: local and global layers differ)
    scale: float | None = None  # None: 1 / sqrt(head_dim)
    softcap: float | None = None  # scores = cap * tanh(scores / cap) before the mask
    alibi_scaled: bool = False  # ALiBi's bias is scaled with the scores (Falcon)
    alibi_bf16: bool = False  # ALiBi's bias rounded to bf16 from each key's position in its row (Falcon's HF model)
    hf_args: tuple[str, ...] = ()  # the HF layer's positional arguments after the hidden states
    hf_returns_tuple: bool = False
    hf_alibi_in_mask: bool = False  # the HF model folds the ALiBi bias into the mask it passes
    hf_window_in_mask: bool = True  # False: the HF model passes a full causal mask to sliding-window layers
    clip_qkv: float | None = None  # q, k and v clamped to [-clip_qkv, clip_qkv] after the qk-norm (OLMo)
    rotary_float: bool = False  # rotary computed in float32, rounded once (OLMo, OLMo 2, Cohere)
    residual_scale: float | None = None  # each branch's output times this before its residual add (Granite)


class SpliceBlock(nn.Module):
    """``x += o(attn(rope(qkv(norm(x)))))``; ``x += down(act(gate) * up)`` (or the layout's variant) with one QKV GEMM
    and one gate+up GEMM.

    ``qkv`` produces ``[q; k; v]``, ``gate_up`` produces ``[gate; up]`` (a plain MLP: its input projection);
    ``o`` and ``down`` are the model's own modules. ``alibi_slopes`` (one per local head) add ALiBi's bias
    (:meth:`alibi`). ``moe``: the layer's own MLP module, called as it is (``gate_up`` and ``down`` are then None).
    ``sinks``: a learned logit per local query head that joins the scores' softmax (GPT-OSS), or None.
    """

    def __init__(self, layer_idx: int, shape: BlockShape, qkv: nn.Module, o: nn.Module, gate_up: nn.Module,
                 down: nn.Module, attn_norm: nn.Module | None, mlp_norm: nn.Module | None,
                 qk_norm: HeadRMSNorm | None = None, layout: BlockLayout = BlockLayout(),
                 attn_out_norm: nn.Module | None = None, mlp_out_norm: nn.Module | None = None,
                 alibi_slopes: torch.Tensor | None = None, moe: nn.Module | None = None,
                 sinks: nn.Parameter | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.shape = shape
        self.layout = layout
        self.window = shape.window
        self.act = activation(shape.activation)
        self.attn_norm, self.qkv, self.qk_norm, self.o = attn_norm, qkv, qk_norm, o
        self.mlp_norm, self.gate_up, self.down, self.moe = mlp_norm, gate_up, down, moe
        self.attn_out_norm, self.mlp_out_norm = attn_out_norm, mlp_out_norm
        self.scale = layout.scale if layout.scale is not None else shape.head_dim ** -0.5
        self.native_attention = False  # decode steps on splice's attention kernel (the kernels step's choice)
        self.native_layer = False  # decode steps in native calls (layers.native_layer; the kernels step's choice)
        # a block whose MLP runs elsewhere (a mixture of experts'): its decode steps' attention half in a native call
        self.native_attention_half = False
        if alibi_slopes is not None:
            self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        else:
            self.alibi_slopes = None
        self.sinks = sinks
        # (positions, dtype) -> (cos, sin), for HF layers that pass no usable cos/sin (set by the fuse step; it must
        # hold no reference to the decode runtime, which would then live as long as the model)
        self.rotary_table = None
        self.is_causal = layout.causal

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """The Hugging Face layer call: HF's cos/sin (or position ids), mask (None: causal, or no mask for an
        encoder) and cache."""
        if len(args) > len(self.layout.hf_args):
            raise TypeError(f"the fused block got {len(args)} positional arguments after the hidden states; its "
                            f"record names {len(self.layout.hf_args)} ({', '.join(self.layout.hf_args) or 'none'})")
        kwargs.update(zip(self.layout.hf_args, args))
        cache = next((kwargs.pop(name) for name in CACHE_ARGS if kwargs.get(name) is not None), None)
        mask = kwargs.pop("attention_mask", None)
        cos, sin = self.hf_rotary(kwargs, hidden_states.dtype)
        x = hidden_states.clone() if self.updates_in_place else hidden_states
        q, k, v, h = self.project(x, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        if isinstance(mask, dict):  # some models hand every layer a mask per layer type
            mask = mask["sliding_attention" if self.window is not None else "full_attention"]
        if self.window is not None and not self.layout.hf_window_in_mask:
            mask = within_window(mask, q.shape[2], k.shape[2], self.window, q.device)
        causal = mask is None and q.shape[2] > 1 and self.layout.causal
        if self.layout.hf_alibi_in_mask:
            mask, bias = self.alibi_from_model_mask(mask, q.shape[2], k.shape[2])
        else:
            bias = self.hf_alibi(mask, q.shape[2], k.shape[2])
        out = self.finish(x, h, self.attend(q, k, v, mask, causal, bias))
        return (out, None) if self.layout.hf_returns_tuple else out

    def hf_rotary(self, kwargs: dict, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """cos and signed sin ``[B, S, 1, rotary_dim]`` for the HF path: the model's own (``rotate_half`` layout), or
        splice's table in ``dtype`` (the hidden states') at ``position_ids`` when the model passes cos/sin of another
        layout (GPT-J)."""
        if not self.layout.rotary:
            return None, None
        if self.rotary_table is not None:
            return self.rotary_table(kwargs["position_ids"], dtype)
        cos, sin = kwargs["position_embeddings"]
        return cos.unsqueeze(2), signed_sin(sin).unsqueeze(2)

    def step(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: StaticKVCache,
             slots: torch.Tensor, mask: torch.Tensor, kv_len: int) -> torch.Tensor:
        """splice's native path: updates ``x`` in place (post-norm: returns a new tensor), keys and values go to
        ``cache`` at ``slots``.

        ``mask`` None means plain causal attention over the first ``kv_len`` slots (an unpadded prompt). A decode step
        of a block whose attention half the kernels step put on a native call (``native_attention_half``) makes that
        call, then its MLP."""
        if self.native_attention_half:
            from .native_layer import attention_call, decode_attention_half, mask_takes_calls, step_takes_calls

            call = attention_call(self, x.shape[0]) if step_takes_calls(x) and mask_takes_calls(mask) else None
            if call is not None:
                if not self.layout.rotary:  # a layer without positions in a rotary model: the call rotates nothing
                    cos = sin = None
                out, h = decode_attention_half(call, x, cache.keys, cache.values, slots, mask, kv_len, cos, sin)
                mlp = self.mlp(h)  # before out.add_ is looked up: a compiled step may resume after the MLP
                return out.add_(mlp)
        q, k, v, h = self.project(x, cos, sin)
        k, v = cache.update(self.layer_idx, k, v, slots, kv_len)
        bias = self.alibi(q.shape[2], kv_len, cache.valid[:, :kv_len], None if mask is None else slots)
        return self.finish(x, h, self.attend(q, k, v, mask, mask is None, bias))

    def project(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """q ``[B, heads, S, D]``, k and v ``[B, kv_heads, S, D]``, rotary applied in place to q and k together; and
        the attention's (normed) input."""
        batch, seq, _ = x.shape
        n_q, n_kv = self.shape.n_heads, self.shape.n_kv_heads
        h = self.attn_norm(x) if self.layout.norm_before and self.attn_norm is not None else x
        qkv = self.qkv(h).view(batch, seq, n_q + 2 * n_kv, self.shape.head_dim)
        qk, v = qkv[:, :, : n_q + n_kv], qkv[:, :, n_q + n_kv:]
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        if self.layout.clip_qkv is not None:
            bound = self.layout.clip_qkv
            qk, v = qk.clamp(-bound, bound), v.clamp(-bound, bound)
        if cos is not None and self.layout.rotary:  # a layer without positions in a rotary model gets its table too
            (apply_rotary_float_ if self.layout.rotary_float else apply_rotary_)(qk, cos, sin)
        q, k = qk[:, :, :n_q], qk[:, :, n_q:]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), h

    def alibi(self, q_len: int, kv_len: int, valid: torch.Tensor | None = None,
              q_slots: torch.Tensor | None = None) -> torch.Tensor | None:
        """ALiBi's bias ``[1 or batch, heads, q_len, kv_len]`` (None without ALiBi) over the first ``kv_len`` slots,
        ``valid [batch, kv_len]`` telling the cache's real-token slots: rounded as Falcon's HF model rounds it
        (``layout.alibi_bf16``: :func:`rounded_alibi_bias`, from ``valid``); else exact, from each key's position in
        its row for queries at ``q_slots`` (``[seq]`` or ``[batch, seq]``: :func:`row_alibi_bias`), or from slots for
        queries at the last ``q_len`` slots (``q_slots`` None: an unpadded prompt, :func:`alibi_bias`)."""
        if self.alibi_slopes is None:
            return None
        if self.layout.alibi_bf16:
            return rounded_alibi_bias(self.alibi_slopes, valid, self.alibi_scale)
        if q_slots is None:
            return alibi_bias(self.alibi_slopes, kv_len, q_len) * self.alibi_scale
        return row_alibi_bias(self.alibi_slopes, valid, q_slots) * self.alibi_scale

    @property
    def alibi_scale(self) -> float:
        """What ALiBi's bias is multiplied by: the score scale where the family scales it with the scores (Falcon)."""
        return self.scale if self.layout.alibi_scaled else 1.0

    def hf_alibi(self, mask: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor | None:
        """ALiBi's bias for the HF path (:meth:`alibi`), each key's position in its row read from the HF model's
        4-D ``mask`` (boolean, or float with masked entries at the dtype's minimum or -inf): its last query sees the
        row's real keys. None: no padding (positions are slots)."""
        if self.alibi_slopes is None or mask is None:
            return self.alibi(q_len, kv_len)
        visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        visible = visible[:, 0, -q_len:, :kv_len]  # [batch, q_len, kv_len]
        keys = visible[:, -1].long().cumsum(-1) - 1
        queries = visible.sum(-1) - 1  # each query's own position: the real keys it sees, itself included
        return positions_alibi_bias(self.alibi_slopes, keys, queries) * self.alibi_scale

    def alibi_from_model_mask(self, mask: torch.Tensor | None, q_len: int,
                              kv_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(mask, bias) for a model that folds ALiBi's bias into the mask it passes (Falcon): that mask as it is when
        it holds this block's heads; when it holds the whole model's heads and the block a tensor-parallel share of
        them, which keys each row sees (read from the mask) and the bias of the block's own heads from its slopes,
        computed as the native path computes it (:meth:`alibi`)."""
        if mask is None or mask.dim() != 4 or mask.shape[1] in (1, self.shape.n_heads):
            return mask, None
        visible = mask[:, :1] if mask.dtype == torch.bool else mask[:, :1] > torch.finfo(mask.dtype).min / 2
        if self.layout.alibi_bf16:
            return visible, rounded_alibi_bias(self.alibi_slopes, visible[:, 0, -1, :kv_len], self.alibi_scale)
        return visible, self.hf_alibi(visible, q_len, kv_len)

    def attend(self, q, k, v, mask, causal: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q`` over ``k, v`` under ``mask`` (None: causal where ``causal``, else none), ``bias``
        (ALiBi's, :meth:`alibi`) added to the scores."""
        if self.native_attention and self.takes_native_attention(q, k, mask, bias):
            if self.sinks is not None:
                out = torch.ops.splice_kernels.decode_attention_sinks(q, k, v, mask, self.scale, self.sink_logits())
            else:
                out = torch.ops.splice_kernels.decode_attention(q, k, v, mask, self.scale)
            return out.transpose(1, 2).flatten(2)
        if self.sinks is not None:
            mask = additive_mask(mask, q.shape[2], k.shape[2], q.dtype, q.device, causal)
            return attend_with_sinks(q, k, v, mask, self.scale, self.sinks).transpose(1, 2).flatten(2)
        if mask is not None and q.shape[2] == 1 and torch.compiler.is_compiling():
            return attend_one_query(q, k, v, mask, self.scale, bias, self.layout.softcap).transpose(1, 2).flatten(2)
        if bias is not None or self.layout.softcap is not None:
            mask = additive_mask(mask, q.shape[2], k.shape[2], q.dtype, q.device, causal)
            if bias is not None:
                mask = mask + bias.to(mask.dtype)
            causal = False
        if self.layout.softcap is not None:
            out = attend_capped(q, k, v, mask, self.scale, self.layout.softcap)
        else:
            gqa = self.shape.n_heads != self.shape.n_kv_heads
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa,
                                                 scale=self.scale)
        return out.transpose(1, 2).flatten(2)

    def takes_native_attention(self, q, k, mask, bias) -> bool:
        """Whether splice's attention kernel computes this call: one query per row, a boolean mask or none, no ALiBi
        bias or soft-capping, and shapes and dtypes it takes (``native.attention_fits``)."""
        return (bias is None and self.layout.softcap is None and (mask is None or mask.dtype == torch.bool)
                and native.attention_fits(q, k))

    def sink_logits(self) -> torch.Tensor | None:
        """The attention sinks as the native attention takes them (float32, contiguous), or None."""
        return None if self.sinks is None else self.sinks.detach().float().contiguous()

    @property
    def updates_in_place(self) -> bool:
        """Whether :meth:`finish` adds into ``x`` itself (pre-norm, parallel); post-norm leaves ``x`` as it was."""
        return self.layout.norm_before or self.layout.parallel

    def finish(self, x: torch.Tensor, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual adds around the MLP: in place on ``x``, or (post-norm) into the new tensors the norms take."""
        out = self.o(attn)
        if self.attn_out_norm is not None:
            out = self.attn_out_norm(out)
        if self.layout.residual_scale is not None:
            out = out * self.layout.residual_scale
        if self.layout.parallel:
            mlp = self.mlp(h if self.mlp_norm is None else self.mlp_norm(x))
            return x.add_(out).add_(mlp)
        if not self.layout.norm_before:
            x = self.attn_norm(x + out)
            return self.mlp_norm(x + self.mlp(x))
        x.add_(out)
        # before x.add_ is looked up: a compiled step may resume after the MLP
        mlp = self.mlp(x if self.mlp_norm is None else self.mlp_norm(x))
        return x.add_(mlp)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            out = self.moe(h)
            out = out[0] if isinstance(out, tuple) else out  # GPT-OSS's MLP returns its router scores too
        elif self.layout.gated:
            gate, up = self.gate_up(h).chunk(2, dim=-1)
            out = self.down(self.act(gate).mul_(up))
        else:
            out = self.down(self.act(self.gate_up(h)))
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm(out)
        return out if self.layout.residual_scale is None else out * self.layout.residual_scale


def additive_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, dtype, device,
                  causal: bool = True) -> torch.Tensor:
    """A float mask (0 where visible, -inf elsewhere) from a boolean or float mask; when None, causal (the queries
    being the last ``q_len`` of ``kv_len`` positions) or, with ``causal`` False, all visible."""
    if mask is None and not causal:
        return torch.zeros(1, 1, q_len, kv_len, dtype=dtype, device=device)
    if mask is None:
        rows = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
        mask = torch.arange(kv_len, device=device)[None, :] <= rows
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def has_fused_blocks(model: nn.Module) -> bool:
    """Whether kernel injection has replaced ``model``'s layers by fused blocks."""
    return any(isinstance(module, SpliceBlock) for module in model.modules())


def within_window(mask: torch.Tensor | None, q_len: int, kv_len: int, window: int, device) -> torch.Tensor:
    """``mask`` (boolean, float or None for causal) restricted to the last ``window`` positions of each query, the
    queries being the last ``q_len`` of ``kv_len`` positions."""
    rows = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    keys = torch.arange(kv_len, device=device)[None, :]
    visible = (keys > rows - window) & (keys <= rows)
    if mask is None:
        return visible
    if mask.dtype == torch.bool:
        return mask & visible
    return mask.masked_fill(~visible, float("-inf"))


def alibi_bias(slopes: torch.Tensor, kv_len: int, q_len: int = 1) -> torch.Tensor:
    """ALiBi's bias ``[1, heads, q_len, kv_len]`` as BLOOM's HF model computes it (in fp32): each head's slope times
    the key's slot less the query's (the queries being the last ``q_len`` of ``kv_len`` slots). A constant shift per
    query row leaves the softmax unchanged, so slots serve as positions even in a left-padded row; measured from the
    query, the bias is small where attention is sharpest, so it keeps its precision there once rounded to a 16-bit
    mask (from slot 0 it would reach ``slope * kv_len``, which bf16 rounds by units at a few thousand slots)."""
    keys = torch.arange(kv_len, device=slopes.device, dtype=torch.float32)
    queries = torch.arange(kv_len - q_len, kv_len, device=slopes.device, dtype=torch.float32)
    return (slopes[:, None, None] * (keys[None, :] - queries[:, None]))[None]


def row_alibi_bias(slopes: torch.Tensor, valid: torch.Tensor, q_slots: torch.Tensor) -> torch.Tensor:
    """ALiBi's bias ``[batch, heads, seq, kv_len]`` as BLOOM's HF model computes it (in fp32) over a cache's real-token
    slots ``valid [batch, kv_len]``, for queries at ``q_slots`` (``[seq]``, or ``[batch, seq]`` per row): each key's
    position is its count of real tokens before it in its row, so a right-padded row's new tokens, which follow its
    pad slots, sit right after its last real token (:func:`positions_alibi_bias`)."""
    keys = valid.long().cumsum(-1) - 1
    queries = keys[:, q_slots] if q_slots.dim() == 1 else keys.gather(1, q_slots)
    return positions_alibi_bias(slopes, keys, queries)


def positions_alibi_bias(slopes: torch.Tensor, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``slopes [heads]`` times each key's position ``keys [batch, kv_len]`` less the query's ``queries [batch, seq]``:
    ``[batch, heads, seq, kv_len]`` in fp32. A constant shift per query leaves the softmax as BLOOM's (slope times the
    key's position), and measured from the query's own position the bias keeps its precision where attention is
    sharpest once rounded to a 16-bit mask (see :func:`alibi_bias`)."""
    offsets = (keys[:, None, :] - queries[:, :, None]).float()
    return slopes.float()[None, :, None, None] * offsets[:, None]


def rounded_alibi_bias(slopes: torch.Tensor, valid: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """ALiBi's bias ``[batch, heads, 1, kv_len]`` as Falcon's HF model builds it, over a cache's real-token slots
    ``valid [batch, kv_len]``: each head's slope times each key's position in its row (its count of real tokens before
    it), the slope, the position and their product each rounded to bf16 as HF's bf16 product rounds them, whatever the
    model's dtype; then times ``scale``.

    Rounded, the bias is no function of slot differences, so positions are counted per row (a left-padded row's from
    its first real token) and the bias is kept as HF's mask holds it, unshifted: its values are then those of a bf16
    tensor times ``scale``, which a 16-bit mask holds as they are."""
    positions = bf16_rounded((valid.cumsum(-1) - 1).float())
    bias = bf16_rounded(bf16_rounded(slopes.float())[None, :, None] * positions[:, None, :])
    return bias[:, :, None] * scale


def bf16_rounded(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), as fp32: in integer ops on its bits, since a compiled
    graph computes ``x.bfloat16().float()`` (or a bf16 product) in fp32 and drops the rounding."""
    bits = x.view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).view(torch.float32)


#: The most score elements (batch x heads x queries x keys) the attention functions that form every score (soft-capped,
#: with sinks) hold at once: a longer prompt's queries go in chunks, so its memory grows with its length, not with the
#: square of it. Each query's softmax is its own, so the chunks give the same rows (up to the float rounding of a
#: matmul of fewer rows).
SCORE_ELEMENTS = 1 << 25


def by_query_chunks(attend_rows, q, k, v, mask: torch.Tensor) -> torch.Tensor:
    """``attend_rows(q, k, v, mask)`` for query chunks of ``q [B, H, L, D]`` (and the rows of ``mask`` that go with
    them) holding at most :data:`SCORE_ELEMENTS` scores each, joined along the queries; K/V repeated for every query
    head once, before."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    rows = max(1, SCORE_ELEMENTS // (q.shape[0] * q.shape[1] * k.shape[2]))
    if rows >= q.shape[2]:
        return attend_rows(q, k, v, mask)
    mask_rows = (lambda first: mask[..., first:first + rows, :]) if mask.shape[-2] > 1 else (lambda first: mask)
    return torch.cat([attend_rows(q[:, :, first:first + rows], k, v, mask_rows(first))
                      for first in range(0, q.shape[2], rows)], dim=2)


def attend_capped(q, k, v, mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Attention with the scores soft-capped (``cap * tanh(s / cap)``) before the mask, softmax in fp32 (Gemma 2);
    queries in chunks (:func:`by_query_chunks`)."""
    def capped(q, k, v, mask):
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap + mask
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)

    return by_query_chunks(capped, q, k, v, mask)


def attend_with_sinks(q, k, v, mask: torch.Tensor, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax also takes one learned logit per query head (``sinks``), which takes its share of the
    probability and adds no value (GPT-OSS's attention sinks), in the model's dtype as its eager attention computes it:
    the scores plus the additive ``mask``, the sink joined, the row's maximum taken off, softmax, the sink dropped;
    queries in chunks (:func:`by_query_chunks`)."""
    def with_sinks(q, k, v, mask):
        scores = torch.matmul(q, k.transpose(2, 3)) * scale + mask
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(-1, dtype=logits.dtype)[..., :-1]
        return torch.matmul(probs.to(v.dtype), v)

    return by_query_chunks(with_sinks, q, k, v, mask)


def attend_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None,
                     bias: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """SDPA for one query position (``q [B, H, 1, D]``, ``k, v [B, KV, L, D]``, boolean ``mask [B, 1, 1, L]``, ALiBi's
    ``bias [1 or B, H, 1, L]``) in plain ops, float32 throughout, query heads grouped by their KV head (no K/V
    copies). The products are written as broadcast multiplies and sums, not matmuls, so inductor fuses each into one
    loop of its own.

    The compiled decode step uses it: the flash-attention kernel inductor would otherwise call costs ~55 us per layer
    in fixed overhead for a single query, two batched matmuls ~24 us (SmolLM2-135M, 2 cores).
    """
    batch, heads, _, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    scale = dim ** -0.5 if scale is None else scale
    scores = (grouped[:, :, :, None, :] * k.float()[:, :, None]).sum(-1) * scale  # [B, KV, G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.float().reshape(-1, kv_heads, heads // kv_heads, length)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = (probs[..., None] * v.float()[:, :, None]).sum(-2)  # [B, KV, G, D]
    return out.to(q.dtype).reshape(batch, heads, 1, dim)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (the geometric series of the paper, interleaved for a head count not a power of 2)."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** power for power in range(1, closest + 1)]
    if closest != n_heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** power for power in range(1, 1 + 2 * min(closest, n_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)
