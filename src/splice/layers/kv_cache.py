"""The static KV cache: preallocated buffers written in place at slot indices."""
from __future__ import annotations

import torch
from torch import nn

from ..native.memory import zeros_on_huge_pages


class StaticKVCache(nn.Module):
    """Keys and values ``[layers, batch, kv_heads, max_len, head_dim]`` and which slots hold real (non-pad) tokens.

    A slot is a column of the (left-padded) batch: the prompt fills slots ``0 .. L-1`` and each new token the next
    one. Nothing is concatenated or reallocated while generating.

    Slots given as ``[batch, seq]`` (rather than ``[seq]``) are per row: each row writes and attends at its own
    slots, so rows of different lengths step together (the serving scheduler's continuous batch). :meth:`rows` views
    a range of rows as a cache of its own, sharing the storage.
    """

    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (n_layers, batch, kv_heads, max_len, head_dim)
        for name in ("keys", "values"):
            buffer = zeros_on_huge_pages(shape, dtype) if torch.device(device or "cpu").type == "cpu" else \
                torch.zeros(shape, dtype=dtype, device=device)
            self.register_buffer(name, buffer, persistent=False)
        self.register_buffer("valid", torch.zeros(batch, max_len, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("slot_ids", torch.arange(max_len, device=device), persistent=False)
        self.filled = 0  # until start() reads the prompt's mask
        self._per_layer()

    def _per_layer(self) -> None:
        self._keys, self._values = self.keys.unbind(0), self.values.unbind(0)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._per_layer()
        return self

    def rows(self, start: int, stop: int) -> "StaticKVCache":
        """Rows ``start .. stop-1`` as a cache sharing this one's storage (writes through it land here)."""
        view = StaticKVCache.__new__(StaticKVCache)
        nn.Module.__init__(view)
        for name in ("keys", "values"):
            view.register_buffer(name, getattr(self, name)[:, start:stop], persistent=False)
        view.register_buffer("valid", self.valid[start:stop], persistent=False)
        view.register_buffer("slot_ids", self.slot_ids, persistent=False)
        view.filled = 0
        view._per_layer()
        return view

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def start(self, prompt_mask: torch.Tensor) -> None:
        """Forget everything; mark the prompt's real tokens (``prompt_mask [batch, L]``, 1 = token, 0 = pad)."""
        self.valid.zero_()
        self.valid[:, : prompt_mask.shape[1]] = prompt_mask.bool()
        # on CPU, the slots known to hold real tokens in every row from the first on (read on a GPU, the mask would
        # wait for the device)
        self.filled = prompt_mask.shape[1] if self.valid.device.type == "cpu" and bool(prompt_mask.all()) else 0

    def mark(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` as holding real tokens (the tokens being generated), without a host sync."""
        self.valid.index_fill_(1, slots, True)
        if self.filled and slots.dim() == 1 and slots.numel() == 1 and int(slots) == self.filled:
            self.filled += 1

    def sees_all(self, q_slots: torch.Tensor, kv_len: int, window: int | None = None) -> bool:
        """Whether one query a row at ``q_slots`` sees every one of the first ``kv_len`` slots, so that its step
        needs no mask: one slot shared by the rows, the last of them, every slot before it known to hold a real token
        in every row (a CPU cache whose prompt had no pad, each new slot marked in turn), and ``kv_len`` within
        ``window``. A decode step without padding; False where not known (a GPU cache, rows of their own slots, a view
        of some rows)."""
        return (0 < kv_len <= self.filled and q_slots.dim() == 1 and q_slots.numel() == 1
                and int(q_slots) == kv_len - 1 and (window is None or kv_len <= window))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_len: int):
        """Write ``k, v [batch, kv_heads, seq, head_dim]`` at ``slots`` (``[seq]``, or ``[batch, seq]`` per row); return
        the first ``kv_len`` slots."""
        keys, values = self._keys[layer], self._values[layer]
        if slots.dim() == 2:
            index = slots[:, None, :, None].expand_as(k)
            keys.scatter_(2, index, k)
            values.scatter_(2, index, v)
        else:
            keys.index_copy_(2, slots, k)
            values.index_copy_(2, slots, v)
        return keys[:, :, :kv_len], values[:, :, :kv_len]

    def mask(self, q_slots: torch.Tensor, kv_len: int, window: int | None = None) -> torch.Tensor:
        """Boolean attention mask ``[batch, 1, seq, kv_len]`` for queries at ``q_slots`` (``[seq]``, or ``[batch, seq]``
        per row): causal, real tokens only, within ``window``.

        A pad query sees the real tokens before it, as Hugging Face's mask lets it (a right-padded row's first new
        token comes from its last pad's query); one with no real token to see (a left pad) sees its own slot, so no
        row is empty (no NaN in the cache).
        """
        k_slots = self.slot_ids[:kv_len]
        q = q_slots[:, None, :, None] if q_slots.dim() == 2 else q_slots[:, None]
        visible = (k_slots <= q) & self.valid[:, None, None, :kv_len]
        if window is not None:
            visible &= k_slots > q - window
        return visible | ((k_slots == q) & ~visible.any(-1, keepdim=True))
