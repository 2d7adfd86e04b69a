"""splice's native GEMVs at every instruction-set level this CPU runs, against torch's kernels of the same format.

The linear stack of a TinyLlama-shaped model (llama-1b: fused QKV, o, gate+up and down per block, ``--layers``
blocks, random weights on 2 MiB pages), one decode step = every projection once on a ``[batch, in]`` bf16 input, so
at batch 1 it reads every weight once. Rows, interleaved round by round (median kept):

* ``native <level> <format>``: ``splice_kernels.bf16_gemv`` / ``int8_gemv`` / ``int4_gemv`` (g32) at each level of
  ``native.supported_isas()`` (``native.use_isa``, or those of ``--levels``);
* ``native <level> <format> dot``: ``int8_dot_gemv`` / ``int4_dot_gemv``, the same weights times x rounded to int8
  per block of 32 with integer dot products (AVX512-VNNI where the level has it, else AVX2's vpmaddubsw);
* ``torch <format>``: ``F.linear`` (oneDNN), ``torch._weight_int8pack_mm``, ``torch._weight_int4pack_mm_for_cpu``.

torch's kernels pick their instruction set when torch starts, so the script runs twice, in two child processes: once
as torch runs here, once with torch held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``: what an
AVX2-only CPU gets), each beside every native level, and prints one table. GB/s = weight bytes read per step / time::

    .venv/bin/python benchmarks/bench_isa.py                      # 22 layers, batch 1, both torch settings
    .venv/bin/python benchmarks/bench_isa.py --layers 8 --batch 1 8 --rounds 5
    .venv/bin/python benchmarks/bench_isa.py --levels avx2 --batch 1 4 --threads 1   # an AVX2 laptop's kernels
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HIDDEN, INTERMEDIATE, KV = 2048, 5632, 256
FUSED = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
GROUP = 32
TORCH_SETTINGS = {"default": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def build(layers: int) -> dict[str, list[tuple]]:
    """Per format, the weights of every projection in the kernels' layouts (random codes: speed only)."""
    from splice import native
    from splice.native.memory import gather_on_huge_pages

    torch.manual_seed(0)
    weights: dict[str, list[tuple]] = {"bf16": [], "int8": [], "int4": [], "torch int4": []}
    for _ in range(layers):
        for n, k in FUSED:
            weights["bf16"].append((torch.randn(n, k, dtype=torch.bfloat16) * 0.02,))
            weights["int8"].append((torch.randint(-127, 128, (n, k), dtype=torch.int8),
                                    torch.rand(n, dtype=torch.bfloat16) * 0.01))
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            sz = (torch.rand(k // GROUP, n, 2) * 0.01).to(torch.bfloat16)
            weights["int4"].append((native.int4_tile_pack(q, sz),))  # the tiles hold the scales and zeros too
            weights["torch int4"].append((torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1), sz))
    gather_on_huge_pages([t for group in weights.values() for entry in group for t in entry if t.nbytes >= 1 << 16])
    return weights


def kernels(weights: dict[str, list[tuple]], levels: tuple[str, ...]) -> dict[str, tuple]:
    """name -> (function of x applied to every projection, the format's weight bytes, native level or None)."""
    import torch.nn.functional as F

    ops = torch.ops.splice_kernels
    nbytes = {fmt: sum(t.nbytes for entry in group for t in entry) for fmt, group in weights.items()}
    rows = {}
    for level in levels:
        rows[f"native {level} bf16"] = (lambda x, w: ops.bf16_gemv(x, w[0]), "bf16", level)
        rows[f"native {level} int8"] = (lambda x, w: ops.int8_gemv(x, w[0], w[1]), "int8", level)
        rows[f"native {level} int4"] = (lambda x, w: ops.int4_gemv(x, w[0], GROUP), "int4", level)
        rows[f"native {level} int8 dot"] = (lambda x, w: ops.int8_dot_gemv(x, w[0], w[1]), "int8", level)
        rows[f"native {level} int4 dot"] = (lambda x, w: ops.int4_dot_gemv(x, w[0], GROUP), "int4", level)
    rows["torch bf16"] = (lambda x, w: F.linear(x, w[0]), "bf16", None)
    rows["torch int8"] = (lambda x, w: torch._weight_int8pack_mm(x, w[0], w[1]), "int8", None)
    rows["torch int4"] = (lambda x, w: torch._weight_int4pack_mm_for_cpu(x, w[0], GROUP, w[1]), "torch int4", None)
    return {name: (fn, fmt, nbytes[fmt], level) for name, (fn, fmt, level) in rows.items()}


def measure(layers: int, batches: list[int], rounds: int, levels: list[str] | None = None) -> dict:
    from splice import native

    if not native.available():
        raise SystemExit("splice's native kernels are not available here")
    unknown = sorted(set(levels or ()) - set(native.supported_isas()))
    if unknown:
        raise SystemExit(f"--levels {', '.join(unknown)}: not run here; allowed: {', '.join(native.supported_isas())}")
    levels = tuple(levels or native.supported_isas())
    weights = build(layers)
    rows = kernels(weights, levels)
    in_features = [k for _ in range(layers) for _, k in FUSED]
    results = []
    for batch in batches:
        inputs = {k: torch.randn(batch, k, dtype=torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
        times: dict[str, list[float]] = {name: [] for name in rows}
        with torch.inference_mode():
            for round_ in range(rounds + 1):  # round 0 warms up
                for name, (fn, fmt, _, level) in rows.items():
                    with native.use_isa(level or native.isa()):
                        start = time.perf_counter()
                        for w, k in zip(weights[fmt], in_features):
                            fn(inputs[k], w)
                        elapsed = time.perf_counter() - start
                    if round_:
                        times[name].append(elapsed * 1e3)
        for name, (_, fmt, nbytes, level) in rows.items():
            ms = statistics.median(times[name])
            results.append({"kernel": name, "format": fmt.replace("torch ", ""), "level": level, "batch": batch,
                            "ms_per_step": round(ms, 2), "weight_bytes": nbytes,
                            "gb_per_s": round(nbytes / ms / 1e6, 1)})
    return {"levels": list(levels), "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "rows": results}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--levels", nargs="+", default=None, help="native levels to time (default: all run here)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/isa.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(args.layers, args.batch, args.rounds, args.levels)))
        return
    report = {"cpu": cpu_model(), "layers": args.layers, "runs": {}}
    for setting, env in TORCH_SETTINGS.items():
        command = [sys.executable, __file__, "--child", "--layers", str(args.layers), "--rounds", str(args.rounds),
                   "--batch", *map(str, args.batch)] + (["--threads", str(args.threads)] if args.threads else [])
        command += ["--levels", *args.levels] if args.levels else []
        done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True)
        report["runs"][setting] = json.loads(done.stdout.strip().splitlines()[-1])
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(f"wrote {args.out}")


def print_table(report: dict) -> None:
    print(f"{report['cpu']}, {report['layers']} TinyLlama-shaped blocks (fused projections), GB/s of weights read")
    for setting, run in report["runs"].items():
        print(f"\ntorch as {setting!r} (torch capability {run['torch_capability']}, {run['threads']} threads)")
        for batch in sorted({row["batch"] for row in run["rows"]}):
            rows = [row for row in run["rows"] if row["batch"] == batch]
            torch_ms = {row["format"]: row["ms_per_step"] for row in rows if row["level"] is None}
            for row in rows:
                ratio = torch_ms[row["format"]] / row["ms_per_step"]
                print(f"  batch {batch:2d}  {row['kernel']:20s} {row['ms_per_step']:8.2f} ms  {row['gb_per_s']:6.1f} GB/s"
                      f"  {ratio:5.2f}x torch {row['format']}")


if __name__ == "__main__":
    main()
