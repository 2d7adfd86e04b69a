"""splice.kernel_choice: which kernel each kind of linear gets, and why."""
import pytest
import torch

from splice import kernel_choice, native
from splice.quant import QuantConfig

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


@needs_native
@pytest.mark.parametrize("config", [QuantConfig(), QuantConfig(bits=4, group_size=32, symmetric=False)],
                         ids=["int8", "int4"])
@pytest.mark.parametrize("level", native.ISA_LEVELS)
def test_dot_products_at_every_level_unless_switched_off(monkeypatch, config, level):
    """int8 and int4 weight-only decode on integer dot products at every level, the reason naming the instructions:
    vpdpbusd where the level and CPU have AVX512-VNNI, else AVX-VNNI's where the CPU has it, else AVX2's vpmaddubsw,
    or for int8 weight-only there vpmaddwd on activations rounded to int16; SPLICE_NATIVE_DOT=0 keeps float products
    and says so."""
    if level not in native.supported_isas():
        pytest.skip(f"this CPU cannot run the {level} kernels")
    with native.use_isa(level):
        choice = kernel_choice.quant_kernel(config, "cpu")
        vnni = level != "avx2" and "avx512_vnni" in native._cpu_flags()
        avx_vnni = "AVX-VNNI vpdpbusd, 256-bit" if "avx_vnni" in native._cpu_flags() else "AVX2 vpmaddubsw"
        instructions = "AVX512-VNNI vpdpbusd" if vnni else avx_vnni
        assert choice.native and kernel_choice.dot_instructions() == instructions
        int16 = config.bits == 8 and instructions == "AVX2 vpmaddubsw"
        assert choice.dot_products == (16 if int16 else 8) and f"level {level}" in choice.reason
        assert (f"integer dot products ({'AVX2 vpmaddwd' if int16 else instructions}; each row of activations rounded "
                f"to int{16 if int16 else 8} per block of {256 if int16 else 32})") in choice.reason
        tiles = level == "avx512" and vnni  # int8 weights kept in the dot products' tiles (not on AMX)
        assert ("(the weight in 16-row tiles)" in choice.reason) == (tiles and config.bits == 8)
        monkeypatch.setenv("SPLICE_NATIVE_DOT", "0")
        off = kernel_choice.quant_kernel(config, "cpu")
        assert off.native and not off.dot_products and "SPLICE_NATIVE_DOT=0" in off.reason
        assert "dot products" not in off.reason
        w8a8 = kernel_choice.quant_kernel(QuantConfig(activations=True), "cpu")  # always rounds its activations
        assert w8a8.native and f"integer dot products ({instructions})" in w8a8.reason
        assert ("(the weight in 16-row tiles)" in w8a8.reason) == tiles


@needs_native
def test_int8_weight_only_rounds_to_int16_at_the_avx2_level_only_without_avx_vnni():
    """int16 activations where the avx2 level has no AVX-VNNI (vpmaddubsw's int8 product costs about as much
    arithmetic as bf16's); with AVX-VNNI (where the CPU has it) and at the VNNI levels, int8 ones."""
    for int8 in (QuantConfig(), QuantConfig(group_size=64)):  # per channel and grouped alike
        with native.use_isa("avx2"), native.use_avx_vnni(False):
            choice = kernel_choice.quant_kernel(int8, "cpu")
            assert kernel_choice.int16_activations() and choice.dot_products == 16
            assert "int16 per block of 256" in choice.reason and kernel_choice.INT16_DOT in choice.reason
        if "avx_vnni" in native._cpu_flags():
            with native.use_isa("avx2"), native.use_avx_vnni(True):
                assert kernel_choice.quant_kernel(int8, "cpu").dot_products == 8
        for level in native.supported_isas()[1:]:
            with native.use_isa(level):
                choice = kernel_choice.quant_kernel(int8, "cpu")
                assert not kernel_choice.int16_activations() and choice.dot_products == 8
                assert "int8 per block of 32" in choice.reason


