"""Which kernel each kind of linear computes with, and why: every such decision splice makes, in one place.

``plan.resolve`` asks here once per model (the choices land on the ``Plan``); the steps apply them (the quantize step
builds its layers for the chosen kernel, the kernels step wraps the float linears), and ``splice info`` prints them.
``splice.quant.quantize`` called directly asks here too. A choice is a strategy name plus the reason in words:

=========  =============================================================================================================
kernel     what computes
=========  =============================================================================================================
native     splice's own GEMVs (``splice.native``: AVX2, AVX-512, AMX) for decode rows; one oneDNN GEMM above the level's
           row limit (``native.MAX_ROWS``), or float32 GEMMs on widened slabs of the weight where oneDNN has no bf16
           arithmetic (``native.prompts_widened``)
packed     float linears only: a weight pre-packed for oneDNN (``layers.packed_linear``)
widened    float linears only, fp16 on a CPU without fp16 arithmetic: torch's GEMV for decode, the weight widened
           to fp32 for one GEMM for prompts (``layers.widened_linear``)
torch      torch's own kernels for the device (``F.linear``; ``_weight_int8pack_mm``, ``_weight_int4pack_mm``)
=========  =============================================================================================================
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import native
from .layers.native_linear import can_use_native
from .layers.packed_linear import can_pack
from .layers.widened_linear import needs_widening

if TYPE_CHECKING:
    from .quant.scheme import QuantConfig

#: The environment variables that change which native kernels run (named in the reasons when set).
NATIVE_ENV = ("SPLICE_NATIVE_KERNELS", "SPLICE_NATIVE_ISA", "SPLICE_NATIVE_AMX", "SPLICE_NATIVE_DOT",
              "SPLICE_NATIVE_AVX_VNNI", "SPLICE_NATIVE_LAYER")
#: The instructions int8 weight-only multiplies its int16 activations with (:func:`int16_activations`).
INT16_DOT = "AVX2 vpmaddwd"
#: Which entry of ``native.MAX_ROWS`` bounds each quantization kind's native GEMV.
ROW_LIMIT_OF = {"int8_weight_only": "int8", "int8_dynamic": "w8a8", "int4_weight_only": "int4"}


@dataclass(frozen=True)
class KernelChoice:
    """How one kind of linear computes (``kernel``: "native", "packed", "widened" or "torch") and why, in words."""

    kernel: str
    reason: str
    #: decode rows summed in integers: 8, rounded to int8 per block of 32; 16 (int8 weight-only only), to int16 per
    #: block of 256 (:func:`int16_activations`); 0, float products
    dot_products: int = 0

    @property
    def native(self) -> bool:
        return self.kernel == "native"


def float_kernel(dtype: torch.dtype | None, device: torch.device) -> KernelChoice:
    """How a fused model's float linears (and those quantization leaves in float) compute."""
    if dtype is not None and can_use_native(dtype, device):
        return KernelChoice("native", f"bf16 on CPU: splice's bf16 GEMV up to {native.MAX_ROWS['bf16']} rows, "
                                      f"{prompt_gemm()} above; {native_level()}")
    if dtype is not None and can_pack(dtype, device):
        return KernelChoice("packed", f"{dtype} on CPU without splice's native bf16 GEMV ({why_not_native(device)}): "
                                      "oneDNN-packed weights")
    if dtype is not None and needs_widening(dtype, device):
        return KernelChoice("widened", f"{dtype} on a CPU without {dtype} arithmetic: torch's converting GEMV for "
                                       "decode, an fp32 GEMM on the widened weight for prompts")
    return KernelChoice("torch", f"{dtype} on {torch.device(device).type}: torch's own linear")


def prompt_gemm() -> str:
    """How the native layers multiply prompts (more rows than their GEMVs take), in words."""
    if native.prompts_widened():
        return "float32 GEMMs on slabs of the widened weight (oneDNN has no bf16 arithmetic on this CPU)"
    return "one oneDNN GEMM"


