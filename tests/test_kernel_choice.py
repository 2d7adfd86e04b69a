"""splice.kernel_choice: which kernel each kind of linear gets, and why."""
import pytest
import torch

from splice import kernel_choice, native
from splice.quant import QuantConfig

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


@needs_native
@pytest.mark.parametrize("config", [QuantConfig(), QuantConfig(bits=4, group_size=32, symmetric=False)],
                         ids=["int8", "int4"])
def test_dot_products_where_the_cpu_has_vnni_unless_switched_off(monkeypatch, config):
    choice = kernel_choice.quant_kernel(config, "cpu")
    ready = torch.ops.splice_kernels.int4_dot_ready() if config.bits == 4 else torch.ops.splice_kernels.int8_dot_ready()
    assert choice.native and choice.dot_products == bool(ready)
    monkeypatch.setenv("SPLICE_NATIVE_DOT", "0")
    off = kernel_choice.quant_kernel(config, "cpu")
    assert off.native and not off.dot_products and "SPLICE_NATIVE_DOT=0" in off.reason


def test_grouped_int8_and_cuda_run_torch_kernels_and_say_why():
    grouped = kernel_choice.quant_kernel(QuantConfig(group_size=64), "cpu")
    assert grouped.kernel == "torch" and "group" in grouped.reason
    cuda = kernel_choice.quant_kernel(QuantConfig(), "cuda")
    assert cuda.kernel == "torch" and "cuda" in cuda.reason


def test_float_kernel_names_the_level_and_any_override(monkeypatch):
    if not native.available():
        assert kernel_choice.float_kernel(torch.bfloat16, torch.device("cpu")).kernel != "native"
        return
    monkeypatch.setenv("SPLICE_NATIVE_AMX", "0")
    choice = kernel_choice.float_kernel(torch.bfloat16, torch.device("cpu"))
    assert choice.kernel == "native" and native.isa() in choice.reason and "SPLICE_NATIVE_AMX=0" in choice.reason
    assert kernel_choice.float_kernel(torch.float32, torch.device("cpu")).kernel == "torch"
