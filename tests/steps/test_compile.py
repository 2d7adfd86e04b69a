"""The compile step: ``compile_decode=True`` compiles splice's decode step; it must not change a single greedy token."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import splice
from splice.layers.native_linear import NativeLinear, can_use_native
from splice.layers.packed_linear import PackedLinear, can_pack

from ..arch.tiny_models import build_family, padded_batch

GREEDY = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)


def test_compiled_decode_gives_hf_greedy_tokens_fp32():
    reference = build_family("llama")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=64)
    runtime = engine.runtime
    assert runtime._compiled_step is not None
    assert engine.step_report("compile").compiled
    ids, mask = padded_batch(batch=3, length=12)
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(engine.generate(ids, attention_mask=mask, **GREEDY), expected)
    # a second request of the same batch size reuses the graph (same cache, same shapes) and stays exact
    with torch.inference_mode():
        expected = reference.generate(ids[:, 3:], attention_mask=mask[:, 3:], **GREEDY)
    assert torch.equal(engine.generate(ids[:, 3:], attention_mask=mask[:, 3:], **GREEDY), expected)


def test_compiled_decode_switches_batch_sizes_and_back():
    """Steady-state steps skip most guard checks (only those that tell graphs apart): a new batch size must still get
    its own graph, and the old one must still be right afterwards."""
    reference = build_family("llama")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=64)
    ids, mask = padded_batch(batch=3, length=12)
    for rows in (slice(2, 3), slice(0, 3), slice(1, 3), slice(2, 3)):  # batch 1, 3, 2, then 1 again
        with torch.inference_mode():
            expected = reference.generate(ids[rows], attention_mask=mask[rows], **GREEDY)
        assert torch.equal(engine.generate(ids[rows], attention_mask=mask[rows], **GREEDY), expected)
    assert {key[0] for key in engine.runtime._compiled_keys} == {1, 2, 3}


def unique_graphs() -> int:
    """Graphs dynamo has compiled in this process (it may reuse another engine's graph of the same shapes: call
    ``torch._dynamo.reset()`` first to count one engine's)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_decode_across_attended_length_buckets_gives_hf_tokens():
    """The compiled step attends over the next power of two of the filled slots (from ``min_attended``): a request
    crossing bucket boundaries compiles one graph per bucket reached, stays exact, and a second request over the same
    buckets compiles nothing."""
    reference = build_family("llama")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=64)
    runtime = engine.runtime
    runtime.min_attended = 8
    ids, mask = padded_batch(batch=2, length=6)  # 20 new tokens: 7 .. 25 filled slots, buckets 8, 16 and 32
    torch._dynamo.reset()
    before = unique_graphs()
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(engine.generate(ids, attention_mask=mask, **GREEDY), expected)
    assert {key[1] for key in runtime._compiled_keys} == {8, 16, 32}
    assert unique_graphs() - before == 3
    with torch.inference_mode():
        expected = reference.generate(ids[:, 1:], attention_mask=mask[:, 1:], **GREEDY)
    assert torch.equal(engine.generate(ids[:, 1:], attention_mask=mask[:, 1:], **GREEDY), expected)
    assert unique_graphs() - before == 3
    with torch.inference_mode():  # each length back on its own graph (the steady-state guard shortcut picks it)
        cache = runtime.cache_for(2)
        for length in (25, 7, 12, 25):
            token, slot = torch.tensor([[5], [9]]), torch.tensor([length - 1])
            position = torch.full((2, 1), length - 1)
            cache.start(torch.ones(2, length - 1, dtype=torch.long))
            cache.mark(slot)
            compiled = runtime.decode_step(token, position, slot, cache, length)
            torch.testing.assert_close(compiled, runtime.forward(token, position, slot, cache, length))
    assert unique_graphs() - before == 3


def test_graphs_stay_bounded_by_the_buckets_of_the_cache():
    """Filling the whole cache compiles one graph per bucket and batch size, and no more, even past dynamo's limit of
    graphs per function (lowered here to stand for many batch sizes times buckets), without falling back to eager."""
    reference = build_family("llama")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=32)
    runtime = engine.runtime
    runtime.min_attended = 2
    assert [runtime.attended_length(n) for n in (1, 2, 3, 4, 5, 17, 32)] == [2, 2, 4, 4, 8, 32, 32]
    ids, mask = padded_batch(batch=2, length=5)
    options = dict(GREEDY, max_new_tokens=27, min_new_tokens=27)  # fills all 32 slots: buckets 8, 16, 32
    torch._dynamo.reset()
    before = unique_graphs()
    with torch._dynamo.config.patch(recompile_limit=4):
        for rows in (slice(0, 2), slice(0, 1), slice(1, 2)):  # batch 2, then batch 1 twice
            with torch.inference_mode():
                expected = reference.generate(ids[rows], attention_mask=mask[rows], **options)
            assert torch.equal(engine.generate(ids[rows], attention_mask=mask[rows], **options), expected)
    assert {key[:2] for key in runtime._compiled_keys} == {(batch, n) for batch in (1, 2) for n in (8, 16, 32)}
    assert unique_graphs() - before == 6