def attention_kernel(dtype: torch.dtype | None, device: torch.device | str) -> KernelChoice:
    """How a fused decoder's decode steps (one query per row) attend; prompts always take SDPA."""
    if dtype in (torch.float32, torch.bfloat16) and native.available_on(device):
        return KernelChoice("native", "decode steps: splice's attention kernel for one query (each row's keys split "
                                      "over the threads, float32 sums; head_dim a multiple of 16 up to 256, no ALiBi "
                                      f"or soft-capping, else as below); prompts: SDPA; {native_level()}")
    why = f"it takes float32 and bfloat16, not {dtype}" if native.available_on(device) else why_not_native(device)
    return KernelChoice("torch", f"SDPA (a compiled step: inductor's fused loops), not splice's attention kernel "
                                 f"({why})")


def layer_kernel(dtype: torch.dtype | None, device: torch.device | str) -> KernelChoice:
    """Whether a fused decoder's decode steps run its blocks in native calls (``layers.native_layer``): bf16 on
    CPU with the native kernels; each block then takes it where its structure and layers allow (the kernels step
    says which did and why the others did not)."""
    if dtype != torch.bfloat16 or not native.available_on(device):
        why = f"it takes bfloat16, not {dtype}" if native.available_on(device) else why_not_native(device)
        return KernelChoice("torch", f"each block's own ops ({why})")
    if native.switched_off("SPLICE_NATIVE_LAYER"):
        return KernelChoice("torch", "each block's own ops (SPLICE_NATIVE_LAYER=0)")
    return KernelChoice("native", "decode steps: a run of blocks in one native call (norms, GEMVs, rotary, cache "
                                  "writes, attention, residual adds and activation), for pre-norm blocks with a gated "
                                  f"SiLU MLP and RMSNorm whose linears all run native GEMVs; {native_level()}")


def quant_kernel(config: QuantConfig, device: torch.device | str) -> KernelChoice:
    """How the linears quantized with ``config`` compute on ``device``."""
    device, kind = torch.device(device), config.kind
    if kind == "int8_weight_only" and (config.group_size is not None or config.q_groups != 1):
        return grouped_int8_kernel(device)
    if native.available_on(device):
        limit = native.MAX_ROWS[ROW_LIMIT_OF[kind]]
        in_tiles = " (the weight in 16-row tiles)" if native.int8_tiles_ready() else ""
        if kind == "int8_dynamic":  # its activations are rounded anyway: always on integer dot products
            return KernelChoice("native", f"activations rounded to int8 per block of 32, splice's int8 GEMV on "
                                          f"integer dot products ({dot_instructions()}){in_tiles} up to {limit} rows, "
                                          f"de-quantise + {prompt_gemm()} above; {native_level()}")
        dot = dot_products()
        if dot:
            bits = ROW_LIMIT_OF[kind]
            limit = max(limit, native.MAX_ROWS[f"{bits}_dot"])  # the dot products' rows, then (AMX) tiles
            tiles = ""
            if native.amx_ready():  # batches past the dot products' rows go to AMX tiles, on x as it is
                first = (native.amx_thresholds()["int4_dot_min_rows"] if bits == "int4"
                         else native.MAX_ROWS["int8_dot"] + 1)
                tiles = f" (from {first} rows, AMX tiles on x as it is)"
            wide = bits == "int8" and int16_activations()
            rounding = (f"{INT16_DOT}; each row of activations rounded to int16 per block of 256" if wide else
                        f"{dot}; each row of activations rounded to int8 per block of 32")
            layout = in_tiles if bits == "int8" and not wide else ""
            return KernelChoice("native", f"splice's {bits} GEMV up to {limit} rows on integer dot products "
                                          f"({rounding}){layout}{tiles}, de-quantise + {prompt_gemm()} above; "
                                          f"{native_level()}", dot_products=16 if wide else 8)
        return KernelChoice("native", f"splice's {ROW_LIMIT_OF[kind]} GEMV up to {limit} rows, de-quantise + "
                                      f"{prompt_gemm()} above; {native_level()}")
    if kind != "int4_weight_only" and device.type == "cuda":
        return KernelChoice("torch", f"the int8 weight widened to the activations' dtype on every call, then torch's "
                                     f"matmul on cuda (torch's int8 kernel is slower there; {why_not_native(device)})")
    return KernelChoice("torch", f"torch's {'int4' if kind == 'int4_weight_only' else 'int8'} kernels for "
                                 f"{device.type} ({why_not_native(device)})")


