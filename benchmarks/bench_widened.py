"""fp16 on a CPU without fp16 arithmetic: torch's fp16 ``F.linear`` against ``WidenedLinear``'s prompt path (the
weight widened to fp32 once, one fp32 GEMM), per count of activation rows; where the second wins is where
``splice.layers.widened_linear.WIDEN_FROM_ROWS`` comes from. Emulate such a CPU on one that has fp16 arithmetic::

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 .venv/bin/python benchmarks/bench_widened.py --threads 1
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def best_us(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=int, default=1536)
    parser.add_argument("--in", dest="in_features", type=int, default=576)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"oneDNN fp16 arithmetic on this CPU: {torch.ops.mkldnn._is_mkldnn_fp16_supported()}")
    weight = torch.randn(args.out, args.in_features).half()
    for rows in args.rows:
        x = torch.randn(rows, args.in_features).half()
        plain = best_us(lambda: F.linear(x, weight), args.repeat)
        widened = best_us(lambda: F.linear(x.float(), weight.float()).half(), args.repeat)
        print(f"{rows:4d} rows: fp16 F.linear {plain:8.0f} us, widened {widened:8.0f} us")


if __name__ == "__main__":
    main()
