"""``splice bench``: the side-by-side runner, on a tiny model so it stays fast."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from splice import bench, native

from .arch.tiny_models import build_family
from .conftest import on_threads


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def bench_on(monkeypatch, load) -> None:
    """The bench on the model ``load(dtype)`` gives for the name "tiny", with a probe that reads 10 GB/s."""
    monkeypatch.setattr(bench, "load_model", lambda name, dtype: load(dtype))
    monkeypatch.setattr(bench, "read_bandwidth_gbs", lambda: 10.0)
    monkeypatch.setattr(bench, "check_model", lambda name: None)  # "tiny" is no model splice.load finds


@pytest.fixture
def tiny_bench(monkeypatch):
    bench_on(monkeypatch, lambda dtype: build_family("llama", dtype=bench_dtype(dtype)))


def bench_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def test_bench_runs_every_mode_and_writes_json(tiny_bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = parse("--model", "tiny", "--batch", "1,2", "--prompt", "8", "--new", "6", "--repeat", "1",
                 "--json", str(out))
    assert args.run(args) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["batch"], r["mode"]) for r in rows] == [(b, m) for b in (1, 2) for m in ("hf", "plain", "inject")]
    for row in rows:
        assert row["prefill_ms"] > 0 and row["decode_tok_s"] > 0 and row["peak_rss_mb"] > 0
        assert row["roofline_tok_s"] == pytest.approx(row["batch"] * 10e9 / row["step_bytes"])
        assert row["bandwidth_share"] == pytest.approx(row["decode_tok_s"] / row["roofline_tok_s"])
        assert row["around_gbs"] == 10.0 and row["bandwidth_share_around"] == pytest.approx(row["bandwidth_share"])
    assert rows[0]["speedup"] == 1.0
    assert report["machine"]["read_bandwidth_gbs"] == 10.0
    printed = capsys.readouterr().out
    assert "decode tok/s" in printed
    assert "read bandwidth 10.0 GB/s" in printed and report["machine"]["bandwidth_probe_pages"] in printed



@pytest.mark.parametrize("fastest_at", [0, 1, 2])
def test_rooflines_come_from_the_fastest_probe_before_between_or_after_the_rows(tiny_bench, tmp_path, monkeypatch,
                                                                                  fastest_at):
    """The bandwidth moves during a run on a shared machine: the probe is read before the rows and after each row;
    the fastest reading divides every row's roofline (a slow reading would credit each row with more than its share),
    and "% around" divides by the faster of the two readings right before and after the row."""
    readings = [10.0, 12.0, 9.0]
    readings[fastest_at] = 25.0
    calls = iter(readings)
    monkeypatch.setattr(bench, "read_bandwidth_gbs", lambda: next(calls))
    out = tmp_path / "bench.json"
    args = parse("--model", "tiny", "--prompt", "8", "--new", "4", "--repeat", "1", "--modes", "inject",
                 "--batch", "1,2", "--json", str(out))  # two rows: before, between, after
    assert args.run(args) == 0
    assert next(calls, None) is None  # every reading was taken
    report = json.loads(out.read_text())
    assert report["machine"]["read_bandwidth_gbs"] == 25.0
    assert report["machine"]["bandwidth_readings_gbs"] == readings
    for i, row in enumerate(report["results"]):
        assert row["roofline_tok_s"] == pytest.approx(row["batch"] * 25e9 / row["step_bytes"])
        around = max(readings[i], readings[i + 1])
        assert row["around_gbs"] == around
        bytes_per_s = row["decode_tok_s"] / row["batch"] * row["step_bytes"]
        assert row["bandwidth_share_around"] == pytest.approx(bytes_per_s / (around * 1e9))
    rows = [bench.Row("m", "bf16", 1, "inject", 1.0, 5.0, 200.0, 1.0, 1.0, 10.0)]
    assert bench.against_the_fastest_probe(rows, [20.0, 10.0]) == (rows, 20.0)  # slower later readings: no change

def test_bench_plot(tiny_bench, tmp_path):
    pytest.importorskip("matplotlib")
    args = parse("--model", "tiny", "--prompt", "8", "--new", "4", "--repeat", "1", "--modes", "hf,inject",
                 "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png"))
    assert args.run(args) == 0
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_bad_mode_is_refused(tiny_bench, tmp_path):
    args = parse("--modes", "hf,fast", "--json", str(tmp_path / "b.json"))
    with pytest.raises(ValueError, match="allowed values are hf, plain, inject"):
        args.run(args)


def test_llama_1b_is_built_once_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path))
    monkeypatch.setattr(bench, "LLAMA_1B", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    folder = bench.llama_1b_folder()
    assert folder.parent == tmp_path and (folder / "config.json").exists()
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert bench.llama_1b_folder() == folder and (folder / "config.json").stat().st_mtime_ns == stamp
    model = bench.load_model("llama-1b", "fp32")
    assert model.config.hidden_size == 32 and model.dtype == torch.float32


def test_llama_1b_first_runs_at_once_save_it_once(monkeypatch, tmp_path):
    import time

    from transformers import LlamaForCausalLM

    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path))
    monkeypatch.setattr(bench, "LLAMA_1B", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    saves, save = [], LlamaForCausalLM.save_pretrained

    def slow_save(self, *args, **kwargs):
        saves.append(args[0])
        time.sleep(0.5)  # the other run starts while this one saves
        return save(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", slow_save)
    folders, errors = on_threads(bench.llama_1b_folder)
    assert not errors and len(saves) == 1 and folders[0] == folders[1] and (folders[0] / "config.json").exists()


def test_weight_bytes_count_a_tied_head_once():
    untied = build_family("llama")
    embedding = untied.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert bench.weight_bytes_per_step(untied) == total - embedding.numel() * 4
    tied = build_family("gemma")
    assert bench.weight_bytes_per_step(tied) == sum(p.numel() * p.element_size() for p in tied.parameters())


def test_bandwidth_is_measured():
    assert bench.read_bandwidth_gbs(gib=0.01, repeats=2) > 0.1


def test_bandwidth_probe_reads_from_huge_pages_as_the_weights_do(monkeypatch):
    """The probe's buffer goes where a kernel-injected model's weights go (one buffer on 2 MiB pages), so the roofline
    is the bandwidth those weights can be read at."""
    gathered = []
    monkeypatch.setattr(bench, "gather_on_huge_pages", lambda tensors: gathered.extend(tensors) or 0)
    bench.read_bandwidth_gbs(gib=0.01, repeats=1)
    assert len(gathered) == 1 and gathered[0].numel() * gathered[0].element_size() >= 0.0099 * 2**30
    pages = bench.machine_info([1.0])["bandwidth_probe_pages"]
    assert pages == ("2 MiB" if bench.native.huge_pages_supported() else "4 KiB")


def test_native_streaming_read_reads_every_byte():
    """The bandwidth probe's checksum changes with any byte of the tensor (so every byte was read)."""
    if not bench.native.available():
        pytest.skip("splice's native kernels are not available here")
    data = torch.zeros(4096, dtype=torch.uint8)
    assert torch.ops.splice_kernels.stream_read(data) == 0
    for index in (0, 1000, 4095):
        data.zero_()
        data[index] = 1
        assert torch.ops.splice_kernels.stream_read(data) != 0
        for streams, ahead in bench.PROBE_PATTERNS:
            assert torch.ops.splice_kernels.stream_read(data, streams, ahead) != 0, (streams, ahead)


