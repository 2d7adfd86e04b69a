"""Thin wrappers over the integer kernels, one per operation, with the CPU / CUDA / native split in one place: torch's
own kernels, and splice's native GEMVs (``splice.native``: AVX2, AVX-512, AMX; ``torch.ops.splice_kernels``) on CPUs
where those build.

Which kernel runs where (M = rows of activations in the call; whether a layer may use the native kernels at all is
given to it when built, as ``splice.kernel_choice.quant_kernel`` decided; the row limits are ``native.MAX_ROWS`` of
the active level):

=============================  ============================================  ========================================
scheme                         CPU, ``splice.native`` available              CPU without it; CUDA
=============================  ============================================  ========================================
int8 weight-only, per channel  ``int8_gemv`` up to ``MAX_ROWS["int8"]``,     ``_weight_int8pack_mm`` for M <= 16 (CPU:
                               torch's kernel to 16, above that              K % 16 == 0), else de-quantise + linear
                               ``int8_linear`` (int8 -> bf16 + one GEMM)
int8 weight-only, grouped      torch's path                                  ``_weight_int8pack_mm`` per group, same
int4 weight-only               ``int4_gemv`` up to ``MAX_ROWS["int4"]``      ``_weight_int4pack_mm[_for_cpu]``, any M
                               (``int4_dot_gemv`` up to ``["int4_dot"]``),
                               above that ``int4_linear`` (de-quantise +
                               one oneDNN GEMM)
W8A8                           ``int8_dot_gemv`` up to ``MAX_ROWS["w8a8"]``  activations rounded to int8 per block
                               (activations rounded to int8 per block of 32  of 32 (``qmath.round_activations``),
                               in the op, integer dot products with          then torch's int8 kernels above
                               AVX512-VNNI or AVX2); above, the rounded
                               activations through the int8 weight-only
                               kernels above
=============================  ============================================  ========================================

Why the native kernels, and why by rows: they stream weights with software prefetch, faster than torch's GEMVs; the
GEMVs' time grows with M, so above a level's row limit one GEMM on the de-quantised weight wins (``docs/kernels.md``
has the measurements behind every limit, and torch's kernels beside them). On the amx level the int8 GEMV runs 5 to
16 rows and the int4 GEMV 3 rows and more on AMX tiles (the weights decoded once per call instead of once per row).
int4 keeps only the tile layout (no second copy of the weight); so does int8 where its integer dot products serve every
decode row (``native.int8_tiles_ready``: AVX512-VNNI without AMX), in tiles of 16 rows (``native.int8_tile_pack``).

Prefill (above those rows) de-quantises the weight to bf16 for one oneDNN GEMM, inside one op per scheme
(``int8_linear``: the native int8 -> bf16 conversion, output scaled after; ``int4_linear``: exactly
``qmath.dequantize_int4`` rounded to bf16). The bf16 copy goes into one buffer kept between calls (the size of the
largest weight; ``native.release_prefill_buffer`` frees it): a fresh buffer per call pays Linux's zeroing of its
pages. Where oneDNN has no bf16 arithmetic (AVX2-only CPUs, ``native.prompts_widened``), its bf16 GEMM is several
times slower than its float32 one: there the same ops run float32 GEMMs instead, each on a slab of the weight
de-quantised and widened into a small kept buffer (``widen``). Checkpoints are the same either way (padding follows
torch's kernel), so a model saved with one kernel loads with the other.

Where the native kernels do not run:

* int8 weight-only: ``_weight_int8pack_mm`` is a GEMV kernel (time grows linearly with M); it runs up to
  ``INT8_KERNEL_MAX_ROWS`` rows, above that the weight is de-quantised to bf16 for one ``F.linear`` (prefill). It is
  much slower with fp32 activations, so activations are cast to bf16. On CPU it needs K a multiple of 16 (torch 2.13
  sums wrongly or crashes otherwise); other K de-quantise.
* int4: ``_weight_int4pack_mm_for_cpu`` at every M. It is a GEMV kernel too, but de-quantising int4 to bf16 in eager
  torch costs more still (the native ``int4_linear`` above needs its tile layout).
* W8A8: the activations are rounded to int8 per row and block of 32 (``qmath.round_activations``), then multiplied
  by the per-channel int8 kernels above. oneDNN's int8 GEMM takes one activation scale per row, which let outlier
  channels flatten whole rows: the perplexity cost then swung by several percent with the CPU's float rounding (see
  ``Int8DynamicLinear``); on CPUs without VNNI its u8 x s8 products also saturate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import native
from . import qmath

INT8_KERNEL_MAX_ROWS = 16
INT8PACK_CPU_K_MULTIPLE = 16  # torch 2.13's CPU _weight_int8pack_mm sums wrongly or segfaults for other K
COMPUTE_DTYPE = torch.bfloat16
CPU_INT4_BLOCK_N = 64  # rows per block of the AVX-512 int4 layout; N is padded to it so every block is full
CUDA_INNER_K_TILES = 8


def int8_weight_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, use_native: bool = False,
                   dot_products: int = 0, widen: bool = False) -> torch.Tensor:
    """``x [M, K] bf16 @ (qweight [N, K] int8 * scales [N] bf16).T``, per output channel. ``use_native``: the layer
    may use ``splice_kernels.int8_gemv`` (for the rows :func:`splice.native.fits`); ``dot_products`` (8 or 16): up
    to ``native.MAX_ROWS["int8_dot"]`` rows go to integer dot products instead, ``int8_dot_gemv`` (8: ``x`` rounded
    to int8 per block of 32) or ``int8_dot16_gemv`` (16: to int16 per block of 256; K whole blocks of 32 either way),
    more, up to ``MAX_ROWS["int8"]`` (AMX tiles), to ``int8_gemv``; ``widen``: prefill as float32 GEMMs on widened slabs
    (``native.prompts_widened``). A uint8 ``qweight`` is the weight in tiles (:func:`int8_tiles_mm`)."""
    if qweight.dtype == torch.uint8:
        return int8_tiles_mm(x, qweight, scales, bool(dot_products), widen)
    if use_native and dot_products and x.shape[1] % qmath.ACTIVATION_BLOCK == 0 and native.fits("int8_dot", x):
        if dot_products == 16:
            return torch.ops.splice_kernels.int8_dot16_gemv(x, qweight, scales)
        return torch.ops.splice_kernels.int8_dot_gemv(x, qweight, scales)
    if use_native and native.fits("int8", x):
        return torch.ops.splice_kernels.int8_gemv(x, qweight, scales)
    if _int8pack_runs(x.device, x.shape[0], x.shape[1]):
        return torch._weight_int8pack_mm(x, qweight, scales)
    if use_native and x.dtype == torch.bfloat16 and x.shape[0] > 0:  # prefill: native conversion, one GEMM
        return torch.ops.splice_kernels.int8_linear(x, qweight, scales, widen)
    return F.linear(x, qweight.to(x.dtype)) * scales


def int8_tiles_mm(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, dot_products: bool,
                  widen: bool = False) -> torch.Tensor:
    """``x [M, K] bf16`` times an int8 weight kept in the dot products' tiles (``native.int8_tile_pack``, where
    ``native.int8_tiles_ready``) and its per-channel ``scales``: with ``dot_products``, up to
    ``native.MAX_ROWS["int8_dot"]`` rows on ``int8_dot_gemv``; other rows (prefill) de-quantised for one GEMM
    (``int8_linear``, which reads tiles too)."""
    if x.shape[0] == 0:
        return x.new_empty((0, tiles.shape[0]))
    if dot_products and native.fits("int8_dot", x):
        return torch.ops.splice_kernels.int8_dot_gemv(x, tiles, scales)
    return torch.ops.splice_kernels.int8_linear(x, tiles, scales, widen)


def int8_dynamic_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    use_native: bool = False, widen: bool = False) -> torch.Tensor:
    """W8A8: ``x`` rounded to int8 per row and block of ``qmath.ACTIVATION_BLOCK``, times the per-channel int8 weight.
    Up to ``native.MAX_ROWS["w8a8"]`` rows (decode; prompts too at the avx512 level) the native kernels run
    ``int8_dot_gemv`` (the rounding and integer dot products in one op, VNNI where the CPU has it); everything else
    rounds ``x`` first and runs :func:`int8_weight_mm`."""
    if use_native and native.fits("w8a8", x) and x.shape[1] % qmath.ACTIVATION_BLOCK == 0:
        return torch.ops.splice_kernels.int8_dot_gemv(x, qweight, scales)
    return int8_weight_mm(qmath.round_activations(x), qweight, scales, use_native, widen=widen)


def int8_grouped_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Grouped int8: ``qweight [G, N, S]``, ``scales [G, N]``; one kernel call per group, summed."""
    groups, _, size = qweight.shape
    if not _int8pack_runs(x.device, x.shape[0], size):
        return F.linear(x, _grouped_weight(qweight, scales, x.dtype))
    chunks = x.reshape(x.shape[0], groups, size)
    out = torch._weight_int8pack_mm(chunks[:, 0].contiguous(), qweight[0], scales[0]).float()
    for g in range(1, groups):  # summed in float32: bf16 partial sums would add up rounding error
        out += torch._weight_int8pack_mm(chunks[:, g].contiguous(), qweight[g], scales[g])
    return out