def test_compiled_step_takes_inputs_no_graph_fits_yet():
    """After generate (inference-mode inputs), a step called with ordinary tensors is not refused by the steady-state
    guard shortcut: it takes the full guard check (and a graph of its own) and gives the eager step's logits."""
    reference = build_family("llama")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=64)
    ids, mask = padded_batch(batch=1, length=12)
    engine.generate(ids, attention_mask=mask, **GREEDY)
    runtime = engine.runtime
    cache = runtime.cache_for(1)
    token, position, slot = torch.tensor([[5]]), torch.tensor([[12]]), torch.tensor([12])  # not inference tensors
    with torch.inference_mode():  # the cache was made in inference mode
        cache.start(torch.ones(1, 12, dtype=torch.long))
        cache.mark(slot)
        compiled = runtime.decode_step(token, position, slot, cache, 13)
        eager = runtime.forward(token, position, slot, cache, 13)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_steady_state_steps_call_their_graph_with_no_guard_check():
    """Once a key (batch, attended length, ...) has passed the steady-state guard shortcut, its steps call the
    compiled code of the graph its inputs passed the full guards of (``direct_step``), nothing checked: each length's
    own graph, the eager step's logits, HF's tokens; inputs no graph has passed get None."""
    reference = build_family("llama")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=64)
    runtime = engine.runtime
    runtime.min_attended = 8
    ids, mask = padded_batch(batch=2, length=6)
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=mask, **GREEDY)
        assert torch.equal(engine.generate(ids, attention_mask=mask, **GREEDY), expected)
        assert {key[1] for key, _ in runtime._direct_steps} == {8, 16, 32}
        assert all(callable(step) for step in runtime._direct_steps.values())
        cache = runtime.cache_for(2)
        for length in (25, 7, 12):
            token, slot = torch.tensor([[5], [9]]), torch.tensor([length - 1])
            position = torch.full((2, 1), length - 1)
            cache.start(torch.ones(2, length - 1, dtype=torch.long))
            cache.mark(slot)
            direct = runtime.direct_step(token, position, slot, cache, runtime.attended_length(length))
            eager = runtime.forward(token, position, slot, cache, length)
            torch.testing.assert_close(direct(runtime, token, position, slot, cache, runtime.attended_length(length)),
                                       eager)
            torch.testing.assert_close(runtime.decode_step(token, position, slot, cache, length), eager)
        one_row = runtime.cache_for(1)  # no graph for batch 1 yet
        assert runtime.direct_step(torch.tensor([[5]]), torch.tensor([[3]]), torch.tensor([3]), one_row, 8) is None
        assert not runtime._direct_steps  # a new cache (another batch size) drops the steps keyed by the old one's id


def test_a_key_without_a_direct_step_is_looked_up_once(monkeypatch):
    """Where dynamo's cache gives no graph to call directly, the step keeps the guard shortcut, and the lookup (a full
    guard check) is not repeated every step."""
    reference = build_family("llama")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=64)
    runtime = engine.runtime
    lookups = []
    monkeypatch.setattr(runtime, "direct_step", lambda *args: lookups.append(args[-1]))
    ids, mask = padded_batch(batch=1, length=12)
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(engine.generate(ids, attention_mask=mask, **GREEDY), expected)
    assert len(lookups) == 1 and list(runtime._direct_steps.values()) == [False]


def test_direct_step_refuses_code_that_does_not_take_forwards_arguments(monkeypatch):
    """A cache entry whose guards pass but whose code takes other arguments (another torch's dynamo) is not called."""
    reference = build_family("llama")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=64)
    runtime = engine.runtime

    class Passes:
        @staticmethod
        def check(frame):
            return True

    def other(a, b):
        return a

    entry = type("Entry", (), {"guard_manager": Passes(), "code": other.__code__})()
    monkeypatch.setattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", lambda code: [entry])
    cache = runtime.cache_for(1)
    assert runtime.direct_step(torch.tensor([[5]]), torch.tensor([[3]]), torch.tensor([3]), cache, 64) is None
    entry.code = type(runtime).forward.__code__  # forward's own arguments: taken
    assert callable(runtime.direct_step(torch.tensor([[5]]), torch.tensor([[3]]), torch.tensor([3]), cache, 64))