def test_native_streaming_read_refuses_other_stream_counts():
    if not bench.native.available():
        pytest.skip("splice's native kernels are not available here")
    with pytest.raises(RuntimeError, match="3 streams; allowed: 1, 2 or 4"):
        torch.ops.splice_kernels.stream_read(torch.zeros(4096, dtype=torch.uint8), 3)


def test_the_probe_is_the_best_of_its_read_patterns(monkeypatch):
    """Every pattern is timed; the figure is the fastest read of all (a pattern that aliases on this CPU must not
    set the roofline)."""
    if not bench.native.available():
        pytest.skip("splice's native kernels are not available here")
    seen, clock = [], iter(range(10_000))
    slow = {(4, True): 8, (2, True): 4, (1, False): 2}  # seconds each pattern's read takes on the fake clock

    def stream_read(matrix, streams, ahead):
        seen.append((streams, ahead))
        for _ in range(slow[streams, ahead] - 1):
            next(clock)

    monkeypatch.setattr(torch.ops.splice_kernels, "stream_read", stream_read)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    gbs = bench.read_bandwidth_gbs(gib=0.01, repeats=2)
    assert sorted(set(seen)) == sorted(bench.PROBE_PATTERNS) and len(seen) == 2 * len(bench.PROBE_PATTERNS)
    assert gbs == pytest.approx(0.01 * 2**30 / 2 / 1e9, rel=0.01)