def int8_grouped_dot_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, widen: bool = False,
                        dot_products: int = 8) -> torch.Tensor:
    """Grouped int8 on splice's integer dot products: ``x [M, K] bf16`` times ``weight [N, K]`` (int8 rows, or uint8
    tiles of ``native.int8_tile_pack``) with a scale per row and group of ``K / G`` inputs (whole blocks of 32: the
    layer zero-pads other groups, and x to match), in ``native.int8_group_scales_pack``'s layout. Rows up to
    ``native.MAX_ROWS["int8_dot"]`` on ``int8_dot_gemv_grouped`` (``dot_products`` 8: x rounded to int8 per block of
    32) or ``int8_dot16_gemv_grouped`` (16: to int16 per block of 256); more as one matmul on the weight de-quantised
    to x's dtype, with ``widen`` (``native.prompts_widened``) as float32 GEMMs on slabs of it widened
    (``splice_kernels.widened_linear``)."""
    if native.fits("int8_dot", x):
        if dot_products == 16:
            return torch.ops.splice_kernels.int8_dot16_gemv_grouped(x, weight, scales)
        return torch.ops.splice_kernels.int8_dot_gemv_grouped(x, weight, scales)
    rows = native.int8_tile_unpack(weight) if weight.dtype == torch.uint8 else weight
    scales = native.int8_group_scales_unpack(scales, rows.shape[0])
    groups, n = scales.shape
    weight = _grouped_weight(rows.reshape(n, groups, -1).transpose(0, 1), scales, x.dtype)
    if widen:
        return torch.ops.splice_kernels.widened_linear(x.float().contiguous(), weight).to(x.dtype)
    return F.linear(x, weight)


