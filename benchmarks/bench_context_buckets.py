"""Decode tokens/s of the compiled step at a short context for several ``max_out_tokens``: the step's cost should follow
the context used, not the size of the static KV cache.

    PYTHONPATH=src python benchmarks/bench_context_buckets.py --max-out 1024 4096 8192 --prompt 256 --new 64

One SmolLM2 (bf16) model per ``max_out_tokens``, kernel-injected, decode step compiled; a warm-up generate each (it
compiles), then ``--repeat`` rounds of one generate per model, the best of each model's runs reported, and the fastest
single decode step. The ratio to the first ``--max-out`` figure is what to compare on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import splice
from splice.streaming import StepClock


def compiled_engine(max_out: int, prompt: torch.Tensor, options: dict):
    model = splice.load("smollm2-135m-instruct", dtype="bf16")[0]
    engine = splice.init_inference(model, replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=max_out)
    engine.generate(prompt, **options)  # compiles
    return engine


def decode_tok_s(engine, prompt: torch.Tensor, options: dict) -> float:
    clock = StepClock()
    engine.generate(prompt, **options, streamer=clock)
    return clock.decode_steps_per_s


def fastest_step_ms(engine, length: int, steps: int = 20) -> float:
    """The fastest of ``steps`` decode steps at ``length`` filled slots (the cache left by the last generate): the
    minimum is the figure least disturbed by other processes on a shared machine."""
    runtime = engine.runtime
    cache = runtime.cache_for(1)
    best = float("inf")
    with torch.inference_mode():  # inputs of the kind generate passes: no graph of their own
        token, position, slot = torch.tensor([[100]]), torch.tensor([[length - 1]]), torch.tensor([length - 1])
        for _ in range(steps):
            start = time.perf_counter()
            runtime.decode_step(token, position, slot, cache, length)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-out", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompt = torch.randint(100, 40000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                   attention_mask=torch.ones_like(prompt))
    engines = {max_out: compiled_engine(max_out, prompt, options) for max_out in args.max_out}
    rows = dict.fromkeys(args.max_out, 0.0)
    steps = dict.fromkeys(args.max_out, float("inf"))
    for _ in range(args.repeat):  # round robin, so drifts in the machine's load touch every engine alike
        for max_out, engine in engines.items():
            rows[max_out] = max(rows[max_out], decode_tok_s(engine, prompt, options))
            steps[max_out] = min(steps[max_out], fastest_step_ms(engine, args.prompt + 1))
    first = args.max_out[0]
    for max_out in args.max_out:
        print(f"max_out_tokens {max_out:5d}: {rows[max_out]:7.1f} tok/s ({rows[max_out] / rows[first]:.2f} x), "
              f"fastest step {steps[max_out]:6.2f} ms ({steps[first] / steps[max_out]:.2f} x speed of "
              f"max_out_tokens {first})", flush=True)
    print(json.dumps({"tok_s": {str(k): round(v, 2) for k, v in rows.items()},
                      "fastest_step_ms": {str(k): round(v, 3) for k, v in steps.items()}}))


if __name__ == "__main__":
    main()
