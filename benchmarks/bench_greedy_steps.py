"""Greedy decoding's steps as native calls that do the loop's bookkeeping too (``runtime.greedy_steps``: positions,
slot, cache marks, the step, the pick, eos, the minimum length's eos ban) against ``generate``'s loop stepping itself,
in one process, in turns: ms a new token each way, the prefill left out.

Ways: ``streamed``, one native call a token (a streamer takes each); ``whole``, no streamer (16 tokens a call);
``loop``, the loop's own steps with ``min_new_tokens`` as ``splice bench`` asks (its eos ban is a processor there:
the pick goes through torch); ``loop-plain``, the loop's own steps without a minimum length (the native pick).
Streamed ways are timed between the streamer's puts; the others as the call's time less a one-token call's::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_greedy_steps.py --model smollm2-135m-instruct --quant int4-sym
    PYTHONPATH=src .venv/bin/python benchmarks/bench_greedy_steps.py --batch 4 --padded 8   # left-padded rows
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
from bench_step_vs_kernels import TokenTimes

WAYS = ("streamed", "whole", "loop", "loop-plain")


def ms_per_token(engine, prompt: torch.Tensor, new: int, way: str,
                 mask: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
    """``generate``'s ms a new token after the first (the prefill's) the ``way`` given, and its tokens; ``mask``:
    the prompt's attention mask (none: no padding)."""
    runtime = engine.runtime
    mask = torch.ones_like(prompt) if mask is None else mask
    options = dict(max_new_tokens=new, do_sample=False, attention_mask=mask)
    if way != "loop-plain":
        options["min_new_tokens"] = new
    offer = runtime.greedy_steps
    if way.startswith("loop"):
        runtime.greedy_steps = lambda *args: None  # the loop is offered no native greedy steps
    try:
        if way == "whole" or way.startswith("loop"):
            start = time.perf_counter()
            engine.generate(prompt, **{**options, "max_new_tokens": 1, "min_new_tokens": 1})
            first = time.perf_counter() - start
            start = time.perf_counter()
            out = engine.generate(prompt, **options)
            return (time.perf_counter() - start - first) / (out.shape[1] - prompt.shape[1] - 1) * 1e3, out
        streamer = TokenTimes()
        out = engine.generate(prompt, streamer=streamer, **options)
        return (streamer.times[-1] - streamer.times[1]) / (len(streamer.times) - 2) * 1e3, out
    finally:
        runtime.greedy_steps = offer


def left_padded(batch: int, length: int, padding: int) -> torch.Tensor | None:
    """The attention mask of ``batch`` prompts of ``length`` whose row r starts with r x ``padding`` pads; None
    without padding."""
    if not padding:
        return None
    columns = torch.arange(length)
    return (columns[None, :] >= padding * torch.arange(batch)[:, None]).long()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quant", default="int4-sym", choices=("bf16",) + tuple(QUANT_SCHEMES))
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--rounds", type=at_least(1), default=8)
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--prompt", type=at_least(1), default=64)
    parser.add_argument("--new", type=at_least(3), default=65, help="new tokens a generate call")
    parser.add_argument("--batch", type=at_least(1), default=1)
    parser.add_argument("--padded", type=at_least(0), default=0,
                        help="left padding of each row after the first: row r's first r x PADDED prompt tokens")
    args = parser.parse_args()
    ways = args.ways.split(",")
    if not ways or any(way not in WAYS for way in ways):
        parser.error(f"--ways {args.ways!r}: allowed, comma-separated: {', '.join(WAYS)}")
    mask = left_padded(args.batch, args.prompt, args.padded)
    if mask is not None and not mask.any(-1).all():
        parser.error(f"--padded {args.padded}: row {args.batch - 1} would be all padding; allowed: "
                     f"(batch - 1) x padded < prompt ({args.prompt})")
    torch.set_num_threads(args.threads)
    options = {} if args.quant == "bf16" else QUANT_SCHEMES[args.quant]
    engine = splice.init_inference(load_model(args.model, "bf16"), replace_with_kernel_inject=True,
                                   max_out_tokens=args.prompt + args.new, **options)
    prompt = torch.randint(100, 1000, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {way: [] for way in ways}
    with torch.inference_mode():
        engine.generate(prompt, max_new_tokens=4, do_sample=False)  # warm
        for r in range(args.rounds):
            tokens = {}
            for way in ways:
                ms, tokens[way] = ms_per_token(engine, prompt, args.new, way, mask)
                times[way].append(ms)
            same = {way for way in ways if way != "loop-plain"}  # a minimum length may change the tokens
            if len({tuple(tokens[way].flatten().tolist()) for way in same}) > 1:
                raise SystemExit("the ways gave different tokens")
            print(f"round {r}: " + ", ".join(f"{way} {times[way][-1]:.3f}" for way in ways) + " ms a token",
                  flush=True)
    base = ways[-1]
    padding = f", rows left-padded by {args.padded} more each" if args.padded else ""
    print(f"{args.model} {args.quant}, batch {args.batch}{padding}, {args.threads} threads, ms a token (median of "
          f"{args.rounds}; speedup over {base}: median of the rounds' ratios, range):")
    for way in ways:
        ratios = [b / a for a, b in zip(times[way], times[base])]
        print(f"  {way:10s} {statistics.median(times[way]):8.3f}  {statistics.median(ratios):.3f}x "
              f"({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