@pytest.mark.parametrize("native_kernels", [True, False])
def test_compiled_decode_runs_the_bf16_weights_eager_runs(native_kernels, monkeypatch):
    """The compiled step calls the same wrapped linears (native GEMV, or oneDNN-packed without native kernels)."""
    if native_kernels and not can_use_native(torch.bfloat16, torch.device("cpu")):
        pytest.skip("splice's native kernels are not available on this machine")
    if not native_kernels:
        if not can_pack(torch.bfloat16, torch.device("cpu")):
            pytest.skip("no oneDNN bf16 on this CPU")
        monkeypatch.setattr(splice.native, "available", lambda: False)
    wrapper = NativeLinear if native_kernels else PackedLinear
    reference = build_family("llama", dtype=torch.bfloat16)
    eager = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    compiled = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                     max_out_tokens=64)
    assert any(isinstance(m, wrapper) for m in compiled.module.modules())  # the very weights eager runs
    ids, mask = padded_batch(batch=1, length=12)
    options = dict(GREEDY, return_dict_in_generate=True, output_logits=True)
    got, expected = (engine.generate(ids, attention_mask=mask, **options) for engine in (compiled, eager))
    # bf16: inductor keeps fused intermediates in fp32 where eager rounds each op, so compare the first decode step's
    # logits (step 0 is the eager prefill in both) and the tokens up to it, not 20 tokens of a random tiny model
    decode_error = (got.logits[1] - expected.logits[1]).abs().max() / expected.logits[1].std()
    assert decode_error < 0.05
    assert torch.equal(got.sequences[:, :14], expected.sequences[:, :14])


@pytest.mark.parametrize("level", ["avx2", "best"])
def test_compiled_decode_runs_the_int8_layers_eager_runs(level):
    """int8 weight-only's decode rows on integer dot products inside the compiled step: int8 activations, or int16
    ones at the avx2 level without AVX-VNNI (``int8_dot16_gemv``); the compiled step gives the eager step's logits."""
    from splice import native
    from splice.kernel_choice import dot_products, int16_activations
    from splice.quant import Int8WeightOnlyLinear

    if not dot_products():
        pytest.skip("splice's native integer dot products do not run here (no native kernels, or SPLICE_NATIVE_DOT=0)")
    if level == "avx2" and "avx2" not in native.supported_isas():
        pytest.skip("this CPU cannot run the avx2 kernels")
    with contextlib.ExitStack() as at_level:
        if level == "avx2":
            at_level.enter_context(native.use_isa("avx2"))
            at_level.enter_context(native.use_avx_vnni(False))
        reference = build_family("llama", dtype=torch.bfloat16)
        engines = [splice.init_inference(copy.deepcopy(reference), dtype=torch.int8, replace_with_kernel_inject=True,
                                         compile_decode=compiled, max_out_tokens=64) for compiled in (True, False)]
        layers = [m for m in engines[0].module.modules() if isinstance(m, Int8WeightOnlyLinear)]
        assert layers and {m.use_dot_products for m in layers} == {16 if int16_activations() else 8}
        assert int16_activations() or level != "avx2"
        ids, mask = padded_batch(batch=1, length=12)
        options = dict(GREEDY, return_dict_in_generate=True, output_logits=True)
        got, expected = (engine.generate(ids, attention_mask=mask, **options) for engine in engines)
    decode_error = (got.logits[1] - expected.logits[1]).abs().max() / expected.logits[1].std()
    assert decode_error < 0.05
    assert torch.equal(got.sequences[:, :14], expected.sequences[:, :14])


def test_compile_decode_needs_kernel_injection():
    with pytest.raises(ValueError, match="compile_decode=True .* replace_with_kernel_inject=True"):
        splice.init_inference(build_family("llama"), compile_decode=True)


def test_cuda_graphs_on_the_cpu_are_refused_before_anything_changes():
    model = build_family("llama")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match="enable_cuda_graph=True on device 'cpu'.*compile_decode=True"):
        splice.init_inference(model, replace_with_kernel_inject=True, enable_cuda_graph=True, device="cpu")
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"


def test_report_says_which_calls_cuda_graphs_replay(monkeypatch):
    """Without kernel injection there is no native decode step: only engine(...) calls are replayed."""
    import splice.plan

    monkeypatch.setattr(splice.plan, "check_graphs", lambda *args: None)  # the CPU refuses CUDA graphs; read the report
    plain = splice.init_inference(build_family("llama"), enable_cuda_graph=True).step_report("compile").summary()
    fused = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, enable_cuda_graph=True,
                                  max_out_tokens=64).step_report("compile").summary()
    assert "replay engine(...) calls" in plain and "replay the decode step" not in plain
    assert "replay the decode step" in fused and "engine(...)" in fused


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_graphs_replay_the_compiled_decode_step_token_exact(fresh_compiles):
    reference = build_family("llama").cuda()
    ids, mask = (t.cuda() for t in padded_batch(batch=3, length=12))
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   enable_cuda_graph=True, max_out_tokens=64)
    assert engine.runtime.graphs.fn == engine.runtime._compiled_step
    for _ in range(2):  # the second request replays the graph the first one captured
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False), expected)
    assert len(engine.runtime.graphs.graphs) == 1
