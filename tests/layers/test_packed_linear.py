"""oneDNN-packed linears for 16-bit weights on CPU, and injection using them."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import splice
from splice.layers.packed_linear import PackedLinear, can_pack

from ..arch.tiny_models import assert_bf16_injection_close_to_hf, build_family

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this torch has no oneDNN bf16 support")


def test_packed_linear_matches_linear_and_frees_the_plain_weight():
    linear = nn.Linear(48, 80, bias=True).to(torch.bfloat16)
    x = torch.randn(3, 5, 48).to(torch.bfloat16)
    expected = linear(x)
    packed = PackedLinear(linear)
    assert linear.weight is None
    torch.testing.assert_close(packed(x), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(packed(x[:, -1:]), expected[:, -1:], rtol=1e-2, atol=1e-2)


def test_can_pack_only_16_bit_weights_on_cpu():
    assert not can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.bfloat16, torch.device("meta"))


def test_bf16_injection_packs_without_native_kernels_and_stays_close_to_hf(monkeypatch):
    monkeypatch.setattr(splice.native, "available", lambda: False)
    reference = build_family("llama", dtype=torch.bfloat16)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    block = engine.module.model.layers[0]
    assert isinstance(block.qkv, PackedLinear) and isinstance(engine.module.lm_head, PackedLinear)
    kernels = engine.step_report("kernels")
    assert (kernels.float_linears.kernel, kernels.float_linears.count) == ("packed", 4 * 2 + 1)
    assert_bf16_injection_close_to_hf(reference, engine)


def test_fp32_injection_does_not_pack(tiny_llama):
    engine = splice.init_inference(tiny_llama, replace_with_kernel_inject=True, max_out_tokens=64)
    assert type(engine.module.model.layers[0].qkv) is nn.Linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_linears_pickle_and_deep_copy_packed(dtype, monkeypatch):
    """Copies unpack the opaque weight and pack it again: an injected engine that packed its linears deep-copies and
    pickles, and the copies give its logits."""
    import pickle

    if not can_pack(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN does not compute in {dtype} on this CPU, so nothing packs")
    linear = nn.Linear(48, 80, bias=True).to(dtype)
    packed = PackedLinear(linear)
    x = torch.randn(3, 48).to(dtype)
    for again in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        assert again.weight.layout == torch._mkldnn and packed.weight.layout == torch._mkldnn
        assert torch.equal(again(x), packed(x))
    monkeypatch.setattr(splice.native, "available", lambda: False)  # bf16 would take the native GEMV otherwise
    engine = splice.init_inference(build_family("llama", dtype=dtype), replace_with_kernel_inject=True,
                                   max_out_tokens=32)
    assert any(isinstance(m, PackedLinear) for m in engine.modules())
    ids = torch.tensor([[3, 4, 5, 6]])
    logits = engine(ids).logits
    for again in (copy.deepcopy(engine), pickle.loads(pickle.dumps(engine))):
        assert torch.equal(again(ids).logits, logits)
