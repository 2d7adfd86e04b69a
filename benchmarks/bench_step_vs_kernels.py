"""The compiled decode step against its own kernels called back to back, and each against the bandwidth probe: where a
quantized step's time goes besides reading its weights.

One kernel-injected, quantized model; taking turns each round: the bandwidth probe; the step's GEMVs alone (every
block's qkv, o, gate_up and down, and the lm_head, run back to back from Python on inputs of the same shapes); the
same with one decode-attention call per block (the step's kernels); its compiled step called directly at one fixed
position; and ``generate``'s time per new token (between the new tokens' arrivals at a streamer, the prefill's
left out). Each is given in ms a step and as its read speed (the GEMVs' weight bytes, plus the KV cache's where it
attends, over its time) over the probe's, read right before and right after it (the host's bandwidth moves within
seconds). The GEMVs' share is what the weights' bandwidth bounds; each line after it adds what the step does besides
(attention, the compiled graph's other work and calls, generate's loop)::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_step_vs_kernels.py --model llama-1b --quant int4-sym
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import splice
from splice.bench import kv_bytes_per_step, load_model, read_bandwidth_gbs
from splice.cli_options import QUANT_SCHEMES
from splice.layers.native_linear import NativeLinear
from splice.quant.layers import Int4WeightOnlyLinear, Int8WeightOnlyLinear

from bench_gemv_rates import at_least  # argparse counts that name a bad value

PROMPT = 64
PROBE_GIB = 0.5  # the probe's buffer: well past the last-level cache, quick enough to read every round


def gemv_call(linear):
    """The native GEMV the linear runs for one row of x, as a function of x; its input width; the bytes it reads."""
    ops = torch.ops.splice_kernels
    if isinstance(linear, Int4WeightOnlyLinear):
        op = ops.int4_dot_gemv if linear.use_dot_products else ops.int4_gemv
        return (lambda x: op(x, linear.packed, linear.group)), linear.in_features, linear.weight_nbytes()
    if isinstance(linear, Int8WeightOnlyLinear) and linear.native_grouped:
        if linear.groups_padded:
            raise TypeError("a grouped int8 linear whose groups are padded spreads x first; this benchmark does not")
        op = ops.int8_dot16_gemv_grouped if linear.use_dot_products == 16 else ops.int8_dot_gemv_grouped
        return (lambda x: op(x, linear.qweight, linear.scales)), linear.in_features, linear.weight_nbytes()
    if isinstance(linear, Int8WeightOnlyLinear):
        # 16: activations rounded to int16 (the avx2 level without AVX-VNNI), 8: to int8, 0: float products
        op = {16: ops.int8_dot16_gemv, 8: ops.int8_dot_gemv}.get(linear.use_dot_products, ops.int8_gemv)
        return (lambda x: op(x, linear.qweight, linear.scales)), linear.in_features, linear.weight_nbytes()
    if isinstance(linear, NativeLinear):
        return (lambda x: ops.bf16_gemv(x, linear.weight)), linear.in_features, linear.weight.nbytes
    raise TypeError(f"{type(linear).__name__} runs no native GEMV this benchmark knows")


def step_gemvs(runtime) -> list[tuple]:
    """(GEMV, input width, bytes) of one decode step, in its order: each block's four, then the lm_head's."""
    calls = [gemv_call(getattr(block, name)) for block in runtime.blocks for name in ("qkv", "o", "gate_up", "down")]
    return calls + [gemv_call(runtime.lm_head)]


def kernels_of(runtime, length: int, attention: bool = True):
    """The step's kernels as one function: each block's four GEMVs and (with ``attention``) its attention over
    ``length`` slots, then the lm_head's GEMV."""
    calls = step_gemvs(runtime)
    inputs = [torch.randn(1, width).bfloat16() for _, width, _ in calls]
    cache = runtime.cache_for(1)
    dims = runtime.dims
    query = torch.randn(1, dims.n_heads, 1, dims.head_dim).bfloat16()
    visible = torch.ones(1, 1, 1, length, dtype=torch.bool)
    scale = dims.head_dim ** -0.5

    def run():
        for i, (call, _, _) in enumerate(calls):
            call(inputs[i])
            if attention and i % 4 == 0 and i < len(calls) - 1:
                keys, values = cache.keys[i // 4, :, :, :length], cache.values[i // 4, :, :, :length]
                torch.ops.splice_kernels.decode_attention(query, keys, values, visible, scale)
    return run


def ms_per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


class TokenTimes:
    """A ``generate`` streamer that notes when each put arrives: the prompt's, then one per new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, _tokens) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def ms_per_token(engine, prompt: torch.Tensor, new: int) -> float:
    """``generate``'s ms per new token after the first (the prefill's): from the second new token's arrival to the
    last's, over the tokens between, so every step's share of the loop around it is counted and the prefill is not."""
    streamer = TokenTimes()
    engine.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=streamer)
    first, last = streamer.times[2], streamer.times[-1]
    return (last - first) / (len(streamer.times) - 3) * 1e3


def beside_the_probe(timing) -> tuple[float, float]:
    """(``timing()``'s ms, the probe's GB/s: the mean of a reading right before and one right after it)."""
    before = read_bandwidth_gbs(PROBE_GIB, repeats=1)
    ms = timing()
    return ms, (before + read_bandwidth_gbs(PROBE_GIB, repeats=1)) / 2


def share(nbytes: int, ms: float, probe_gbs: float) -> float:
    """Read speed (``nbytes`` in ``ms``) over the probe's."""
    return nbytes / (ms * 1e-3) / 1e9 / probe_gbs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--quant", default="int4-sym", choices=("bf16",) + tuple(QUANT_SCHEMES))
    parser.add_argument("--rounds", type=at_least(1), default=6)
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--new", type=at_least(2), default=33, help="new tokens of the generate runs")
    parser.add_argument("--calls", type=at_least(1), default=10, help="steps (or kernel runs) a timing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = {} if args.quant == "bf16" else QUANT_SCHEMES[args.quant]
    model = load_model(args.model, "bf16")
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=PROMPT + args.new,
                                   **options)
    runtime = engine.runtime
    runtime.compile_decode()
    prompt = torch.randint(100, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        engine.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)  # compiles
        cache = runtime.cache_for(1)
        token, position = torch.tensor([[5]]), torch.tensor([[PROMPT]])
        slot = cache.slot_ids[PROMPT:PROMPT + 1].clone()
        length = runtime.attended_length(PROMPT + 1)
        gemv_bytes = sum(nbytes for _, _, nbytes in step_gemvs(runtime))
        step_bytes = gemv_bytes + kv_bytes_per_step(model, 1, length)
        work = {"GEMVs": (kernels_of(runtime, length, attention=False), gemv_bytes),
                "+ attention": (kernels_of(runtime, length), step_bytes),
                "compiled step": (lambda: runtime.decode_step(token, position, slot, cache, PROMPT + 1), step_bytes)}
        for fn, _ in work.values():
            ms_per_call(fn, 3)  # warm
        shares: dict[str, list[float]] = {name: [] for name in (*work, "generate")}
        print(f"{args.model} {args.quant}, {args.threads} threads: {gemv_bytes / 1e6:.1f} MB of GEMV weights a step, "
              f"{(step_bytes - gemv_bytes) / 1e6:.1f} MB of KV cache")
        timings = {name: (lambda fn=fn: ms_per_call(fn, args.calls), nbytes) for name, (fn, nbytes) in work.items()}
        timings["generate"] = (lambda: ms_per_token(engine, prompt, args.new), step_bytes)
        for r in range(args.rounds):
            line = []
            for name, (timing, nbytes) in timings.items():
                ms, probe = beside_the_probe(timing)
                shares[name].append(share(nbytes, ms, probe))
                line.append(f"{name} {ms:.2f} ms ({shares[name][-1]:.2f} of {probe:.1f} GB/s)")
            print(f"round {r}: " + ", ".join(line), flush=True)
        print("median share of the probe: " + ", ".join(f"{name} {statistics.median(values):.3f}"
                                                     for name, values in shares.items()))


if __name__ == "__main__":
    main()
