"""The decode GEMVs alone, at one instruction-set level: in the cache, GMAC/s (one thread by default), where the
instructions a kernel issues bound it; and from memory, each kernel's read speed over the bandwidth probe's, the two
taking turns so each round's ratio sees one state of the host, where the reads should bound it. The int8 kernel is
the one int8 weight-only layers call at that level (int16 activations at the avx2 level without AVX-VNNI, else int8
ones); int8-tiles the same weight in the tiles int8 layers keep where ``native.int8_tiles_ready`` (the avx512 level
with VNNI; elsewhere the kernels read them back to rows every call); int8-g64 grouped int8 (a scale per row and 64
columns) in the layout and on the activations its layers take at that level; int4 is asymmetric (a scale and zero
per group), int4-sym symmetric (the scale alone), groups of 32. Run it before and after a kernel change::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_gemv_rates.py
    PYTHONPATH=src .venv/bin/python benchmarks/bench_gemv_rates.py --level avx2 --memory-layers 0
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from splice import native
from splice.kernel_choice import int16_activations
from splice.native.memory import gather_on_huge_pages

from bench_quant import FUSED
from bench_read_sizes import best_gbs  # the probe's read patterns, the fastest taken

KINDS = ("bf16", "int8", "int8-tiles", "int8-g64", "int4", "int4-sym")
GROUP = 32
INT8_GROUP = 64


def operands(kind: str, n: int, k: int) -> tuple:
    """A random weight of ``kind`` [n, k] in the layout its decode GEMV takes."""
    if kind == "bf16":
        return ((torch.randn(n, k) * 0.02).bfloat16(),)
    if kind in ("int8", "int8-tiles", "int8-g64"):
        rows = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        if kind == "int8-g64":  # the layout Int8WeightOnlyLinear keeps at the active level
            scales = native.int8_group_scales_pack(torch.rand(k // INT8_GROUP, n).bfloat16() * 0.01)
            tiled = int16_activations() or native.int8_grouped_tiles_ready()
            return native.int8_tile_pack(rows) if tiled else rows, scales
        return native.int8_tile_pack(rows) if kind == "int8-tiles" else rows, torch.rand(n).bfloat16() * 0.01
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    zeros = torch.zeros(k // GROUP, n) if kind == "int4-sym" else torch.randn(k // GROUP, n) * 0.01
    scales_and_zeros = torch.stack([torch.rand(k // GROUP, n) * 0.01, zeros], -1)
    return (native.int4_tile_pack(codes, scales_and_zeros),)  # the tiles hold the scales and zeros too


def call(kind: str, x: torch.Tensor, weight: tuple, ops=None) -> torch.Tensor:
    """``kind``'s decode GEMV, from ``ops`` (splice's op library by default; bench_two_builds passes another build's)."""
    ops = torch.ops.splice_kernels if ops is None else ops
    if kind == "bf16":
        return ops.bf16_gemv(x, *weight)
    if kind in ("int8", "int8-tiles"):
        return (ops.int8_dot16_gemv if int16_activations() else ops.int8_dot_gemv)(x, *weight)
    if kind == "int8-g64":
        return (ops.int8_dot16_gemv_grouped if int16_activations() else ops.int8_dot_gemv_grouped)(x, *weight)
    return ops.int4_dot_gemv(x, *weight, GROUP)


def weight_bytes(weight: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in weight)


def cache_rates(shapes, rows: int, reps: int, kinds=KINDS) -> dict[tuple[tuple[int, int], str], float]:
    """{(shape, kind): GMAC/s}, the median of 7 timings of ``reps`` calls on a weight small enough to stay cached."""
    out = {}
    for n, k in shapes:
        x = torch.randn(rows, k).bfloat16()
        for kind in kinds:
            weight = operands(kind, n, k)
            call(kind, x, weight)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                for _ in range(reps):
                    call(kind, x, weight)
                times.append((time.perf_counter() - start) / reps)
            out[((n, k), kind)] = rows * n * k / statistics.median(times) / 1e9
    return out


