"""StaticKVCache with per-row slots: each row writes and attends at its own slot, so rows of different lengths decode
together and each gets the logits it gets alone."""
from __future__ import annotations

import copy

import pytest
import torch

from splice import native
from splice.layers.kv_cache import StaticKVCache
from splice.steps.fuse import inject
from tests.arch.tiny_models import build_family


def small_cache(batch: int = 3, max_len: int = 8) -> StaticKVCache:
    return StaticKVCache(n_layers=2, batch=batch, kv_heads=2, max_len=max_len, head_dim=4, dtype=torch.float32,
                         device="cpu")


def test_per_row_update_writes_each_row_at_its_own_slot():
    cache = small_cache()
    k = torch.randn(3, 2, 1, 4)
    v = torch.randn(3, 2, 1, 4)
    slots = torch.tensor([[0], [5], [2]])
    keys, values = cache.update(1, k, v, slots, kv_len=6)
    assert keys.shape == (3, 2, 6, 4)
    for row, slot in enumerate((0, 5, 2)):
        assert torch.equal(cache.keys[1, row, :, slot], k[row, :, 0])
        assert torch.equal(cache.values[1, row, :, slot], v[row, :, 0])
        others = [s for s in range(8) if s != slot]
        assert not cache.keys[1, row, :, others].any() and not cache.keys[0].any()


def test_per_row_mask_is_causal_per_row_and_honours_the_window():
    cache = small_cache()
    cache.valid.fill_(True)
    slots = torch.tensor([[0], [5], [2]])
    mask = cache.mask(slots, kv_len=6)
    assert mask.shape == (3, 1, 1, 6)
    for row, slot in enumerate((0, 5, 2)):
        assert mask[row, 0, 0].tolist() == [s <= slot for s in range(6)]
    windowed = cache.mask(slots, kv_len=6, window=2)
    for row, slot in enumerate((0, 5, 2)):
        assert windowed[row, 0, 0].tolist() == [slot - 2 < s <= slot for s in range(6)]


def test_rows_share_storage_with_the_cache():
    cache = small_cache()
    view = cache.rows(1, 3)
    assert view.batch == 2 and view.max_len == 8
    view.update(0, torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), torch.tensor([3]), kv_len=4)
    assert cache.keys[0, 1:, :, 3].eq(1).all() and not cache.keys[0, 0].any()


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2", "bloom", "gemma2"])
def test_per_row_decode_step_equals_each_row_alone(family):
    """Three prompts of different lengths, each prefilled on its own row (positions = slots, no padding), then one
    decode step with per-row slots: each row's logits equal that prompt's decode step run alone (mistral: a sliding
    window shorter than the prompts; bloom: ALiBi; gemma2: soft-capping and alternating windows)."""
    runtime = inject(copy.deepcopy(build_family(family)), max_out_tokens=32)
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (4, 11, 7)]
    nexts = torch.tensor([[5], [9], [17]])
    with torch.inference_mode():
        alone = [decode_alone(runtime, prompt, nexts[i:i + 1]) for i, prompt in enumerate(prompts)]
        cache = runtime.new_cache(3)
        cache.valid.fill_(True)
        for row, prompt in enumerate(prompts):
            prefill(runtime, cache.rows(row, row + 1), prompt)
        slots = torch.tensor([[p.shape[1]] for p in prompts])
        together = runtime.decode_step(nexts, slots, slots, cache, int(slots.max()) + 1)
    for row in range(3):
        torch.testing.assert_close(together[row], alone[row][0], rtol=1e-5, atol=1e-5)


def prefill(runtime, cache: StaticKVCache, prompt: torch.Tensor) -> torch.Tensor:
    length = prompt.shape[1]
    positions = torch.arange(length)[None]
    return runtime.forward(prompt, positions, cache.slot_ids[:length], cache, length, dense=True)


def decode_alone(runtime, prompt: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Prefill and one decode step the way ``splice.generation.decode`` runs a batch of one."""
    length = prompt.shape[1]
    cache = runtime.new_cache(1)
    cache.start(torch.ones_like(prompt))
    prefill(runtime, cache, prompt)
    slot = cache.slot_ids[length:length + 1]
    cache.mark(slot)
    return runtime.decode_step(token, torch.tensor([[length]]), slot, cache, length + 1)


def test_a_cache_spanning_huge_pages_starts_on_one():
    cache = StaticKVCache(n_layers=4, batch=2, kv_heads=2, max_len=1024, head_dim=64, dtype=torch.bfloat16,
                          device="cpu")  # 2 MiB each of keys and values
    assert cache.keys.shape == (4, 2, 2, 1024, 64) and not cache.keys.any() and not cache.values.any()
    if native.huge_pages_supported():
        assert cache.keys.data_ptr() % native.HUGE_PAGE == 0 and cache.values.data_ptr() % native.HUGE_PAGE == 0


def test_sees_all_only_for_the_last_slot_of_an_unpadded_cpu_cache_marked_in_turn():
    cache = StaticKVCache(n_layers=1, batch=2, kv_heads=1, max_len=16, head_dim=16, dtype=torch.float32, device="cpu")
    last = torch.tensor([5])
    assert not cache.sees_all(torch.tensor([3]), 4)  # before start: not known
    cache.start(torch.ones(2, 4, dtype=torch.long))
    assert cache.sees_all(torch.tensor([3]), 4)
    assert not cache.sees_all(last, 6)  # slots 4 and 5 not marked yet
    cache.mark(torch.tensor([4]))
    cache.mark(torch.tensor([5]))
    assert cache.sees_all(last, 6) and cache.sees_all(last, 6, window=6)
    assert not cache.sees_all(torch.tensor([4]), 6)  # slot 5 is after the query
    assert not cache.sees_all(last, 6, window=5)  # slot 0 is outside the window
    assert not cache.sees_all(torch.tensor([[5], [5]]), 6)  # rows of their own slots
    assert not cache.rows(0, 1).sees_all(last, 6)
    for window in (None, 6):  # where it sees all, the mask is all True
        assert cache.mask(last, 6, window).all()
    cache.mark(torch.tensor([7]))  # out of turn: slot 6 is not known to hold a token
    assert not cache.sees_all(torch.tensor([7]), 8)
    cache.start(torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))  # a left pad
    assert not cache.sees_all(torch.tensor([3]), 4)
