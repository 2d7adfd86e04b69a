"""splice's native CPU decode kernels (``gemv.cpp``): bf16, int8 and int4 GEMVs for a few rows of activations.

They are compiled once per machine with torch's C++ extension builder into ``$SPLICE_CACHE/kernels/<hash>`` (about
half a minute on 2 cores; a compiler lock makes concurrent ranks wait for one build) and registered as the torch ops
``torch.ops.splice_kernels.*``, so they also run inside ``torch.compile`` graphs. They need an x86 CPU with AVX-512
BF16 and a C++ compiler; without either, or with ``SPLICE_NATIVE_KERNELS=0``, :func:`available` is False and callers
use torch's own kernels (a warning says why, once, unless the variable turned them off).

Why not only torch's kernels: see ``gemv.cpp`` — torch's GEMVs read weights at 14-22 GB/s on this project's 2-core
Xeon, these at 22-28 GB/s, and :func:`advise_huge_pages` adds a few more by putting weights on 2 MiB pages.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import platform
import sys
import warnings
from functools import cache
from pathlib import Path

import torch

from ..models import cache_dir

SOURCE = Path(__file__).with_name("gemv.cpp")
#: Most rows of activations each kernel is used for (measured on a 2-core AVX-512/AMX Xeon, TinyLlama-shaped layers,
#: against oneDNN's bf16 linear): bf16 1.18x at 1 row, 1.03x at 4, 0.72x at 8 (AMX wins there); int8 1.96x at 1 row,
#: 0.82x at 8 with AVX-512 only (torch's int8 kernel: 0.62x), so 8 rows there, and 16 where ``int8_gemv`` runs 5 rows
#: and more on AMX (1.4-1.7x at 8 and 16 rows; set when the kernels load). The int4 GEMV itself takes any number of
#: rows (on AMX from 3 rows); quantized layers switch to ``int4_linear`` (de-quantise + oneDNN) above
#: :data:`int4_gemv_max_rows`.
MAX_ROWS = {"bf16": 4, "int8": 8, "int4": 1 << 30}
INT8_MAX_ROWS = {"amx": 16, "avx512": 8}
#: Most rows ``int4_gemv`` is used for before quantized layers de-quantise the weight for one oneDNN GEMM instead
#: (``int4_linear``, from ``splice.quant.kernels.int4_mm``): 64 where ``int4_gemv`` runs 3 rows and more on AMX (one
#: 5632x2048 g32 layer, us, GEMV vs de-quantise + linear: 16 rows 658 vs 1642, 64 rows 1604 vs 2160, 128 rows 4365 vs
#: 2478), else 15 (AVX-512 only: it grows by ~125 us a row there). Set when the kernels load (:func:`available`).
INT4_GEMV_MAX_ROWS = {"amx": 64, "avx512": 15}
int4_gemv_max_rows = INT4_GEMV_MAX_ROWS["avx512"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
CFLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]
INT4_TILE = 16  # weight rows per int4 tile
INT4_CHUNK = 8  # input columns per int32 word of a tile row
INT4_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of each nibble slot in a word: k and k + 1 sit 16 bits apart


def enabled_by_env() -> bool:
    return os.environ.get("SPLICE_NATIVE_KERNELS", "1") not in ("0", "false", "no", "off")


@cache
def available() -> bool:
    """Whether the native kernels are built and loaded here (builds them on the first call)."""
    if not enabled_by_env():
        return False
    reason = unsupported_reason()
    if reason is None:
        try:
            _build()
            return True
        except Exception as error:  # a missing compiler, a broken toolchain: fall back, but say so
            reason = f"building them failed ({type(error).__name__}: {str(error).strip().splitlines()[-1][:200]})"
    warnings.warn(f"splice's native CPU kernels are not used: {reason}; torch's kernels run instead "
                  "(set SPLICE_NATIVE_KERNELS=0 to silence this)", RuntimeWarning, stacklevel=2)
    return False


def amx_ready() -> bool:
    """Whether ``int4_gemv`` (from 3 rows) and ``int8_gemv`` (from 5) run on AMX tiles: the kernels are
    :func:`available`, the CPU has AMX-BF16, Linux lets this process use the tile state, and ``SPLICE_NATIVE_AMX``
    does not say 0 (read once)."""
    return available() and torch.ops.splice_kernels.amx_ready()


def release_prefill_buffer() -> int:
    """Free the bf16 buffer quantized layers de-quantise their weights into for prefill (kept between calls, the
    size of the largest weight seen; made again on the next prefill). Returns the bytes freed."""
    if not (enabled_by_env() and available.cache_info().currsize and available()):
        return 0
    freed = torch.ops.splice_kernels.prefill_buffer_bytes()
    torch.ops.splice_kernels.release_prefill_buffer()
    return freed


def available_on(device: torch.device | str) -> bool:
    """Whether tensors on ``device`` can use the native kernels: CPU, and :func:`available`. Layers ask once, when
    built (``available`` is not traceable by ``torch.compile``), and keep the answer."""
    return torch.device(device).type == "cpu" and available()


def unsupported_reason() -> str | None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"they need Linux on x86-64, this is {sys.platform} on {platform.machine()}"
    missing = [flag for flag in CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _build() -> None:
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()

    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + torch.__version__.encode() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    build_dir = cache_dir() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    load(name=f"splice_kernels_{key}", sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
         build_directory=str(build_dir), is_python_module=False, verbose=False)
    _register_fakes()
    global int4_gemv_max_rows
    kind = "amx" if torch.ops.splice_kernels.amx_ready() else "avx512"
    int4_gemv_max_rows = INT4_GEMV_MAX_ROWS[kind]
    MAX_ROWS["int8"] = INT8_MAX_ROWS[kind]


def _put_ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) lives in the
    environment's scripts folder, which is not on PATH when Python is run by its full path."""
    try:
        import ninja
    except ImportError:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def _register_fakes() -> None:
    """Shape functions, so ``torch.compile`` can trace the ops."""
    def fake_rows(x, rows):
        return x.new_empty((x.shape[0], rows), dtype=torch.bfloat16)

    torch.library.register_fake("splice_kernels::bf16_gemv")(lambda x, w: fake_rows(x, w.shape[0]))
    torch.library.register_fake("splice_kernels::int8_gemv")(lambda x, w, scales: fake_rows(x, w.shape[0]))
    torch.library.register_fake("splice_kernels::int4_gemv")(
        lambda x, w, scales_and_zeros, group: fake_rows(x, w.shape[0] * INT4_TILE))
    torch.library.register_fake("splice_kernels::int8_linear")(lambda x, w, scales: fake_rows(x, w.shape[0]))
    torch.library.register_fake("splice_kernels::int4_linear")(
        lambda x, w, scales_and_zeros, group: fake_rows(x, w.shape[0] * INT4_TILE))
    torch.library.register_fake("splice_kernels::int4_dequantize")(
        lambda w, scales_and_zeros, group: w.new_empty((w.shape[0] * INT4_TILE, w.shape[1] * INT4_CHUNK),
                                                       dtype=torch.bfloat16))