@needs_native
def test_grouped_int8_runs_the_native_grouped_gemv_unless_the_dot_products_are_off(monkeypatch):
    grouped = kernel_choice.quant_kernel(QuantConfig(group_size=64), "cpu")
    assert grouped.kernel == "native" and grouped.dot_products == 8
    assert "grouped int8 GEMV" in grouped.reason and "torch's int8 kernel, one call per group" in grouped.reason
    monkeypatch.setenv("SPLICE_NATIVE_DOT", "0")
    off = kernel_choice.quant_kernel(QuantConfig(group_size=64), "cpu")
    assert off.kernel == "torch" and "SPLICE_NATIVE_DOT=0" in off.reason and "per group" in off.reason


def test_cuda_runs_torch_kernels_and_says_why():
    grouped = kernel_choice.quant_kernel(QuantConfig(group_size=64), "cuda")
    assert grouped.kernel == "torch" and "per group" in grouped.reason
    cuda = kernel_choice.quant_kernel(QuantConfig(), "cuda")
    assert cuda.kernel == "torch" and "cuda" in cuda.reason and "widened" in cuda.reason
    assert "int4 kernels for cuda" in kernel_choice.quant_kernel(QuantConfig(bits=4, group_size=32), "cuda").reason


def test_cuda_int8_layers_widen_the_weight_rather_than_call_torch_s_int8_kernel():
    """On CUDA torch's int8 kernel ran several times slower than a widened weight and one matmul: int8_weight_mm
    never calls it there, whatever the rows; on the CPU it still takes the rows it suits."""
    from splice.quant import kernels

    assert not kernels._int8pack_runs(torch.device("cuda"), 1, 2048)
    assert kernels._int8pack_runs(torch.device("cpu"), 1, kernels.INT8PACK_CPU_K_MULTIPLE * 4)


def test_float_kernel_names_the_level_and_any_override(monkeypatch):
    if not native.available():
        assert kernel_choice.float_kernel(torch.bfloat16, torch.device("cpu")).kernel != "native"
        return
    monkeypatch.setenv("SPLICE_NATIVE_AMX", "0")
    choice = kernel_choice.float_kernel(torch.bfloat16, torch.device("cpu"))
    assert choice.kernel == "native" and native.isa() in choice.reason and "SPLICE_NATIVE_AMX=0" in choice.reason
    assert kernel_choice.float_kernel(torch.float32, torch.device("cpu")).kernel == "torch"


def test_attention_kernel_is_native_for_float32_and_bfloat16_on_cpu_only():
    for dtype in (torch.float32, torch.bfloat16):
        choice = kernel_choice.attention_kernel(dtype, torch.device("cpu"))
        assert choice.native == native.available() and ("attention kernel" in choice.reason)
    fp16 = kernel_choice.attention_kernel(torch.float16, torch.device("cpu"))
    assert fp16.kernel == "torch" and ("float16" in fp16.reason or not native.available())
    cuda = kernel_choice.attention_kernel(torch.bfloat16, torch.device("cuda"))
    assert cuda.kernel == "torch" and "cuda" in cuda.reason


def test_layer_kernel_is_native_for_bfloat16_on_cpu_unless_switched_off(monkeypatch):
    bf16 = kernel_choice.layer_kernel(torch.bfloat16, torch.device("cpu"))
    assert bf16.native == native.available()
    if native.available():
        assert "a run of blocks in one native call" in bf16.reason
    fp32 = kernel_choice.layer_kernel(torch.float32, torch.device("cpu"))
    assert fp32.kernel == "torch" and ("float32" in fp32.reason or not native.available())
    cuda = kernel_choice.layer_kernel(torch.bfloat16, torch.device("cuda"))
    assert cuda.kernel == "torch" and "cuda" in cuda.reason
    monkeypatch.setenv("SPLICE_NATIVE_LAYER", "0")
    off = kernel_choice.layer_kernel(torch.bfloat16, torch.device("cpu"))
    assert off.kernel == "torch" and ("SPLICE_NATIVE_LAYER=0" in off.reason or not native.available())