def test_step_bytes_count_the_kv_cache_a_step_reads():
    """Per sequence, every layer's keys and values over the slots read: the tokens so far for eager steps, rounded up to
    the attended length for compiled ones."""
    model = build_family("llama")
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert bench.kv_bytes_per_step(model, batch=3, slots=10) == 3 * 10 * per_slot
    args = parse("--prompt", "8", "--new", "4")
    assert bench.attended_slots(args, "inject") == 10  # slots 9, 10, 11 filled by the decode steps
    assert bench.attended_slots(args, "inject+compile") == 12  # 256 and up, capped at prompt + new
    long = parse("--prompt", "300", "--new", "4")
    assert bench.attended_slots(long, "inject+compile") == 304 and bench.attended_slots(long, "inject") == 302


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_a_compiled_run_of_steps_in_one_native_call_reads_the_eager_steps_slots():
    import splice

    compiled = [splice.init_inference(build_family("llama", dtype=dtype), replace_with_kernel_inject=True,
                                      compile_decode=True, max_out_tokens=16)
                for dtype in (torch.bfloat16, torch.float32)]
    assert bench.slots_run(compiled[0], "inject+compile", 1) == "eager"  # bf16 on CPU: one native call a step
    assert bench.slots_run(compiled[1], "inject+compile", 1) == "inject+compile"  # fp32: the graph
    assert bench.slots_run(compiled[0], "inject", 1) == "inject" and bench.slots_run(None, "hf", 1) == "hf"


@pytest.mark.parametrize("family, modes, quant, rows", [
    ("llama", "hf", "int8,int4", ["hf", "inject+int8", "inject+int4"]),
    ("deepseek_v3", "hf,plain", "int8", ["hf", "plain", "plain+int8"]),  # no injection record: on the plain model
])
def test_quant_rows_are_quantized_and_smaller(monkeypatch, tmp_path, family, modes, quant, rows):
    bench_on(monkeypatch, lambda dtype: build_family(family, dtype=bench_dtype(dtype)))
    out = tmp_path / "bench.json"
    args = parse("--model", "tiny", "--prompt", "8", "--new", "4", "--repeat", "1", "--modes", modes,
                 "--quant", quant, "--json", str(out))
    assert args.run(args) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in results] == rows
    rooflines = [r["roofline_tok_s"] for r in results[len(modes.split(",")) - 1:]]  # the last float row on
    assert rooflines == sorted(set(rooflines))  # each scheme fewer bytes a step (a mixture's experts included)
    assert all(r["decode_tok_s"] > 0 and r["speedup"] > 0 for r in results)


@pytest.fixture
def tiny_moe_bench(monkeypatch):
    """The bench on a tiny DeepSeek-V3: a mixture of experts kernel injection has no record for."""
    bench_on(monkeypatch, lambda dtype: build_family("deepseek_v3", dtype=bench_dtype(dtype)))


def test_options_for_injected_rows_are_refused_where_every_quant_row_is_plain(tiny_moe_bench, tmp_path, capsys):
    args = parse("--model", "tiny", "--modes", "hf,plain", "--quant", "int8", "--compile", "--json",
                 str(tmp_path / "b.json"))
    family = r"\('deepseek_v3'\)"
    with pytest.raises(ValueError, match=rf"--compile: kernel injection has no record for tiny's family {family}, "
                                         r"so its --quant rows run on the plain model and nothing would be compiled"):
        args.run(args)
    assert capsys.readouterr().out == ""  # before any row was timed or printed


