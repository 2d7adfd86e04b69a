"""int8 weight-only's decode GEMV on int16 activations (``int8_dot16_gemv``) against int8 ones (``int8_dot_gemv``) and
the bf16 GEMV, the kernels alone, taking turns in one process: ``--layers`` llama-1b blocks of fused weights (random,
on 2 MiB pages, so each pass reads them from memory), every kernel timed over all of them once a round, the order
reversed every other round; the median and range of the rounds' ratios are printed, so the host's load moving between
rounds cancels out. At the avx2 level by default (where splice picks int16 activations without AVX-VNNI)::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_int8_activations.py --rows 1 2 8 16 32
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from splice import native
from splice.native.memory import gather_on_huge_pages

from bench_quant import FUSED

KERNELS = ("bf16", "int8 activations", "int16 activations")
RATIOS = (("int8 activations", "int16 activations"), ("bf16", "int16 activations"), ("bf16", "int8 activations"))


def weights(shapes, layers: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(int8 weight, its scales, a bf16 weight of the same shape) for every matrix of ``layers`` blocks."""
    torch.manual_seed(0)
    out = [(torch.randint(-127, 128, shape, dtype=torch.int8), torch.rand(shape[0]).bfloat16() * 0.01,
            (torch.randn(shape) * 0.02).bfloat16()) for _ in range(layers) for shape in shapes]
    gather_on_huge_pages([t for w8, _, wb in out for t in (w8, wb)])
    return out


def call(kernel: str, x: torch.Tensor, w8: torch.Tensor, scales: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    ops = torch.ops.splice_kernels
    if kernel == "bf16":
        return ops.bf16_gemv(x, wb)
    return (ops.int8_dot16_gemv if kernel == "int16 activations" else ops.int8_dot_gemv)(x, w8, scales)


def ratios(matrices, rows: int, rounds: int) -> dict[tuple[str, str], list[float]]:
    """Per round, time(a) / time(b) for each pair of :data:`RATIOS`: above 1, b is faster."""
    inputs = [torch.randn(rows, w8.shape[1]).bfloat16() for w8, _, _ in matrices]
    out: dict[tuple[str, str], list[float]] = {pair: [] for pair in RATIOS}
    for kernel in KERNELS:  # warm-up
        call(kernel, inputs[0], *matrices[0])
    for i in range(rounds):
        times = {}
        for kernel in (KERNELS if i % 2 else KERNELS[::-1]):
            start = time.perf_counter()
            for x, matrix in zip(inputs, matrices):
                call(kernel, x, *matrix)
            times[kernel] = time.perf_counter() - start
        for a, b in RATIOS:
            out[(a, b)].append(times[a] / times[b])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows of x (batch)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--level", default="avx2", choices=native.ISA_LEVELS)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("splice's native kernels are not available here")
    torch.set_num_threads(args.threads)
    matrices = weights(FUSED.values(), args.layers)
    with native.use_isa(args.level):
        print(f"{args.layers} llama-1b blocks, level {args.level}, {args.threads} threads, median of {args.rounds} "
              "rounds' time ratios (range)")
        for rows in args.rows:
            found = ratios(matrices, rows, args.rounds)
            print(f"{rows:3d} rows  " + "  ".join(f"{a} / {b} {statistics.median(v):.3f} ({min(v):.2f}-{max(v):.2f})"
                                                  for (a, b), v in found.items()))


if __name__ == "__main__":
    main()
