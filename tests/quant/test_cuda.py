"""The quantized layers on CUDA (torch's int4 / int8 kernels; W8A8 rounds the activations per block, then runs the
int8 ones): kernel against the de-quantized weights, the saved form moving between CPU and CUDA, and a kernel-injected
int4 model generating. Skipped without a CUDA device; ``benchmarks/device_check.sh`` runs them on a lent GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import splice
from splice.quant import HANDLERS

from ..arch.tiny_models import build_family
from .test_layers import SCHEMES, _reference_input

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
CUDA_SCHEMES = ("int8", "int8-g64", "int4-g32", "int4-g64-asym", "int4-g128", "w8a8")


def _cuda_layer(scheme: str, out_features: int = 200, in_features: int = 320):
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features, device="cuda") / in_features ** 0.5
    bias = torch.randn(out_features, device="cuda")
    return weight, bias, HANDLERS[SCHEMES[scheme].kind].from_float(weight, bias, SCHEMES[scheme])


@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("scheme", CUDA_SCHEMES)
def test_cuda_kernel_matches_dequantized_weights(scheme, rows):
    _, bias, layer = _cuda_layer(scheme)
    x = torch.randn(rows, 320, device="cuda")
    expected = F.linear(_reference_input(x, scheme), layer.dequantize(), bias)
    out = layer(x)
    assert out.device.type == "cuda" and out.shape == expected.shape
    assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2


@needs_cuda
@pytest.mark.parametrize("scheme", ["int8", "int4-g32", "w8a8"])
def test_saved_form_moves_between_cpu_and_cuda(scheme):
    """Packed layouts (and int4's padding) differ by device: a CUDA layer's state loads into a CPU layer and the CPU
    layer's back into a CUDA one, the weights unchanged."""
    _, _, layer = _cuda_layer(scheme)
    cpu = HANDLERS[SCHEMES[scheme].kind].empty(320, 200, True, SCHEMES[scheme], "cpu")
    cpu.load_state_dict({key: value.cpu() for key, value in layer.state_dict().items()})
    torch.testing.assert_close(cpu.dequantize(), layer.dequantize().cpu(), rtol=0, atol=0)
    back = HANDLERS[SCHEMES[scheme].kind].empty(320, 200, True, SCHEMES[scheme], "cuda")
    back.load_state_dict(cpu.state_dict())
    torch.testing.assert_close(back.dequantize(), layer.dequantize(), rtol=0, atol=0)


@needs_cuda
def test_kernel_injected_int4_model_generates_on_cuda():
    model = build_family("llama", dtype=torch.bfloat16)
    engine = splice.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True, max_out_tokens=32,
                                   device="cuda", quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 32}})
    assert engine.step_report("quantize").quant.kernel.kernel == "torch"
    ids = torch.randint(0, 128, (2, 6), device="cuda")
    out = engine.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 11) and out.device.type == "cuda"
    assert torch.isfinite(engine(ids).logits).all()
