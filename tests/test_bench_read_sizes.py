"""``benchmarks/bench_read_sizes.py``: the bandwidth probe on reads the size of a decode step's matrices."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splice import native

from .benchmark_scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_read_sizes.py"
needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


def load_script():
    return load_benchmark("bench_read_sizes")


def test_slices_cover_the_region_in_reads_of_the_size():
    script = load_script()
    separate = script.slices(8, 2, huge=False)
    assert [p.numel() for p in separate] == [2 << 20] * 4
    on_huge_pages = script.slices(8, 2, huge=True)
    if not native.huge_pages_supported():
        assert on_huge_pages is None and math.isnan(script.best_gbs(on_huge_pages, 1))
        return
    assert [p.numel() for p in on_huge_pages] == [2 << 20] * 4
    assert on_huge_pages[0].data_ptr() % native.HUGE_PAGE == 0  # one buffer from a 2 MiB boundary
    assert all(b.data_ptr() - a.data_ptr() == 2 << 20 for a, b in zip(on_huge_pages, on_huge_pages[1:]))


@needs_native
def test_script_prints_a_row_per_size():
    run = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "1,2", "--region-mb", "4", "--rounds", "1",
                          "--threads", "1"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")})
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(float(row[2]) > 0 for row in rows)


@needs_native
def test_kernels_are_timed_against_the_probe_on_their_own_weights(capsys):
    load_script().kernels_against_probe(rounds=1, layers=1)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["int4_dot_gemv", "int8_dot_gemv"]
    assert all("the probe on its weights" in line and line.endswith("%)") for line in lines)


@pytest.mark.parametrize("argv, named", [(["--sizes", "0,4"], "--sizes '0,4'"), (["--sizes", "two"], "--sizes 'two'"),
                                         (["--region-mb", "0"], "--region-mb 0")])
def test_bad_sizes_are_refused_naming_the_value(argv, named):
    run = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")})
    assert run.returncode == 2 and named in run.stderr and "allowed" in run.stderr and "Traceback" not in run.stderr
