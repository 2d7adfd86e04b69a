"""The model side of continuous batching: row moves, batch buckets, plans."""
from __future__ import annotations

import pytest
import torch

from splice.serve.batch import BatchRunner, Move, StepPlan, batch_bucket
from splice.steps.fuse import inject
from tests.arch.tiny_models import build_family


def test_batch_buckets_are_powers_of_two_up_to_max_batch():
    assert [batch_bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [batch_bucket(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]


def test_a_move_copies_the_filled_slots_of_every_layer_and_nothing_else():
    runner = BatchRunner(inject(build_family("llama"), max_out_tokens=16), max_batch=3)
    cache = runner.cache
    cache.keys.normal_()
    cache.values.normal_()
    before_keys, before_values = cache.keys.clone(), cache.values.clone()
    runner.move(Move(source=2, target=0, filled=5))
    assert torch.equal(cache.keys[:, 0, :, :5], before_keys[:, 2, :, :5])
    assert torch.equal(cache.values[:, 0, :, :5], before_values[:, 2, :, :5])
    assert torch.equal(cache.keys[:, 0, :, 5:], before_keys[:, 0, :, 5:])
    assert torch.equal(cache.keys[:, 1:], before_keys[:, 1:])


def test_a_moved_row_decodes_as_it_did_in_its_old_row():
    runner = BatchRunner(inject(build_family("llama"), max_out_tokens=16), max_batch=2)
    prompt = (5, 17, 33, 9)
    with torch.inference_mode():
        runner.run(StepPlan(prefills=((1, 0, prompt),)))
        in_place = runner.step((7, 7), (0, 4))[1]  # row 0 is free: a token at its slot 0
        runner.run(StepPlan(prefills=((1, 0, prompt),)))
        runner.move(Move(source=1, target=0, filled=4))
        moved = runner.step((7,), (4,))[0]
    torch.testing.assert_close(moved, in_place, rtol=1e-5, atol=1e-5)


def test_plans_without_work_are_idle():
    assert StepPlan(max_batch=4).idle
    assert not StepPlan(stop=True).idle and not StepPlan(moves=(Move(1, 0, 3),)).idle


def test_padding_rows_of_a_compiled_step_leave_a_partly_prefilled_prompt_alone():
    """Three rows step, padded to a batch of 4 whose last row holds the first chunk of a prompt: its slots are
    untouched and the three rows get the logits of the unpadded step. (The runtime's eager forward stands in for
    the compiled one: the padding is the batch runner's, compiling adds nothing to it.)"""
    runtime = inject(build_family("llama"), max_out_tokens=16)
    runner = BatchRunner(runtime, max_batch=4)
    prompts = ((5, 17, 33), (9, 90), (41, 7, 8, 2))
    with torch.inference_mode():
        runner.run(StepPlan(prefills=tuple((row, 0, prompt) for row, prompt in enumerate(prompts))))
        runner.run(StepPlan(prefills=((3, 0, (11, 12, 13, 14, 15)),)))
        keys, values = runner.cache.keys.clone(), runner.cache.values.clone()
        unpadded = runner.step((6, 6, 6), (3, 2, 4))
        runner.cache.keys.copy_(keys)  # undo the step's writes
        runner.cache.values.copy_(values)
        runtime._compiled_step = runtime.forward
        padded = runner.step((6, 6, 6), (3, 2, 4))
    assert torch.equal(runner.cache.keys[:, 3, :, :5], keys[:, 3, :, :5])
    assert torch.equal(runner.cache.values[:, 3, :, :5], values[:, 3, :, :5])
    torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)


def test_a_cache_larger_than_the_memory_available_is_refused_before_it_is_allocated(monkeypatch):
    from splice.serve import batch

    runtime = inject(build_family("llama"), max_out_tokens=16)
    needed = batch.cache_bytes(runtime, 4)
    assert needed == 4 * 16 * 2 * len(runtime.blocks) * runtime.blocks[0].shape.n_kv_heads * \
        runtime.blocks[0].shape.head_dim * 4
    monkeypatch.setattr(batch, "free_bytes", lambda device: needed - 1)
    with pytest.raises(ValueError, match=r"max_batch=4 rows x max_out_tokens=16 slots .* \(--max-batch\)"):
        BatchRunner(runtime, max_batch=4)
    monkeypatch.setattr(batch, "free_bytes", lambda device: needed)
    assert BatchRunner(runtime, max_batch=4).cache.batch == 4
