"""Kernel injection: fp32 parity with the unmodified Hugging Face model for every family, and what it does to the
model (weights moved, one QKV GEMM, one gate+up GEMM, original layers released)."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import splice
from splice.generation import prefill_positions
from splice.layers.block import SpliceBlock
from splice.steps.fuse import inject

from ..arch.tiny_models import FAMILIES, build_family, padded_batch


def scaled_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    return ((reference - value).abs().max() / reference.std()).item()


def native_logits(runtime, ids, mask):
    cache = runtime.new_cache(ids.shape[0])
    cache.start(mask)
    slots = torch.arange(ids.shape[1])
    return runtime.forward(ids, prefill_positions(mask), slots, cache, ids.shape[1], last_only=False)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_logits_match_the_reference(model_type):
    reference = build_family(model_type)
    model = copy.deepcopy(reference)
    runtime = inject(model, max_out_tokens=64)
    ids, _ = padded_batch(batch=2, length=12)
    full = torch.ones_like(ids)
    with torch.inference_mode():
        expected = reference(ids).logits
        assert scaled_error(expected, model(ids).logits) < 1e-4  # HF forward through the fused blocks
        assert scaled_error(expected, native_logits(runtime, ids, full)) < 1e-4  # splice's native path


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_padded_logits_match_the_reference(model_type):
    reference = build_family(model_type)
    model = copy.deepcopy(reference)
    runtime = inject(model, max_out_tokens=64)
    ids, mask = padded_batch(batch=3, length=12)
    with torch.inference_mode():
        expected = reference(ids, attention_mask=mask).logits
        real = mask.bool()
        assert scaled_error(expected[real], model(ids, attention_mask=mask).logits[real]) < 1e-4
        assert scaled_error(expected[real], native_logits(runtime, ids, mask)[real]) < 1e-4


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_weights_are_moved_not_copied(model_type):
    model = build_family(model_type)
    layer = model.model.layers[0]
    o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
    kept = {"o": o_proj.weight.data_ptr(), "down": down_proj.weight.data_ptr(),
            "norm": layer.input_layernorm.weight.data_ptr()}
    if model_type == "phi3":
        kept["qkv"] = layer.self_attn.qkv_proj.weight.data_ptr()
    released = weakref.ref(layer)
    del layer
    inject(model, max_out_tokens=32)
    gc.collect()
    block = model.model.layers[0]
    assert released() is None  # the original layer object is gone
    assert block.o is o_proj and block.down is down_proj
    assert block.o.weight.data_ptr() == kept["o"] and block.down.weight.data_ptr() == kept["down"]
    assert block.attn_norm.weight.data_ptr() == kept["norm"]
    if model_type == "phi3":
        assert block.qkv.weight.data_ptr() == kept["qkv"]


def test_one_qkv_gemm_and_one_gate_up_gemm_per_block():
    model = build_family("qwen2")
    inject(model, max_out_tokens=32)
    for block in model.model.layers:
        assert isinstance(block, SpliceBlock)
        linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
        assert len(linears) == 4
        assert block.qkv.out_features == (4 + 2 * 2) * 16 and block.qkv.bias is not None
        assert block.gate_up.out_features == 2 * 128


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_block_calls_the_layers_own_mlp_module(family):
    model = build_family(family)
    mlps = [layer.mlp for layer in model.model.layers]
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    for block, mlp in zip(engine.runtime.blocks, mlps):
        assert block.moe is mlp and block.gate_up is None and block.down is None
    assert "the layer's own mixture of experts" in engine.step_report("fuse").summary()


def test_parameter_memory_does_not_grow():
    model = build_family("llama")
    before = sum(p.numel() for p in model.parameters())
    inject(model, max_out_tokens=32)
    assert sum(p.numel() for p in model.parameters()) == before


def test_init_inference_injects(tiny_llama):
    reference = copy.deepcopy(tiny_llama)
    engine = splice.init_inference(tiny_llama, replace_with_kernel_inject=True, max_out_tokens=64)
    assert engine.runtime is not None
    fused = engine.step_report("fuse")
    assert (fused.family, fused.layers, fused.kv_cache_tokens) == ("llama", 2, 64)
    ids = torch.randint(3, 128, (2, 8))
    with torch.inference_mode():
        assert scaled_error(reference(ids).logits, engine(ids).logits) < 1e-4


def test_init_inference_refuses_unsupported_family_before_changing_the_model():
    from transformers import CodeGenConfig, CodeGenForCausalLM

    model = CodeGenForCausalLM(CodeGenConfig(n_layer=1, n_embd=32, n_head=2, rotary_dim=8, vocab_size=64,
                                             n_positions=32, bos_token_id=1, eos_token_id=2))
    with pytest.raises(ValueError, match="model_type='codegen'.*llama"):
        splice.init_inference(model, replace_with_kernel_inject=True)
    assert type(model.transformer.h[0]).__name__ == "CodeGenBlock"


def test_plain_path_is_untouched(tiny_llama):
    engine = splice.init_inference(tiny_llama, replace_with_kernel_inject=False)
    assert engine.runtime is None
    assert not any(isinstance(m, SpliceBlock) for m in engine.module.modules())


@pytest.mark.slow
def test_real_smollm2_logits_match(smollm2):
    reference, tokenizer = smollm2
    model = copy.deepcopy(reference)
    runtime = inject(model, max_out_tokens=64)
    batch = tokenizer(["The capital of France is", "Once upon a time, there was a little"], return_tensors="pt",
                      padding=True, padding_side="left")
    with torch.inference_mode():
        expected = reference(**batch).logits
        real = batch.attention_mask.bool()
        assert scaled_error(expected[real], model(**batch).logits[real]) < 1e-4
        native = native_logits(runtime, batch.input_ids, batch.attention_mask)
        assert scaled_error(expected[real], native[real]) < 1e-4


@pytest.mark.slow
def test_compiled_decode_step_gives_the_same_tokens():
    from splice.generation import generate

    reference, model = build_family("llama"), build_family("llama")
    runtime = inject(model, max_out_tokens=32)
    runtime.compile_decode()
    ids, mask = padded_batch()
    options = dict(max_new_tokens=12, eos_token_id=None)
    for _ in range(2):  # the second call reuses the compiled graph and the cache
        assert torch.equal(generate(model, runtime, ids, attention_mask=mask, **options),
                           reference.generate(ids, attention_mask=mask, **options))


def shard_in_process(model, rank: int, tp: int):
    """One rank's shards of ``model`` by AutoTP's plan, made in this process (no collective runs until a forward)."""
    from splice.distributed import ParallelContext
    from splice.tp import apply_plan, autotp_plan, trace_model

    ctx = ParallelContext(rank=rank, world_size=tp)
    apply_plan(model, autotp_plan(model, trace_model(model)), ctx)
    return ctx


@pytest.mark.parametrize("model_type", ["llama", "phi3", "qwen3"])
def test_head_counts_come_from_each_rank_weights(model_type):
    """4 query / 2 KV heads over 3 ranks: 1, 1, 2 query heads, one (replicated) KV head each — uneven, so a ratio of
    the config's counts would be wrong; separate and checkpoint-fused (Phi-3) QKV alike."""
    shapes = []
    for rank in range(3):
        model = build_family(model_type)
        shard_in_process(model, rank, 3)
        block = inject(model, max_out_tokens=32).blocks[0]
        shapes.append((block.shape.n_heads, block.shape.n_kv_heads))
        assert block.qkv.out_features == (shapes[-1][0] + 2) * block.shape.head_dim
    assert shapes == [(1, 1), (1, 1), (2, 1)]