def fits(kind: str, x: torch.Tensor) -> bool:
    """Whether a ``kind`` ("bf16", "int8", "int4") call with input ``x [rows, K]`` suits the native kernel: bf16 on
    CPU, at most ``MAX_ROWS[kind]`` rows. Layers check :func:`available` once when built (it is not traceable by
    ``torch.compile``) and this on every call (it is)."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS[kind])


# ---- int4 layout ----------------------------------------------------------------------------------------------------
def int4_tile_pack(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` values 0..15 (N a multiple of 16, K of 8) -> the kernel's ``[N/16, K/8, 16]`` int32 tiles: word
    (t, c, r) holds ``q[16t + r, 8c .. 8c + 7]`` as nibbles in the order k = 0, 2, 4, 6, 1, 3, 5, 7."""
    n, k = q.shape
    chunks = q.to(torch.int32).reshape(n // INT4_TILE, INT4_TILE, k // INT4_CHUNK, INT4_CHUNK).transpose(1, 2)
    words = torch.zeros(chunks.shape[:-1], dtype=torch.int32, device=q.device)
    for slot, column in enumerate(INT4_ORDER):
        words |= chunks[..., column] << (4 * slot)
    return words.contiguous()


def int4_tile_unpack(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`int4_tile_pack`: ``q [N, K]`` uint8."""
    tiles, chunks, _ = words.shape
    columns = [None] * INT4_CHUNK
    for slot, column in enumerate(INT4_ORDER):
        columns[column] = (words >> (4 * slot)) & 15
    q = torch.stack(columns, dim=-1)  # [tiles, chunks, 16, 8]
    return q.transpose(1, 2).reshape(tiles * INT4_TILE, chunks * INT4_CHUNK).to(torch.uint8)


def int4_tile_scales(scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``[K/group, N, 2]`` -> the kernel's ``[N/16, K/group, 16, 2]`` bf16 (one 64-byte line per tile and group)."""
    groups, n, _ = scales_and_zeros.shape
    tiled = scales_and_zeros.to(torch.bfloat16).reshape(groups, n // INT4_TILE, INT4_TILE, 2).transpose(0, 1)
    return tiled.contiguous()


def int4_untile_scales(tiled: torch.Tensor) -> torch.Tensor:
    tiles, groups, _, _ = tiled.shape
    return tiled.transpose(0, 1).reshape(groups, tiles * INT4_TILE, 2).contiguous()


# ---- huge pages -----------------------------------------------------------------------------------------------------
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE, MADV_PAGEOUT = 14, 25, 21
PAGE = 4096


@cache
def _libc():
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def huge_pages_supported() -> bool:
    """Linux with transparent huge pages available to ``madvise`` (and not switched off by SPLICE_NATIVE_KERNELS)."""
    return _libc() is not None and enabled_by_env() and _transparent_huge_pages_allowed()


@cache
def _transparent_huge_pages_allowed() -> bool:
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def _whole_pages(tensor: torch.Tensor, page: int) -> tuple[int, int] | None:
    """(address, length) of the ``page``-aligned pages lying wholly inside a CPU tensor's memory, or None (no such
    page, not a plain CPU tensor, or no libc to advise)."""
    if _libc() is None or tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_mkldnn:
        return None
    start = tensor.data_ptr()
    first, last = -(-start // page) * page, (start + tensor.numel() * tensor.element_size()) // page * page
    return (first, last - first) if last > first else None


def advise_huge_pages(tensor: torch.Tensor, collapse: bool = True) -> int:
    """Ask Linux to back the 2 MiB-aligned interior of a CPU tensor's memory with huge pages: ``MADV_HUGEPAGE`` (pages
    touched from now on), and with ``collapse`` also ``MADV_COLLAPSE`` (pages already there, Linux >= 6.1). Streaming
    weights then misses the TLB far less. Returns the bytes advised (0 where nothing applies: small tensors, other
    systems, file-backed memory)."""
    pages = _whole_pages(tensor, HUGE_PAGE) if huge_pages_supported() else None
    if pages is None or _libc().madvise(*pages, MADV_HUGEPAGE) != 0:
        return 0
    if collapse:
        _libc().madvise(*pages, MADV_COLLAPSE)  # best effort: older kernels leave it to khugepaged
    return pages[1]


def release_freed_memory() -> None:
    """Hand memory that was freed back to the OS (glibc keeps freed heap chunks, so RSS would not drop after weights
    are moved or quantized)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def page_out(tensor: torch.Tensor) -> None:
    """Ask Linux to drop the whole pages under a CPU tensor from this process's memory (``MADV_PAGEOUT``), keeping
    their contents: a memory-mapped checkpoint's clean pages are re-read from the file if touched again, anonymous
    pages stay (there is no swap to move them to). For weights that were just copied elsewhere: their file pages
    would otherwise stay resident until the checkpoint is unmapped, doubling the process's memory."""
    pages = _whole_pages(tensor, PAGE)
    if pages is not None:
        _libc().madvise(*pages, MADV_PAGEOUT)  # best effort: Linux >= 5.4