def _grouped_weight(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A grouped int8 weight (``qweight [G, N, S]``, ``scales [G, N]``) de-quantised to ``[N, G * S]`` in ``dtype``."""
    return (qweight.to(dtype) * scales[..., None]).permute(1, 0, 2).reshape(qweight.shape[1], -1)


def _int8pack_runs(device: torch.device, rows: int, k: int) -> bool:
    """Whether ``_weight_int8pack_mm`` suits ``[rows, k]`` inputs: at most ``INT8_KERNEL_MAX_ROWS`` rows, a kernel for
    the device, and on CPU ``k`` a multiple of ``INT8PACK_CPU_K_MULTIPLE``. Never on CUDA: there torch's kernel runs
    several times slower than widening the weight to the activations' dtype and one matmul (docs/benchmarks.md, "CUDA
    graph replay on an H200")."""
    if rows > INT8_KERNEL_MAX_ROWS or device.type == "cuda":
        return False
    if device.type == "cpu":
        return k % INT8PACK_CPU_K_MULTIPLE == 0
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", device.type.upper())


# ---- int4 -----------------------------------------------------------------------------------------------------------
def int4_padding(device: torch.device, group: int) -> tuple[int, int]:
    """(multiple for N, multiple for K) the int4 kernels of ``device`` need."""
    if device.type == "cuda":
        return 8, max(group, CUDA_INNER_K_TILES * 16)
    return CPU_INT4_BLOCK_N, group


def int4_padded_shape(out_features: int, in_features: int, group: int, device: torch.device) -> tuple[int, int]:
    """``(N', K')``: the features zero-padded as the int4 kernels of ``device`` need them."""
    n_multiple, k_multiple = int4_padding(device, group)
    return -(-out_features // n_multiple) * n_multiple, -(-in_features // k_multiple) * k_multiple


def int4_pack(q: torch.Tensor, scales_and_zeros: torch.Tensor,
              use_native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, K]`` (0..15, already padded) and the saved ``scales_and_zeros [K / group, N, 2]`` -> ``(packed,
    packed_scales)`` as :func:`int4_mm` reads them: splice's native tiles (``use_native``, CPU) hold the scales
    beside the weight (``packed_scales`` empty), torch's layout for ``q``'s device keeps them apart, in bf16."""
    if use_native:
        return native.int4_tile_pack(q, scales_and_zeros), scales_and_zeros.new_empty(0, dtype=COMPUTE_DTYPE)
    scales = scales_and_zeros.to(COMPUTE_DTYPE)
    if q.device.type == "cuda":
        return torch._convert_weight_to_int4pack(qmath.pack_nibbles(q), CUDA_INNER_K_TILES), scales
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1), scales


def int4_unpack_scales(packed: torch.Tensor, packed_scales: torch.Tensor, use_native: bool = False) -> torch.Tensor:
    """The saved ``scales_and_zeros [K / group, N, 2]`` of :func:`int4_pack`'s pair."""
    return native.int4_untile_scales(packed) if use_native else packed_scales


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor,
            use_native: bool = False, dot_products: bool = False, widen: bool = False) -> torch.Tensor:
    """``x [M, K] bf16`` times the int4 weight packed by :func:`int4_pack` (same ``use_native``), with the scales and
    zeros it gave (native tiles hold their own, and ``scales_and_zeros`` is not read). Native tiles: ``int4_gemv`` up
    to ``native.MAX_ROWS["int4"]`` rows (with ``dot_products``, ``int4_dot_gemv`` up to
    ``native.MAX_ROWS["int4_dot"]``: x rounded to int8 per block of 32, integer dot products), above that
    ``int4_linear`` (the weight de-quantised into the kept bf16 buffer for one oneDNN/AMX GEMM; with ``widen``, slab
    by slab, widened, for float32 GEMMs)."""
    if use_native:
        if x.shape[0] == 0:  # the native ops take at least one row
            return x.new_empty((0, packed.shape[0] * native.INT4_TILE))
        if x.shape[0] <= native.MAX_ROWS["int4_dot" if dot_products else "int4"]:
            op = torch.ops.splice_kernels.int4_dot_gemv if dot_products else torch.ops.splice_kernels.int4_gemv
            return op(x, packed, group)
        return torch.ops.splice_kernels.int4_linear(x, packed, group, widen)
    if x.device.type == "cuda":
        return torch._weight_int4pack_mm(x, packed, group, scales_and_zeros)
    return torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)


