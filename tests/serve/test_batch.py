"""The model side of continuous batching: row moves, batch buckets, plans."""
from __future__ import annotations

import pytest
import torch

import splice
from splice import native
from splice.serve.batch import BatchRunner, Move, StepPlan, batch_bucket, prefill_groups
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


def test_prefill_groups_join_consecutive_rows_from_slot_0_up_to_the_limit():
    prefills = ((2, 12, (1,)), (3, 0, (1, 2)), (4, 0, (3,)), (5, 0, (4,)), (7, 0, (5,)), (8, 0, (6,)))
    assert prefill_groups(prefills, 2) == [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]
    assert prefill_groups(prefills, 4) == [range(0, 1), range(1, 4), range(4, 6)]
    assert prefill_groups(prefills, 1) == [range(i, i + 1) for i in range(6)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_prompts_prefilled_together_fill_the_cache_and_give_the_logits_of_each_alone(family):
    """Three prompts of different lengths in one right-padded forward (rows 1..3): each row's filled slots and its
    last token's logits are those of its own forward; the rows around them are untouched."""
    runner = BatchRunner(inject(build_family(family), max_out_tokens=16), max_batch=5)
    prompts = ((5, 17, 33), (9, 90, 4, 61, 7, 2), (41, 7))
    with torch.inference_mode():
        alone = [runner.prefill(1 + i, 0, prompt) for i, prompt in enumerate(prompts)]
        keys = [runner.cache.keys[:, 1 + i, :, :len(p)].clone() for i, p in enumerate(prompts)]
        runner.cache.keys.zero_()
        logits = runner.run(StepPlan(prefills=tuple((1 + i, 0, p) for i, p in enumerate(prompts)), prefill_batch=3))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits.prefills[i], alone[i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(runner.cache.keys[:, 1 + i, :, :len(prompt)], keys[i], rtol=1e-4, atol=1e-4)
    assert not runner.cache.keys[:, 0].any() and not runner.cache.keys[:, 4].any()


def test_a_failing_group_reports_its_error_to_each_of_its_prompts(monkeypatch):
    runner = BatchRunner(inject(build_family("llama"), max_out_tokens=16), max_batch=3)

    def failing(first_row, chunks):
        raise RuntimeError("group fault")

    monkeypatch.setattr(runner, "prefill_together", failing)
    seen = []
    with torch.inference_mode():
        out = runner.run(StepPlan(prefills=((0, 0, (5, 6)), (1, 0, (7,)), (2, 0, (8, 9))), prefill_batch=2),
                         on_prefill=lambda index, logits, error: seen.append((index, logits is None, str(error))))
    assert seen[:2] == [(0, True, "group fault"), (1, True, "group fault")]
    assert seen[2][:2] == (2, False) and out.prefills[2].shape == (runner.runtime.config.vocab_size,)


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


@pytest.mark.parametrize("graphs", [False, True])
def test_a_runtime_replaying_cuda_graphs_steps_batches_padded_to_their_bucket(monkeypatch, graphs):
    """Each batch size is a graph of its own with CUDA graphs as with a compiled step: three rows step as four."""
    runtime = inject(build_family("llama"), max_out_tokens=16)
    runner = BatchRunner(runtime, max_batch=4)
    if graphs:
        runtime.capture_graphs()
    batches = []
    monkeypatch.setattr(runtime, "decode_step", lambda ids, *rest: batches.append(len(ids)) or torch.zeros(len(ids), 8))
    runner.step((6, 6, 6), (0, 0, 0))
    assert batches == [4 if graphs else 3]


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_a_compiled_runtime_steps_batches_that_run_as_one_native_call_unpadded(monkeypatch):
    """Such steps run eagerly (SpliceCausalLM.step_runs_natively): no graph per batch size, so nothing to pad to."""
    engine = splice.init_inference(build_family("llama", dtype=torch.bfloat16), replace_with_kernel_inject=True,
                                   compile_decode=True, max_out_tokens=16)
    runtime = engine.runtime
    runner = BatchRunner(runtime, max_batch=4)
    batches = []
    monkeypatch.setattr(runtime, "decode_step", lambda ids, *rest: batches.append(len(ids)) or torch.zeros(len(ids), 8))
    runner.step((6, 6, 6), (0, 0, 0))
    runtime.compile_native_steps = True  # the graph for every step: padded to its bucket
    runner.step((6, 6, 6), (0, 0, 0))
    assert batches == [3, 4]
