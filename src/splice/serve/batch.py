"""The model side of continuous batching: one KV cache of ``max_batch`` rows, one row per running request.

A request's prompt fills slots ``0 .. L-1`` of its row (no left padding) and each new token the next slot, so a row's
position equals its slot. Running requests keep rows ``0 .. n-1``: a request that leaves hands its row to the last
running one (its filled slots are copied), and the batched decode step runs on the contiguous rows ``[:n]`` with
per-row slots. The operations are plain data in, logits out, so under tensor parallelism every rank replays rank 0's
:class:`StepPlan` and runs the same collectives in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.causal_lm import SpliceCausalLM
from ..layers.kv_cache import StaticKVCache
from ..machine import free_bytes


@dataclass(frozen=True)
class Move:
    """Copy the first ``filled`` slots of row ``source`` into row ``target`` (every layer)."""

    source: int
    target: int
    filled: int


@dataclass(frozen=True)
class StepPlan:
    """What one scheduler iteration does to the cache, in this order: ``moves`` (compacting the running rows), each
    prompt chunk of ``prefills`` ``(row, first slot, token ids)`` on its row (up to ``prefill_batch`` consecutive
    chunks from slot 0 on consecutive rows in one forward, :func:`prefill_groups`), then one decode step feeding
    ``step_tokens[i]`` at slot ``step_slots[i]`` of row ``i``; ``stop`` ends a following rank. The prompts' rows lie
    past the stepping rows, so the order is free: prompts go first so that a new request's first token does not wait
    for a decode step. Plain data, so it crosses ranks by ``broadcast_object``."""

    moves: tuple[Move, ...] = ()
    step_tokens: tuple[int, ...] = ()
    step_slots: tuple[int, ...] = ()
    prefills: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    prefill_batch: int = 1
    stop: bool = False
    max_batch: int = 0  # the scheduler's, so a following rank builds the same cache

    @property
    def idle(self) -> bool:
        return not (self.moves or self.step_tokens or self.prefills or self.stop)


@dataclass
class StepLogits:
    """fp32 logits a plan produced: ``step [n, vocab]`` for the decode step's rows, ``prefills[i] [vocab]`` at the
    last token of each prompt chunk (``None`` where it raised; ``prefill_errors[i]`` holds the exception)."""

    step: torch.Tensor | None = None
    prefills: list = field(default_factory=list)
    prefill_errors: list = field(default_factory=list)


def prefill_groups(prefills: tuple[tuple[int, int, tuple[int, ...]], ...], most: int) -> list[range]:
    """The indices of ``prefills`` that run in one forward each: consecutive chunks from slot 0 on consecutive rows,
    at most ``most`` together; any other chunk alone."""
    groups: list[range] = []
    for index, (row, start, _) in enumerate(prefills):
        if groups and start == 0 and len(groups[-1]) < most:
            last_row, last_start, _ = prefills[groups[-1][-1]]
            if last_start == 0 and row == last_row + 1:
                groups[-1] = range(groups[-1].start, index + 1)
                continue
        groups.append(range(index, index + 1))
    return groups


def batch_bucket(n: int, max_batch: int) -> int:
    """The batch the compiled step runs ``n`` rows as: the next power of two, at most ``max_batch`` (so the graphs
    are at most ``log2(max_batch) + 2`` batch sizes times the attended-length buckets)."""
    return min(max_batch, 1 << (n - 1).bit_length())


def cache_bytes(runtime: SpliceCausalLM, rows: int) -> int:
    """Bytes of a KV cache of ``rows`` rows of ``max_len`` slots (keys and values, every layer)."""
    shape = runtime.blocks[0].shape
    per_slot = 2 * len(runtime.blocks) * shape.n_kv_heads * shape.head_dim * runtime.dtype.itemsize
    return rows * runtime.max_len * per_slot


def check_cache_fits(runtime: SpliceCausalLM, rows: int) -> None:
    """Raise before allocating a KV cache the device has no memory for: the serving cache is allocated whole, for
    ``max_batch`` rows of ``max_out_tokens`` slots, and a model's full context times a batch can need far more than
    the machine has."""
    size, free = cache_bytes(runtime, rows), free_bytes(runtime.device.type)
    if free is not None and size > free:
        raise ValueError(f"a KV cache of max_batch={rows} rows x max_out_tokens={runtime.max_len} slots needs "
                         f"{size / 2**30:.1f} GiB, and {runtime.device.type} has {free / 2**30:.1f} GiB available; "
                         "allowed: a smaller max_batch (--max-batch) or max_out_tokens (--max-out-tokens)")


class BatchRunner:
    """Runs :class:`StepPlan` s on ``runtime`` (the engine's :class:`SpliceCausalLM`) over its own cache."""

    def __init__(self, runtime: SpliceCausalLM, max_batch: int):
        self.runtime = runtime
        self.max_batch = max_batch
        check_cache_fits(runtime, max_batch)
        self.cache = runtime.new_cache(max_batch)
        # every slot counts as a real token: a row's causal mask (key slot <= its own slot) hides what lies beyond
        # its length, including what an earlier request left there
        self.cache.valid.fill_(True)
        self._views: dict[int, StaticKVCache] = {}  # rows [:n], kept so a compiled step sees the same cache object

    def view(self, n: int) -> StaticKVCache:
        """Rows ``[:n]`` as a cache (one object per ``n``)."""
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = self.cache.rows(0, n)
        return view

    def run(self, plan: StepPlan, on_step=None, on_prefill=None) -> StepLogits:
        """Apply ``plan``; the prefill errors are caught per prompt, a failing decode step raises.

        ``on_prefill(index, logits, error)`` runs as soon as prompt chunk ``plan.prefills[index]`` is done and
        ``on_step(logits)`` as soon as the decode step is, before the rest of the plan runs (so a token goes out
        while the next forward runs); what they raise propagates."""
        out = StepLogits()
        for move in plan.moves:
            self.move(move)
        for group in prefill_groups(plan.prefills, plan.prefill_batch):
            first_row, start, _ = plan.prefills[group.start]
            chunks = [plan.prefills[index][2] for index in group]
            logits = error = None
            try:
                logits = self.prefill(first_row, start, chunks[0]) if len(chunks) == 1 else \
                    self.prefill_together(first_row, chunks)
            except Exception as caught:  # noqa: BLE001 - reported as the error of the group's requests
                error = caught
            for i, index in enumerate(group):
                row_logits = None if logits is None else logits if len(chunks) == 1 else logits[i]
                out.prefills.append(row_logits)
                out.prefill_errors.append(error)
                if on_prefill is not None:
                    on_prefill(index, row_logits, error)
        if plan.step_tokens:
            out.step = self.step(plan.step_tokens, plan.step_slots)
            if on_step is not None:
                on_step(out.step)
        return out

    def move(self, move: Move) -> None:
        cache, filled = self.cache, move.filled
        for buffer in (cache.keys, cache.values):
            buffer[:, move.target, :, :filled].copy_(buffer[:, move.source, :, :filled])

    def prefill(self, row: int, start: int, chunk: tuple[int, ...]) -> torch.Tensor:
        """Prompt tokens ``chunk`` at slots ``start ..`` of ``row`` (batch 1); the fp32 logits of the chunk's last
        position ``[vocab]``. A chunk from slot 0 takes the dense causal path ``generate`` takes for an unpadded
        prompt; a later chunk attends to the row's earlier slots through the causal mask."""
        runtime, end = self.runtime, start + len(chunk)
        device = runtime.device
        ids = torch.tensor([chunk], dtype=torch.long, device=device)
        cache = self.cache.rows(row, row + 1)
        slots = cache.slot_ids[start:end]
        logits = runtime.forward(ids, slots[None], slots, cache, end, dense=start == 0)
        return logits[0].float()

    def prefill_together(self, first_row: int, chunks: list[tuple[int, ...]]) -> torch.Tensor:
        """Prompts (or first chunks) ``chunks[i]`` at slots ``0 ..`` of rows ``first_row + i``, in one forward: fp32
        logits ``[len(chunks), vocab]`` of each one's last token. The rows are right-padded to the longest; a row's
        padding fills slots past its prompt, which its causal mask hides and its own tokens overwrite (as a freed
        row's old contents are). One forward pays once for what every forward costs whatever its rows (a quantized
        layer de-quantises its weight once per forward on the prefill path)."""
        runtime, rows, longest = self.runtime, len(chunks), max(map(len, chunks))
        device = runtime.device
        ids = torch.tensor([[*chunk, *[0] * (longest - len(chunk))] for chunk in chunks], dtype=torch.long,
                           device=device)
        cache = self.cache.rows(first_row, first_row + rows)
        slots = cache.slot_ids[:longest]
        last = torch.tensor([len(chunk) - 1 for chunk in chunks], dtype=torch.long, device=device)
        return runtime.forward(ids, slots[None].expand(rows, -1), slots, cache, longest, dense=True, last=last).float()

    def step(self, tokens: tuple[int, ...], slots: tuple[int, ...]) -> torch.Tensor:
        """One decode step of rows ``[:len(tokens)]``, row ``i`` feeding ``tokens[i]`` at its slot ``slots[i]``
        (= its position); fp32 logits ``[n, vocab]``. A runtime with a graph per shape (compiled, or CUDA graphs;
        ``static_shapes``) runs the batch padded to its bucket: the padding rows (free, or holding a prompt still
        being prefilled) write at the last slot, which no row of theirs holds yet and which a row writes itself
        before it reads it, at position 0 (within any position table)."""
        runtime, n = self.runtime, len(tokens)
        batch = batch_bucket(n, self.max_batch) if runtime.static_shapes(n) else n
        pad = batch - n
        device = runtime.device
        ids = torch.tensor([*tokens, *[0] * pad], dtype=torch.long, device=device)[:, None]
        at = torch.tensor([*slots, *[self.cache.max_len - 1] * pad], dtype=torch.long, device=device)[:, None]
        positions = torch.tensor([*slots, *[0] * pad], dtype=torch.long, device=device)[:, None]
        logits = runtime.decode_step(ids, positions, at, self.view(batch), max(slots) + 1)
        return logits[:n].float()