def memory_shares(layers: int, rows: int, rounds: int, kinds=KINDS,
                  shapes=None) -> dict[str, list[tuple[float, float]]]:
    """{kind: [(GB/s, GB/s over the probe's) per round]}: ``layers`` llama-1b blocks' fused weights of each kind
    (``shapes`` instead, where given) on 2 MiB pages, every matrix once a round, and the probe over a buffer as large
    as the int8 weights, in turns (the order reversed every other round)."""
    shapes = list(FUSED.values()) * layers if shapes is None else shapes
    weights = {kind: [operands(kind, n, k) for n, k in shapes] for kind in kinds}
    probe = torch.ones(sum(n * k for n, k in shapes), dtype=torch.uint8)
    gather_on_huge_pages([t for each in weights.values() for weight in each for t in weight] + [probe])
    inputs = [torch.randn(rows, k).bfloat16() for _, k in shapes]
    sizes = {kind: sum(weight_bytes(w) for w in each) for kind, each in weights.items()}
    out = {kind: [] for kind in kinds}
    for i in range(rounds):
        speeds = {}
        for name in (("probe",) + tuple(kinds))[:: 1 if i % 2 else -1]:
            if name == "probe":
                speeds[name] = best_gbs([probe], rounds=1)
                continue
            start = time.perf_counter()
            for x, weight in zip(inputs, weights[name]):
                call(name, x, weight)
            speeds[name] = sizes[name] / (time.perf_counter() - start) / 1e9
        for kind in kinds:
            out[kind].append((speeds[kind], speeds[kind] / speeds["probe"]))
    return out


def merged_shapes(layers: int) -> list[tuple[int, int]]:
    """The weights of ``layers`` llama-1b blocks as one matrix per input width: the same bytes as their per-layer
    matrices in two calls, so a call's fixed costs (rounding x, waking the threads, each stream's first reads) all but
    vanish beside the reads."""
    widths = sorted({k for _, k in FUSED.values()})
    return [(layers * sum(n for n, k in FUSED.values() if k == width), width) for width in widths]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) <= 0 or s[1] % 256 or s[0] % 16 for s in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NxK[,NxK...], N a multiple of 16, K of 256")
    return shapes


def at_least(minimum: int):
    """An argparse type: a whole number of at least ``minimum``, else an error naming the value."""
    def parse(text: str) -> int:
        value = int(text) if text.isdigit() else None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least {minimum}")
        return value
    return parse


positive = at_least(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", default=None, choices=native.ISA_LEVELS, help="default: the best level here")
    parser.add_argument("--rows", type=positive, nargs="+", default=[1, 2], help="rows of x (batch)")
    parser.add_argument("--cache-shapes", type=parse_shapes, default=parse_shapes("1024x2048,512x5632"))
    parser.add_argument("--cache-threads", type=positive, default=1)
    parser.add_argument("--reps", type=positive, default=300, help="calls per cache timing")
    parser.add_argument("--memory-layers", type=int, default=8, help="llama-1b blocks from memory (0: skip)")
    parser.add_argument("--memory-threads", type=positive, default=2)
    parser.add_argument("--rounds", type=positive, default=11)
    parser.add_argument("--merged", action="store_true",
                        help="from memory, also the same weights as one matrix per input width, in turns with the "
                             "per-layer calls (what a call's fixed costs take)")
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("splice's native kernels are not available here")
    if args.level and args.level not in native.supported_isas():
        parser.error(f"--level {args.level} does not run here; allowed: {', '.join(native.supported_isas())}")
    with native.use_isa(args.level) if args.level else contextlib.nullcontext():
        level = native.isa()
        torch.set_num_threads(args.cache_threads)
        for rows in args.rows:
            rates = cache_rates(args.cache_shapes, rows, args.reps)
            print(f"{level}, in cache, {args.cache_threads} thread(s), {rows} row(s), GMAC/s: " + "  ".join(
                f"{kind} {n}x{k} {rate:.1f}" for ((n, k), kind), rate in rates.items()))
        if args.memory_layers:
            torch.set_num_threads(args.memory_threads)
            layouts = {"per layer": None, "merged": merged_shapes(args.memory_layers)} if args.merged else {"": None}
            for rows in args.rows:
                for layout, shapes in layouts.items():
                    shares = memory_shares(args.memory_layers, rows, args.rounds, shapes=shapes)
                    print(f"{level}, {args.memory_layers} llama-1b blocks from memory{' ' + layout if layout else ''}, "
                          f"{args.memory_threads} threads, {rows} row(s), median of {args.rounds} rounds: " + "  ".join(
                              f"{kind} {statistics.median(s for s, _ in v):.1f} GB/s = "
                              f"{statistics.median(r for _, r in v):.3f} of the probe" for kind, v in shares.items()))


if __name__ == "__main__":
    main()
