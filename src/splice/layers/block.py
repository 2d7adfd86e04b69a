"""The generic fused transformer block (pre-norm attention + gated MLP) that replaces a model's decoder layers.

It knows nothing about any family's names: ``splice.steps.fuse`` builds it from an architecture record.
Two entry points share the same fused code:

* ``forward`` has the Hugging Face decoder-layer interface, so the model's own forward and ``generate`` (any
  option, any HF cache) still run on the injected model;
* ``step`` is splice's native path over a :class:`~splice.layers.kv_cache.StaticKVCache`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import StaticKVCache
from .norm import HeadRMSNorm, RMSNorm
from .rotary import apply_rotary_, signed_sin

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


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


class SpliceBlock(nn.Module):
    """``x += o(attn(rope(qkv(norm(x)))))``; ``x += down(act(gate) * up)`` with one QKV GEMM and one gate+up GEMM.

    ``qkv`` produces ``[q; k; v]``, ``gate_up`` produces ``[gate; up]``; ``o`` and ``down`` are the model's own modules.
    """

    def __init__(self, layer_idx: int, shape: BlockShape, qkv: nn.Module, o: nn.Module, gate_up: nn.Module,
                 down: nn.Module, attn_norm: RMSNorm, mlp_norm: RMSNorm, qk_norm: HeadRMSNorm | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.shape = shape
        self.window = shape.window
        self.act = activation(shape.activation)
        self.attn_norm, self.qkv, self.qk_norm, self.o = attn_norm, qkv, qk_norm, o
        self.mlp_norm, self.gate_up, self.down = mlp_norm, gate_up, down
        self.is_causal = True

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, cache=None,
                past_key_values=None, **kwargs) -> torch.Tensor:
        """The Hugging Face decoder-layer call: HF's cos/sin, mask (None means causal) and cache object."""
        cache = cache if cache is not None else past_key_values
        cos, sin = position_embeddings
        x = hidden_states.clone()
        q, k, v = self.project(x, cos.unsqueeze(2), signed_sin(sin).unsqueeze(2))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        causal = attention_mask is None and q.shape[2] > 1
        return self.finish(x, self.attend(q, k, v, attention_mask, causal))

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache, slots: torch.Tensor,
             mask: torch.Tensor, kv_len: int) -> torch.Tensor:
        """splice's native path: updates ``x`` in place, keys and values go to ``cache`` at ``slots``.

        ``mask`` None means plain causal attention over the first ``kv_len`` slots (an unpadded prompt)."""
        q, k, v = self.project(x, cos, sin)
        k, v = cache.update(self.layer_idx, k, v, slots, kv_len)
        return self.finish(x, self.attend(q, k, v, mask, mask is None))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q ``[B, heads, S, D]``, k and v ``[B, kv_heads, S, D]``, rotary applied in place to q and k together."""
        batch, seq, _ = x.shape
        n_q, n_kv = self.shape.n_heads, self.shape.n_kv_heads
        qkv = self.qkv(self.attn_norm(x)).view(batch, seq, n_q + 2 * n_kv, self.shape.head_dim)
        qk = qkv[:, :, : n_q + n_kv]
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        apply_rotary_(qk, cos, sin)
        return qk[:, :, :n_q].transpose(1, 2), qk[:, :, n_q:].transpose(1, 2), qkv[:, :, n_q + n_kv:].transpose(1, 2)

    def attend(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        if mask is not None and q.shape[2] == 1 and torch.compiler.is_compiling():
            return attend_one_query(q, k, v, mask).transpose(1, 2).flatten(2)
        gqa = self.shape.n_heads != self.shape.n_kv_heads
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
        return out.transpose(1, 2).flatten(2)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual adds (in place on ``x``) and the gated MLP."""
        x.add_(self.o(attn))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x.add_(self.down(self.act(gate).mul_(up)))
        return x


def attend_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA for one query position (``q [B, H, 1, D]``, ``k, v [B, KV, L, D]``, boolean ``mask [B, 1, 1, L]``) in
    plain ops, float32 throughout, query heads grouped by their KV head (no K/V copies). The products are written as
    broadcast multiplies and sums, not matmuls, so inductor fuses each into one loop of its own.

    The compiled decode step uses it: the flash-attention kernel inductor would otherwise call costs ~55 us per layer
    in fixed overhead for a single query, two batched matmuls ~24 us (SmolLM2-135M, 2 cores).
    """
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    scores = (grouped[:, :, :, None, :] * k.float()[:, :, None]).sum(-1) * dim ** -0.5  # [B, KV, G, L]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = (probs[..., None] * v.float()[:, :, None]).sum(-2)  # [B, KV, G, D]
    return out.to(q.dtype).reshape(batch, heads, 1, dim)
