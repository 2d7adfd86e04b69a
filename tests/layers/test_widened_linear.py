"""fp16 on a CPU without fp16 arithmetic: torch's converting GEMV for decode rows, an fp32 GEMM on the widened weight
for prompts; and kernel injection choosing it (the CPU is emulated here by the plan's two capability checks; the real
emulated CPU runs in tests/test_deepspeed_snippets.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import splice
from splice import kernel_choice, plan
from splice.layers import widened_linear
from splice.layers.widened_linear import WIDEN_FROM_ROWS, WidenedLinear, needs_widening

from ..conftest import build_tiny, tiny_llama_config


@pytest.mark.parametrize("rows", [1, WIDEN_FROM_ROWS - 1, WIDEN_FROM_ROWS, 3 * WIDEN_FROM_ROWS])
def test_widened_linear_matches_fp32_and_widens_from_its_row_count(monkeypatch, rows):
    linear = nn.Linear(48, 80, bias=True).to(torch.float16)
    x = torch.randn(rows, 48).to(torch.float16)
    expected = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    seen, linear_op, product = [], F.linear, widened_linear.widened_product
    monkeypatch.setattr(widened_linear.F, "linear", lambda x, w, b: seen.append(w.dtype) or linear_op(x, w, b))
    monkeypatch.setattr(widened_linear, "widened_product", lambda x, w, b: seen.append("widened") or product(x, w, b))
    layer = WidenedLinear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias  # nothing copied, nothing kept in fp32
    out = layer(x.unsqueeze(0))
    assert out.dtype == torch.float16 and out.shape == (1, rows, 80)
    torch.testing.assert_close(out[0].float(), expected, rtol=2e-3, atol=2e-3)
    assert seen[0] == ("widened" if rows >= WIDEN_FROM_ROWS else torch.float16)


def test_needs_widening_only_fp16_on_a_cpu_without_it(monkeypatch):
    assert not needs_widening(torch.bfloat16, torch.device("cpu"))
    assert not needs_widening(torch.float16, torch.device("meta"))
    monkeypatch.setattr(widened_linear, "onednn_computes_in", lambda dtype: False)
    assert needs_widening(torch.float16, torch.device("cpu"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fp16_injection_without_fp16_arithmetic_widens_every_float_linear(monkeypatch, tied):
    reference = build_tiny(tiny_llama_config(tie_word_embeddings=tied, initializer_range=0.2))
    monkeypatch.setattr(kernel_choice, "can_pack", lambda dtype, device: False)
    monkeypatch.setattr(kernel_choice, "needs_widening", lambda dtype, device: dtype == torch.float16)
    monkeypatch.setattr(plan, "onednn_computes_in", lambda dtype: dtype != torch.float16)
    with pytest.warns(UserWarning, match=r"no AVX512-FP16 .* slower than dtype=torch.bfloat16"):
        engine = splice.init_inference(copy.deepcopy(reference), dtype=torch.float16, replace_with_kernel_inject=True)
    assert engine.step_report("kernels").float_linears.kernel == "widened"
    block = engine.module.model.layers[0]
    assert all(isinstance(getattr(block, name), WidenedLinear) for name in ("qkv", "o", "gate_up", "down"))
    head = engine.module.lm_head
    assert isinstance(head, WidenedLinear)
    assert (head.weight is engine.module.model.embed_tokens.weight) == tied
    ids = torch.tensor([[5, 17, 33, 9, 71, 4] * 3])  # a prompt past WIDEN_FROM_ROWS, then decode rows
    expected = reference.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(engine.generate(ids, max_new_tokens=8, do_sample=False), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prompts_in_float32_widens_16_bit_linears_inside_the_block_only(monkeypatch, dtype):
    """Every plain 16-bit ``nn.Linear`` multiplies in float32 inside the block (the products and float32 sums of a
    16-bit GEMM, output in the input's dtype); hooks still fire, and the class's forward is back afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32, bias=False)).to(dtype)
    x = torch.randn(2, 24, 64).to(dtype)
    hooked = []
    model[2].register_forward_hook(lambda module, inputs, output: hooked.append(inputs[0].shape))
    hidden = F.linear(x.float(), model[0].weight.float(), model[0].bias.float()).to(dtype).relu()
    expected = F.linear(hidden.float(), model[2].weight.float()).to(dtype)
    monkeypatch.setattr(widened_linear, "onednn_computes_in", lambda d: False)
    with widened_linear.prompts_in_float32(model) as count:
        assert count == 2 and "forward" in vars(model[0])
        got = model(x)
    assert got.dtype == dtype and hooked == [(2, 24, 96)]
    torch.testing.assert_close(got, expected)  # float32 products and sums, rounded once (the sums' order may differ)
    assert "forward" not in vars(model[0]) and "forward" not in vars(model[2])
    monkeypatch.setattr(widened_linear, "onednn_computes_in", lambda d: True)
    with widened_linear.prompts_in_float32(model) as count:
        assert count == 0  # a CPU with the arithmetic keeps the 16-bit GEMM