def test_bad_quant_scheme_is_refused(tiny_bench, tmp_path):
    args = parse("--quant", "int3", "--json", str(tmp_path / "b.json"))
    with pytest.raises(ValueError, match="--quant='int3': 'int3' is not allowed; allowed values are int8, int8-g64, "
                                         "w8a8, int4"):
        args.run(args)


def test_rss_peak_sees_memory_freed_before_the_block_ends():
    from splice.bench import RssPeak, current_rss_mb

    before = current_rss_mb()
    with RssPeak() as rss:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del block
    assert rss.peak_mb >= before + 48


def test_table_puts_quantized_rows_beside_the_float_row_of_their_mode():
    def row(mode: str, tok_s: float, speedup: float = float("nan")) -> bench.Row:
        return bench.Row("m", "bf16", 1, mode, 10.0, tok_s, 1000 / tok_s, 100.0, speedup, 50.0)

    table = bench.format_table([row("inject", 10.0), row("inject+compile", 20.0), row("inject+int4", 25.0),
                                row("inject+int4+compile", 52.0), row("inject+int8", 16.0, speedup=1.6)])
    cells = {line.split()[4]: line.split()[9:11] for line in table.splitlines()[2:]}
    assert cells["inject+int4"] == ["-", "2.50x"]  # no HF row: no speedup over it
    assert cells["inject+int4+compile"] == ["-", "2.60x"]  # against inject+compile, not inject
    assert cells["inject+int8"] == ["1.60x", "1.60x"]
    assert cells["inject+compile"] == ["-", "-"]


def test_table_says_which_compiled_rows_compiled_no_graph():
    row = bench.Row("m", "bf16", 1, "inject+compile", 10.0, 10.0, 100.0, 100.0, 1.0, 50.0)
    table = bench.format_table([replace(row, graphs=0), replace(row, mode="inject+int4+compile", graphs=0),
                                replace(row, mode="inject+int8+compile", graphs=2), replace(row, mode="inject")])
    said = "inject+compile, inject+int4+compile: no graph compiled; every decode step was one native call"
    assert table.splitlines()[-1].startswith(said)
    assert "no graph" not in bench.format_table([replace(row, graphs=1), replace(row, mode="inject")])


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_a_compiled_row_counts_its_graphs(tiny_bench, tmp_path, fresh_compiles):
    """bf16 on the native kernels: every step one native call, run eagerly (no graph); fp32: the graph."""
    for dtype, compiled in (("bf16", False), ("fp32", True)):
        out = tmp_path / f"{dtype}.json"
        args = parse("--model", "tiny", "--dtype", dtype, "--prompt", "8", "--new", "4", "--repeat", "1",
                     "--modes", "inject", "--compile", "--json", str(out))
        assert args.run(args) == 0
        rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
        assert rows["inject"]["graphs"] is None and bool(rows["inject+compile"]["graphs"]) == compiled


def test_table_shows_each_rows_share_of_the_bandwidth_read_around_it():
    """10 tok/s at batch 2 is 5 steps/s; 2 GB a step is 10 GB/s, 40 % of 25 GB/s (and "% of bw" 20 % of the 50 tok/s
    roofline); a row timed without the probe around it shows "-"."""
    row = bench.Row("m", "bf16", 2, "inject", 10.0, 10.0, 200.0, 100.0, 1.0, 50.0, step_bytes=2 * 10**9,
                    around_gbs=25.0)
    assert row.bandwidth_share_around == pytest.approx(0.4)
    lines = bench.format_table([row, replace(row, mode="plain", around_gbs=float("nan"))]).splitlines()
    header = lines[0].split("  ")
    assert any("% around" in cell for cell in header)
    assert lines[2].split()[-3:-1] == ["20%", "40%"] and lines[3].split()[-3:-1] == ["20%", "-"]