def int4_unpack_cpu_layout(packed: torch.Tensor, k: int) -> torch.Tensor:
    """``q [N, K]`` from the AVX-512 CPU layout (blocks of 64 rows; byte j of (block, k) holds row j in its low
    nibble and row j + 32 in its high nibble). Callers verify it once per layer with :func:`int4_unpack_verified`."""
    n = packed.numel() * 2 // k
    blocks = packed.reshape(n // CPU_INT4_BLOCK_N, k, CPU_INT4_BLOCK_N // 2)
    both = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [N / 64, K, 64]
    return both.permute(0, 2, 1).reshape(n, k)


def int4_unpack_verified(packed: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether :func:`int4_unpack_cpu_layout` reads ``packed`` back to ``q`` on this machine (AVX-512 layout)."""
    if packed.device.type != "cpu" or q.shape[0] % CPU_INT4_BLOCK_N:
        return False
    return torch.equal(int4_unpack_cpu_layout(packed, q.shape[1]), q.to(torch.uint8))


def int4_unpack_by_kernel(packed: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
    """``q [N, K]`` from any kernel layout, by multiplying the identity with scale 1 and zero 8 (exact in bf16)."""
    ones = torch.ones(k // group, n, 1, dtype=COMPUTE_DTYPE, device=packed.device)
    identity_sz = torch.cat([ones, ones * 8], dim=-1)
    eye = torch.eye(k, dtype=COMPUTE_DTYPE, device=packed.device)
    rows = [int4_mm(eye[start:start + 256], packed, group, identity_sz) for start in range(0, k, 256)]
    return torch.cat(rows).t().round().to(torch.uint8)
