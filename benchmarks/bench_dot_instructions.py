"""The avx2 level's integer dot products with AVX-VNNI's vpdpbusd against vpmaddubsw + vpmaddwd, on weights that fit
the L2 cache (so the arithmetic, not the memory, is timed): int4 and int8 decode GEMVs at 1 and 4 rows, one thread,
the two paths taking turns. Needs a CPU with AVX-VNNI.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_dot_instructions.py
"""
from __future__ import annotations

import time

import torch

from splice import native


def best_us(call, calls: int = 2000, repeats: int = 5) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)
    if not native.available() or "avx_vnni" not in native._cpu_flags():
        raise SystemExit("needs splice's native kernels on a CPU with AVX-VNNI")
    n, k = 256, 2048
    w4 = native.int4_tile_pack(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.randn(k // 32, n, 2).bfloat16())
    w8, scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16()
    with native.use_isa("avx2"):
        for rows in (1, 4):
            x = torch.randn(rows, k).bfloat16()
            for name, call in (("int4_dot_gemv", lambda: torch.ops.splice_kernels.int4_dot_gemv(x, w4, 32)),
                               ("int8_dot_gemv", lambda: torch.ops.splice_kernels.int8_dot_gemv(x, w8, scales))):
                times = {True: [], False: []}
                for on in (False, True, False, True):
                    with native.use_avx_vnni(on):
                        times[on].append(best_us(call))
                plain, vnni = min(times[False]), min(times[True])
                print(f"{name} {rows} row(s): vpmaddubsw {plain:.1f} us, AVX-VNNI {vnni:.1f} us, {plain / vnni:.2f}x")


if __name__ == "__main__":
    main()