def test_fusing_resolves_under_tensor_parallel_contexts():
    from splice.distributed import ParallelContext

    from .plans import plan_for

    plan = plan_for(build_family("llama"), ParallelContext(rank=1, world_size=2), replace_with_kernel_inject=True,
                    max_out_tokens=32, tensor_parallel={"tp_size": 2})
    assert plan.fuse and plan.tp_plan is not None


@pytest.mark.parametrize("wrapper_name", ["PackedLinear", "NativeLinear"])
def test_wrapping_keeps_the_parallel_wrappers(wrapper_name):
    """bf16 on CPU under tensor parallelism: the plain linears inside the row/vocab-parallel wrappers are wrapped
    (oneDNN-packed or native), the wrappers (which own the all-reduce / all-gather) stay."""
    from splice.layers.native_linear import NativeLinear, can_use_native
    from splice.layers.packed_linear import PackedLinear, can_pack
    from splice.tp.layers import RowParallelLinear, VocabParallelLinear
    from splice.steps.kernels import wrap_linears

    wrapper = {"PackedLinear": PackedLinear, "NativeLinear": NativeLinear}[wrapper_name]
    usable = {PackedLinear: can_pack, NativeLinear: can_use_native}[wrapper]
    if not usable(torch.bfloat16, torch.device("cpu")):
        pytest.skip(f"{wrapper_name} is not available on this machine")
    model = build_family("llama", dtype=torch.bfloat16)
    shard_in_process(model, 0, 2)
    runtime = inject(model, max_out_tokens=32)
    assert wrap_linears(model, runtime, wrapper) == 4 * len(runtime.blocks) + 1
    block = runtime.blocks[0]
    assert isinstance(block.qkv, wrapper) and isinstance(block.gate_up, wrapper)
    for parallel in (block.o, block.down):
        assert isinstance(parallel, RowParallelLinear) and isinstance(parallel.linear, wrapper)
    assert isinstance(runtime.lm_head, VocabParallelLinear) and isinstance(runtime.lm_head.linear, wrapper)