def test_isa_times_every_injected_row_at_each_level(tiny_bench, tmp_path, monkeypatch):
    """``--isa avx2,<best>``: each kernel-injected row is timed once per level, with the native kernels at that level
    while it runs (HF rows once, at no level)."""
    from splice import native

    if not native.available():
        pytest.skip("splice's native kernels are not available here")
    levels = ["avx2", native.supported_isas()[-1]]
    seen = []

    def fake_time(generate, prompt, new, repeat):
        seen.append(native.isa())
        return 1.0, 10.0, 100.0

    monkeypatch.setattr(bench, "time_generate", fake_time)
    out = tmp_path / "bench.json"
    args = parse("--model", "tiny", "--dtype", "bf16", "--prompt", "8", "--new", "4", "--repeat", "1", "--modes",
                 "hf,inject", "--quant", "int8", "--isa", ",".join(levels), "--json", str(out))
    before = native.isa()
    assert args.run(args) == 0
    modes = [r["mode"] for r in json.loads(out.read_text())["results"]]
    assert modes == ["hf"] + [f"inject@{level}" for level in levels] + [f"inject+int8@{level}" for level in levels]
    assert seen == [before] + levels + levels and native.isa() == before


def test_isa_names_the_levels_this_machine_runs(tiny_bench, tmp_path):
    from splice import native

    if not native.available():
        pytest.skip("splice's native kernels are not available here")
    args = parse("--isa", "sse2", "--json", str(tmp_path / "b.json"))
    with pytest.raises(ValueError, match="--isa.*allowed values are " + ", ".join(native.supported_isas())):
        args.run(args)


def test_profile_breaks_each_injected_run_into_stages(tiny_bench, tmp_path, capsys, fresh_compiles):
    out = tmp_path / "bench.json"
    args = parse("--model", "tiny", "--prompt", "8", "--new", "5", "--repeat", "1", "--modes", "hf,inject",
                 "--compile", "--profile", "--json", str(out))
    assert args.run(args) == 0
    profiles = json.loads(out.read_text())["profiles"]
    assert [(p["mode"], p["step"]) for p in profiles] == [("inject", "eager"), ("inject+compile", "compiled")]
    for profile in profiles:
        assert profile["stages"]["qkv"] > 0 and profile["stages"]["lm_head"] > 0
        assert sum(profile["stages"].values()) == pytest.approx(profile["step_ms"])
    printed = capsys.readouterr().out
    assert "decode step by stage" in printed and "gate_up" in printed


def test_profile_needs_three_new_tokens(tiny_bench, tmp_path):
    args = parse("--new", "2", "--profile", "--json", str(tmp_path / "b.json"))
    with pytest.raises(ValueError, match="--new >= 3"):
        args.run(args)


def test_profiles_at_each_context_length_are_told_apart(tiny_bench, tmp_path, capsys, monkeypatch):
    """``--context 8,12 --profile``: each profile carries its prompt length, and the printed columns name it (the
    same mode, batch and dtype at two lengths would otherwise print two identical column names)."""
    monkeypatch.setattr(bench, "time_generate", lambda generate, prompt, new, repeat: (1.0, 10.0, 100.0))
    out = tmp_path / "bench.json"
    args = parse("--model", "tiny", "--context", "8,12", "--new", "4", "--repeat", "1", "--modes", "inject",
                 "--profile", "--json", str(out))
    assert args.run(args) == 0
    profiles = json.loads(out.read_text())["profiles"]
    assert [(p["prompt"], p["mode"], p["batch"], p["dtype"]) for p in profiles] == [(8, "inject", 1, "fp32"),
                                                                                    (12, "inject", 1, "fp32")]
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("stage "))
    assert header.split() == ["stage", "inject", "b1", "fp32", "p8", "inject", "b1", "fp32", "p12"]


