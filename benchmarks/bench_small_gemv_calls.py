"""The fixed cost of one integer dot-product GEMV call: ``int4_dot_gemv`` and ``int8_dot_gemv`` on a small weight (64
output rows, so the weight itself is read in a few microseconds) for one row of x of each input width a decode step
rounds (llama-1b's 2048 and 5632, SmolLM2's 576 and 1536), at every level this CPU runs. What is left is mostly
rounding x to int8 per block of 32 and arranging it for the kernel, done once per call on the calling thread while the
other threads wait, and dispatch. Microseconds a call, best of ``--rounds`` x ``--calls``, one thread::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_small_gemv_calls.py
"""
from __future__ import annotations

import argparse

import torch

from splice import native

from bench_dot_instructions import best_us  # best of repeats x calls, in microseconds

WIDTHS = (576, 1536, 2048, 5632)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("needs splice's native kernels")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ops = torch.ops.splice_kernels
    for level in native.supported_isas():
        with native.use_isa(level):
            cells = []
            for k in WIDTHS:
                x = torch.randn(1, k).bfloat16()
                q = torch.randint(0, 16, (64, k), dtype=torch.uint8)
                tiles = native.int4_tile_pack(q, (torch.rand(k // 32, 64, 2) * 0.01).bfloat16())
                w8, s8 = torch.randint(-127, 128, (64, k), dtype=torch.int8), torch.rand(64).bfloat16()
                int4 = best_us(lambda: ops.int4_dot_gemv(x, tiles, 32), args.calls, args.rounds)
                int8 = best_us(lambda: ops.int8_dot_gemv(x, w8, s8), args.calls, args.rounds)
                cells.append(f"k={k} int4 {int4:.1f} int8 {int8:.1f}")
            print(f"{level}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