def test_native_linears_take_over_a_tied_lm_head_without_copying():
    """The native path keeps the plain layout, so a tied lm_head is wrapped and still shares the embedding table."""
    from splice.layers.native_linear import NativeLinear, can_use_native
    from splice.steps.kernels import wrap_linears

    if not can_use_native(torch.bfloat16, torch.device("cpu")):
        pytest.skip("splice's native kernels are not available on this machine")
    model = build_family("gemma", dtype=torch.bfloat16)  # tied embeddings
    embed = model.get_input_embeddings().weight
    runtime = inject(model, max_out_tokens=32)
    wrap_linears(model, runtime, NativeLinear)
    assert isinstance(runtime.lm_head, NativeLinear) and runtime.lm_head.weight is embed
    assert model.get_output_embeddings() is runtime.lm_head


def test_an_injected_engine_pickles_and_still_records_hidden_states_as_hf(tmp_path):
    """The fused blocks' hidden-state recorders are picklable: torch.save / pickle of an injected engine round-trip,
    and the reloaded engine's logits and hidden states are the HF model's."""
    import pickle

    model = build_family("llama")
    reference = copy.deepcopy(model)
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.save(engine, tmp_path / "engine.pt")
    for again in (pickle.loads(pickle.dumps(engine)), torch.load(tmp_path / "engine.pt", weights_only=False)):
        with torch.no_grad():
            got, want = again(ids, output_hidden_states=True), reference(ids, output_hidden_states=True)
        assert torch.allclose(got.logits, want.logits, atol=1e-5)
        assert len(got.hidden_states) == len(want.hidden_states)
        assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got.hidden_states, want.hidden_states))


def test_hidden_states_are_recorded_as_hf_under_the_registry_of_earlier_transformers_5(monkeypatch):
    """Earlier transformers 5 releases keep ``_can_record_outputs`` in a plain dict keyed by the class's name, with no
    ``get`` that takes a module: kernel injection under it still gives the fused blocks HF's hidden-state recorder."""
    output_capturing = pytest.importorskip("transformers.utils.output_capturing")
    model = build_family("llama")
    reference = copy.deepcopy(model)
    with monkeypatch.context() as patch:
        patch.setattr(output_capturing, "_CAN_RECORD_REGISTRY", dict(output_capturing._CAN_RECORD_REGISTRY))
        engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        got, want = engine(ids, output_hidden_states=True), reference(ids, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states) == model.config.num_hidden_layers + 1
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got.hidden_states, want.hidden_states))


@pytest.mark.parametrize("name", ["gptj", "llama"])
def test_the_decode_runtime_and_its_cache_go_with_the_engine(name):
    """Nothing the fused model keeps (GPT-J's rotary lookup for the HF path included) refers to the decode runtime:
    once the engine is gone, its runtime and KV cache are collected while the model lives on, and the model's own
    forward and generate still give the reference's logits and tokens."""
    reference = build_family(name)
    model = copy.deepcopy(reference)
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    ids, mask = padded_batch(batch=2, length=8)
    greedy = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
    with torch.inference_mode():
        engine.generate(ids, attention_mask=mask, **greedy)
        model(ids, attention_mask=mask)  # the HF path (GPT-J: splice's rotary table)
    runtime, cache = weakref.ref(engine.runtime), weakref.ref(engine.runtime.cache_for(2))
    del engine
    gc.collect()
    assert runtime() is None and cache() is None
    with torch.inference_mode():
        expected, got = reference(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
        assert scaled_error(expected[mask.bool()], got[mask.bool()]) < 1e-4
        assert torch.equal(model.generate(ids, attention_mask=mask, **greedy),
                           reference.generate(ids, attention_mask=mask, **greedy))


def test_a_mixture_of_experts_records_its_router_logits_as_the_model_does():
    reference = build_family("mixtral")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=32)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected, got = reference(ids, output_router_logits=True), engine(ids, output_router_logits=True)
    assert len(got.router_logits) == len(expected.router_logits) == 2
    for want, have in zip(expected.router_logits, got.router_logits):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.aux_loss, expected.aux_loss)
