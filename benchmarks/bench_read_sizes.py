"""What one call reading a weight can reach: splice's streaming read (``splice_kernels.stream_read`` in each of its
read patterns, the best taken, as the bandwidth probe ``splice bench`` divides by does) on reads the size of a decode
step's matrices, against the probe's own 1 GiB.

A decode step reads each weight matrix in one call (llama-1b int8: 4-23 MB each, ~90 calls a token); each call starts
its streams from cold and ends when its slowest thread does. Each size is read from a ``--region-mb`` region (768 by
default: more than the cache), one call per slice; on 2 MiB pages (one 2 MiB-aligned buffer, as ``native.memory``
places a kernel-injected model's weights; "n/a" without transparent huge pages) and as separate tensors the way torch
allocates them (4 KiB pages, unless Linux's THP mode is ``always``). GB/s, best of ``--rounds``.

``--kernels`` also reads 12 llama-1b layers' worth of int8 and int4 (symmetric g32) weights on 2 MiB pages with the
decode GEMVs (one row of x) and with the probe, call for call, taking turns: how close each kernel comes to a plain
read of the same bytes::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_read_sizes.py --threads 2 --kernels
"""
from __future__ import annotations

import argparse
import time

import torch

from splice import native
from splice.bench import PROBE_PATTERNS
from splice.native.memory import gather_on_huge_pages

from bench_weight_streams import int4_layers, int8_layers  # the same llama-1b-shaped weights


def slices(region_mb: int, size_mb: int, huge: bool) -> list[torch.Tensor] | None:
    """``region_mb`` of bytes as consecutive ``size_mb`` reads: views of one buffer on 2 MiB pages (None where Linux
    has no huge pages to give), or separate tensors."""
    count = max(1, region_mb // size_mb)
    if not huge:
        return [torch.ones(size_mb << 20, dtype=torch.uint8) for _ in range(count)]
    region = torch.ones(count * (size_mb << 20), dtype=torch.uint8)
    if not gather_on_huge_pages([region]):
        return None
    return list(region.split(size_mb << 20))


def best_gbs(parts: list[torch.Tensor] | None, rounds: int) -> float:
    """The fastest read of ``parts`` (one call each) in any of the probe's read patterns, ``rounds`` turns each."""
    if parts is None:
        return float("nan")
    best = float("inf")
    for _ in range(rounds):
        for streams, ahead in PROBE_PATTERNS:
            start = time.perf_counter()
            for part in parts:
                torch.ops.splice_kernels.stream_read(part, streams, ahead)
            best = min(best, time.perf_counter() - start)
    return sum(p.numel() for p in parts) / best / 1e9


def kernels_against_probe(rounds: int, layers: int = 12) -> None:
    """Each quantized GEMV over ``layers`` layers' weights, and the probe over the same weight tensors."""
    torch.manual_seed(0)
    int4, int8 = int4_layers(layers), int8_layers(layers)
    for group in (int4, int8):
        for tensors in list(zip(*group))[1:]:  # the weights into one buffer on 2 MiB pages, int8's scales into another
            gather_on_huge_pages(list(tensors))
    x = {k: torch.randn(1, k).bfloat16() for k in (2048, 5632)}
    runs = {
        "int4_dot_gemv": (lambda: [torch.ops.splice_kernels.int4_dot_gemv(x[k], w, 32) for k, w in int4], int4),
        "int8_dot_gemv": (lambda: [torch.ops.splice_kernels.int8_dot_gemv(x[k], w, s) for k, w, s in int8], int8),
    }
    for name, (call, weights) in runs.items():
        weight_bytes = sum(t.nbytes for _, *tensors in weights for t in tensors)
        probe = [w.view(torch.uint8).flatten() for _, w, *_ in weights]  # int4's tiles hold their scales, int8's not
        kernel_best, probe_best = 0.0, 0.0
        for _ in range(rounds):
            start = time.perf_counter()
            call()
            kernel_best = max(kernel_best, weight_bytes / (time.perf_counter() - start) / 1e9)
            probe_best = max(probe_best, best_gbs(probe, 1))
        print(f"{name}: {kernel_best:.1f} GB/s, the probe on its weights {probe_best:.1f} GB/s "
              f"({100 * kernel_best / probe_best:.0f} %)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="2,4,8,16,64,256,768", help="comma-separated MB per call")
    parser.add_argument("--region-mb", type=int, default=768, help="MB read per round (default 768)")
    parser.add_argument("--kernels", action="store_true", help="also the int8 and int4 GEMVs against the probe")
    args = parser.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes or not all(s.isdigit() and int(s) > 0 for s in sizes):
        parser.error(f"--sizes {args.sizes!r}: allowed a comma-separated list of whole MB above 0")
    if args.region_mb < 1:
        parser.error(f"--region-mb {args.region_mb}: allowed 1 or more")
    if not native.available():
        raise SystemExit("needs splice's native kernels")
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads; GB/s, best of {args.rounds} reads of {args.region_mb} MiB in calls of each size")
    print(f"{'MB a call':>10} {'2 MiB pages':>12} {'separate':>12}")
    for size in map(int, sizes):
        huge, separate = (best_gbs(slices(args.region_mb, size, flag), args.rounds) for flag in (True, False))
        print(f"{size:>10} {'n/a' if huge != huge else f'{huge:.1f}':>12} {separate:>12.1f}", flush=True)
    if args.kernels:
        kernels_against_probe(args.rounds)


if __name__ == "__main__":
    main()
