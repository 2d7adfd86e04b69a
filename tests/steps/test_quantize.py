"""The quantize step: config mapping, validation before any change (in the plan), and what it reports."""
from __future__ import annotations

import pytest
import torch

from splice.quant import Int4WeightOnlyLinear, Int8DynamicLinear, Int8WeightOnlyLinear, QuantizedLinear
from splice.steps.quantize import quantize_weights

from ..arch.tiny_models import build_family
from .plans import plan_for, run_step


def _run(model, **config):
    stage, report = run_step(quantize_weights, model, **config)
    return stage.model, report


@pytest.mark.parametrize("config, layer_type", [
    ({"dtype": torch.int8}, Int8WeightOnlyLinear),
    ({"dtype": "int8"}, Int8WeightOnlyLinear),
    ({"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 32}}}, Int4WeightOnlyLinear),
    ({"quant": {"enabled": True, "activation": {"enabled": True}}}, Int8DynamicLinear),
])
def test_quantizes_the_block_linears(tiny_llama, config, layer_type):
    model, report = _run(tiny_llama, **config)
    assert isinstance(model.model.layers[0].mlp.gate_proj, layer_type)
    assert type(model.lm_head) is Int8WeightOnlyLinear and not model.lm_head.grouped  # the default head: int8
    assert report.step == "quantize" and len(report.quant.quantized) == 14 + 1
    assert report.quant.kind == layer_type.kind
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 128, (1, 8))).logits).all()


@pytest.mark.parametrize("quantize_lm_head, head_type", [(None, Int8WeightOnlyLinear), (True, Int4WeightOnlyLinear),
                                                         (False, torch.nn.Linear)])
def test_output_head_is_int8_by_default_the_scheme_or_float(tiny_llama, quantize_lm_head, head_type):
    model, report = _run(tiny_llama, quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 32},
                                            "quantize_lm_head": quantize_lm_head})
    assert type(model.lm_head) is head_type
    assert ("lm_head" in report.quant.kept_float) == (quantize_lm_head is False)
    assert ("output head lm_head: int8_weight_only" in report.summary()) == (quantize_lm_head is None)


def test_skipped_without_quantization(tiny_llama):
    model, report = _run(tiny_llama, dtype="bf16")
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    assert report.quant is None and report.summary() == "skipped (no quantization asked for)"


def test_check_raises_before_anything_changes(tiny_llama):
    with pytest.raises(ValueError, match="q_groups=3 does not divide in_features=64"):
        plan_for(tiny_llama, quant={"enabled": True, "weight": {"num_bits": 8, "q_groups": 3}})
    assert not any(isinstance(m, QuantizedLinear) for m in tiny_llama.modules())


def test_calibration_ids_run_gptq(tiny_llama):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model, report = _run(tiny_llama, quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 32,
                                                                        "calibration_ids": ids}})
    assert isinstance(model.model.layers[0].mlp.gate_proj, Int4WeightOnlyLinear)
    assert "GPTQ on 2x16 tokens" in report.quant.calibration


def test_calibration_ids_with_int8_raise_in_check(tiny_llama):
    with pytest.raises(ValueError, match="int4 weights only"):
        plan_for(tiny_llama, quant={"enabled": True, "weight": {"num_bits": 8, "calibration_ids": [[1, 2, 3]]}})


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
    assert head is engine.runtime.lm_head
    kernels = engine.step_report("kernels")
    floats = kernels.float_linears
    assert (floats.kernel, floats.count) == (("torch", 0) if quantize_lm_head else ("native", 1))
    assert (kernels.quantized_linears.linears, kernels.quantized_linears.kernel) == ("int4_weight_only", "native")
    if not quantize_lm_head:
        torch.testing.assert_close(head.weight, reference, rtol=0, atol=0)
    ids = torch.randint(0, 128, (1, 6))
    assert engine.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 10)


def test_report_names_the_kernels(tiny_llama):
    from splice import native

    _, report = _run(tiny_llama, dtype="int8")
    expected = "native" if native.available() else "torch"
    assert report.quant.kernel.kernel == expected
    assert report.summary().endswith(f"kernels: {expected}")
    if native.available():
        assert native.isa() in report.quant.kernel.reason
