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
    assert (row.format, row.llamacpp_decode, row.llamacpp_prefill, row.splice_decode, row.splice_prefill,
            row.decode_ratio, row.prefill_ratio, row.decode_ratio_by_sitting) == ("int8 vs Q8_0", 12.0, 100.0, 9.0,
                                                                                60.0, 0.75, 0.6, [0.9, 0.5])
    assert math.isnan(row.bytes_ratio)  # neither engine's bytes given


def test_rows_give_both_engines_bytes_and_their_ratio():
    llamacpp = [{"int8": {"decode": 10.0, "prefill": 100.0}}]
    splice = [{"int8": {"decode": 9.0, "prefill": 50.0, "step_bytes": 1_000_000_000}}]
    [row] = bl.make_rows(llamacpp, splice, ["int8"], {"int8": 1_100_000_000})
    assert (row.llamacpp_step_bytes, row.splice_step_bytes) == (1.1e9, 1e9) and row.bytes_ratio == pytest.approx(1.1)
    table = bl.format_table([row], "AMD EPYC", 2).splitlines()
    assert "bytes x" in table[-3] and table[-1].split() == ["int8", "vs", "Q8_0", "1100.0", "11.0", "1000.0", "9.0",
                                                            "1.10x"]


def test_splice_step_bytes_come_from_its_report():
    rows = [{"mode": "inject+int8+compile", "prefill_ms": 1000.0, "decode_tok_s": 6.0, "step_bytes": 123}]
    assert bl.parse_splice({"results": rows}, ["int8"], prompt=100)["int8"]["step_bytes"] == 123


