"""Kernel settings compared a token apart, in whole decode steps. Whole ``generate`` calls taking turns differ by more
from round to round than most kernel changes do (the host's read bandwidth moves within seconds); here one greedy,
streamed ``generate`` (one native call a token) switches between the kernel settings as they are and the ones
``--set`` names at every new token, so consecutive steps see the same state of the host. Each round prints the median
step time under each and their ratio (the changed settings' time over the others'), the tokens checked the same as
the first round's; the median of the rounds' ratios ends the run::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_setting_turns.py --set weight_streams=4
    PYTHONPATH=src .venv/bin/python benchmarks/bench_setting_turns.py --model llama-1b --quant int8 \
        --set work_stealing=0
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
from bench_two_builds import parse_setting  # NAME=VALUE of the settings both kernel builds share

PROMPT = 32


class SettingTurns:
    """A streamer that applies ``settings[0]`` or ``settings[1]`` (``{name: value}``, each set as ``set_<name>``) in
    turn after each token it is handed, and notes when each arrived: step i (between tokens i and i + 1) ran under
    ``settings[i % 2]``."""

    def __init__(self, ops, settings: tuple[dict, dict]):
        self.ops, self.settings = ops, settings
        self.arrivals: list[float] = []

    def apply(self, which: int) -> None:
        for name, value in self.settings[which].items():
            getattr(self.ops, f"set_{name}")(value)

    def put(self, _tokens) -> None:
        self.arrivals.append(time.perf_counter())
        self.apply((len(self.arrivals) - 1) % 2)  # the first put is the prompt's: step 0 follows it

    def end(self) -> None:
        self.apply(0)

    def step_times(self) -> tuple[list[float], list[float]]:
        """Seconds of the steps under each setting: the first put is the prompt's, the second the prefill's token,
        after which the steps alternate, changed first (that one left out: the first native call warms up)."""
        steps = [later - earlier for earlier, later in zip(self.arrivals[1:], self.arrivals[2:])]
        return steps[1::2], steps[2::2]


def current(ops, names) -> dict:
    """The present values of the settings ``names`` (``avx_vnni``'s getter is ``avx_vnni_ready``)."""
    return {name: getattr(ops, "avx_vnni_ready" if name == "avx_vnni" else name)() for name in names}


def one_round(engine, prompt: torch.Tensor, new: int, ops, changed: dict) -> tuple[float, float, torch.Tensor]:
    """Median step seconds under the settings as they are and under ``changed``, and the tokens."""
    turns = SettingTurns(ops, (current(ops, changed), changed))
    with torch.inference_mode():
        tokens = engine.generate(prompt, max_new_tokens=new, do_sample=False, streamer=turns)
    as_they_are, with_changes = turns.step_times()
    return statistics.median(as_they_are), statistics.median(with_changes), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quant", default="int4-sym", choices=("bf16",) + tuple(QUANT_SCHEMES))
    parser.add_argument("--set", type=parse_setting, action="append", required=True, metavar="NAME=VALUE")
    parser.add_argument("--rounds", type=at_least(1), default=6)
    parser.add_argument("--new", type=at_least(8), default=256, help="new tokens a generate call")
    parser.add_argument("--threads", type=at_least(1), default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = torch.ops.splice_kernels
    changed = dict(args.set)
    model = load_model(args.model, "bf16")
    options = {} if args.quant == "bf16" else QUANT_SCHEMES[args.quant]
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=PROMPT + args.new, **options)
    prompt = torch.randint(100, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    print(f"{args.model} {args.quant}, {args.threads} threads, {args.new} new tokens a round; as they are: "
          f"{current(ops, changed)}, changed: {changed}")
    ratios, first = [], None
    for index in range(args.rounds):
        base, with_changes, tokens = one_round(engine, prompt, args.new, ops, changed)
        first = tokens if first is None else first
        if not torch.equal(tokens, first):
            raise SystemExit(f"round {index}: the tokens differ from the first round's")
        ratios.append(with_changes / base)
        print(f"round {index}: as they are {base * 1e3:.3f} ms a step, changed {with_changes * 1e3:.3f} ms, "
              f"changed / as they are {ratios[-1]:.4f}")
    print(f"median time ratio, changed / as they are: {statistics.median(ratios):.4f}")


if __name__ == "__main__":
    main()
