"""Whole-model decode steps and prefills with one of the native GEMVs' row limits (``native.MAX_ROWS``) at two values,
in turns: where a limit hands a call's rows to another kernel (de-quantise + GEMM for int8 and int4, oneDNN's GEMM for
bf16), which side is faster with a model's own shapes, at the batch sizes and prompt lengths given. Each round times
both limits back to back (the order reversed every other round); each line gives the medians and their ratio::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_row_limits.py --quant int4-sym --key int4_dot --limits 15,2048
    PYTHONPATH=src .venv/bin/python benchmarks/bench_row_limits.py --quant int8 --key int8_dot --limits 16,2048 \\
        --batches 24,32 --prompts 32,128,1024
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

from splice import native
from splice.cli_options import QUANT_SCHEMES

from bench_gemv_rates import at_least, positive
from bench_native_layer import PROMPT, decode_step, engine_of, timed_ms


def positive_list(text: str) -> list[int]:
    """Comma-separated whole numbers from 1; argparse names the bad value."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers from 1, separated by commas")
    return values


@contextmanager
def row_limit(key: str, limit: int):
    """``native.MAX_ROWS[key]`` at ``limit`` inside the block, then as before (an eager step's plan is kept per row
    limits, so a step re-gathers its native calls for each)."""
    before = native.MAX_ROWS[key]
    native.MAX_ROWS[key] = limit
    try:
        yield
    finally:
        native.MAX_ROWS[key] = before


def token_ids(engine, shape: tuple[int, int]) -> torch.Tensor:
    """Random token ids the model takes (from the upper part of its vocabulary, past most special tokens)."""
    vocab = engine.module.config.vocab_size
    return torch.randint(min(100, vocab // 2), min(1000, vocab), shape)


def ms(work, calls: int) -> float:
    """``work()``'s time in ms, the mean of ``calls`` after one untimed call (a step after the limit changed gathers
    its native calls again)."""
    timed_ms(work, 1)
    return timed_ms(work, calls)


def in_turns(key: str, limits: list[int], timing, rounds: int) -> dict[int, list[float]]:
    """``timing()`` (ms) with each limit, per round, the order reversed every other round."""
    times = {limit: [] for limit in limits}
    for r in range(rounds):
        for limit in limits if r % 2 == 0 else limits[::-1]:
            with row_limit(key, limit):
                times[limit].append(timing())
    return times


def line(what: str, times: dict[int, list[float]]) -> str:
    (low, first), (high, second) = ((limit, statistics.median(t)) for limit, t in times.items())
    return f"{what}: limit {low} {first:.1f} ms, limit {high} {second:.1f} ms ({first / second:.2f}x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--quant", default="int4-sym", choices=("bf16",) + tuple(QUANT_SCHEMES))
    parser.add_argument("--key", default="int4_dot", help="the MAX_ROWS entry to set")
    parser.add_argument("--limits", type=positive_list, default=[15, 2048], help="two values, comma-separated")
    parser.add_argument("--batches", type=positive_list, default=[16, 24, 32], help="decode batch sizes")
    parser.add_argument("--prompts", type=positive_list, default=[16, 128, 1024], help="prompt lengths")
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--calls", type=positive, default=3, help="decode steps a timing")
    parser.add_argument("--threads", type=positive, default=2)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("splice's native kernels are not available here")
    if args.key not in native.MAX_ROWS or len(args.limits) != 2:
        parser.error(f"--key {args.key!r} --limits {args.limits}: expected one of {', '.join(native.MAX_ROWS)} "
                     "and two limits")
    torch.set_num_threads(args.threads)
    engine = engine_of(args.model, args.quant, True, False, max_out_tokens=max(args.prompts + [PROMPT]) + 4)
    print(f"{args.model} {args.quant}, {args.threads} threads, level {native.isa()}, MAX_ROWS[{args.key!r}] at "
          f"{args.limits[0]} and {args.limits[1]} in turns, {args.rounds} rounds (medians)")
    for batch in args.batches:
        _, step = decode_step(engine, token_ids(engine, (batch, PROMPT)))
        print(line(f"decode step, batch {batch}", in_turns(args.key, args.limits, lambda: ms(step, args.calls),
                                                            args.rounds)), flush=True)
    for length in args.prompts:
        prompt = token_ids(engine, (1, length))

        def prefill():  # the prompt and its first token
            start = time.perf_counter()
            with torch.inference_mode():
                engine.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            return (time.perf_counter() - start) * 1e3
        print(line(f"prefill, {length} tokens", in_turns(args.key, args.limits, prefill, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
