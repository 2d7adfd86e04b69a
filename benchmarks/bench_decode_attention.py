"""Decode tok/s at several contexts with splice's attention kernel for decode steps against the fused block's other
path (SDPA eager, inductor's fused loops compiled): two engines from one llama-1b-shaped model, the second with
``block.native_attention = False``, taking turns so the machine's load hits both.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_decode_attention.py --contexts 256,1024,4096 --compile
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import splice
from splice.bench import QUANT_SCHEMES, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,1024,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--quant", choices=sorted(QUANT_SCHEMES), help="a splice bench --quant scheme (default bf16)")
    parser.add_argument("--compile", action="store_true", help="compiled decode steps")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    model = load_model("llama-1b", "bf16")
    options = engine_options(args.quant)
    engines = {}
    for name in ("native", "other"):
        engine = splice.init_inference(copy.deepcopy(model), replace_with_kernel_inject=True,
                                       max_out_tokens=max(contexts) + args.new + 8, compile_decode=args.compile,
                                       **options)
        for block in engine.runtime.blocks:
            block.native_attention = name == "native"
        engines[name] = engine
    del model
    with torch.inference_mode():
        for context in contexts:
            speeds = time_contexts(engines, torch.randint(0, 32000, (1, context)), args.new, args.rounds)
            native, other = max(speeds["native"]), max(speeds["other"])
            print(f"context {context}: splice's attention kernel {native:.2f} tok/s, the block's other path "
                  f"{other:.2f} tok/s, {native / other:.2f}x", flush=True)


def engine_options(scheme: str | None) -> dict:
    """``init_inference`` options for a ``splice bench --quant`` scheme (None or "bf16": none), the activations bf16."""
    options = dict(QUANT_SCHEMES.get(scheme, {}))
    options.setdefault("dtype", torch.bfloat16)
    return options


def time_contexts(engines: dict, prompt: torch.Tensor, new: int, rounds: int) -> dict[str, list[float]]:
    """Decode tok/s of each engine per round: a generate of ``new`` + 1 tokens less one of 1 token (the prefill)."""
    for engine in engines.values():
        engine.generate(prompt, max_new_tokens=4, do_sample=False)  # compiles this length's graph
    speeds = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            prefill = timed(lambda: engine.generate(prompt, max_new_tokens=1, do_sample=False))
            total = timed(lambda: engine.generate(prompt, max_new_tokens=new + 1, do_sample=False))
            speeds[name].append(new / (total - prefill))
    return speeds


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
