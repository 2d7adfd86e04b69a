"""The native GEMVs against the widened float32 GEMMs (``native.prompts_widened``) at a range of row counts, on one
TinyLlama-shaped 5632 x 2048 layer per format: where the avx2 level's row limits come from (``docs/kernels.md``).

Microseconds per layer, the median of ``--passes`` passes over ``--layers`` random layers (more than the caches hold),
all ops side by side in one process. Runs at the active level; on a CPU whose oneDNN has bf16 arithmetic the widened
ops still run (they are what an AVX2-only CPU would run)::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_widened_prompts.py
    PYTHONPATH=src .venv/bin/python benchmarks/bench_widened_prompts.py --rows 1,8,32,64,128 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from splice import native

N, K, GROUP = 5632, 2048, 32


def per_layer_us(op, layers: int, passes: int) -> float:
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for i in range(layers):
            op(i)
        times.append((time.perf_counter() - start) / layers * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128", help="comma-separated row counts")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not native.available():
        raise SystemExit("splice's native kernels are not available on this machine")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ops = torch.ops.splice_kernels
    bf16 = [(torch.randn(N, K) * 0.02).bfloat16() for _ in range(args.layers)]
    int8 = [torch.randint(-127, 128, (N, K), dtype=torch.int8) for _ in range(args.layers)]
    scales = torch.rand(N).bfloat16() * 0.01
    codes = [torch.randint(0, 16, (N, K), dtype=torch.uint8) for _ in range(args.layers)]
    int4_scales = (torch.rand(K // GROUP, N, 2) * 0.01).bfloat16()  # one set of scales, packed into every layer's tiles
    int4 = [native.int4_tile_pack(q, int4_scales) for q in codes]
    print(f"level {native.isa()}, prompts widened here: {native.prompts_widened()}, {torch.get_num_threads()} threads; "
          f"us per {N}x{K} layer")
    print("rows   bf16_gemv  widened | int8_dot  int8_lin(w) | int4_dot  int4_lin(w)")
    for m in rows:
        x = torch.randn(m, K).bfloat16()
        timed = [per_layer_us(op, args.layers, args.passes) for op in (
            lambda i: ops.bf16_gemv(x, bf16[i]), lambda i: ops.widened_linear(x, bf16[i]),
            lambda i: ops.int8_dot_gemv(x, int8[i], scales), lambda i: ops.int8_linear(x, int8[i], scales, True),
            lambda i: ops.int4_dot_gemv(x, int4[i], GROUP),
            lambda i: ops.int4_linear(x, int4[i], GROUP, True))]
        print(f"{m:4d}  " + "  ".join(f"{t:9.0f}" for t in timed), flush=True)


if __name__ == "__main__":
    main()
