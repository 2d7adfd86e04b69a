"""``benchmarks/bench_two_builds.py``: the working tree's GEMVs against another revision's, in one process."""
from __future__ import annotations

import argparse
import re
import types

import pytest
import torch

from splice import native

from .benchmark_scripts import load_benchmark

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


def test_the_base_registers_its_ops_under_a_namespace_of_its_own():
    bench = load_benchmark("bench_two_builds")
    text = native.SOURCE.read_text()
    renamed = bench.renamed_source(text)
    assert "TORCH_LIBRARY(splice_kernels_base, lib)" in renamed
    assert "TORCH_LIBRARY_IMPL(splice_kernels_base, CPU, lib)" in renamed
    assert "TORCH_LIBRARY(splice_kernels," not in renamed and "TORCH_LIBRARY_IMPL(splice_kernels," not in renamed
    assert len(renamed) == len(text) + 2 * len("_base")
    with pytest.raises(SystemExit, match="0 'TORCH_LIBRARY_IMPL"):
        bench.renamed_source(text.replace("TORCH_LIBRARY_IMPL(splice_kernels,", "TORCH_LIBRARY_IMPL(other,"))


def test_an_unknown_revision_is_refused_naming_it():
    bench = load_benchmark("bench_two_builds")
    with pytest.raises(SystemExit, match="'no-such-revision'"):
        bench.base_source("no-such-revision")


def test_the_base_takes_the_working_trees_settings_it_has():
    bench = load_benchmark("bench_two_builds")
    values = {"isa": 1, "weight_streams": 4, "work_stealing": False, "software_prefetch": 5,
              "software_prefetch_rows": [1, 0, 1], "avx_vnni_ready": True}
    here = types.SimpleNamespace(**{name: (lambda value=value: value) for name, value in values.items()},
                                 **{f"set_{name}": None for name in bench.SETTINGS})
    written = {}
    base = types.SimpleNamespace(**{f"set_{name}": (lambda value, name=name: written.__setitem__(name, value))
                                    for name in bench.SETTINGS if name != "software_prefetch"},
                                 **{name: None for name in values if name != "software_prefetch"})
    copied = bench.match_settings(base, here)
    assert written == copied == {"isa": 1, "weight_streams": 4, "work_stealing": False,
                                 "software_prefetch_rows": [1, 0, 1], "avx_vnni": True}


def test_the_summary_splits_the_rounds_at_the_median_probe():
    bench = load_benchmark("bench_two_builds")
    results = [bench.Round(probe=60.0, base=40.0, here=48.0), bench.Round(probe=62.0, base=50.0, here=55.0),
               bench.Round(probe=30.0, base=27.0, here=27.0), bench.Round(probe=34.0, base=30.0, here=29.0)]
    text = bench.summary(results)
    # the median probe is 47: ratios 1.2 and 1.1 above it, 1.0 and 0.967 below
    assert "all 1.050 (4)" in text and "probe >= 47.0 GB/s 1.150 (2)" in text and "below 0.983 (2)" in text
    assert "base 0.844, here 0.870 of the probe" in text


@needs_native
def test_the_same_source_built_as_the_base_gives_the_same_outputs_and_is_timed_in_turns():
    """The harness compares like with like: the working tree's own gemv.cpp built as the base (once per machine and
    source), with the settings copied, gives bit for bit the working tree's outputs for every kind; and a round
    times both."""
    bench = load_benchmark("bench_two_builds")
    base = bench.load_base(bench.renamed_source(native.SOURCE.read_text()), "the working tree")
    here = torch.ops.splice_kernels
    with native.use_weight_streams(4), native.use_work_stealing(False):
        copied = bench.match_settings(base, here)
        assert copied["weight_streams"] == 4 and copied["work_stealing"] is False
        assert base.weight_streams() == 4 and not base.work_stealing()
        for kind in bench.KINDS:
            x = torch.randn(3, 256).bfloat16()
            weight = bench.operands(kind, 64, 256)
            assert torch.equal(bench.call(kind, x, weight, base), bench.call(kind, x, weight, here)), kind
    results = bench.rounds(base, here, "int4-sym", rows=1, layers=1, count=2, shapes=[(64, 512), (32, 256)])
    assert len(results) == 2 and all(r.probe > 0 and r.base > 0 and r.here > 0 for r in results)
    shapes = [(32, 256)] * len(bench.FUSED) * 2  # two blocks' worth: two attention calls, one after every fourth GEMV
    results = bench.rounds(base, here, "bf16", rows=2, layers=2, count=2, shapes=shapes, attention_keys=40)
    assert len(results) == 2 and all(r.base > 0 and r.here > 0 for r in results)


def test_attention_runs_after_each_blocks_gemvs_and_its_cache_counts(monkeypatch):
    bench = load_benchmark("bench_two_builds")
    events = []
    ops = types.SimpleNamespace(decode_attention=lambda q, k, v, mask, scale: events.append(("attention", k.shape)))
    monkeypatch.setattr(bench, "call", lambda kind, x, weight, ops: events.append(("gemv", x.shape[1])))
    monkeypatch.setattr(bench, "gather_on_huge_pages", lambda tensors: None)
    monkeypatch.setattr(bench, "best_gbs", lambda parts, rounds: 10.0)
    sizes = []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: len(events) * 1e-3)
    shapes = [(16, 64)] * len(bench.FUSED) * 2
    results = bench.rounds(ops, ops, "bf16", rows=1, layers=2, count=1, shapes=shapes, attention_keys=24)
    per_pass = len(events) // 2
    kinds = [kind for kind, _ in events[:per_pass]]
    assert kinds == (["gemv"] * len(bench.FUSED) + ["attention"]) * 2
    assert events[len(bench.FUSED)][1] == (1, bench.KV_HEADS, 24, bench.HEAD_DIM)
    weights = sum(bench.weight_bytes(bench.operands("bf16", n, k)) for n, k in shapes)
    cache = 2 * 2 * bench.KV_HEADS * 24 * bench.HEAD_DIM * 2  # two blocks, keys and values, bf16
    sizes.append((weights + cache) / (per_pass * 1e-3) / 1e9)
    assert results[0].base == pytest.approx(sizes[0]) and results[0].here == pytest.approx(sizes[0])


@pytest.mark.parametrize("text", ["prefetch=4", "software_prefetch=four", "weight_streams", "=2",
                                  "software_prefetch=0,1", "software_prefetch_rows=0,x,3"])
def test_a_bad_setting_is_refused_naming_it(text):
    bench = load_benchmark("bench_two_builds")
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
        bench.parse_setting(text)
    assert bench.parse_setting("software_prefetch=4") == ("software_prefetch", 4)
    assert bench.parse_setting("work_stealing=0") == ("work_stealing", 0)
    assert bench.parse_setting("software_prefetch_rows=0,0,3") == ("software_prefetch_rows", [0, 0, 3])