def grouped_int8_kernel(device: torch.device) -> KernelChoice:
    """How int8 weight-only linears quantized in groups of input columns compute: splice's grouped GEMV on integer
    dot products where the native kernels run and the dot products are on, else torch's int8 kernel per group."""
    from .quant.qmath import ACTIVATION_BLOCK as block, WIDE_ACTIVATION_BLOCK  # here: splice.quant imports this module

    per_group = "torch's int8 kernel, one call per group"
    dot = dot_products() if native.available_on(device) else ""
    if not dot:
        why = "SPLICE_NATIVE_DOT=0" if native.available_on(device) else why_not_native(device)
        return KernelChoice("torch", f"grouped int8 runs on {per_group} ({why})")
    wide = int16_activations()
    rounding = f"int16 per block of {WIDE_ACTIVATION_BLOCK}" if wide else f"int8 per block of {block}"
    tiles = " the weight in 16-row tiles," if wide or native.int8_grouped_tiles_ready() else ""
    dot = INT16_DOT if wide else dot
    return KernelChoice("native", f"splice's grouped int8 GEMV up to {native.MAX_ROWS['int8_dot']} rows on integer dot "
                                  f"products ({dot}; each row of activations rounded to {rounding}),{tiles} "
                                  f"with each group zero-padded to whole blocks of {block} where that adds at most "
                                  f"half its bytes (else {per_group}), de-quantise + {prompt_gemm()} above; "
                                  f"{native_level()}",
                        dot_products=16 if wide else 8)


def dot_products() -> str:
    """:func:`dot_instructions`, or "" with ``SPLICE_NATIVE_DOT=0`` (float products for int8 and int4 weight-only, to
    compare the two)."""
    return "" if native.switched_off("SPLICE_NATIVE_DOT") else dot_instructions()


def int16_activations() -> bool:
    """Whether int8 weight-only's decode rows round their activations to int16 (``int8_dot16_gemv``, :data:`INT16_DOT`)
    rather than to int8: at the avx2 level without AVX-VNNI. There an int8 x int8 product takes vpmaddubsw, vpmaddwd
    and a float multiply-add per block of 32 columns, little less arithmetic than bf16's multiply-adds, so a batch
    bound by arithmetic gains little from int8; int16 activations need two vpmaddwd and two adds per 32 columns, and
    their rounding error is far smaller (``docs/kernels.md``)."""
    return native.isa() == "avx2" and not native.avx_vnni_ready()


def dot_instructions() -> str:
    """The instructions the native int8 and int4 decode GEMVs multiply in integers with at the active level:
    "AVX512-VNNI vpdpbusd" (the avx512 and amx levels, on a CPU with AVX512-VNNI), else the avx2 kernels' "AVX-VNNI
    vpdpbusd, 256-bit" (a CPU with AVX-VNNI, unless turned off) or "AVX2 vpmaddubsw"; "" where the native kernels
    are not available."""
    if not native.available():
        return ""
    if torch.ops.splice_kernels.vnni_ready():
        return "AVX512-VNNI vpdpbusd"
    return "AVX-VNNI vpdpbusd, 256-bit" if native.avx_vnni_ready() else "AVX2 vpmaddubsw"


def native_level() -> str:
    """The native kernels' level, what it uses, and what set it (the CPU, or an environment variable)."""
    level = native.isa()
    source = env_overrides() or "the best this CPU runs"
    return f"level {level} ({native.ISA_DESCRIPTIONS[level]}), {source}"


def why_not_native(device: torch.device | str) -> str:
    """Why splice's native kernels do not run for tensors on ``device``."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"they are CPU kernels and the weights are on {device.type}"
    if not native.enabled_by_env():
        return f"SPLICE_NATIVE_KERNELS={os.environ['SPLICE_NATIVE_KERNELS']}"
    return native.unsupported_reason() or "they did not build here (see the warning above)"


def env_overrides() -> str:
    """The native-kernel environment variables set in this process, as ``NAME=value`` pairs ("" if none)."""
    return ", ".join(f"{name}={os.environ[name]}" for name in NATIVE_ENV if os.environ.get(name, "").strip())
