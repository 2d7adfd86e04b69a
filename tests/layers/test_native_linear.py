"""bf16 linears on splice's native GEMV, and injection using them."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import splice
from splice.layers.native_linear import NativeLinear, can_use_native

from ..arch.tiny_models import assert_bf16_injection_close_to_hf, build_family, padded_batch

pytestmark = pytest.mark.skipif(not can_use_native(torch.bfloat16, torch.device("cpu")),
                                reason="splice's native kernels are not available on this machine")


@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_the_float_product_at_every_row_count(bias):
    linear = nn.Linear(200, 70, bias=bias).to(torch.bfloat16)
    wrapped = NativeLinear(linear)
    assert wrapped.weight is linear.weight  # nothing copied
    for rows in (1, 3, 4, 5, 16, 40):  # native up to the level's row limit, a GEMM above
        x = torch.randn(rows, 1, 200).to(torch.bfloat16)
        expected = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
        torch.testing.assert_close(wrapped(x).float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bias", [False, True])
def test_prompts_without_bf16_arithmetic_take_the_widened_float32_gemms(monkeypatch, bias):
    """A layer built where oneDNN has no bf16 arithmetic multiplies prompts on ``widened_linear``; decode rows keep
    the native GEMV."""
    from splice import native
    monkeypatch.setattr(native, "prompts_widened", lambda: True)
    linear = nn.Linear(200, 70, bias=bias).to(torch.bfloat16)
    wrapped = NativeLinear(linear)
    calls, op = [], torch.ops.splice_kernels.widened_linear
    monkeypatch.setattr(torch.ops.splice_kernels, "widened_linear", lambda x, w: calls.append(x.shape) or op(x, w))
    prompt = native.MAX_ROWS["bf16"] + 1
    for rows in (1, prompt):
        x = torch.randn(rows, 1, 200).to(torch.bfloat16)
        expected = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
        out = wrapped(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 1, 70)
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    assert calls == [(prompt, 200)] and "prompts: float32 GEMMs on widened slabs" in repr(wrapped)


def test_the_avx2_level_keeps_batches_to_its_row_limit_on_the_gemv(monkeypatch):
    """At the avx2 level (no bf16 arithmetic in oneDNN) the bf16 GEMV serves up to ``native.AVX2_BF16_ROWS`` rows,
    prompts included, where it beats the widened float32 GEMMs; longer prompts take those."""
    from splice import native
    monkeypatch.setattr(native, "prompts_widened", lambda: True)
    linear = nn.Linear(96, 40).to(torch.bfloat16)
    with native.use_isa("avx2"):
        wrapped = NativeLinear(linear)
        limit = native.MAX_ROWS["bf16"]
        assert limit == native.AVX2_BF16_ROWS > 32
        gemv, widened = torch.ops.splice_kernels.bf16_gemv, torch.ops.splice_kernels.widened_linear
        calls = []
        monkeypatch.setattr(torch.ops.splice_kernels, "bf16_gemv",
                            lambda x, w, *rest: calls.append(("gemv", x.shape[0])) or gemv(x, w, *rest))
        monkeypatch.setattr(torch.ops.splice_kernels, "widened_linear",
                            lambda x, w: calls.append(("widened", x.shape[0])) or widened(x, w))
        for rows in (limit, limit + 1):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            expected = x.float() @ linear.weight.float().T + linear.bias.float()
            torch.testing.assert_close(wrapped(x).float(), expected, rtol=2e-2, atol=2e-2)
    assert calls == [("gemv", limit), ("widened", limit + 1)]


def test_can_use_native_only_for_bf16_on_cpu():
    assert not can_use_native(torch.float32, torch.device("cpu"))
    assert not can_use_native(torch.float16, torch.device("cpu"))
    assert not can_use_native(torch.bfloat16, torch.device("meta"))


def test_bf16_injection_uses_native_linears_and_stays_close_to_hf():
    reference = build_family("llama", dtype=torch.bfloat16)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    block = engine.module.model.layers[0]
    assert isinstance(block.qkv, NativeLinear) and isinstance(engine.module.lm_head, NativeLinear)
    kernels = engine.step_report("kernels")
    assert (kernels.float_linears.kernel, kernels.float_linears.count) == ("native", 4 * 2 + 1)
    assert_bf16_injection_close_to_hf(reference, engine)
    ids, _ = padded_batch()
    with torch.inference_mode():
        greedy_ref = reference.generate(ids[:1, 4:], max_new_tokens=12, do_sample=False)
        greedy = engine.generate(ids[:1, 4:], max_new_tokens=12, do_sample=False)
    assert (greedy_ref == greedy).float().mean() > 0.9

