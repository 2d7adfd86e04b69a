"""Decode speed of several formats of one model in one process, taking turns: one kernel-injected engine per format
(bf16, or a ``splice bench --quant`` scheme), each round every engine's ``generate`` once (the order reversed every
other round), ms a step between the new tokens' arrivals (the prefill left out). Per format: the median ms a step, its
tokens/s, and the median and range of the rounds' speed ratios to the first format. ``splice bench`` times its rows
one after another, so the host's bandwidth moving between rows moves their ratios; here each round's ratio sees one
state of the host. For the batch targets, at the level an AVX2-only CPU runs::

    SPLICE_NATIVE_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=src .venv/bin/python benchmarks/bench_format_turns.py \\
        --model llama-1b --formats bf16,int8,int4-sym --batch 8
"""
from __future__ import annotations

import argparse
import statistics

import torch

import splice
from splice.bench import load_model
from splice.cli_options import QUANT_SCHEMES

from bench_gemv_rates import at_least, positive  # argparse counts that name a bad value
from bench_step_vs_kernels import ms_per_token

#: formats besides ``splice bench``'s: DeepSpeed's q_groups=64 (groups of 32 inputs on llama-1b's 2048-wide inputs, of
#: 88 on its down projection's 5632, which the native kernels zero-pad to 96 columns)
MORE_SCHEMES = {"int8-q64": {"quant": {"enabled": True, "weight": {"num_bits": 8, "q_groups": 64}}}}
FORMATS = ("bf16",) + tuple(QUANT_SCHEMES) + tuple(MORE_SCHEMES)


def engine_for(model_name: str, fmt: str, max_out_tokens: int):
    """A kernel-injected engine of ``fmt`` on a bf16 copy of the model."""
    options = {} if fmt == "bf16" else {**QUANT_SCHEMES, **MORE_SCHEMES}[fmt]
    return splice.init_inference(load_model(model_name, "bf16"), replace_with_kernel_inject=True,
                                 max_out_tokens=max_out_tokens, **options)


def turns(engines: dict, prompt: torch.Tensor, new: int, rounds: int) -> dict[str, list[float]]:
    """{format: ms a step per round}: every engine once a round (warmed up first), the order reversed every other
    round."""
    names = list(engines)
    times: dict[str, list[float]] = {name: [] for name in names}
    with torch.inference_mode():
        for name in names:
            ms_per_token(engines[name], prompt, min(new, 4))
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                times[name].append(ms_per_token(engines[name], prompt, new))
    return times


def summary(times: dict[str, list[float]], batch: int) -> list[tuple[str, float, float, float, float, float]]:
    """Per format: (name, median ms a step, tokens/s over the batch, and the median, least and greatest of the rounds'
    speed ratios to the first format's)."""
    first = next(iter(times.values()))
    rows = []
    for name, ms in times.items():
        ratios = [base / own for base, own in zip(first, ms)]
        median = statistics.median(ms)
        rows.append((name, median, batch * 1e3 / median, statistics.median(ratios), min(ratios), max(ratios)))
    return rows


def formats_of(text: str) -> list[str]:
    chosen = [f for f in text.split(",") if f]
    bad = [f for f in chosen if f not in FORMATS]
    if bad or len(chosen) < 2 or len(set(chosen)) != len(chosen):
        raise argparse.ArgumentTypeError(f"{text!r}: two or more different formats of {', '.join(FORMATS)}")
    return chosen


def add_turn_arguments(parser: argparse.ArgumentParser, batch: int) -> None:
    """The run's sizes: ``--batch``, ``--prompt``, ``--new``, ``--rounds``, ``--threads``."""
    parser.add_argument("--batch", type=positive, default=batch)
    parser.add_argument("--prompt", type=positive, default=32)
    parser.add_argument("--new", type=at_least(3), default=24, help="new tokens a generate call")
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--threads", type=positive, default=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b", help="as splice bench: a name, folder or llama-1b")
    parser.add_argument("--formats", type=formats_of, default=formats_of("bf16,int8,int4-sym"),
                        help=f"comma-separated, the first the others are compared with; of {', '.join(FORMATS)}")
    add_turn_arguments(parser, batch=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {fmt: engine_for(args.model, fmt, args.prompt + args.new) for fmt in args.formats}
    prompt = torch.randint(100, 1000, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    times = turns(engines, prompt, args.new, args.rounds)
    print(f"{args.model}, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, {args.rounds} rounds, "
          f"{args.threads} threads")
    print(f"{'format':<10} {'ms a step':>10} {'tok/s':>9} {'x ' + args.formats[0]:>10} {'range':>13}")
    for name, ms, tok_s, ratio, low, high in summary(times, args.batch):
        print(f"{name:<10} {ms:>10.2f} {tok_s:>9.1f} {ratio:>9.3f}x {low:>6.3f}-{high:.3f}x")


if __name__ == "__main__":
    main()