def test_profile_with_nothing_to_profile_is_refused_before_loading(tiny_bench, tmp_path, capsys, monkeypatch):
    """``--profile`` breaks down kernel-injected runs only: with none in --modes and no --quant it is refused, in one
    CLI error line, before the native kernels, the bandwidth probe or a model is loaded."""
    from .conftest import run_cli

    for name in ("load_model", "read_bandwidth_gbs"):
        monkeypatch.setattr(bench, name, lambda *a, name=name: pytest.fail(f"{name} called before the check"))
    monkeypatch.setattr(bench.native, "available", lambda: pytest.fail("native kernels loaded before the check"))
    code, out, err = run_cli(["bench", "--model", "tiny", "--modes", "hf,plain", "--profile", "--json",
                              str(tmp_path / "b.json")], capsys)
    assert code == 2 and out == ""
    assert err == ("splice: error: --profile with --modes hf,plain and no --quant: nothing would be profiled; "
                   "allowed: --modes including inject, or --quant with a scheme (or no --profile)\n")
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("option", ["--profile", "--compile"])
@pytest.mark.parametrize("options", [["--modes", "hf,inject"], ["--modes", "hf", "--quant", "int8"]])
def test_an_injected_only_option_with_an_injected_run_passes_the_check(tiny_bench, tmp_path, option, options):
    """A kernel-injected mode or a --quant row gives --profile something to profile and --compile something to
    compile: the run goes on to the next check (here an unwritable --json, so nothing is loaded)."""
    args = parse(option, *options, "--json", str(tmp_path / "no-such-folder" / "b.json"))
    with pytest.raises(ValueError, match="--json .*cannot write there"):
        args.run(args)


def test_bench_context_rows_run_each_length(tiny_bench, tmp_path):
    out = tmp_path / "bench.json"
    args = parse("--model", "tiny", "--context", "8,20", "--new", "4", "--repeat", "1", "--modes", "hf,inject",
                 "--json", str(out))
    assert args.run(args) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["prompt"], r["mode"]) for r in rows] == [(8, "hf"), (8, "inject"), (20, "hf"), (20, "inject")]
    assert report["settings"]["prompt"] == [8, 20]
    assert rows[2]["speedup"] == 1.0  # each context's rows against HF at that context
    longer, shorter = rows[3], rows[1]
    assert longer["step_bytes"] > shorter["step_bytes"]  # the KV cache read grows with the context


@pytest.fixture
def no_timing(tiny_bench, monkeypatch):
    """Fails a test that gets as far as loading or timing a model."""
    monkeypatch.setattr(bench, "bench_configuration", lambda *a, **k: pytest.fail("timed before checking outputs"))


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_output_that_cannot_be_written_is_refused_before_timing(no_timing, tmp_path, flag):
    unwritable = str(tmp_path / "no-such-folder" / "out.png")
    outputs = {"--json": str(tmp_path / "b.json"), flag: unwritable}
    args = parse(*[item for pair in outputs.items() for item in pair])
    with pytest.raises(ValueError, match=rf"{flag} .*no-such-folder/out\.png: cannot write there \(No such file or "
                                         r"directory\); allowed: a file in an existing folder"):
        args.run(args)
    assert not (tmp_path / "b.json").exists()  # the check leaves no file behind


