"""The compiled decode step against its own kernels called back to back: what a fused per-layer op could save.

One kernel-injected, quantized model; its compiled step is called directly at one fixed position, taking turns with
the step's GEMVs (every block's qkv, o, gate_up and down, and the lm_head) and one decode-attention call per block run
back to back from Python on inputs of the same shapes. A ratio near 1 leaves nothing for a fused step to save beyond
the noise; the kernels' own time is what the weights' bandwidth bounds. ms a step, each round 20 steps of each::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_step_vs_kernels.py --model llama-1b --quant int4-sym
"""
from __future__ import annotations

import argparse
import time

import torch

import splice
from splice.bench import load_model
from splice.cli_options import QUANT_SCHEMES
from splice.layers.native_linear import NativeLinear
from splice.quant.layers import Int4WeightOnlyLinear, Int8WeightOnlyLinear

PROMPT = 64


def gemv_call(linear):
    """The native GEMV the linear runs for one row of x, as a function of x, and its input width."""
    ops = torch.ops.splice_kernels
    if isinstance(linear, Int4WeightOnlyLinear):
        op = ops.int4_dot_gemv if linear.use_dot_products else ops.int4_gemv
        return (lambda x: op(x, linear.packed, linear.packed_scales, linear.group)), linear.in_features
    if isinstance(linear, Int8WeightOnlyLinear):
        op = ops.int8_dot_gemv if linear.use_dot_products else ops.int8_gemv
        return (lambda x: op(x, linear.qweight, linear.scales)), linear.in_features
    if isinstance(linear, NativeLinear):
        return (lambda x: ops.bf16_gemv(x, linear.weight)), linear.in_features
    raise TypeError(f"{type(linear).__name__} runs no native GEMV this benchmark knows")


def kernels_of(runtime, length: int):
    """The step's kernels as one function: each block's four GEMVs and its attention over ``length`` slots, then the
    lm_head's GEMV."""
    calls = [gemv_call(getattr(block, name)) for block in runtime.blocks for name in ("qkv", "o", "gate_up", "down")]
    calls.append(gemv_call(runtime.lm_head))
    inputs = [torch.randn(1, width).bfloat16() for _, width in calls]
    cache = runtime.cache_for(1)
    dims = runtime.dims
    query = torch.randn(1, dims.n_heads, 1, dims.head_dim).bfloat16()
    visible = torch.ones(1, 1, 1, length, dtype=torch.bool)
    scale = dims.head_dim ** -0.5

    def run():
        for i, (call, _) in enumerate(calls):
            call(inputs[i])
            if i % 4 == 0 and i < len(calls) - 1:
                keys, values = cache.keys[i // 4, :, :, :length], cache.values[i // 4, :, :, :length]
                torch.ops.splice_kernels.decode_attention(query, keys, values, visible, scale)
    return run


def ms_per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--quant", default="int4-sym", choices=tuple(QUANT_SCHEMES))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = splice.init_inference(load_model(args.model, "bf16"), replace_with_kernel_inject=True,
                                   max_out_tokens=PROMPT + 16, **QUANT_SCHEMES[args.quant])
    runtime = engine.runtime
    runtime.compile_decode()
    prompt = torch.randint(100, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        engine.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # compiles the step
        cache = runtime.cache_for(1)
        token, position = torch.tensor([[5]]), torch.tensor([[PROMPT]])
        slot = cache.slot_ids[PROMPT:PROMPT + 1].clone()
        length = runtime.attended_length(PROMPT + 1)
        kernels = kernels_of(runtime, length)

        def step():
            runtime.decode_step(token, position, slot, cache, PROMPT + 1)

        for fn in (step, kernels):
            ms_per_call(fn, 3)  # warm
        for r in range(args.rounds):
            step_ms, kernels_ms = ms_per_call(step, 20), ms_per_call(kernels, 20)
            print(f"round {r}: compiled step {step_ms:.2f} ms, its kernels back to back {kernels_ms:.2f} ms, "
                  f"ratio {step_ms / kernels_ms:.3f}", flush=True)


if __name__ == "__main__":
    main()
