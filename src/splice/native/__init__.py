"""splice's native CPU decode kernels (``gemv.cpp``): bf16, int8 and int4 GEMVs for a few rows of activations.

They are compiled once per machine with torch's C++ extension builder into ``$SPLICE_CACHE/kernels/<key>`` (about
half a minute on 2 cores, announced on stderr). ``<key>`` hashes everything that changes the binary
(:func:`_build_key`), so installs and environments that differ build side by side and never rebuild each other's
library. One process builds (a file lock per key), in a private folder, and renames the finished library into place;
the others wait and load it. Loading a library built earlier needs no compiler (:func:`build_library`). The library
registers the torch ops ``torch.ops.splice_kernels.*``, so they also run inside ``torch.compile`` graphs. The build
is for baseline x86-64, with each kernel written once per instruction-set level and chosen at run time
(:data:`ISA_LEVELS`): ``avx2`` (AVX2 + FMA), ``avx512`` (AVX-512 with BF16 dot products), ``amx`` (``avx512`` plus AMX
tiles for batches). Without a C++ compiler (and no library built here before for this torch and Python), on a CPU
without AVX2 and FMA, or with ``SPLICE_NATIVE_KERNELS=0``, :func:`available` is False and callers use torch's own
kernels (a warning says why, once, unless the variable turned them off).

The level defaults to the best the CPU runs; ``SPLICE_NATIVE_ISA=avx2|avx512|amx`` caps it (so the AVX2 path runs and
is tested on an AVX-512 machine), as does ``SPLICE_NATIVE_AMX=0`` (at most ``avx512``); :func:`use_isa` switches it
inside one process. At the ``avx2`` level the integer dot products use AVX-VNNI where the CPU has it (most AVX2-only
Intel laptops since 2021), unless ``SPLICE_NATIVE_AVX_VNNI=0`` (:func:`avx_vnni_ready`, :func:`use_avx_vnni`).

Why not only torch's kernels: see ``gemv.cpp`` and ``docs/benchmarks.md``.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from functools import cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from ..models import cache_dir, cache_subfolder, exclusive_lock

SOURCE = Path(__file__).with_name("gemv.cpp")
#: Instruction-set levels, lowest first; their index + 1 is the level number the C++ side uses.
ISA_LEVELS = ("avx2", "avx512", "amx")
#: What each level runs, for reports.
ISA_DESCRIPTIONS = {"avx2": "AVX2 + FMA", "avx512": "AVX-512 BF16", "amx": "AVX-512 BF16, AMX tiles for batches"}
#: CPU flags (``/proc/cpuinfo`` names) each level needs.
ISA_FLAGS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "amx": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16"),
}


@cache
def _cpu_flags() -> frozenset[str]:
    return frozenset((_cpuinfo_value("flags") or "").split())


@cache
def _cpu_vendor() -> str | None:
    return _cpuinfo_value("vendor_id")


def _cpuinfo_value(name: str) -> str | None:
    """The first ``name : value`` of /proc/cpuinfo, or None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def _onednn_has_tiles() -> bool:
    """Whether oneDNN's bf16 GEMM runs on AMX tiles here (wherever the CPU has them, whatever splice's level)."""
    return {"amx_tile", "amx_bf16"} <= _cpu_flags()


#: bf16 rows the avx512 level's GEMV serves on a CPU without AMX tiles, where oneDNN's bf16 GEMM runs on AVX-512 (AMD
#: Zen 4): the GEMV beats that GEMM up to 16 rows there (``docs/kernels.md``). With tiles the GEMM wins from 5 rows.
AVX512_BF16_ROWS_WITHOUT_TILES = 16


