"""What this machine gives splice: the CPU and its instruction sets, splice's native kernels and the level they run
at, which kernel each kind of linear layer runs for how many rows (and why), transparent huge pages, and memory.

:func:`describe_machine` gathers it as a dict (``splice info --json``), :func:`render_machine` writes it as text.
Every row limit comes from the modules that decide it (``splice.native``, ``splice.quant.kernels``, and the AMX
thresholds in ``gemv.cpp``), so the report cannot drift from what runs.
"""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from . import native
from .quant import kernels, qmath

#: The CPU flags (``/proc/cpuinfo`` names) splice's kernels or torch's use, reported present or absent.
ISA_FEATURES = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
NATIVE_ENV = ("SPLICE_NATIVE_KERNELS", "SPLICE_NATIVE_ISA", "SPLICE_NATIVE_AMX", "SPLICE_WEIGHT_STREAMS",
              "SPLICE_SOFTWARE_PREFETCH")
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PREFILL_WHY = "prefill: the weight de-quantised to bf16 into a kept buffer, then one GEMM"
WIDENED_WHY = ("no bf16 arithmetic in oneDNN on this CPU: float32 GEMMs, each on a slab of the weight widened into a "
               "small kept buffer")


def describe_machine() -> dict[str, Any]:
    """The machine report (see the module docstring); builds splice's native kernels if they are not built yet."""
    return {
        "cpu": describe_cpu(),
        "isa_features": {flag: flag in native._cpu_flags() for flag in ISA_FEATURES},
        "native": describe_native(),
        "kernels": kernel_table(),
        "huge_pages": {"mode": transparent_huge_pages_mode(), "used_by_splice": native.huge_pages_supported()},
        "memory": describe_memory(),
    }


