"""``benchmarks/bench_llamacpp.py``: its pure parts (arguments, parsing both engines' JSON, the table, the source
patch). Nothing here builds llama.cpp or downloads anything, except the one end-to-end run that
``SPLICE_TEST_LLAMACPP=1`` turns on."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from .benchmark_scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_llamacpp.py"


def load_script():
    return load_benchmark("bench_llamacpp")


bl = load_script()
FILES = {"bf16": Path("/c/llama-1b-bf16.gguf"), "int8": Path("/c/llama-1b-q8_0.gguf"),
         "int4": Path("/c/llama-1b-q4_0.gguf")}


def record(path: str, prompt: int, new: int, samples: list[float], depth: int = 0) -> dict:
    """A llama-bench JSON record, the fields the script reads plus a few it does not."""
    return {"build_commit": "0c1e57098", "model_filename": path, "n_prompt": prompt, "n_gen": new,
            "n_depth": depth, "n_threads": 2, "avg_ts": sum(samples) / len(samples), "samples_ts": samples}


def test_defaults_and_formats():
    args = bl.parse_args([])
    assert (args.threads, args.new, args.prompt, args.sittings) == (2, 64, 128, 2)
    assert args.formats == ["bf16", "int8", "int4-sym", "int4"] and args.json == "bench_out/llamacpp.json"
    # each pair reads the same bits per weight with the same scheme
    assert {name: f.gguf_type for name, f in bl.FORMATS.items()} == {"bf16": "BF16", "int8": "Q8_0", "int4-sym": "Q4_0",
                                                                  "int4": "Q4_1"}
    assert bl.parse_args(["--formats", " int4, bf16"]).formats == ["int4", "bf16"]


@pytest.mark.parametrize("argv, named", [
    (["--threads", "0"], "--threads=0"),
    (["--new", "1"], "--new=1"),
    (["--prompt", "-3"], "--prompt=-3"),
    (["--sittings", "0"], "--sittings=0"),
    (["--reps", "0"], "--reps=0"),
    (["--formats", "int8,int3"], "'int8,int3'"),
    (["--formats", "int8,int8"], "'int8,int8'"),
    (["--formats", ","], "','"),
])
def test_bad_arguments_name_the_value(argv, named):
    with pytest.raises(ValueError, match=named.replace("+", r"\+")) as error:
        bl.parse_args(argv)
    if "--formats" in argv:
        assert "bf16, int8, int4-sym, int4" in str(error.value)  # and the allowed ones


def test_llama_bench_records_become_best_rates_per_format_and_phase():
    records = [record(str(FILES["int8"]), 128, 0, [90.0, 100.0, 95.0]),
               record(str(FILES["int4"]), 128, 0, [120.0]),
               record(str(FILES["int8"]), 0, 32, [10.0, 12.5], depth=128),
               record(str(FILES["int4"]), 0, 32, [20.0], depth=128),
               record(str(FILES["int4"]), 128, 32, [99.0]),  # prompt and generation together: not ours
               record("/elsewhere/other.gguf", 0, 32, [1.0])]
    parsed = bl.parse_llama_bench(records, {k: FILES[k] for k in ("int8", "int4")})
    assert parsed == {"int8": {"prefill": 100.0, "decode": 12.5}, "int4": {"prefill": 120.0, "decode": 20.0}}


def test_splice_report_gives_the_compiled_rows():
    rows = [{"mode": "inject", "prefill_ms": 900.0, "decode_tok_s": 5.0},
            {"mode": "inject+compile", "prefill_ms": 1000.0, "decode_tok_s": 6.0},
            {"mode": "inject+int4", "prefill_ms": 700.0, "decode_tok_s": 9.0},
            {"mode": "inject+int4+compile", "prefill_ms": 640.0, "decode_tok_s": 11.0}]
    parsed = bl.parse_splice({"results": rows}, ["bf16", "int4"], prompt=128)
    assert parsed == {"bf16": {"decode": 6.0, "prefill": 128.0}, "int4": {"decode": 11.0, "prefill": 200.0}}
    with pytest.raises(ValueError, match="'inject\\+int8\\+compile'"):
        bl.parse_splice({"results": rows}, ["int8"], prompt=128)


def test_rows_take_the_best_sitting_and_the_ratio_is_splice_over_llamacpp():
    llamacpp = [{"int8": {"decode": 10.0, "prefill": 100.0}}, {"int8": {"decode": 12.0, "prefill": 80.0}}]
    splice = [{"int8": {"decode": 9.0, "prefill": 50.0}}, {"int8": {"decode": 6.0, "prefill": 60.0}}]
    [row] = bl.make_rows(llamacpp, splice, ["int8"])
    assert row == bl.Row("int8 vs Q8_0", 12.0, 100.0, 9.0, 60.0, 0.75, 0.6, [0.9, 0.5])


def test_a_missing_figure_is_nan_not_an_error():
    [row] = bl.make_rows([{}], [{"int4": {"decode": 9.0, "prefill": 50.0}}], ["int4"])
    assert math.isnan(row.llamacpp_decode) and math.isnan(row.decode_ratio) and row.decode_ratio_by_sitting == []


def test_table_names_cpu_threads_and_every_format():
    rows = [bl.Row("bf16", 5.0, 50.0, 6.0, 40.0, 1.2, 0.8, [1.2, 0.96]),
            bl.Row("int4 g32 vs Q4_0", 20.0, 90.0, 15.0, 45.0, 0.75, 0.5)]
    table = bl.format_table(rows, "Intel(R) Xeon(R) Processor", 2)
    lines = table.splitlines()
    assert lines[0].startswith("CPU: Intel(R) Xeon(R) Processor, 2 threads")
    assert "llama.cpp decode" in lines[1] and "splice decode" in lines[1]
    assert lines[3].split()[:3] == ["bf16", "5.00", "50.0"] and lines[3].endswith("1.20x     0.80x  1.20x 0.96x")
    assert "decode x by sitting" in lines[1] and lines[4].endswith("0.50x")
    assert lines[4].startswith("int4 g32 vs Q4_0") and "0.75x" in lines[4]


def test_cpu_model_from_cpuinfo():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8592+\nflags\t: fpu\n"
    assert bl.cpu_model(text) == "Intel(R) Xeon(R) Platinum 8592+"
    assert bl.cpu_model("processor : 0\n") == "unknown"


def test_changelog_commit_is_the_versions_latest_update():
    changelog = ("## [Unreleased]\n\n## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n\n"
                 "## [0.3.35]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n"
                 "- feat: update llama.cpp to ggml-org/llama.cpp@adb55e514\n")
    assert bl.changelog_commit(changelog, "0.3.36") == "0c1e57098"
    assert bl.changelog_commit(changelog, "0.3.35") == "4df29be4f"
    with pytest.raises(ValueError, match="'0.3.1'"):
        bl.changelog_commit(changelog, "0.3.1")


def test_patch_applies_once_and_refuses_a_changed_source(tmp_path):
    relative, text, replacement = bl.PATCHES[0]
    target = tmp_path / relative
    target.parent.mkdir(parents=True)
    target.write_text("inline void f() {\n" + text + "}\n")
    assert bl.patch_source(tmp_path) == [relative]
    patched = target.read_text()
    assert replacement in patched and patched.count(text) == 1
    bl.patch_source(tmp_path)
    assert target.read_text() == patched  # a second run leaves it alone
    target.write_text("inline void f() {}\n")
    with pytest.raises(ValueError, match="found 0"):
        bl.patch_source(tmp_path)


def test_a_dying_child_is_named_with_its_signal():
    with pytest.raises(RuntimeError, match="signal 9"):
        bl.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], capture=True)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPLICE_TEST_LLAMACPP") != "1",
                    reason="builds llama.cpp and runs both engines on llama-1b: set SPLICE_TEST_LLAMACPP=1")
def test_end_to_end(tmp_path):
    out = tmp_path / "llamacpp.json"
    argv = ["--sittings", "1", "--new", "4", "--prompt", "16", "--reps", "1", "--formats", "int4", "--json", str(out)]
    assert bl.main(argv) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["format"] == "int4 g32 vs Q4_1" and row["llamacpp_decode"] > 0 and row["splice_decode"] > 0
