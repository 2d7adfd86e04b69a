"""The quantize transform: config mapping, validation before any change, and what it records."""
from __future__ import annotations

import pytest
import torch

from splice.config import resolve_config
from splice.pipeline import PipelineContext
from splice.quant import Int4WeightOnlyLinear, Int8DynamicLinear, Int8WeightOnlyLinear, QuantConfig, QuantizedLinear
from splice.transforms import quantize as quantize_transform

from ..arch.tiny_models import build_family


def _run(model, **config):
    resolved = resolve_config(config)
    ctx = PipelineContext(device=torch.device("cpu"))
    quantize_transform.check(model, resolved, ctx)
    return quantize_transform.quantize_model(model, resolved, ctx), ctx


@pytest.mark.parametrize("config, layer_type", [
    ({"dtype": torch.int8}, Int8WeightOnlyLinear),
    ({"dtype": "int8"}, Int8WeightOnlyLinear),
    ({"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 32}}}, Int4WeightOnlyLinear),
    ({"quant": {"enabled": True, "activation": {"enabled": True}}}, Int8DynamicLinear),
])
def test_quantizes_the_block_linears(tiny_llama, config, layer_type):
    model, ctx = _run(tiny_llama, **config)
    assert isinstance(model.model.layers[0].mlp.gate_proj, layer_type)
    assert not isinstance(model.lm_head, QuantizedLinear)
    assert ctx.report[-1][0] == "quantize" and "14 linears" in ctx.report[-1][1]
    assert isinstance(ctx.extras["quant_config"], QuantConfig)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 128, (1, 8))).logits).all()


def test_skipped_without_quantization(tiny_llama):
    model, ctx = _run(tiny_llama, dtype="bf16")
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    assert ctx.report == [("quantize", "skipped (no quantization asked for)")]


def test_check_raises_before_anything_changes(tiny_llama):
    config = resolve_config({"quant": {"enabled": True, "weight": {"num_bits": 8, "q_groups": 3}}})
    with pytest.raises(ValueError, match="q_groups=3 does not divide in_features=64"):
        quantize_transform.check(tiny_llama, config, PipelineContext(device=torch.device("cpu")))
    assert not any(isinstance(m, QuantizedLinear) for m in tiny_llama.modules())


def test_calibration_ids_run_gptq(tiny_llama):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model, ctx = _run(tiny_llama, quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 32,
                                                                     "calibration_ids": ids}})
    assert isinstance(model.model.layers[0].mlp.gate_proj, Int4WeightOnlyLinear)
    assert "GPTQ on 2x16 tokens" in ctx.report[-1][1]


def test_calibration_ids_with_int8_raise_in_check(tiny_llama):
    config = resolve_config({"quant": {"enabled": True, "weight": {"num_bits": 8, "calibration_ids": [[1, 2, 3]]}}})
    with pytest.raises(ValueError, match="int4 weights only"):
        quantize_transform.check(tiny_llama, config, PipelineContext(device=torch.device("cpu")))


@pytest.mark.parametrize("quantize_lm_head", [False, True])
def test_linears_left_in_float_go_on_the_native_gemv_after_injection(quantize_lm_head):
    """Kernel-injected bf16 on CPU: the float lm_head runs on splice's native GEMV as it would without quantization
    (a plain ``nn.Linear`` would run oneDNN's slower GEMV); a quantized one stays quantized."""
    import splice
    from splice.layers.native_linear import NativeLinear, can_use_native

    if not can_use_native(torch.bfloat16, torch.device("cpu")):
        pytest.skip("splice's native kernels are not available on this machine")
    model = build_family("llama", dtype=torch.bfloat16)
    reference = model.lm_head.weight.detach().clone()
    engine = splice.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True, max_out_tokens=32,
                                   quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 32},
                                          "quantize_lm_head": quantize_lm_head})
    head = engine.module.lm_head
    assert isinstance(head, QuantizedLinear if quantize_lm_head else NativeLinear)
    assert head is engine.module.splice_runtime.lm_head
    quantize_note = dict(engine.report)["quantize"]
    assert ("1 linears on splice's native bf16 GEMV" in quantize_note) is not quantize_lm_head
    if not quantize_lm_head:
        torch.testing.assert_close(head.weight, reference, rtol=0, atol=0)
    ids = torch.randint(0, 128, (1, 6))
    assert engine.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 10)


def test_report_names_the_kernels(tiny_llama):
    from splice import native

    _, ctx = _run(tiny_llama, dtype="int8")
    note = ctx.report[-1][1]
    if native.available():
        assert f"kernels: splice native ({native.ISA_DESCRIPTIONS[native.isa()]})" in note
    else:
        assert "kernels: torch's" in note
