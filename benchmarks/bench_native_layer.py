"""Decode steps with the blocks in one native call (``decode_layers``) against the blocks' own ops, in one process, in
turns: two kernel-injected engines of the same model, one with ``SPLICE_NATIVE_LAYER=0``'s choice (every block its
own ops), each round timing a run of decode steps of each (the order alternating, as the host's bandwidth moves within
seconds). Eager steps (what ``splice generate`` runs) or compiled ones (``--compile``); ms a step, and the ratio::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_native_layer.py --model smollm2-135m-instruct --quant bf16
    PYTHONPATH=src .venv/bin/python benchmarks/bench_native_layer.py --model llama-1b --quant int4-sym --compile
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import splice
from splice.bench import load_model
from splice.cli_options import QUANT_SCHEMES

from bench_gemv_rates import at_least  # argparse counts that name a bad value

PROMPT = 64


def engine_of(model_name: str, quant: str, native_layers: bool, compiled: bool, max_out_tokens: int = 256):
    """A kernel-injected bf16 engine (``quant`` a ``splice bench --quant`` scheme, or bf16); ``native_layers`` False
    runs every block's own ops."""
    options = QUANT_SCHEMES[quant] if quant != "bf16" else {}
    model = model_name if isinstance(model_name, torch.nn.Module) else load_model(model_name, "bf16")
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=max_out_tokens,
                                   compile_decode=compiled, **options)
    if not native_layers:
        for block in engine.runtime.blocks:
            block.native_layer = False
    return engine


def decode_step(engine, prompt: torch.Tensor):
    """A greedy generate of a few tokens (compiling the step's graph), then one decode step as a function: the next
    token at the next slot, repeatable (it writes the same slot each time)."""
    runtime = engine.runtime
    with torch.inference_mode():
        tokens = engine.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    length = prompt.shape[1]
    cache = runtime.cache_for(prompt.shape[0])
    token, position = tokens[:, length:length + 1], torch.full((prompt.shape[0], 1), length)
    slot = cache.slot_ids[length:length + 1].clone()
    return tokens, lambda: runtime.decode_step(token, position, slot, cache, length + 1)


def timed_ms(step, calls: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(calls):
            step()
    return (time.perf_counter() - start) / calls * 1e3


def in_turns(steps: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    """ms a step of each named step, per round, the order reversed every other round."""
    names = list(steps)
    times = {name: [] for name in names}
    for name in names:
        timed_ms(steps[name], 2)  # warm
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            times[name].append(timed_ms(steps[name], calls))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model splice.load takes, or llama-1b")
    parser.add_argument("--quant", default="bf16", help=f"bf16 or one of {', '.join(QUANT_SCHEMES)}")
    parser.add_argument("--compile", action="store_true", help="compiled decode steps (else eager)")
    parser.add_argument("--rounds", type=at_least(1), default=12)
    parser.add_argument("--calls", type=at_least(1), default=20, help="decode steps a round, each way")
    parser.add_argument("--threads", type=at_least(1), default=2)
    args = parser.parse_args()
    if args.quant != "bf16" and args.quant not in QUANT_SCHEMES:
        parser.error(f"--quant {args.quant!r}; allowed: bf16, {', '.join(QUANT_SCHEMES)}")
    torch.set_num_threads(args.threads)
    prompt = torch.randint(100, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    engines = {"own ops": engine_of(args.model, args.quant, False, args.compile),
               "native calls": engine_of(args.model, args.quant, True, args.compile)}
    print(engines["native calls"].step_report("kernels").summary().split("; blocks: ")[-1])
    tokens, steps = {}, {}
    for name, engine in engines.items():
        tokens[name], steps[name] = decode_step(engine, prompt)
    same = torch.equal(tokens["own ops"], tokens["native calls"])
    times = in_turns(steps, args.rounds, args.calls)
    ratios = [own / native for own, native in zip(times["own ops"], times["native calls"])]
    mode = "compiled" if args.compile else "eager"
    print(f"{args.model} {args.quant}, {mode} steps, {args.threads} threads; greedy tokens the same: {same}")
    for round_, (own, native, ratio) in enumerate(zip(times["own ops"], times["native calls"], ratios)):
        print(f"round {round_:2d}: own ops {own:7.3f} ms, native calls {native:7.3f} ms, {ratio:.3f}")
    print(f"median ms a step: own ops {statistics.median(times['own ops']):.3f}, native calls "
          f"{statistics.median(times['native calls']):.3f}; median ratio {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