#: Most rows of activations each native GEMV serves, per level; more rows (prefill) go to one oneDNN GEMM (bf16),
#: torch's int8 kernel and then de-quantise + GEMM (int8), or de-quantise + GEMM (int4). The limits are measured
#: crossovers on TinyLlama-shaped layers and whole models (``docs/kernels.md`` has the tables): with AMX the int8 GEMV
#: runs 5-16 rows and the int4 GEMV 3 rows and more on tiles, so the int4 GEMV serves more rows there. "int8_dot": the
#: most rows int8 weight-only sends to the integer dot products (``int8_dot_gemv``: on the weight's tiles where
#: :func:`int8_tiles_ready`, else on a transposed kernel from 3 rows); more, up to "int8", go to ``int8_gemv`` (on AMX
#: its tiles overtake the dot products from 9 rows); "int8" alone bounds the float products. "int4_dot": the most rows
#: int4 sends to its integer dot products (``int4_dot_gemv``), "int4" to its float products (``int4_gemv``). The avx2
#: level is what AVX2-only CPUs run, where oneDNN has no bf16 arithmetic and prompts take float32 GEMMs on widened
#: slabs (``prompts_widened``): those cost several times the float-product GEMVs' time up to 32 rows and the bf16
#: GEMV's up to AVX2_BF16_ROWS. At the avx512 and avx2 levels the integer dot products beat both de-quantise + GEMM
#: and the widened GEMMs at every prompt length and batch measured (on AVX512-VNNI they compute twice the bf16 GEMM's
#: products an instruction), hence DOT_ROWS there, prompts included.
DOT_ROWS = 2048
AVX2_BF16_ROWS = 128
#: "w8a8": the most rows W8A8 sends to ``int8_dot_gemv`` (its activations are rounded either way): the int8 GEMV's
#: rows, or the dot products' where those are more (the avx512 and avx2 levels: prompts too).
ROW_LIMITS = {
    "amx": {"bf16": 4, "int8": 16, "int8_dot": 8, "int4": 64, "int4_dot": 64, "w8a8": 16},
    "avx512": {"bf16": 4 if _onednn_has_tiles() else AVX512_BF16_ROWS_WITHOUT_TILES, "int8": 16,
               "int8_dot": DOT_ROWS, "int4": 15, "int4_dot": DOT_ROWS, "w8a8": DOT_ROWS},
    "avx2": {"bf16": AVX2_BF16_ROWS, "int8": 32, "int8_dot": DOT_ROWS, "int4": 32, "int4_dot": DOT_ROWS,
             "w8a8": DOT_ROWS},
}
#: The active level's limits (updated by :func:`set_isa`); read by :func:`fits` and the quantized layers.
MAX_ROWS = dict(ROW_LIMITS["avx512"])
#: Weight streams per thread of the decode GEMVs (``weight_streams``) where four read faster than two, by
#: ``/proc/cpuinfo`` vendor: measured on an Intel Xeon with AVX-512 (``docs/kernels.md``, "Weight streams per
#: thread"). Elsewhere two: on an AMD Zen 3 four streams a power of two apart read at two thirds of one, and on an
#: AMD Zen 4 the GEMVs read faster as two streams than as four.
WEIGHT_STREAMS_BY_VENDOR = {"GenuineIntel": 4}
WEIGHT_STREAM_COUNTS = ("1", "2", "4")  # what SPLICE_WEIGHT_STREAMS (and set_weight_streams) take
#: The kinds of weight whose decode GEMVs can prefetch in software (``software_prefetch``), in gemv.cpp's bit order.
PREFETCH_KINDS = ("bf16", "int8", "int4")
#: The kinds prefetched in software, each from the rows of x in one pass over the weights given, where that is not
#: every kind in every pass, by ``/proc/cpuinfo`` vendor: on an AMD Zen 4 the GEMVs of one or two rows read as fast or
#: faster leaving their streams to the hardware prefetcher, and those of three rows or more (more arithmetic per byte,
#: fewer reads in flight of their own) read faster with it (``docs/kernels.md``, "Software prefetch").
SOFTWARE_PREFETCH_BY_VENDOR = {"AuthenticAMD": {"bf16": 3, "int8": 3, "int4": 3}}
CFLAGS = ["-O3", "-fopenmp"]  # baseline x86-64: gemv.cpp enables each level's instructions in its own regions
INT4_TILE = 16  # weight rows per int4 tile
INT4_CHUNK = 8  # input columns per int32 word of a tile row
INT4_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of each nibble slot in a word: k and k + 1 sit 16 bits apart
_OFF = ("0", "false", "no", "off")


