"""The kernels step: the fused blocks' decode-step attention as the plan chose it, and said so."""
import copy

import pytest
import torch

import splice
from splice import native

from splice.steps.kernels import small_step_tensors

from ..arch.tiny_models import build_family

PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def attention_calls(engine, new_tokens: int) -> int:
    with torch.profiler.profile() as profile:
        engine.generate(PROMPT, max_new_tokens=new_tokens, do_sample=False)
    return sum(event.name == "splice_kernels::decode_attention" for event in profile.events())


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_decode_steps_attend_on_the_native_kernel_and_prompts_do_not():
    engine = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, max_out_tokens=32)
    assert all(block.native_attention for block in engine.runtime.blocks)
    assert "attention: decode steps: splice's attention kernel" in engine.step_report("kernels").summary()
    layers = len(engine.runtime.blocks)
    assert attention_calls(engine, 4) == 3 * layers  # the 3 decode steps; the prefill is SDPA's


def test_float16_and_alibi_attend_as_before():
    fp16 = splice.init_inference(build_family("llama"), dtype=torch.float16, replace_with_kernel_inject=True,
                                 max_out_tokens=32)
    assert not any(block.native_attention for block in fp16.runtime.blocks)
    assert "not splice's attention kernel" in fp16.step_report("kernels").summary()
    bloom = splice.init_inference(build_family("bloom"), replace_with_kernel_inject=True, max_out_tokens=32)
    assert attention_calls(bloom, 3) == 0  # ALiBi's bias: the block's own path


def test_the_blocks_norms_and_biases_share_huge_pages_and_the_tokens_stay_the_same():
    reference = build_family("qwen2")  # biases on q, k and v
    expected = reference.generate(PROMPT, max_new_tokens=6, do_sample=False)
    engine = splice.init_inference(build_family("qwen2"), replace_with_kernel_inject=True, max_out_tokens=32)
    small = small_step_tensors(engine.runtime)
    norms = [block.attn_norm.weight for block in engine.runtime.blocks] + [engine.runtime.norm.weight]
    assert all(any(t is norm for t in small) for norm in norms)
    assert any(t.dim() == 1 and t.numel() == block.qkv.weight.shape[0]
               for block in engine.runtime.blocks for t in small)  # the fused qkv's bias
    assert torch.equal(engine.generate(PROMPT, max_new_tokens=6, do_sample=False), expected)
    summary = engine.step_report("kernels").summary()
    if native.huge_pages_supported():
        assert len({t.untyped_storage().data_ptr() for t in small if t.dtype == norms[0].dtype}) == 1
        assert "norms and biases on 2 MiB pages" in summary
    else:
        assert "norms and biases" not in summary


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_a_mixture_of_experts_linears_take_the_native_gemv_and_the_logits_stay_close():
    """Qwen2-MoE's shared expert and its one-output gate are plain linears inside the layer's own MLP module; each
    expert's matrices become a native GEMV on its slice of the 3-D weight (nothing copied)."""
    from splice.layers.native_linear import NativeLinear

    reference = build_family("qwen2_moe", dtype=torch.bfloat16)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, dtype=torch.bfloat16,
                                   max_out_tokens=32)
    moe = engine.runtime.blocks[0].moe
    shared = moe.shared_expert
    assert all(isinstance(linear, NativeLinear)
               for linear in (shared.gate_proj, shared.up_proj, shared.down_proj, moe.shared_expert_gate))
    experts = moe.experts
    assert [len(experts.gate_up_proj), len(experts.down_proj)] == [4, 4]
    assert all(isinstance(layer, NativeLinear) for layer in [*experts.gate_up_proj, *experts.down_proj])
    first, second = experts.gate_up_proj[0].weight, experts.gate_up_proj[1].weight
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()  # views of one weight
    assert "native" in engine.step_report("kernels").summary()
    with torch.inference_mode():
        expected = reference(PROMPT).logits
        got = engine(PROMPT).logits
    assert ((got - expected).float().abs().max() / expected.float().std()).item() < 0.05