def test_a_plot_format_matplotlib_cannot_draw_is_refused_before_timing(no_timing, tmp_path):
    pytest.importorskip("matplotlib")
    args = parse("--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "bars.docx"))
    with pytest.raises(ValueError, match=r"--plot .*bars\.docx: matplotlib cannot draw \.docx files; allowed: .*\.png"):
        args.run(args)


def test_plot_without_matplotlib_is_refused_before_timing(no_timing, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    args = parse("--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png"))
    with pytest.raises(ValueError, match=r"--plot needs matplotlib \(matplotlib is missing\); allowed: after pip "
                                         r"install 'splice\[plot\]', or no --plot"):
        args.run(args)


def test_checking_an_existing_output_leaves_it_as_it_was(tmp_path):
    existing = tmp_path / "old.json"
    existing.write_text("previous results")
    bench.check_writable(str(existing), "--json")
    assert existing.read_text() == "previous results"


def test_the_machine_line_shows_how_far_the_probe_readings_spread():
    """Every probe reading goes into the report; the head line names the fastest (the roofline's), how many readings
    and the slowest, and says so when the host's bandwidth moved by more than a fifth during the run."""
    steady = bench.machine_info([29.0, 30.0, 28.5])
    assert steady["bandwidth_readings_gbs"] == [29.0, 30.0, 28.5]
    line = bench.describe_machine(steady)
    assert "read bandwidth 30.0 GB/s" in line and "fastest of 3 readings, the slowest 28.5" in line
    assert "moved" not in line
    moved = bench.describe_machine(bench.machine_info([33.0, 60.0]))
    assert "the slowest 33.0" in moved and "the host's read bandwidth moved during the run" in moved
    single = bench.describe_machine(bench.machine_info([30.0]))
    assert "readings" not in single and "moved" not in single


def test_time_generate_warms_up_once_unless_told_it_was_done():
    calls = []

    def generate(prompt, streamer, **options):
        calls.append(options["max_new_tokens"])
        streamer.put(prompt)
        for _ in range(options["max_new_tokens"]):
            streamer.put(prompt[:, :1])

    _, tok_s, _ = bench.time_generate(generate, torch.zeros(1, 4, dtype=torch.long), 3, repeat=2)
    assert calls == [3, 3, 3] and tok_s > 0  # a warm-up, then the two timed runs
    calls.clear()
    bench.time_generate(generate, torch.zeros(1, 4, dtype=torch.long), 3, repeat=1, warm_up=False)
    assert calls == [3]


@pytest.fixture
def nothing_loaded(tiny_bench, monkeypatch):
    """Fails a test that gets as far as resolving or loading a model, building the native kernels or reading the
    bandwidth probe."""
    for name in ("check_model", "load_model", "read_bandwidth_gbs"):
        monkeypatch.setattr(bench, name, lambda *a, name=name: pytest.fail(f"{name} called before the check"))
    monkeypatch.setattr(bench.native, "available", lambda: pytest.fail("native kernels loaded before the check"))


def refused(argv: list[str], capsys, tmp_path) -> str:
    """``splice bench argv`` run to its error, which must be one line and leave an existing --json file as it was:
    the error's text."""
    from .conftest import run_cli

    out = tmp_path / "b.json"
    out.write_text("previous results")
    code, printed, err = run_cli(["bench", *argv, "--json", str(out)], capsys)
    assert code == 2 and printed == "" and err.startswith("splice: error: ") and err.count("\n") == 1, err
    assert out.read_text() == "previous results"
    return err


@pytest.mark.parametrize("named", [["inject", "hf", "plain"], ["plain", "inject", "hf"], ["hf", "plain", "inject"]])
def test_modes_run_in_one_order_whatever_order_they_are_named_in(tiny_bench, tmp_path, monkeypatch, named):
    """Injection replaces the model's layers in place: the hf and plain rows are timed before it, on the model as
    loaded, whatever order --modes names them in; the rows, and the speedups over hf, come out the same."""
    from splice.layers.block import SpliceBlock

    loaded, injected = [], []
    load = bench.load_model
    monkeypatch.setattr(bench, "load_model", lambda name, dtype: loaded.append(load(name, dtype)) or loaded[-1])
    speeds = iter([10.0, 15.0, 30.0])

    def fake_time(generate, prompt, new, repeat):
        injected.append(isinstance(loaded[-1].model.layers[0], SpliceBlock))
        return 1.0, next(speeds), 100.0

    monkeypatch.setattr(bench, "time_generate", fake_time)
    out = tmp_path / "bench.json"
    args = parse("--model", "tiny", "--prompt", "4", "--new", "4", "--repeat", "1", "--modes", ",".join(named),
                 "--json", str(out))
    assert args.run(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in rows] == ["hf", "plain", "inject"] and injected == [False, False, True]
    assert [r["speedup"] for r in rows] == [1.0, 1.5, 3.0]


@pytest.mark.parametrize("modes, twice", [("inject,inject", "'inject'"), ("hf,plain,hf", "'hf'")])
def test_a_mode_given_twice_is_refused_before_loading(nothing_loaded, tmp_path, capsys, modes, twice):
    err = refused(["--model", "tiny", "--modes", modes], capsys, tmp_path)
    assert err == (f"splice: error: --modes='{modes}': {twice} given more than once; allowed values are hf, plain, "
                   "inject, each at most once\n")


@pytest.mark.parametrize("model, dtype, problem", [
    ("tiny", "fp32,fp33", "'fp33' is not allowed"),
    ("tiny", ",", "no value given"),
    ("tiny", "fp32,float32", "'fp32' given more than once"),
    ("llama-1b", "int8", "'int8' is not allowed"),
])
def test_a_bad_dtype_is_refused_before_loading(nothing_loaded, tmp_path, capsys, model, dtype, problem):
    """Every --dtype value is checked before anything is loaded or timed (a bad second value would otherwise fail
    after the first's rows, and an empty list would write a report without rows over the --json file)."""
    err = refused(["--model", model, "--modes", "plain", "--dtype", dtype], capsys, tmp_path)
    allowed = "allowed values are fp32, bf16, fp16 (or another name of one, as float32 or bfloat16), each at most once"
    int8 = "; int8 is a quantization: --quant int8 runs it" if dtype == "int8" else ""
    assert err == f"splice: error: --dtype='{dtype}': {problem}; {allowed}{int8}\n"


def test_dtypes_take_their_short_names():
    assert bench.bench_dtypes("bf16, float32,half") == ["bf16", "fp32", "fp16"]


@pytest.mark.parametrize("options, given, effect", [
    (["--compile"], "--compile", "compiled"),
    (["--isa", "avx2"], "--isa avx2", "timed at another level of the native kernels"),
])
def test_an_option_only_injected_runs_honour_is_refused_without_one(nothing_loaded, tmp_path, capsys, options, given,
                                                                     effect):
    """--compile and --isa act on kernel-injected runs only (as --profile does): with none to act on they are refused
    before anything is loaded, so the JSON never records a compile that did not happen."""
    err = refused(["--model", "tiny", "--modes", "plain", *options], capsys, tmp_path)
    option = given.split()[0]
    assert err == (f"splice: error: {given} with --modes plain and no --quant: nothing would be {effect}; allowed: "
                   f"--modes including inject, or --quant with a scheme (or no {option})\n")


def test_prompt_beside_context_is_refused_before_loading(nothing_loaded, tmp_path, capsys):
    err = refused(["--model", "tiny", "--context", "8,16", "--prompt", "4"], capsys, tmp_path)
    assert err == ("splice: error: --prompt 4 with --context 8,16: --context sets the prompt lengths, so --prompt "
                   "would have no effect; allowed: one of them (--context 8,16,4 adds that length)\n")


def test_an_unknown_model_is_refused_before_the_kernels_and_the_probe(tmp_path, capsys, monkeypatch):
    """The model is found before the native kernels are built and the bandwidth probe runs; the error lists every
    model bench accepts, llama-1b among them."""
    from splice.models import BUILTIN_MODELS

    for name in ("load_model", "read_bandwidth_gbs"):
        monkeypatch.setattr(bench, name, lambda *a, name=name: pytest.fail(f"{name} called before the check"))
    monkeypatch.setattr(bench.native, "available", lambda: pytest.fail("native kernels loaded before the check"))
    (tmp_path / "folder").mkdir()
    for model, problem in ((str(tmp_path / "nonexistent"), "no such built-in name, folder or .gguf file"),
                           (str(tmp_path / "folder"), "without config.json")):
        err = refused(["--model", model], capsys, tmp_path)
        assert err.startswith("splice: error: --model: ") and model in err and problem in err, err
        accepted = err.split("accepted: ")[1]
        assert all(repr(name) in accepted for name in ["llama-1b", *BUILTIN_MODELS]), err


def test_llama_1b_passes_the_model_check_without_being_built(monkeypatch):
    monkeypatch.setattr(bench, "llama_1b_folder", lambda: pytest.fail("built by the check"))
    bench.check_model("llama-1b")


@pytest.mark.parametrize("threads, warned", [(3, True), (2, False)])
def test_more_threads_than_cpus_is_warned_about(tiny_bench, tmp_path, capsys, monkeypatch, threads, warned):
    """--threads above the CPUs this process may run on runs, with a warning naming both figures, before the native
    kernels are loaded."""
    from .conftest import run_cli

    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(bench.native, "available", lambda: (_ for _ in ()).throw(ValueError("stopped here")))
    code, _, err = run_cli(["bench", "--model", "tiny", "--threads", str(threads), "--json",
                            str(tmp_path / "b.json")], capsys)
    assert code == 2 and err.endswith("splice: error: stopped here\n")
    warning = (f"splice: warning: --threads {threads} is more than the 2 CPUs this process may run on: the threads "
               "take turns on them and every row runs slower than on as many threads as CPUs\n")
    assert (warning in err) == warned, err
