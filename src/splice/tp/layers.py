"""Parallel layers. Each holds only its rank's shard and does its own communication through the ParallelContext.

Quantization contract ("shard first, then quantize"): a column-parallel linear is a plain ``nn.Linear`` with fewer
outputs; :class:`RowParallelLinear` and :class:`VocabParallelLinear` wrap an inner plain ``nn.Linear`` (``.linear``,
without bias) and keep their collective and bias *outside* it. A quantizer may replace any ``nn.Linear`` — including
``.linear`` inside these wrappers — with its own module of the same call signature, and the all-reduce / all-gather
stays in place.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..distributed import ParallelContext


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard @ W_shard^T) + b``: the input features are split over the group."""

    def __init__(self, linear: nn.Linear, bias: nn.Parameter | None, ctx: ParallelContext):
        super().__init__()
        self.linear, self.bias, self.ctx = linear, bias, ctx

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def weight(self) -> torch.Tensor | None:
        """The inner linear's weight (this rank's input columns), for model code that reads it to pick a dtype (T5's
        feed-forward casts its input to ``wo.weight.dtype``); None when a quantizer's module holds no ``weight``."""
        return getattr(self.linear, "weight", None)

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"rank={self.ctx.rank}/{self.ctx.world_size}, bias={self.bias is not None}"


class VocabParallelLinear(nn.Module):
    """An lm_head split by vocabulary rows; the logits are all-gathered so every rank has all of them."""

    def __init__(self, linear: nn.Linear, sizes: list[int], ctx: ParallelContext):
        super().__init__()
        self.linear, self.sizes, self.ctx = linear, list(sizes), ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_gather_last(self.linear(x), self.sizes)

    def extra_repr(self) -> str:
        return f"vocab={sum(self.sizes)}, rows per rank={self.sizes}"


class VocabParallelEmbedding(nn.Module):
    """An embedding split by vocabulary rows ``start:stop``; ids elsewhere give zeros, then the group sums.

    ``embedding`` is the original embedding module (its own class) holding only this rank's rows, and the lookup
    calls *its* forward, so whatever that forward does to a row — Gemma's ``GemmaTextScaledWordEmbedding`` multiplies
    by ``sqrt(hidden)`` in transformers 5 — happens exactly as in the unsharded model, with no knowledge of the
    class. This is exact for any forward that maps each id to a function of its own row (lookup, then scale, offset
    or cast): every id is owned by one rank, the others contribute zeros. Its attributes stay readable through the
    wrapper where code inspects the embedding module (``weight``, ``embed_scale``).
    """

    def __init__(self, embedding: nn.Embedding, start: int, num_embeddings: int, ctx: ParallelContext):
        super().__init__()
        self.embedding, self.start, self.num_embeddings, self.ctx = embedding, start, num_embeddings, ctx
        self.embedding_dim = embedding.weight.shape[1]

    @property
    def weight(self) -> nn.Parameter:
        """This rank's rows (the tensor a tied lm_head shares)."""
        return self.embedding.weight

    @property
    def embed_scale(self):
        """The wrapped embedding's own ``embed_scale`` (None if it has none): a reader that would otherwise scale
        the embeddings itself (splice's native path) sees that the module already does."""
        return getattr(self.embedding, "embed_scale", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = self.embedding(local.masked_fill(outside, 0))
        return self.ctx.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))

    def extra_repr(self) -> str:
        stop = self.start + self.weight.shape[0]
        return f"rows {self.start}:{stop} of {self.num_embeddings}, dim={self.embedding_dim}"


def local_embedding(module: nn.Embedding, weight: torch.Tensor, start: int) -> nn.Embedding:
    """A shallow copy of ``module`` (same class, same buffers and settings) holding ``weight``, the rows from
    ``start`` on (all its columns, or a rank's per-head columns); its ``padding_idx`` is renumbered to the local rows
    (None when another rank owns it)."""
    local = copy.copy(module)
    local._parameters, local._buffers, local._modules = (dict(module._parameters), dict(module._buffers),
                                                          dict(module._modules))
    local._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    local.weight = _param(weight)
    local.num_embeddings, local.embedding_dim = weight.shape
    pad = module.padding_idx
    local.padding_idx = pad - start if pad is not None and start <= pad < start + weight.shape[0] else None
    return local


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding exactly these tensors (no copy, no initialisation)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = _param(weight)
    if bias is not None:
        linear.bias = _param(bias)
    return linear


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