# ---- CPU and memory -------------------------------------------------------------------------------------------------
def describe_cpu() -> dict[str, Any]:
    return {
        "model": _cpuinfo_field("model name") or platform.processor() or "unknown",
        "vendor": _cpuinfo_field("vendor_id"),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name : value`` of /proc/cpuinfo, or None (no such field, or no /proc)."""
    return _first_field(Path("/proc/cpuinfo"), name)


def _first_field(path: Path, name: str) -> str | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def describe_memory() -> dict[str, int | None]:
    """Total and available RAM in bytes, from /proc/meminfo (None where it cannot be read)."""
    return {"total_bytes": _meminfo_bytes("MemTotal"), "available_bytes": _meminfo_bytes("MemAvailable")}


def free_bytes(device: str) -> int | None:
    """Memory a new allocation can take on ``device`` ("cpu": the kernel's MemAvailable; "cuda": the current GPU's
    free memory); None where it cannot be told."""
    if device == "cpu":
        return describe_memory()["available_bytes"]
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    return None


def _meminfo_bytes(name: str) -> int | None:
    value = _first_field(Path("/proc/meminfo"), name)  # "<number> kB"
    if value is None:
        return None
    number, _, unit = value.partition(" ")
    return int(number) * (1024 if unit.strip() == "kB" else 1)


def transparent_huge_pages_mode() -> str | None:
    """The bracketed word of the kernel's THP setting (``always``, ``madvise``, ``never``), or None without one."""
    try:
        found = re.search(r"\[(\w+)\]", THP_MODE_FILE.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


# ---- native kernels -------------------------------------------------------------------------------------------------
def describe_native() -> dict[str, Any]:
    available = native.available()
    level = native.isa()
    return {
        "available": available,
        "reason": None if available else native_unavailable_reason(),
        "env": {name: os.environ.get(name) for name in NATIVE_ENV},
        "level": level,
        "level_description": native.ISA_DESCRIPTIONS[level] if level else None,
        "levels_here": list(native.supported_isas()),
        "level_chosen_by": level_chosen_by() if level else None,
        "levels": [describe_level(name) for name in native.ISA_LEVELS],
        "max_rows": dict(native.MAX_ROWS) if available else None,
        "weight_streams": native.weight_streams() if available else None,
        "weight_streams_chosen_by": weight_streams_chosen_by() if available else None,
        "software_prefetch": native.software_prefetch() if available else None,
        "software_prefetch_chosen_by": software_prefetch_chosen_by() if available else None,
    }


def weight_streams_chosen_by() -> str:
    """What set the decode GEMVs' weight streams: the CPU's vendor, SPLICE_WEIGHT_STREAMS, or this process."""
    return _setting_chosen_by(native.weight_streams() != native.initial_weight_streams(), "SPLICE_WEIGHT_STREAMS",
                              "splice.native.use_weight_streams")


def software_prefetch_chosen_by() -> str:
    """What set the kinds of weight prefetched in software: the CPU's vendor, SPLICE_SOFTWARE_PREFETCH, or this
    process."""
    return _setting_chosen_by(native.software_prefetch() != native.initial_software_prefetch(),
                              "SPLICE_SOFTWARE_PREFETCH", "splice.native.use_software_prefetch")


def _setting_chosen_by(switched: bool, variable: str, switch: str) -> str:
    """A kernel setting's origin: ``switch`` in this process where ``switched`` (it differs from what the kernels
    started with), else the environment ``variable`` where set, else the CPU vendor's default."""
    if switched:
        return f"set in this process ({switch})"
    value = os.environ.get(variable, "").strip()
    return f"{variable}={value}" if value else f"the default for {native._cpu_vendor() or 'this CPU'}"


def native_unavailable_reason() -> str:
    """Why :func:`splice.native.available` is False here."""
    if not native.enabled_by_env():
        return f"SPLICE_NATIVE_KERNELS={os.environ['SPLICE_NATIVE_KERNELS']} turns them off"
    return native.unsupported_reason() or "building them failed (splice's RuntimeWarning says why)"


def level_chosen_by() -> str:
    """What set the active level: the CPU's best, a cap from the environment, or a switch inside this process."""
    level, best = native.isa(), native.supported_isas()[-1]
    if level == best:
        return "the best this CPU runs"
    requested = os.environ.get("SPLICE_NATIVE_ISA", "").strip().lower()
    if requested == level:
        return f"SPLICE_NATIVE_ISA={requested} caps it (this CPU runs up to {best})"
    amx = os.environ.get("SPLICE_NATIVE_AMX", "").strip()
    if level == "avx512" and amx.lower() in native._OFF:
        return f"SPLICE_NATIVE_AMX={amx} caps it at avx512 (this CPU runs up to {best})"
    return f"set in this process (splice.native.set_isa / use_isa); this CPU runs up to {best}"


def describe_level(level: str) -> dict[str, Any]:
    """One instruction-set level: the CPU flags it needs, whether it runs here, and if not, why."""
    missing = [flag for flag in native.ISA_FLAGS[level] if flag not in native._cpu_flags()]
    runs = level in native.supported_isas()
    return {"level": level, "description": native.ISA_DESCRIPTIONS[level], "flags": list(native.ISA_FLAGS[level]),
            "runs_here": runs, "why_not": None if runs else _level_missing_reason(missing)}


def _level_missing_reason(missing: list[str]) -> str:
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if not native.available():
        return f"the native kernels are not available: {native_unavailable_reason()}"
    return "Linux does not let this process use the AMX tile state"


# ---- which kernel each linear runs ----------------------------------------------------------------------------------
def kernel_table() -> list[dict[str, Any]]:
    """One entry per kind of linear and range of activation rows (``max_rows`` None: no upper bound): the kernel that
    runs on CPU and why. Covers the float linears of an injected model and every quantized scheme."""
    if native.available():
        rows = bf16_native_rows() + int8_native_rows() + int4_native_rows()
    else:
        rows = bf16_torch_rows() + int8_torch_rows() + int4_torch_rows()
    return rows + other_float_rows() + int8_grouped_rows() + w8a8_rows()


def _row(linear: str, first: int, last: int | None, kernel: str, why: str) -> dict[str, Any]:
    return {"linear": linear, "min_rows": first, "max_rows": last, "kernel": kernel, "why": why}


def _ranges(linear: str, steps: list[tuple[int | None, str, str]]) -> list[dict[str, Any]]:
    """Consecutive row ranges from ``(last row or None, kernel, why)`` steps; steps whose range is empty drop out."""
    rows, first = [], 1
    for last, kernel, why in steps:
        if last is None or last >= first:
            rows.append(_row(linear, first, last, kernel, why))
            first = last + 1 if last is not None else first
    return rows


def _torch_reason() -> str:
    return f"splice's native kernels are not available: {native_unavailable_reason()}"


def _vector_description() -> str:
    """What the native GEMVs' dot products run on: the active level's vector instructions (at the amx level, the
    level below it: AMX adds tiles for batches, not vector instructions)."""
    level = native.isa()
    if native.amx_ready():
        level = native.ISA_LEVELS[native.ISA_LEVELS.index(level) - 1]
    return native.ISA_DESCRIPTIONS[level]


def bf16_native_rows() -> list[dict[str, Any]]:
    return _ranges("bf16, kernel injection", [
        (native.MAX_ROWS["bf16"], "splice_kernels.bf16_gemv",
         f"NativeLinear: native GEMV ({_vector_description()} vector code) streams the weight for decode rows"),
        (None, "splice_kernels.widened_linear", f"NativeLinear, prefill: {WIDENED_WHY}") if native.prompts_widened()
        else (None, "F.linear (oneDNN GEMM)", "NativeLinear, prefill: one oneDNN GEMM beats a GEMV per row")])


def bf16_torch_rows() -> list[dict[str, Any]]:
    return [_row("bf16, kernel injection", 1, None, _packed_or_plain(torch.bfloat16), _torch_reason())]


def other_float_rows() -> list[dict[str, Any]]:
    return [*fp16_rows(),
            _row("fp32; any float without kernel injection", 1, None, "F.linear (torch)",
                 "splice wraps float linears only at kernel injection, and only bf16 ones in its native GEMV")]


def fp16_rows() -> list[dict[str, Any]]:
    from .layers.widened_linear import WIDEN_FROM_ROWS, needs_widening

    if not needs_widening(torch.float16, "cpu"):
        return [_row("fp16, kernel injection", 1, None, _packed_or_plain(torch.float16),
                     "splice's native GEMV is bf16 only")]
    why = "no fp16 arithmetic on this CPU (oneDNN cannot pack fp16)"
    return _ranges("fp16, kernel injection", [
        (WIDEN_FROM_ROWS - 1, "F.linear (torch's fp16 GEMV)", f"WidenedLinear, decode: {why}; converts as it streams"),
        (None, "F.linear (fp32 GEMM)", "WidenedLinear, prefill: the weight widened to fp32 once per call")])


def _packed_or_plain(dtype: torch.dtype) -> str:
    from .layers.packed_linear import can_pack

    return "PackedLinear (weight packed once for oneDNN)" if can_pack(dtype, "cpu") else "F.linear (torch)"


def _decode_op(bits: str) -> str:
    """The native decode GEMV the quantized layers call: the integer dot-product one where the kernel choice takes
    them (``kernel_choice.dot_products``; for int8 on int16 activations where ``kernel_choice.int16_activations``),
    else the float one."""
    from .kernel_choice import dot_products, int16_activations

    if not dot_products():
        return f"{bits}_gemv"
    return "int8_dot16_gemv" if bits == "int8" and int16_activations() else f"{bits}_dot_gemv"


def int8_native_rows() -> list[dict[str, Any]]:
    native_max, torch_max = native.MAX_ROWS["int8"], kernels.INT8_KERNEL_MAX_ROWS
    decode_op = _decode_op("int8")
    if decode_op != "int8_gemv":  # the dot products up to their limit, then AMX tiles where present
        steps = _amx_split(native.MAX_ROWS["int8_dot"], decode_op)
        if native.amx_ready():
            steps.append((native_max, "splice_kernels.int8_gemv", "native GEMV on AMX tiles, x as it is (past the "
                                                                  "rows the dot products take)"))
    else:
        steps = _amx_split(native_max, "int8_gemv")
    steps = steps + [
        (torch_max, "torch._weight_int8pack_mm",
         f"torch's int8 GEMV (K a multiple of {kernels.INT8PACK_CPU_K_MULTIPLE}; other K: int8_linear)"),
        (None, "splice_kernels.int8_linear", _prefill_why())]
    return _ranges("int8 weight-only, per channel", steps)


def int4_native_rows() -> list[dict[str, Any]]:
    op = _decode_op("int4")
    steps = _amx_split(native.MAX_ROWS["int4_dot" if op == "int4_dot_gemv" else "int4"], op) + [
        (None, "splice_kernels.int4_linear", _prefill_why())]
    return _ranges("int4 weight-only", steps)


def _prefill_why() -> str:
    return f"prefill: {WIDENED_WHY}" if native.prompts_widened() else PREFILL_WHY


def _amx_split(native_max: int, op: str) -> list[tuple[int | None, str, str]]:
    """The native GEMV's steps up to ``native_max`` rows: vector dot products, and at the amx level AMX tiles where
    ``native.amx_thresholds()`` puts them (int8: up to one tile of rows; int8_dot_gemv: never)."""
    kernel = f"splice_kernels.{op}"
    vector = f"native GEMV ({_vector_description()} vector code)"
    if op.endswith("_dot_gemv"):
        vector += ", x rounded to int8 per block of 32, integer dot products"
    elif op == "int8_dot16_gemv":
        vector += ", x rounded to int16 per block of 256, integer dot products"
    if not native.amx_ready() or op in ("int8_dot_gemv", "int8_dot16_gemv"):
        return [(native_max, kernel, vector)]
    amx = native.amx_thresholds()
    amx_min = {"int4_gemv": amx["int4_min_rows"], "int4_dot_gemv": amx["int4_dot_min_rows"],
               "int8_gemv": amx["int8_min_rows"]}[op]
    tiles = f"native GEMV on AMX tiles (from {amx_min} rows)"
    int4 = op.startswith("int4")
    if int4:
        tiles += f"; groups not a multiple of {amx['int4_group_multiple']} stay on vector code"
    amx_max = native_max if int4 else min(native_max, amx["int8_max_rows"])
    return [(min(amx_min - 1, native_max), kernel, vector), (amx_max, kernel, tiles), (native_max, kernel, vector)]


def int8_torch_rows() -> list[dict[str, Any]]:
    return _ranges("int8 weight-only, per channel", [
        (kernels.INT8_KERNEL_MAX_ROWS, "torch._weight_int8pack_mm",
         f"{_torch_reason()}; torch's int8 GEMV (K a multiple of {kernels.INT8PACK_CPU_K_MULTIPLE})"),
        (None, "de-quantise + F.linear", f"{_torch_reason()}; prefill: one GEMM on the de-quantised weight")])


def int4_torch_rows() -> list[dict[str, Any]]:
    return [_row("int4 weight-only", 1, None, "torch._weight_int4pack_mm_for_cpu", _torch_reason())]


def int8_grouped_rows() -> list[dict[str, Any]]:
    from .kernel_choice import dot_products, int16_activations

    per_group = (kernels.INT8_KERNEL_MAX_ROWS, "torch._weight_int8pack_mm per group",
                 f"torch's int8 GEMV, one call per group (group size a multiple of {kernels.INT8PACK_CPU_K_MULTIPLE})")
    prefill = (None, "de-quantise + F.linear", "prefill: one GEMM on the de-quantised weight")
    if not (native.available() and dot_products()):
        return _ranges("int8 weight-only, grouped", [per_group, prefill])
    block = qmath.ACTIVATION_BLOCK
    if int16_activations():
        grouped = (native.MAX_ROWS["int8_dot"], "splice_kernels.int8_dot16_gemv_grouped",
                   f"native GEMV, x rounded to int16 per block of {qmath.WIDE_ACTIVATION_BLOCK}, integer dot products "
                   "(the weight in 16-row tiles), a scale per group")
    else:
        grouped = (native.MAX_ROWS["int8_dot"], "splice_kernels.int8_dot_gemv_grouped",
                   f"native GEMV, x rounded to int8 per block of {block}, integer dot products, a scale per group")
    if native.prompts_widened():
        prefill = (None, "splice_kernels.widened_linear", f"prefill: the weight de-quantised to bf16; {WIDENED_WHY}")
    return (_ranges(f"int8 weight-only, grouped (each group zero-padded to whole blocks of {block}, if that adds at "
                    "most half)", [grouped, prefill])
            + _ranges("int8 weight-only, grouped (groups of under 22 or 33-42 inputs)", [per_group, prefill]))


def w8a8_rows() -> list[dict[str, Any]]:
    rounded = (f"after rounding the activations to int8 per block of {qmath.ACTIVATION_BLOCK} "
               "(qmath.round_activations)")
    if not native.available():
        return [_row("W8A8", 1, None, "the int8 per-channel kernels above", rounded)]
    return _ranges("W8A8", [
        (native.MAX_ROWS["w8a8"], "splice_kernels.int8_dot_gemv",
         f"native GEMV, x rounded to int8 per block of {qmath.ACTIVATION_BLOCK}, integer dot products"),
        (None, "splice_kernels.int8_linear", f"{_prefill_why()}, {rounded}")])


# ---- text -----------------------------------------------------------------------------------------------------------
def render_machine(machine: dict[str, Any]) -> str:
    """The text form of :func:`describe_machine`'s report."""
    lines = [f"{key:<16} {value}" for key, value in summary_lines(machine)]
    return "\n".join(["machine", *("  " + line for line in lines), "  kernels per linear (CPU, rows of activations):",
                      *("    " + line for line in render_kernel_table(machine["kernels"]))])


def summary_lines(machine: dict[str, Any]) -> list[tuple[str, str]]:
    cpu, features, memory = machine["cpu"], machine["isa_features"], machine["memory"]
    return [
        ("cpu", f"{cpu['model']} ({cpu['vendor'] or 'vendor unknown'}), {cpu['logical_cores']} logical cores"),
        ("torch", f"{cpu['torch_version']}, {cpu['torch_threads']} threads, "
                  f"CPU capability {cpu['torch_cpu_capability']}"),
        ("isa present", " ".join(flag for flag, has in features.items() if has) or "none of splice's"),
        ("isa absent", " ".join(flag for flag, has in features.items() if not has) or "none"),
        *native_lines(machine["native"]),
        ("huge pages", f"THP {machine['huge_pages']['mode'] or 'unknown'}; splice "
                       f"{'uses' if machine['huge_pages']['used_by_splice'] else 'does not use'} them"),
        ("memory", f"{_gib(memory['total_bytes'])} total, {_gib(memory['available_bytes'])} available"),
    ]


def native_lines(info: dict[str, Any]) -> list[tuple[str, str]]:
    if not info["available"]:
        return [("native kernels", f"not available: {info['reason']}")]
    limits = ", ".join(f"{kind} {rows}" for kind, rows in info["max_rows"].items())
    return [("native kernels", "available"),
            ("level", f"{info['level']} ({info['level_description']}): {info['level_chosen_by']}"),
            ("levels here", ", ".join(info["levels_here"])),
            *[(f"  {level['level']}", f"needs {' '.join(level['flags'])}: {level['why_not']}")
              for level in info["levels"] if not level["runs_here"]],
            ("max rows", f"{limits} (most rows each native GEMV serves)"),
            ("weight streams", f"{info['weight_streams']} a thread for 1-2 rows of x ({info['weight_streams_chosen_by']}; "
                               "kernels whose registers hold fewer walk 2)"),
            ("prefetch", prefetch_line(info["software_prefetch"], info["software_prefetch_chosen_by"]))]


def prefetch_line(kinds: dict[str, int], chosen_by: str) -> str:
    """``splice info --machine``'s line on software prefetch: which kinds' GEMVs prefetch, from how many rows of x a
    pass, and what chose that."""
    if not kinds:
        return f"none: every GEMV leaves its weight streams to the hardware prefetcher ({chosen_by})"
    each = ", ".join(kind if rows == 1 else f"{kind} (from {rows} rows of x)" for kind, rows in kinds.items())
    return (f"in software in the {each} GEMVs ({chosen_by}; the rest leave their weight streams to the hardware "
            "prefetcher)")


def _gib(size: int | None) -> str:
    return "unknown" if size is None else f"{size / 2**30:.1f} GiB"


def render_kernel_table(table: list[dict[str, Any]]) -> list[str]:
    """One heading per kind of linear, then a line per row range: rows, kernel, why."""
    kernel_width = max(len(entry["kernel"]) for entry in table)
    lines, linear = [], None
    for entry in table:
        if entry["linear"] != linear:
            linear = entry["linear"]
            lines.append(linear)
        lines.append(f"  {_row_range(entry):<7} {entry['kernel']:<{kernel_width}}  {entry['why']}")
    return lines


def _row_range(entry: dict[str, Any]) -> str:
    first, last = entry["min_rows"], entry["max_rows"]
    if last is None:
        return f"{first}+"
    return str(first) if first == last else f"{first}-{last}"
