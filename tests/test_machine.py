"""The machine report: its shape, that it follows the native kernels' level and row limits, and that it says why
torch's kernels run where splice's native ones do not. Expectations come from this machine, whatever its CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from splice import machine, native
from splice.quant import kernels

REPORT_KEYS = {"cpu", "isa_features", "native", "kernels", "huge_pages", "memory"}
GEMV_KINDS = {"bf16": ("bf16_gemv",), "int8": ("int8_dot_gemv", "int8_dot16_gemv", "int8_gemv"),  # decode
              "int4": ("int4_dot_gemv",)}
NATIVE_MISSING = None if native.available() else machine.native_unavailable_reason()
needs_native = pytest.mark.skipif(NATIVE_MISSING is not None,
                                  reason=f"splice's native kernels are not available here: {NATIVE_MISSING}")


def _report_in_subprocess(**env: str) -> dict:
    code = "import json; from splice.machine import describe_machine; print(json.dumps(describe_machine()))"
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _skip_unless_level_runs(level: str) -> None:
    if NATIVE_MISSING is not None:
        pytest.skip(f"splice's native kernels are not available here: {NATIVE_MISSING}")
    if level not in native.supported_isas():
        pytest.skip(f"this machine cannot run the {level} kernels (it needs CPU flags "
                    f"{', '.join(native.ISA_FLAGS[level])}; levels here: {', '.join(native.supported_isas())})")


def _entries(report: dict, kernel_prefix: str) -> list[dict]:
    return [entry for entry in report["kernels"] if entry["kernel"].startswith(kernel_prefix)]


def test_report_keys_and_types():
    report = machine.describe_machine()
    assert set(report) == REPORT_KEYS
    cpu = report["cpu"]
    assert isinstance(cpu["model"], str) and cpu["model"]
    assert cpu["logical_cores"] == os.cpu_count() and cpu["torch_threads"] == torch.get_num_threads()
    assert cpu["torch_version"] == torch.__version__
    assert cpu["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert list(report["isa_features"]) == list(machine.ISA_FEATURES)
    assert all(isinstance(has, bool) for has in report["isa_features"].values())
    assert isinstance(report["huge_pages"]["used_by_splice"], bool)
    assert report["huge_pages"]["mode"] in (None, "always", "madvise", "never")
    assert all(size is None or (isinstance(size, int) and size > 0) for size in report["memory"].values())
    assert all(set(entry) == {"linear", "min_rows", "max_rows", "kernel", "why"} for entry in report["kernels"])
    json.dumps(report)  # the --json form


def test_isa_features_cover_every_level_and_match_the_cpu_flags():
    report = machine.describe_machine()
    for flags in native.ISA_FLAGS.values():
        assert set(flags) <= set(machine.ISA_FEATURES)
    assert report["isa_features"] == {flag: flag in native._cpu_flags() for flag in machine.ISA_FEATURES}


def test_native_section_follows_the_native_module():
    info = machine.describe_machine()["native"]
    assert info["available"] == native.available()
    assert info["level"] == native.isa()
    assert info["levels_here"] == list(native.supported_isas())
    assert [level["level"] for level in info["levels"]] == list(native.ISA_LEVELS)
    for level in info["levels"]:
        assert level["runs_here"] == (level["level"] in native.supported_isas())
        assert (level["why_not"] is None) == level["runs_here"]
    if native.available():
        assert info["reason"] is None and info["max_rows"] == native.MAX_ROWS
        assert info["level_description"] == native.ISA_DESCRIPTIONS[native.isa()]
        assert info["weight_streams"] == native.weight_streams()
        with native.use_weight_streams(1):
            assert machine.describe_machine()["native"]["weight_streams_chosen_by"] == \
                "set in this process (splice.native.use_weight_streams)"
        assert info["software_prefetch"] == native.software_prefetch()
        with native.use_software_prefetch(False):
            assert machine.describe_machine()["native"]["software_prefetch"] == {}
        with native.use_software_prefetch({"int4": 3}):
            assert machine.describe_machine()["native"]["software_prefetch"] == {"int4": 3}


@pytest.mark.parametrize("variable, value, setting, use, default, chosen_by", [
    ("SPLICE_WEIGHT_STREAMS", "1", 1, "use_weight_streams", "default_weight_streams", "weight_streams_chosen_by"),
    ("SPLICE_SOFTWARE_PREFETCH", "none", False, "use_software_prefetch", "default_software_prefetch",
     "software_prefetch_chosen_by"),
])
def test_kernel_settings_name_what_chose_them(monkeypatch, variable, value, setting, use, default, chosen_by):
    """The CPU vendor's default, the environment variable, or a switch in this process: whichever set the kernels'
    weight streams and software prefetch is what `splice info --machine` names."""
    if not native.available():
        pytest.skip(f"splice's native kernels are not available here: {NATIVE_MISSING}")
    use, named = getattr(native, use), getattr(machine, chosen_by)
    if variable == "SPLICE_SOFTWARE_PREFETCH" and not native.default_software_prefetch():
        value, setting = "all", True  # a setting other than this CPU's default
    monkeypatch.delenv(variable, raising=False)
    with use(getattr(native, default)()):
        assert named() == f"the default for {native._cpu_vendor() or 'this CPU'}"
        monkeypatch.setenv(variable, value)
        assert named() == f"set in this process (splice.native.{use.__name__})"
    with use(setting):
        assert named() == f"{variable}={value}"


def test_kernel_table_row_ranges_run_from_one_row_to_no_limit():
    entries_by_linear: dict[str, list[dict]] = {}
    for entry in machine.describe_machine()["kernels"]:
        entries_by_linear.setdefault(entry["linear"], []).append(entry)
    for linear, entries in entries_by_linear.items():
        assert entries[0]["min_rows"] == 1, linear
        assert entries[-1]["max_rows"] is None, linear
        for before, after in zip(entries, entries[1:]):
            assert after["min_rows"] == before["max_rows"] + 1, linear


@needs_native
def test_kernel_table_row_limits_are_native_max_rows():
    report = machine.describe_machine()
    for kind, ops in GEMV_KINDS.items():
        gemv = [entry for op in ops for entry in _entries(report, f"splice_kernels.{op}")]
        assert gemv, kind
        # the quantized kinds' decode rows: integer dot products, then (int8 at the amx level) tiles
        limit = max(native.MAX_ROWS[kind], native.MAX_ROWS.get(f"{kind}_dot", 0))
        assert gemv[0]["min_rows"] == 1 and gemv[-1]["max_rows"] == limit
        after = [entry for entry in report["kernels"]
                 if entry["linear"] == gemv[-1]["linear"] and entry["min_rows"] == limit + 1]
        assert len(after) == 1 and not any(op in after[0]["kernel"] for op in ops), kind


@needs_native
def test_int8_table_hands_over_to_torch_then_prefill_at_its_constants():
    entries = [entry for entry in machine.describe_machine()["kernels"]
               if entry["linear"] == "int8 weight-only, per channel"]
    prefill = entries[-1]
    assert prefill["kernel"] == "splice_kernels.int8_linear"
    assert prefill["min_rows"] == max(native.MAX_ROWS["int8"], native.MAX_ROWS["int8_dot"],
                                      kernels.INT8_KERNEL_MAX_ROWS) + 1


@needs_native
def test_w8a8_table_rounds_on_dot_products_up_to_its_row_limit_then_prefill():
    entries = [entry for entry in machine.describe_machine()["kernels"] if entry["linear"] == "W8A8"]
    assert [entry["kernel"] for entry in entries] == ["splice_kernels.int8_dot_gemv", "splice_kernels.int8_linear"]
    assert entries[0]["max_rows"] == native.MAX_ROWS["w8a8"] and entries[1]["min_rows"] == native.MAX_ROWS["w8a8"] + 1
    assert "rounding the activations to int8" in entries[1]["why"]


def test_avx2_level_is_reported():
    _skip_unless_level_runs("avx2")
    with native.use_isa("avx2"):
        report = machine.describe_machine()
    assert report["native"]["level"] == "avx2"
    assert report["native"]["level_description"] == native.ISA_DESCRIPTIONS["avx2"]
    assert report["native"]["max_rows"] == native.ROW_LIMITS["avx2"]
    assert not any("AMX" in entry["why"] for entry in report["kernels"])
    assert "level            avx2" in machine.render_machine(report)


def test_amx_level_puts_batches_on_tiles_where_the_kernels_do():
    _skip_unless_level_runs("amx")
    with native.use_isa("amx"):
        report = machine.describe_machine()
    tiles = [entry for entry in report["kernels"] if "AMX tiles" in entry["why"]]
    thresholds = native.amx_thresholds()
    # with integer dot products (the default): int4 from its own threshold; int8 past the dot products' rows, on
    # int8_gemv (int8_dot_gemv itself never uses tiles)
    limits = native.ROW_LIMITS["amx"]
    assert [(entry["kernel"], entry["min_rows"], entry["max_rows"]) for entry in tiles] == [
        ("splice_kernels.int8_gemv", limits["int8_dot"] + 1, limits["int8"]),
        ("splice_kernels.int4_dot_gemv", thresholds["int4_dot_min_rows"], limits["int4"])]
    assert limits["int8_dot"] + 1 >= thresholds["int8_min_rows"]  # int8_gemv is on its tiles there


def test_amx_level_without_dot_products_puts_both_gemvs_on_tiles():
    _skip_unless_level_runs("amx")
    report = _report_in_subprocess(SPLICE_NATIVE_DOT="0", SPLICE_NATIVE_ISA="amx")
    tiles = [entry for entry in report["kernels"] if "AMX tiles" in entry["why"]]
    with native.use_isa("amx"):
        thresholds = native.amx_thresholds()
    assert {entry["min_rows"] for entry in tiles} == {thresholds["int8_min_rows"], thresholds["int4_min_rows"]}
    amx_limits = native.ROW_LIMITS["amx"]
    assert {entry["max_rows"] for entry in tiles} == {amx_limits["int8"], amx_limits["int4"]}


def test_native_kernels_off_means_torch_kernels_and_the_reason():
    report = _report_in_subprocess(SPLICE_NATIVE_KERNELS="0")
    info = report["native"]
    assert info["available"] is False and info["level"] is None and info["max_rows"] is None
    assert "SPLICE_NATIVE_KERNELS=0" in info["reason"]
    assert not _entries(report, "splice_kernels.")
    for linear in ("bf16, kernel injection", "int8 weight-only, per channel", "int4 weight-only"):
        entries = [entry for entry in report["kernels"] if entry["linear"] == linear]
        assert entries and all(info["reason"] in entry["why"] for entry in entries), linear
    assert report["huge_pages"]["used_by_splice"] is False


def test_environment_cap_is_named_as_what_chose_the_level():
    levels = native.supported_isas()
    if len(levels) < 2:
        pytest.skip(f"one level or none runs here ({', '.join(levels) or 'none'}): nothing to cap")
    info = _report_in_subprocess(SPLICE_NATIVE_ISA=levels[0])["native"]
    assert info["level"] == levels[0]
    assert f"SPLICE_NATIVE_ISA={levels[0]}" in info["level_chosen_by"]


def test_text_form_names_the_cpu_the_level_and_every_linear():
    report = machine.describe_machine()
    text = machine.render_machine(report)
    assert report["cpu"]["model"] in text
    assert (f"level            {report['native']['level']}" in text if report["native"]["available"]
            else report["native"]["reason"] in text)
    assert all(entry["linear"] in text and entry["kernel"] in text for entry in report["kernels"])


def test_the_prefetch_line_names_the_kinds_or_says_none():
    assert machine.prefetch_line({"int4": 3}, "the default for AuthenticAMD") == (
        "in software in the int4 (from 3 rows of x) GEMVs (the default for AuthenticAMD; the rest leave their weight "
        "streams to the hardware prefetcher)")
    assert machine.prefetch_line({"bf16": 1, "int4": 1}, "SPLICE_SOFTWARE_PREFETCH=bf16,int4") == (
        "in software in the bf16, int4 GEMVs (SPLICE_SOFTWARE_PREFETCH=bf16,int4; the rest leave their weight "
        "streams to the hardware prefetcher)")
    assert machine.prefetch_line({}, "SPLICE_SOFTWARE_PREFETCH=none") == (
        "none: every GEMV leaves its weight streams to the hardware prefetcher (SPLICE_SOFTWARE_PREFETCH=none)")
