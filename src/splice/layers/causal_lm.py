"""splice's native causal-LM path over the injected model: embedding -> fused blocks -> final norm -> lm_head.

It holds the model's own modules (registered in the model, so moving the model moves them) and reads their tensors at
call time; it owns only derived tables (rotary) and the KV cache it is asked to build.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..arch.record import ModelDims
from .block import SpliceBlock
from .kv_cache import StaticKVCache
from .norm import RMSNorm
from .rotary import RopeTable, build_table


class SpliceCausalLM:
    """``forward(tokens, positions, slots, cache, kv_len)`` returns the logits of the last position (or all).

    The embedding and the lm_head are called as modules: under tensor parallelism they are vocab-parallel (the
    embedding sums its rows over the group, the lm_head all-gathers), so every rank gets the full logits."""

    def __init__(self, config: Any, dims: ModelDims, embed: nn.Embedding, blocks: nn.ModuleList, norm: RMSNorm,
                 lm_head: nn.Module, embed_scale: bool, max_len: int):
        self.config = config  # read only (rope types that need transformers' own init functions)
        self.dims = dims
        self.embed, self.blocks, self.norm, self.lm_head = embed, blocks, norm, lm_head
        # the family scales its embeddings: here, unless the embedding module does it itself (Gemma in transformers 5)
        scales_itself = getattr(embed, "embed_scale", None) is not None
        self.embed_scale = math.sqrt(dims.hidden) if embed_scale and not scales_itself else None
        self.max_len = max_len
        self.windows = sorted({block.window for block in blocks}, key=lambda w: -1 if w is None else w)
        self._rope: RopeTable | None = None
        self._compiled_step = None
        self._compiled_keys: set[tuple] = set()  # (batch, dtype, device) the compiled step has run with
        self._cache: StaticKVCache | None = None

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def rope(self) -> RopeTable:
        """The rotary table for ``max_len`` positions on the model's device and dtype (built once)."""
        table = self._rope
        if table is None or table.cos.device != self.device or table.cos.dtype != self.dtype:
            table = build_table(self.dims.rope, self.config, self.dims.head_dim, self.max_len, self.dtype, self.device)
            self._rope = table
        return table

    def new_cache(self, batch: int) -> StaticKVCache:
        block = self.blocks[0].shape
        return StaticKVCache(len(self.blocks), batch, block.n_kv_heads, self.max_len, block.head_dim, self.dtype,
                             self.device)

    def cache_for(self, batch: int) -> StaticKVCache:
        """The KV cache for ``batch`` rows, kept between requests of the same batch size (a compiled step keeps its
        graph); its stale contents are never attended to, as ``start`` marks every slot empty."""
        cache = self._cache
        if cache is None or cache.batch != batch or cache.keys.device != self.device or cache.keys.dtype != self.dtype:
            self._cache = None  # release the old buffers before allocating the new ones
            cache = self._cache = self.new_cache(batch)
        return cache

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: StaticKVCache,
                kv_len: int, last_only: bool = True, dense: bool = False) -> torch.Tensor:
        """``tokens, positions [batch, seq]`` at cache ``slots [seq]``; attends to the first ``kv_len`` slots.

        ``dense``: a prompt without padding filling slots ``0 .. kv_len-1``, so full-attention layers need no mask
        (SDPA's causal kernel).
        """
        x = self.embed_tokens(tokens)
        cos, sin = self.rope().lookup(positions)
        masks = {window: None if dense and window is None else cache.mask(slots, kv_len, window)
                 for window in self.windows}
        for block in self.blocks:
            x = block.step(x, cos, sin, cache, slots, masks[block.window], kv_len)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.norm(x))
        return logits[:, -1] if last_only else logits

    __call__ = forward

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, cache: StaticKVCache,
                    kv_len: int) -> torch.Tensor:
        """One new token per row (``tokens, positions [batch, 1]`` at ``slot [1]``): the only step worth compiling."""
        if self._compiled_step is None:
            return self.forward(tokens, positions, slot, cache, kv_len)
        # static shapes: attend over the whole cache, the mask hides the rest
        key = (tokens.shape[0], self.dtype, self.device)
        if key not in self._compiled_keys or not hasattr(torch.compiler, "set_stance"):
            logits = self._compiled_step(tokens, positions, slot, cache, self.max_len)
            self._compiled_keys.add(key)
            return logits
        # a graph for this batch, dtype and device exists: check only the guards that tell graphs apart (evaluating
        # every guard on every parameter costs ~1 ms a step on SmolLM2-135M, 2 cores). Inputs no graph fits (say,
        # tensors made outside inference mode) are refused before anything runs; they then take the full check.
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._compiled_step(tokens, positions, slot, cache, self.max_len)
        except RuntimeError as error:
            if "Recompilation triggered" not in str(error):
                raise
        return self._compiled_step(tokens, positions, slot, cache, self.max_len)

    def compile_decode(self, **options) -> None:
        """Compile the decode step with ``torch.compile`` (opt-in: compiling takes tens of seconds on a small CPU).

        oneDNN-packed linears run inside the graph as the ``splice::packed_linear`` custom op (``layers.compiled``)."""
        self.rope()
        self._compiled_step = torch.compile(self.forward, dynamic=False, **options)
        self._compiled_keys = set()

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Through the embedding module itself: a vocab-parallel one looks up its rows and sums over the group."""
        x = self.embed(tokens)
        if self.embed_scale is not None:
            x.mul_(torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype))
        return x