def enabled_by_env() -> bool:
    return os.environ.get("SPLICE_NATIVE_KERNELS", "1") not in _OFF


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` says off (0, false, no, off; any case, spaces ignored)."""
    return os.environ.get(name, "1").strip().lower() in _OFF


@cache
def available() -> bool:
    """Whether the native kernels are built and loaded here (builds them on the first call). Raises ValueError for a
    ``SPLICE_NATIVE_ISA`` this CPU cannot run."""
    if not enabled_by_env():
        return False
    requested = _requested_isa()
    reason = unsupported_reason()
    if reason is None:
        try:
            _build()
        except Exception as error:  # a missing compiler, a broken toolchain: fall back, but say so
            last_line = (str(error).strip().splitlines() or [""])[-1][:400]
            reason = f"building them failed ({type(error).__name__}: {last_line})"
    if reason is None:
        _set_level(_initial_isa(requested))
        torch.ops.splice_kernels.set_weight_streams(initial_weight_streams())
        _set_software_prefetch(initial_software_prefetch())
        if switched_off("SPLICE_NATIVE_AVX_VNNI"):
            torch.ops.splice_kernels.set_avx_vnni(False)
        return True
    warnings.warn(f"splice's native CPU kernels are not used: {reason}; torch's kernels run instead "
                  "(set SPLICE_NATIVE_KERNELS=0 to silence this)", RuntimeWarning, stacklevel=2)
    return False


def _requested_isa() -> str | None:
    value = os.environ.get("SPLICE_NATIVE_ISA", "").strip().lower()
    if value and value not in ISA_LEVELS:
        raise ValueError(f"SPLICE_NATIVE_ISA={value!r} is not a level; allowed: {', '.join(ISA_LEVELS)}")
    return value or None


def _initial_isa(requested: str | None) -> str:
    """The level to start at: the best here, capped by SPLICE_NATIVE_ISA and SPLICE_NATIVE_AMX=0."""
    levels = _levels_here()
    if requested is not None and requested not in levels:
        raise ValueError(f"SPLICE_NATIVE_ISA={requested!r} needs CPU flags this machine lacks "
                         f"({', '.join(f for f in ISA_FLAGS[requested] if f not in _cpu_flags()) or 'AMX tile state'});"
                         f" allowed here: {', '.join(levels)}")
    level = requested or levels[-1]
    if switched_off("SPLICE_NATIVE_AMX") and level == "amx":
        level = "avx512"
    return level


def supported_isas() -> tuple[str, ...]:
    """The levels this machine can run, lowest first (empty where the kernels are not :func:`available`)."""
    return _levels_here() if available() else ()


def _levels_here() -> tuple[str, ...]:
    return ISA_LEVELS[: torch.ops.splice_kernels.best_isa()]


def isa() -> str | None:
    """The level the kernels run at now, or None where they are not :func:`available`."""
    return ISA_LEVELS[torch.ops.splice_kernels.isa() - 1] if available() else None


def set_isa(level: str) -> None:
    """Run the kernels at ``level`` (one of :func:`supported_isas`) from now on, with that level's row limits.
    Layers built earlier keep their layout, which is the same at every level. Loads the kernels where nothing has
    yet; raises ValueError where they are not available."""
    if not available():
        raise ValueError(f"ISA level {level!r} cannot be set: splice's native kernels are not available here "
                         "(SPLICE_NATIVE_KERNELS=0, or the warning when they were first asked for says why); "
                         "allowed: no level")
    _set_level(level)


def _set_level(level: str) -> None:
    """``set_isa`` on kernels already loaded (:func:`available` calls it while it loads them)."""
    levels = _levels_here()
    if level not in levels:
        raise ValueError(f"ISA level {level!r} is not available here; allowed: {', '.join(levels)}")
    torch.ops.splice_kernels.set_isa(ISA_LEVELS.index(level) + 1)
    MAX_ROWS.update(ROW_LIMITS[level])


@contextlib.contextmanager
def use_isa(level: str) -> Iterator[None]:
    """Run the kernels at ``level`` inside the block (tests, benchmarks), then at the level before."""
    before = isa()
    set_isa(level)
    try:
        yield
    finally:
        set_isa(before)


def avx_vnni_ready() -> bool:
    """Whether the ``avx2`` level's integer dot products (``int8_dot_gemv``, ``int4_dot_gemv``) use AVX-VNNI's 256-bit
    ``vpdpbusd`` (CPUs with AVX-VNNI, unless ``SPLICE_NATIVE_AVX_VNNI=0`` or :func:`use_avx_vnni`); else they use
    ``vpmaddubsw``, as on AVX2 CPUs without it. Both give the same integers."""
    return available() and torch.ops.splice_kernels.avx_vnni_ready()


def use_avx_vnni(on: bool) -> contextlib.AbstractContextManager[None]:
    """AVX-VNNI on or off for the ``avx2`` level's dot products inside the block (tests, benchmarks), then as before.
    Turning it on where the CPU lacks it raises."""
    return _kernel_setting(avx_vnni_ready, torch.ops.splice_kernels.set_avx_vnni, on)


def default_weight_streams() -> int:
    """The weight streams the decode GEMVs walk on this CPU unless told otherwise: :data:`WEIGHT_STREAMS_BY_VENDOR`
    for its vendor, else 2."""
    return WEIGHT_STREAMS_BY_VENDOR.get(_cpu_vendor() or "", 2)


def initial_weight_streams() -> int:
    """The weight streams the kernels start with: ``SPLICE_WEIGHT_STREAMS`` (1, 2 or 4) where set, else
    :func:`default_weight_streams`. Raises ValueError for any other value."""
    value = os.environ.get("SPLICE_WEIGHT_STREAMS", "").strip()
    if not value:
        return default_weight_streams()
    if value not in WEIGHT_STREAM_COUNTS:
        raise ValueError(f"SPLICE_WEIGHT_STREAMS={value!r} is not a stream count; allowed: "
                         f"{', '.join(WEIGHT_STREAM_COUNTS)}")
    return int(value)


def _loaded_kernels():
    """The kernels' op namespace, loading them where nothing has yet; RuntimeError where they are not available."""
    if not available():
        raise RuntimeError("splice's native kernels are not available here (SPLICE_NATIVE_KERNELS=0, or the warning "
                           "when they were first asked for says why)")
    return torch.ops.splice_kernels


def weight_streams() -> int:
    """Weight streams per thread of the decode GEMVs for one or two rows of x: that many parts of each thread's share
    of the weight walked side by side, so more reads are in flight (:func:`initial_weight_streams`). 1, 2 or 4; the
    kernels whose sums for four streams do not fit their registers walk at most two (``int8_gemv``, and the avx2
    level's ``bf16_gemv``, ``int8_dot_gemv`` and ``int4_dot_gemv``), the avx512 level's ``bf16_gemv``,
    ``int8_dot_gemv`` and ``int4_dot_gemv`` up to four."""
    return _loaded_kernels().weight_streams()


def use_weight_streams(streams: int) -> contextlib.AbstractContextManager[None]:
    """``streams`` (1, 2 or 4) weight streams per thread inside the block (tests, benchmarks), then as before."""
    if not available():
        raise RuntimeError("splice's native kernels are not available here")
    return _kernel_setting(weight_streams, torch.ops.splice_kernels.set_weight_streams, streams)


def work_stealing() -> bool:
    """Whether the decode GEMVs that walk weight streams (``bf16_gemv``, ``int8_gemv``, ``int8_dot_gemv``,
    ``int4_dot_gemv``) let a thread done with its share of the weight take the pieces left of another's (the
    default), rather than wait for it at the end of the call. The outputs are the same either way."""
    return _loaded_kernels().work_stealing()


def use_work_stealing(on: bool) -> contextlib.AbstractContextManager[None]:
    """Work stealing on or off inside the block (tests, benchmarks), then as before."""
    if not available():
        raise RuntimeError("splice's native kernels are not available here")
    return _kernel_setting(work_stealing, torch.ops.splice_kernels.set_work_stealing, on)


def layer_region() -> bool:
    """Whether ``decode_layers`` runs its layers in one parallel region (the default): every thread takes its share of
    each kernel in turn and the threads meet at barriers between the kernels, rather than each kernel waking the
    threads and joining them. The outputs are the same either way."""
    return _loaded_kernels().layer_region()


def use_layer_region(on: bool) -> contextlib.AbstractContextManager[None]:
    """One parallel region a ``decode_layers`` call on or off inside the block (tests, benchmarks), then as before."""
    if not available():
        raise RuntimeError("splice's native kernels are not available here")
    return _kernel_setting(layer_region, torch.ops.splice_kernels.set_layer_region, on)


def software_prefetch() -> dict[str, int]:
    """The kinds of weight (of :data:`PREFETCH_KINDS`) whose decode GEMVs prefetch each weight stream a few KiB
    ahead in software, each with the rows of x in one pass over the weights from which it does (1: every pass); the
    other kinds and passes leave the reads to the CPU's hardware prefetcher alone (:func:`initial_software_prefetch`).
    The outputs are the same either way."""
    rows = _loaded_kernels().software_prefetch_rows()
    return {kind: count for kind, count in zip(PREFETCH_KINDS, rows) if count > 0}


def use_software_prefetch(kinds: bool | str | Iterable[str] | Mapping[str, int]
                          ) -> contextlib.AbstractContextManager[None]:
    """Software prefetch inside the block (tests, benchmarks), then as before: for ``kinds`` (a name of
    :data:`PREFETCH_KINDS` or several) in every pass, or per name from the rows of x a pass a mapping gives (``{"int4":
    3}``); True: every kind in every pass, False: none. Raises ValueError for another name or row count."""
    if not available():
        raise RuntimeError("splice's native kernels are not available here")
    if isinstance(kinds, bool):
        chosen = dict.fromkeys(PREFETCH_KINDS if kinds else (), 1)
    elif isinstance(kinds, Mapping):
        chosen = _prefetch_rows(dict(kinds), "kinds")
    else:
        chosen = _prefetch_rows(dict.fromkeys((kinds,) if isinstance(kinds, str) else tuple(kinds), 1), "kinds")
    return _kernel_setting(software_prefetch, _set_software_prefetch, chosen)


def default_software_prefetch() -> dict[str, int]:
    """The kinds of weight prefetched in software on this CPU unless told otherwise, each from its rows of x a pass:
    :data:`SOFTWARE_PREFETCH_BY_VENDOR` for its vendor, else every kind in every pass."""
    return dict(SOFTWARE_PREFETCH_BY_VENDOR.get(_cpu_vendor() or "", dict.fromkeys(PREFETCH_KINDS, 1)))


def initial_software_prefetch() -> dict[str, int]:
    """The kinds the kernels start with: ``SPLICE_SOFTWARE_PREFETCH`` where set (``all``, ``none``, or kinds separated
    by commas, each in every pass or from a number of rows of x a pass: ``int4``, ``bf16,int8``, ``int4:3``), else
    :func:`default_software_prefetch`. Raises ValueError for any other value."""
    value = os.environ.get("SPLICE_SOFTWARE_PREFETCH", "").strip().lower()
    if not value:
        return default_software_prefetch()
    if value in ("all", "none"):
        return dict.fromkeys(PREFETCH_KINDS if value == "all" else (), 1)
    what = f"SPLICE_SOFTWARE_PREFETCH={value!r}"
    chosen = {}
    for part in value.split(","):
        kind, colon, rows = (piece.strip() for piece in part.partition(":"))
        if colon and not rows.isdigit():
            raise ValueError(f"{what}: {rows!r} after {kind}: is not a row count; allowed: a whole number from 1")
        chosen[kind] = int(rows) if colon else 1
    return _prefetch_rows(chosen, what)


def _prefetch_rows(rows: dict, what: str) -> dict[str, int]:
    """``rows`` (kind -> the rows of x a pass from which it prefetches) checked, in :data:`PREFETCH_KINDS`' order."""
    unknown = [kind for kind in rows if kind not in PREFETCH_KINDS]
    if unknown:
        raise ValueError(f"{what}: {', '.join(map(repr, unknown))} is not a kind of weight; allowed: "
                         f"{', '.join(PREFETCH_KINDS)} (or, in the variable, all or none)")
    bad = {kind: count for kind, count in rows.items() if isinstance(count, bool) or not isinstance(count, int)
           or count < 1}
    if bad:
        raise ValueError(f"{what}: {bad} is not a row count per kind; allowed: whole numbers from 1")
    return {kind: rows[kind] for kind in PREFETCH_KINDS if kind in rows}


def _set_software_prefetch(rows: dict[str, int]) -> None:
    torch.ops.splice_kernels.set_software_prefetch_rows([rows.get(kind, 0) for kind in PREFETCH_KINDS])


@contextlib.contextmanager
def _kernel_setting(read: Callable[[], Any], write: Callable[[Any], None], value: Any) -> Iterator[None]:
    """``write(value)`` inside the block, then the setting ``read()`` gave before it."""
    before = read()
    write(value)
    try:
        yield
    finally:
        write(before)


def amx_ready() -> bool:
    """Whether ``int4_gemv`` (from 3 rows), ``int4_dot_gemv`` (from 7) and ``int8_gemv`` (from 5) run on AMX tiles:
    the active level is ``amx``
    (the CPU has AMX-BF16, Linux lets this process use the tile state, and nothing capped the level)."""
    return available() and torch.ops.splice_kernels.amx_ready()


def amx_thresholds() -> dict[str, int]:
    """Where the AMX paths of the GEMVs start and stop (rows of activations), as ``gemv.cpp`` decides them:
    ``int4_min_rows`` (``int4_gemv``), ``int4_dot_min_rows`` (``int4_dot_gemv``), ``int8_min_rows``,
    ``int8_max_rows`` (``int8_gemv``; ``int8_dot_gemv`` never uses tiles), and ``int4_group_multiple`` (other int4
    groups stay on vector code)."""
    if not available():
        raise RuntimeError("splice's native kernels are not available here")
    int4_min, int8_min, int8_max, columns, int4_dot_min = torch.ops.splice_kernels.amx_thresholds()
    return {"int4_min_rows": int4_min, "int4_dot_min_rows": int4_dot_min, "int8_min_rows": int8_min,
            "int8_max_rows": int8_max, "int4_group_multiple": columns}


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
    missing = [flag for flag in ISA_FLAGS["avx2"] if flag not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


LDFLAGS = ["-fopenmp"]


def _build_key(source: Path = SOURCE, cflags: tuple[str, ...] = tuple(CFLAGS),
               ldflags: tuple[str, ...] = tuple(LDFLAGS)) -> str:
    """``<inputs>_<compiler>``: a hash of everything that changes the binary but the compiler (:func:`_inputs_key`),
    then a hash of the compiler's version. Paths are left out: two installs of the same source share one build. The
    first part alone finds a library built by another compiler, for a machine that has none (:func:`_prebuilt`)."""
    compiler = hashlib.sha256(_compiler_version().encode()).hexdigest()[:8]
    return f"{_inputs_key(source, cflags, ldflags)}_{compiler}"


def _inputs_key(source: Path, cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """A hash of the source, the flags, torch (version, commit and C++ ABI), Python and the machine type."""
    parts = [source.read_bytes(), " ".join(cflags).encode(), " ".join(ldflags).encode(), torch.__version__.encode(),
             str(torch.version.git_version).encode(), str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(),
             sys.version.encode(), platform.machine().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def library_path(key: str | None = None, stem: str = "splice_kernels") -> Path:
    """Where the built library of this source, flags, compiler, torch and Python lives (or will)."""
    key = key or _build_key()
    return cache_dir() / "kernels" / key / f"{stem}_{key}.so"


def _compiler_version() -> str:
    compiler = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return compiler


def _build() -> None:
    build_library(SOURCE, "splice_kernels", CFLAGS, LDFLAGS, what="splice's native CPU kernels")
    _register_fakes()


def build_library(source: Path, name: str, cflags: list[str], ldflags: list[str], what: str) -> Path:
    """Load the cached library of ``source`` into this process (``torch.ops.load_library``), building it first if no
    process has: under a per-key file lock, in a private folder, then renamed into place, so concurrent processes and
    installs build once and never load a half-written file. Building and waiting say so on stderr, naming ``what``.
    Without a C++ compiler nothing is built: the library another compiler built from the same source and flags for
    this torch and Python is loaded, if its recorded size and sha256 still hold (:func:`_prebuilt`).
    Returns the library's path, ``$SPLICE_CACHE/kernels/<key>/<name>_<key>.so``."""
    key = _build_key(source, tuple(cflags), tuple(ldflags))
    path = library_path(key, stem=name)
    damage = _library_damage(path) if path.exists() else None
    if path.exists() and damage is None:
        return _loaded(path)
    missing = _missing_compiler()
    if missing is not None:
        return _loaded(_prebuilt(_inputs_key(source, tuple(cflags), tuple(ldflags)), name, missing))
    if damage is not None:
        print(f"splice: the cached library of {what}, {path}, is damaged ({damage}); building it again",
              file=sys.stderr, flush=True)
    cache_subfolder("kernels", key)
    with exclusive_lock(path.parent / "build.lock", lambda: print(
            f"splice: waiting for another process to finish building {what}...", file=sys.stderr, flush=True)):
        if not path.exists() or _library_damage(path) is not None:  # else another process built it meanwhile
            _compile(source, cflags, ldflags, path, what)  # loads it, too
            return path
    return _loaded(path)


def _loaded(library: Path) -> Path:
    """``library``, loaded into this process (its ops registered)."""
    torch.ops.load_library(str(library))
    return library


def _prebuilt(inputs_key: str, name: str, missing_compiler: str) -> Path:
    """The newest cached library ``name`` whose key starts with ``inputs_key`` (the same source, flags, torch and
    Python, built by any compiler) and whose size and sha256 match those recorded when it was built. Raises
    RuntimeError saying why nothing can build here (``missing_compiler``) when there is none."""
    folder = cache_dir() / "kernels"
    for library in sorted(folder.glob(f"{inputs_key}_*/{name}_{inputs_key}_*.so"), key=_modified, reverse=True):
        if _checksum_path(library).is_file() and _library_damage(library) is None:
            return library
    raise RuntimeError(f"{missing_compiler} (no library built from this source for this torch and Python is in "
                       f"{str(folder)!r} to load instead)")


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile
        return 0.0


def _missing_compiler() -> str | None:
    """Why no C++ compiler can build here (``$CXX``, else ``c++``, not found or not running), or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return (f"no C++ compiler: {compiler!r} ({'CXX' if 'CXX' in os.environ else 'the default'}) is not on PATH; "
                "install g++ or set CXX to a C++ compiler")
    try:
        run = subprocess.run([compiler, "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        return f"the C++ compiler {compiler!r} does not run ({error}); install g++ or set CXX to a C++ compiler"
    if run.returncode != 0:
        return (f"the C++ compiler {compiler!r} does not run ('{compiler} --version' exits with {run.returncode}); "
                "install g++ or set CXX to a C++ compiler")
    return None


def _checksum_path(library: Path) -> Path:
    """The file beside a built library holding its size and sha256, written before the library is renamed in."""
    return library.with_name(library.name + ".sha256")


def _library_damage(library: Path) -> str | None:
    """What is wrong with a cached library file (truncated, changed), or None. Loading a truncated ELF file kills
    the process with SIGBUS rather than raising, so it is checked first: against the size and sha256 written beside
    it when it was built, and (for a library built without them) against the file size its ELF headers imply."""
    try:
        data = library.read_bytes()
        recorded = _checksum_path(library).read_text().split() if _checksum_path(library).exists() else None
    except OSError as error:
        return f"unreadable: {error.strerror or error}"
    if recorded is not None:
        if recorded != [str(len(data)), hashlib.sha256(data).hexdigest()]:
            return f"{len(data)} bytes with sha256 {hashlib.sha256(data).hexdigest()}, built as {' '.join(recorded)}"
        return None
    return _elf_damage(data)


def _elf_damage(data: bytes) -> str | None:
    """Whether ``data`` is too short for what its 64-bit little-endian ELF headers say lies in it: the program
    headers' loaded segments and the section header table (at the end of a linked library)."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return f"not a 64-bit little-endian ELF library ({len(data)} bytes)"

    def field(offset: int, size: int) -> int:
        return int.from_bytes(data[offset:offset + size], "little")

    ends = [field(0x28, 8) + field(0x3C, 2) * field(0x3A, 2),  # section headers: e_shoff + e_shnum * e_shentsize
            field(0x20, 8) + field(0x38, 2) * field(0x36, 2)]  # program headers: e_phoff + e_phnum * e_phentsize
    if ends[1] <= len(data):
        for header in range(field(0x20, 8), ends[1], field(0x36, 2)):
            if field(header, 4) == 1:  # PT_LOAD: p_offset + p_filesz
                ends.append(field(header + 8, 8) + field(header + 32, 8))
    if max(ends) > len(data):
        return f"truncated: {len(data)} bytes, its ELF headers need {max(ends)}"
    return None


def _compile(source: Path, cflags: list[str], ldflags: list[str], path: Path, what: str) -> None:
    """Build ``source`` in a fresh folder next to ``path`` (torch's builder, which also loads the library) and rename
    the library to ``path``. Called with the build lock held, so leftovers of a killed build can go."""
    from torch.utils.cpp_extension import load

    print(f"splice: building {what}, once per machine (about half a minute)...", file=sys.stderr, flush=True)
    for leftover in path.parent.glob("building-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    _put_ninja_on_path()
    folder = Path(tempfile.mkdtemp(prefix="building-", dir=path.parent))
    try:
        load(name=path.stem, sources=[str(source)], extra_cflags=cflags, extra_ldflags=ldflags,
             build_directory=str(folder), is_python_module=False, verbose=False)
        data = (folder / path.name).read_bytes()
        checksum = folder / "checksum"
        checksum.write_text(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
        os.replace(checksum, _checksum_path(path))  # first: a library in place always has its checksum beside it
        os.replace(folder / path.name, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
    torch.library.register_fake("splice_kernels::int8_dot_gemv")(lambda x, w, scales: fake_rows(x, w.shape[0]))
    torch.library.register_fake("splice_kernels::int8_dot16_gemv")(lambda x, w, scales: fake_rows(x, w.shape[0]))
    for grouped in ("int8_dot_gemv_grouped", "int8_dot16_gemv_grouped"):
        torch.library.register_fake(f"splice_kernels::{grouped}")(lambda x, w, scales: fake_rows(x, w.shape[0]))
    torch.library.register_fake("splice_kernels::int4_gemv")(
        lambda x, w, group: fake_rows(x, w.shape[0] * INT4_TILE))
    torch.library.register_fake("splice_kernels::int4_dot_gemv")(
        lambda x, w, group: fake_rows(x, w.shape[0] * INT4_TILE))
    torch.library.register_fake("splice_kernels::int8_linear")(
        lambda x, w, scales, widen=False: fake_rows(x, w.shape[0]))
    torch.library.register_fake("splice_kernels::int4_linear")(
        lambda x, w, group, widen=False: fake_rows(x, w.shape[0] * INT4_TILE))
    torch.library.register_fake("splice_kernels::widened_linear")(lambda x, w: x.new_empty((x.shape[0], w.shape[0])))
    torch.library.register_fake("splice_kernels::int4_dequantize")(
        lambda w, group: w.new_empty((w.shape[0] * INT4_TILE, w.shape[1] * group), dtype=torch.bfloat16))
    torch.library.register_fake("splice_kernels::decode_attention")(
        lambda q, k, v, mask, scale: q.new_empty((q.shape[0], q.shape[1], 1, q.shape[3])))
    torch.library.register_fake("splice_kernels::decode_attention_sinks")(
        lambda q, k, v, mask, scale, sinks: q.new_empty((q.shape[0], q.shape[1], 1, q.shape[3])))
    torch.library.register_fake("splice_kernels::decode_layers")(_fake_decode_layers)
    torch.library.register_fake("splice_kernels::decode_attention_half")(
        lambda x, keys, values, layer, slots, mask, kv_len, cos, sin, norms, eps, tensors, kinds, groups, heads, scale,
        residual_scale: (torch.empty_like(x), torch.empty_like(x)))
    torch.library.register_fake("splice_kernels::rms_norm")(lambda x, weight, eps: torch.empty_like(x))
    torch.library.register_fake("splice_kernels::experts_decode")(
        lambda x, index, weights, chosen, experts, tensors, kinds, groups: x.new_empty(x.shape))


def _fake_decode_layers(x, keys, values, layers, slots, masks, kv_len, cos, sin, norms, eps, tensors, kinds, groups,
                        heads, scales, layouts, head, head_eps, head_norm, head_kind, head_group):
    """The hidden states' shape, or with a head (its norm's weight and bias, then the lm_head's weight, scales and
    bias) the logits' (an int4 weight is int32 tiles of INT4_TILE rows)."""
    if not head:
        return x.new_empty(x.shape)
    outputs = head[2].shape[0] * (INT4_TILE if head[2].dtype == torch.int32 else 1)
    return x.new_empty((x.shape[0], outputs))


def attention_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``decode_attention`` takes these shapes and dtypes: one query per row, fp32 or bf16 on CPU, a head_dim
    that is a multiple of 16 up to 256. Shapes only, so ``torch.compile`` traces it."""
    return (q.device.type == "cpu" and q.shape[2] == 1 and q.dtype in (torch.float32, torch.bfloat16)
            and k.dtype == q.dtype and q.shape[3] % 16 == 0 and q.shape[3] <= 256)


def argmax_fits(scores: torch.Tensor) -> bool:
    """Whether ``argmax_rows`` takes these scores: float32 or bf16 ``[rows, vocab]``, contiguous, on CPU."""
    return (scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.bfloat16) and scores.dim() == 2
            and scores.shape[1] > 0 and scores.is_contiguous())


def prompts_widened() -> bool:
    """Whether prompts (more rows than the GEMVs take) run as float32 GEMMs on slabs of the widened weight
    (``widened_linear``, ``int8_linear`` / ``int4_linear`` with ``widen``) rather than one bf16 GEMM: where torch's
    oneDNN has no bf16 arithmetic (AVX2-only CPUs; ``ONEDNN_MAX_CPU_ISA`` below AVX-512 emulates one), its bf16 matmul
    is several times slower than its float32 one."""
    return not onednn_computes_in(torch.bfloat16)


def onednn_computes_in(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN has arithmetic for the 16-bit ``dtype`` on this CPU: fp16 needs AVX512-FP16 or
    AVX-NE-CONVERT, bf16 AVX-512 (oneDNN honours ``ONEDNN_MAX_CPU_ISA``, so a smaller CPU can be emulated)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def fits(kind: str, x: torch.Tensor) -> bool:
    """Whether a ``kind`` (a key of ``MAX_ROWS``) call with input ``x [rows, K]`` suits the native GEMV: bf16 on
    CPU, at most ``MAX_ROWS[kind]`` rows (the active level's limit). Layers check :func:`available` once when built (it is not traceable by
    ``torch.compile``) and this on every call (it is)."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS[kind])


# ---- int4 layout ----------------------------------------------------------------------------------------------------
def int4_tile_pack(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` values 0..15 (N a multiple of 16) and ``scales_and_zeros [K/group, N, 2]`` -> the kernels' int4
    tiles, one tensor: per tile of 16 rows and group, the group's chunk words, then its rows' bf16 (scale, zero)
    pairs, ``int32 [N/16, K/group, 2 * group + 16]``; the scales alone (16 bf16 in 8 words, ``2 * group + 8``) where
    every zero is 0 (a symmetric weight: the kernels stream a tenth fewer bytes). Word ``16c + r`` of (tile, group)
    holds row ``16 tile + r``'s columns ``8c .. 8c + 7`` of the group as nibbles in the order k = 0, 2, 4, 6, 1, 3, 5,
    7. A tile's weights and scales are one sequential stream, in the order the GEMVs read them."""
    n, k = q.shape
    groups = scales_and_zeros.shape[0]
    group, tiles = k // groups, n // INT4_TILE
    if k != groups * group or group % INT4_CHUNK or n % INT4_TILE or scales_and_zeros.shape != (groups, n, 2):
        raise ValueError(f"int4_tile_pack: q {tuple(q.shape)} and scales_and_zeros {tuple(scales_and_zeros.shape)} "
                         f"are not [N, K] (N a multiple of {INT4_TILE}) and [K/group, N, 2] with group a multiple of "
                         f"{INT4_CHUNK}")
    chunks = q.to(torch.int32).reshape(tiles, INT4_TILE, k // INT4_CHUNK, INT4_CHUNK).transpose(1, 2)
    words = torch.zeros(chunks.shape[:-1], dtype=torch.int32, device=q.device)
    for slot, column in enumerate(INT4_ORDER):
        words |= chunks[..., column] << (4 * slot)
    lines = scales_and_zeros.to(torch.bfloat16).reshape(groups, tiles, INT4_TILE, 2).transpose(0, 1)
    if not lines[..., 1].any():
        lines = lines[..., 0]
    lines = lines.contiguous().reshape(tiles, groups, -1).view(torch.int32)
    return torch.cat([words.reshape(tiles, groups, -1), lines], dim=2).contiguous()


def int4_tile_group(w: torch.Tensor) -> int:
    """The columns per group of int4 tiles from :func:`int4_tile_pack` (their words per tile and group tell)."""
    words = w.shape[2]  # the group's chunk words (a multiple of 16), then 16 words of pairs or 8 of scales alone
    scale_words = INT4_TILE if words % INT4_TILE == 0 else INT4_TILE // 2
    return (words - scale_words) * INT4_CHUNK // INT4_TILE


def int4_tile_unpack(w: torch.Tensor) -> torch.Tensor:
    """The codes of :func:`int4_tile_pack`'s tiles: ``q [N, K]`` uint8."""
    tiles, groups, _ = w.shape
    group = int4_tile_group(w)
    words = w[..., : group * INT4_TILE // INT4_CHUNK].reshape(tiles, groups * group // INT4_CHUNK, INT4_TILE)
    columns = [None] * INT4_CHUNK
    for slot, column in enumerate(INT4_ORDER):
        columns[column] = (words >> (4 * slot)) & 15
    q = torch.stack(columns, dim=-1)  # [tiles, chunks, 16, 8]
    return q.transpose(1, 2).reshape(tiles * INT4_TILE, groups * group).to(torch.uint8)


def int4_untile_scales(w: torch.Tensor) -> torch.Tensor:
    """The scales and zeros of :func:`int4_tile_pack`'s tiles: ``[K/group, N, 2]`` bf16 (zeros 0 for scales alone)."""
    tiles, groups, _ = w.shape
    group = int4_tile_group(w)
    lines = w[..., group * INT4_TILE // INT4_CHUNK:].contiguous().view(torch.bfloat16)
    lines = lines.reshape(tiles, groups, INT4_TILE, -1)
    if lines.shape[-1] == 1:
        lines = torch.cat([lines, torch.zeros_like(lines)], dim=-1)
    return lines.transpose(0, 1).reshape(groups, tiles * INT4_TILE, 2).contiguous()


# ---- int8 layout ----------------------------------------------------------------------------------------------------
INT8_TILE_ROWS = 16  # weight rows per int8 tile
INT8_TILE_STEP = 64  # input columns per step of a tile (a last step may hold 32)
INT8_TILE_BLOCK = 32  # K must be a multiple of it
FLIPPED_WORD = -0x7F7F7F80  # 0x80808080 as an int32: every byte of a word xor 0x80


def int8_tiles_ready() -> bool:
    """Whether int8 layers keep their weight in tiles (:func:`int8_tile_pack`) for ``int8_dot_gemv``: the active
    level is ``avx512`` on a CPU with AVX512-VNNI (the ``amx`` level's int8 GEMV, on AMX tiles from 9 rows, reads
    rows)."""
    return available() and torch.ops.splice_kernels.int8_tiles_ready()


def int8_grouped_tiles_ready() -> bool:
    """Whether grouped int8 layers keep their weight in tiles (:func:`int8_tile_pack`) for ``int8_dot_gemv_grouped``:
    wherever its integer dot products run on AVX512-VNNI (the ``avx512`` and ``amx`` levels; grouped int8 has no AMX
    tile path)."""
    return available() and torch.ops.splice_kernels.vnni_ready()


def int8_group_scales_pack(scales: torch.Tensor) -> torch.Tensor:
    """Grouped int8 scales ``[G, N]`` -> the layout ``int8_dot_gemv_grouped`` reads: ``[ceil(N / 16), G, 16]``, each
    16 rows' scales of one group side by side (the last tile's rows past N zero), so a kernel walking 16 rows reads
    their scales in sequence."""
    groups, n = scales.shape
    tiles = -(-n // INT8_TILE_ROWS)
    padded = scales.new_zeros(groups, tiles * INT8_TILE_ROWS)
    padded[:, :n] = scales
    return padded.reshape(groups, tiles, INT8_TILE_ROWS).transpose(0, 1).contiguous()


def int8_group_scales_unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`int8_group_scales_pack` for ``n`` rows: ``[G, N]``."""
    tiles, groups, _ = packed.shape
    return packed.transpose(0, 1).reshape(groups, tiles * INT8_TILE_ROWS)[:, :n].contiguous()


def int8_tile_pack(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` int8 (K a multiple of 32) -> the same weight as ``int8_dot_gemv``'s tiles, uint8 ``[N, K]``: each
    16 rows' step of 64 columns (the last may be 32) is 64-byte vectors, vector j holding 4-column word j of rows 0 ..
    15; the rows past the last whole 16 stay rows. Every byte is stored as ``q + 128`` (``q ^ 0x80``)."""
    n, k = q.shape
    if q.dtype != torch.int8 or k % INT8_TILE_BLOCK:
        raise ValueError(f"int8_tile_pack takes int8 [N, K] with K a multiple of {INT8_TILE_BLOCK}, got {q.dtype} "
                         f"{tuple(q.shape)}")
    whole, steps = n // INT8_TILE_ROWS * INT8_TILE_ROWS, k // INT8_TILE_STEP * INT8_TILE_STEP
    words = q.contiguous().view(torch.int32) ^ FLIPPED_WORD  # [N, K / 4]: moved as whole 4-column words
    g, step_words = whole // INT8_TILE_ROWS, INT8_TILE_STEP // 4
    groups = words[:whole].reshape(g, INT8_TILE_ROWS, k // 4)
    main = groups[:, :, :steps // 4].reshape(g, INT8_TILE_ROWS, steps // INT8_TILE_STEP, step_words)
    last = groups[:, :, steps // 4:].transpose(1, 2)
    tiles = torch.cat([main.permute(0, 2, 3, 1).reshape(g, INT8_TILE_ROWS * steps // 4),
                       last.reshape(g, INT8_TILE_ROWS * (k - steps) // 4)], dim=1)
    return torch.cat([tiles.reshape(whole, k // 4), words[whole:]]).contiguous().view(torch.uint8)


def int8_tile_unpack(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`int8_tile_pack`: ``q [N, K]`` int8."""
    n, k = tiles.shape
    whole, steps = n // INT8_TILE_ROWS * INT8_TILE_ROWS, k // INT8_TILE_STEP * INT8_TILE_STEP
    words = tiles.contiguous().view(torch.int32)
    g, step_words = whole // INT8_TILE_ROWS, INT8_TILE_STEP // 4
    groups = words[:whole].reshape(g, INT8_TILE_ROWS * k // 4)
    main = groups[:, :steps * INT8_TILE_ROWS // 4].reshape(g, steps // INT8_TILE_STEP, step_words, INT8_TILE_ROWS)
    last = groups[:, steps * INT8_TILE_ROWS // 4:].reshape(g, (k - steps) // 4, INT8_TILE_ROWS)
    rows = torch.cat([main.permute(0, 3, 1, 2).reshape(g, INT8_TILE_ROWS, steps // 4), last.transpose(1, 2)], dim=2)
    return (torch.cat([rows.reshape(whole, k // 4), words[whole:]]) ^ FLIPPED_WORD).contiguous().view(torch.int8)


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