def test_gguf_step_bytes_leave_out_the_embedding_unless_it_is_the_head(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    def write(path, with_head):
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_block_count(2)
        writer.add_embedding_length(64)
        writer.add_head_count(4)
        writer.add_head_count_kv(2)
        writer.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float16))
        if with_head:
            writer.add_tensor("output.weight", np.zeros((100, 64), dtype=np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write(tmp_path / "head.gguf", True)
    write(tmp_path / "tied.gguf", False)
    kv = 2 * 2 * 2 * 16 * 2 * 10  # K and V, 2 layers, 2 KV heads of 16, f16, 10 positions
    assert bl.gguf_step_bytes(tmp_path / "head.gguf", 10) == 64 * 64 * 2 + 100 * 64 * 2 + kv
    assert bl.gguf_step_bytes(tmp_path / "tied.gguf", 10) == 64 * 64 * 2 + 100 * 64 * 4 + kv
    assert bl.decode_slots(bl.parse_args(["--prompt", "128", "--new", "65"])) == 160


def test_a_missing_figure_is_nan_not_an_error():
    [row] = bl.make_rows([{}], [{"int4": {"decode": 9.0, "prefill": 50.0}}], ["int4"])
    assert math.isnan(row.llamacpp_decode) and math.isnan(row.decode_ratio) and row.decode_ratio_by_sitting == []


def test_table_names_cpu_threads_and_every_format():
    rows = [bl.Row("bf16", 5.0, 50.0, 6.0, 40.0, 1.2, 0.8, decode_ratio_by_sitting=[1.2, 0.96]),
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
    assert row["llamacpp_step_bytes"] > 0 and row["splice_step_bytes"] > 0


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPLICE_TEST_LLAMACPP") != "1",
                    reason="builds llama.cpp and runs both engines on llama-1b: set SPLICE_TEST_LLAMACPP=1")
def test_end_to_end_pairs(tmp_path):
    out = tmp_path / "pairs.json"
    argv = ["--pairs", "2", "--new", "4", "--prompt", "16", "--formats", "int4", "--json", str(out)]
    assert bl.main(argv) == 0
    report = json.loads(out.read_text())
    [row] = report["rows"]
    assert row["format"] == "int4 g32 vs Q4_1" and row["ratio_low"] <= row["ratio"] <= row["ratio_high"]
    assert len(report["pairs"]["int4"]) == 2 and all(p["llama.cpp"] > 0 and p["splice"] > 0
                                                     for p in report["pairs"]["int4"])


def test_pairs_argument():
    assert bl.parse_args([]).pairs == 0 and bl.parse_args(["--pairs", "3"]).pairs == 3
    with pytest.raises(ValueError, match="--pairs=-1"):
        bl.parse_args(["--pairs", "-1"])


def test_pairs_alternate_which_engine_goes_first(monkeypatch):
    calls = []

    class FakeWorker:
        def __init__(self, args):
            calls.append("start")

        def decode(self, name):
            calls.append(f"splice {name}")
            return {"decode": 20.0, "step_bytes": 1000}

        def probe(self):
            calls.append("probe")
            return 30.0 + len(calls)

        def close(self):
            calls.append("close")

    def fake_llamacpp(tool, path, args):
        calls.append(f"llama.cpp {path.name}")
        return 10.0

    monkeypatch.setattr(bl, "SpliceWorker", FakeWorker)
    monkeypatch.setattr(bl, "llamacpp_decode", fake_llamacpp)
    args = bl.parse_args(["--pairs", "2", "--formats", "int8,int4"])
    pairs = bl.run_pairs(args, Path("/c/llama-bench"), FILES)
    assert calls == ["start", "probe", "llama.cpp llama-1b-q8_0.gguf", "splice int8", "probe",
                     "probe", "llama.cpp llama-1b-q4_0.gguf", "splice int4", "probe",
                     "probe", "splice int8", "llama.cpp llama-1b-q8_0.gguf", "probe",
                     "probe", "splice int4", "llama.cpp llama-1b-q4_0.gguf", "probe", "close"]
    # the probe around each pair (30 + the calls so far): before and after, and their mean
    assert pairs["int8"] == [{"llama.cpp": 10.0, "splice": 20.0, "splice_step_bytes": 1000, "probe_gbs": 33.5,
                              "probe_before_after": [32.0, 35.0]},
                             {"llama.cpp": 10.0, "splice": 20.0, "splice_step_bytes": 1000, "probe_gbs": 41.5,
                              "probe_before_after": [40.0, 43.0]}]


def test_pair_rows_take_the_median_of_the_pairs_ratios():
    runs = [{"llama.cpp": 10.0, "splice": 12.0, "splice_step_bytes": 1e9, "probe_gbs": 20.0},
            {"llama.cpp": 20.0, "splice": 20.0, "splice_step_bytes": 1e9, "probe_gbs": 40.0},
            {"llama.cpp": 10.0, "splice": 15.0, "splice_step_bytes": 1e9, "probe_gbs": 25.0}]
    [row] = bl.make_pair_rows({"int8": runs}, {"int8": 1.1e9})
    # the median ratio is 1.2 (of 1.2, 1.0, 1.5), not the ratio of the medians (15 / 10)
    assert (row.llamacpp_decode, row.splice_decode, row.ratio, row.ratio_low, row.ratio_high) == (10.0, 15.0, 1.2,
                                                                                                  1.0, 1.5)
    # shares per pair: llama.cpp 11/20, 22/40, 11/25; splice 12/20, 20/40, 15/25
    assert row.probe_gbs == 25.0 and row.llamacpp_share == pytest.approx(0.55) and row.splice_share == 0.6
    table = bl.format_pair_table([row], "AMD EPYC", 2, 3).splitlines()
    assert "3 back-to-back pairs" in table[0]
    assert table[-1].split() == ["int8", "vs", "Q8_0", "10.00", "11.0", "15.00", "15.0", "1.20x", "1.00-1.50x", "1.10x",
                                 "25.0", "55%", "60%"]


def test_the_worker_handle_reads_answers_past_other_output():
    worker = bl.SpliceWorker.__new__(bl.SpliceWorker)

    class Process:
        stdout = iter(["Loading weights: 100%\n", bl.ANSWER + '{"format": "int8", "decode": 5.0}\n'])

        def wait(self):
            return 1

    worker.process = Process()
    assert worker.answer() == {"format": "int8", "decode": 5.0}
    with pytest.raises(RuntimeError, match="exit status 1"):
        worker.answer()


@pytest.fixture
def worker_starts(monkeypatch) -> list[tuple[list[str], dict]]:
    """(command, environment) of each splice worker started, the worker a stand-in that answers it is ready."""
    starts = []

    class Process:
        def __init__(self):
            self.stdout = iter([bl.ANSWER + '{"ready": true}\n'])

    def popen(command, env=None, **kwargs):
        starts.append((command, env))
        return Process()

    monkeypatch.setattr(bl.subprocess, "Popen", popen)
    return starts


def test_eager_steps_only_in_pairs_and_the_worker_is_told(worker_starts):
    with pytest.raises(ValueError, match="--eager: only with --pairs"):
        bl.parse_args(["--eager"])
    for argv in (["--pairs", "2"], ["--pairs", "2", "--eager"]):
        bl.SpliceWorker(bl.parse_args(argv))
    commands = [command for command, _ in worker_starts]
    assert "--eager" not in commands[0] and commands[1][-1] == "--eager"


def test_levels_build_apart_and_tell_splice_its_level():
    assert bl.parse_args([]).level == "native"
    native, avx2 = bl.LEVELS["native"], bl.LEVELS["avx2"]
    assert native.cmake_flags == bl.CMAKE_FLAGS and native.build_dir != avx2.build_dir
    # the AVX2 build: no -march=native, no AVX-512, no AVX-VNNI; the rest of the flags as the native build's
    assert "-DGGML_NATIVE=OFF" in avx2.cmake_flags and "-DGGML_NATIVE=ON" not in avx2.cmake_flags
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=OFF"} <= set(avx2.cmake_flags)
    assert set(bl.CMAKE_FLAGS[1:]) <= set(avx2.cmake_flags)
    # AVX-VNNI where the CPU has it, as splice's avx2 level takes it
    assert bl.level_cmake_flags(avx2, {"avx2"})[-1] == "-DGGML_AVX_VNNI=OFF"
    assert bl.level_cmake_flags(avx2, {"avx2", "avx_vnni"})[-1] == "-DGGML_AVX_VNNI=ON"
    assert bl.level_cmake_flags(native, {"avx_vnni"}) == bl.CMAKE_FLAGS
    env = bl.splice_env("avx2")
    assert (env["SPLICE_NATIVE_ISA"], env["ONEDNN_MAX_CPU_ISA"]) == ("avx2", "AVX2")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(bl.REPO / "src")
    assert bl.splice_env().get("SPLICE_NATIVE_ISA") == os.environ.get("SPLICE_NATIVE_ISA")  # native: as it is
    with pytest.raises(ValueError, match="--level='avx3': one of native, avx2"):
        bl.parse_args(["--level", "avx3"])


def test_a_level_the_cpu_cannot_run_is_refused_by_name():
    bl.check_cpu_flags(bl.LEVELS["avx2"], frozenset("fpu sse2 avx avx2 fma f16c bmi2".split()))
    with pytest.raises(ValueError, match="--level avx2: this CPU lacks avx2, bmi2"):
        bl.check_cpu_flags(bl.LEVELS["avx2"], frozenset("fpu sse2 avx fma f16c".split()))
    bl.check_cpu_flags(bl.LEVELS["native"], frozenset())  # needs nothing


def test_the_worker_runs_at_the_level_asked(worker_starts):
    bl.SpliceWorker(bl.parse_args(["--pairs", "2", "--level", "avx2"]))
    assert worker_starts[0][1]["SPLICE_NATIVE_ISA"] == "avx2"


def test_the_report_names_the_level(tmp_path, capsys):
    facts = {"commit": "0c1e570", "level": "avx2"}
    bl.publish(facts, "table", {"rows": []}, tmp_path / "out.json")
    assert bl.LEVELS["avx2"].description in capsys.readouterr().out


def test_the_model_is_llama_1b_or_the_builtin_one_and_the_worker_is_told(worker_starts):
    assert bl.parse_args([]).model == "llama-1b"
    assert bl.parse_args(["--model", "smollm2-135m-instruct"]).model == "smollm2-135m-instruct"
    for bad in ("gpt2", "missing.gguf"):
        allowed = "one of llama-1b, smollm2-135m-instruct or a .gguf file"
        with pytest.raises(ValueError, match=f"--model='{bad}': {allowed}"):
            bl.parse_args(["--model", bad])
    bl.SpliceWorker(bl.parse_args(["--pairs", "2", "--model", "smollm2-135m-instruct"]))
    command = worker_starts[0][0]
    assert command[command.index("--model") + 1] == "smollm2-135m-instruct"


def write_gguf(path: Path, types: dict[str, str]) -> None:
    """A GGUF whose tensors (2-D, 32 x 32, zero-filled) are stored in ``types`` ({name: GGUF type name})."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, type_name in types.items():
        quant = gguf.GGMLQuantizationType[type_name]
        block, size = gguf.GGML_QUANT_SIZES[quant]
        writer.add_tensor(name, np.zeros((32, 32 // block * size), dtype=np.uint8), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_builtin_model_runs_as_shipped_and_requantized_for_the_other_formats(tmp_path, monkeypatch):
    shipped = tmp_path / "wheel" / "SmolLM2.Q4_1.gguf"
    shipped.parent.mkdir()
    write_gguf(shipped, {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q4_1"})
    assert bl.gguf_file_type(shipped) == "Q4_1"  # most matrices', not the embedding's
    monkeypatch.setattr(bl, "builtin_gguf", lambda: shipped)
    calls = []

    def run(command, env=None, capture=False):
        calls.append(command)
        Path(command[-3]).write_bytes(b"gguf")  # llama-quantize's output (a .tmp, renamed into place)
        return ""

    monkeypatch.setattr(bl, "run", run)
    tools = {"llama-quantize": Path("/tools/llama-quantize")}
    files = bl.gguf_files(tmp_path / "cache", Path("/src"), tools, ["int4", "int8", "bf16"], 2,
                          "smollm2-135m-instruct")
    assert files["int4"] == shipped  # Q4_1: the wheel's file itself
    assert files["int8"].name == "smollm2-135m-instruct-q8_0.gguf" and files["int8"].exists()
    assert files["bf16"].name == "smollm2-135m-instruct-bf16.gguf"
    assert [c[:3] for c in calls] == [["/tools/llama-quantize", "--allow-requantize", str(shipped)]] * 2
    assert [c[-2:] for c in calls] == [["Q8_0", "2"], ["BF16", "2"]]
    bl.gguf_files(tmp_path / "cache", Path("/src"), tools, ["int8"], 2, "smollm2-135m-instruct")
    assert len(calls) == 2  # made once


def test_the_report_names_the_model(tmp_path, capsys):
    bl.publish({"commit": "0c1e570", "model": "smollm2-135m-instruct"}, "table", {"rows": []}, tmp_path / "out.json")
    assert capsys.readouterr().out.startswith("smollm2-135m-instruct: llama.cpp 0c1e570")


def test_a_gguf_file_runs_as_it_is_and_requantized_under_its_name_and_hash(tmp_path, monkeypatch):
    mine = tmp_path / "mine.Q4_0.gguf"
    write_gguf(mine, {"output.weight": "Q6_K", "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_0"})
    assert bl.parse_args(["--model", str(mine)]).model == str(mine)
    monkeypatch.setattr(bl, "run", lambda command, env=None, capture=False: Path(command[-3]).write_bytes(b"gguf"))
    files = bl.gguf_files(tmp_path / "cache", Path("/src"), {"llama-quantize": Path("/q")}, ["int4-sym", "int4"], 2,
                          str(mine))
    from splice.models import file_sha256

    assert files["int4-sym"] == mine  # its own type's row takes it as it is
    assert files["int4"].name == f"mine.Q4_0-{file_sha256(mine)[:12]}-q4_1.gguf"
