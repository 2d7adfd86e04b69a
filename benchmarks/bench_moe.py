"""A mixture of experts decoding: the bf16 model as transformers runs it against splice's engines, in turns.

Random weights of a Mixtral shape scaled down (``MixtralConfig`` with the sizes below; nothing is downloaded), one
process. Every row is ``splice.init_inference`` of its own bf16 copy of the model in one format and mode: ``plain``
without kernel injection (``plain:bf16`` is the model as transformers runs it), ``inject`` with it (fused attention
blocks, splice's decode loop; each layer's own mixture of experts); the quantized formats replace the linears and each
expert's matrices by quantized layers (``splice.quant.experts``). The rows take turns (``bench_format_turns.turns``);
the table gives each one's median ms a step and its speed ratio to the first row's, round by round::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_moe.py              # plain and inject; bf16, int8, int4-sym
    PYTHONPATH=src .venv/bin/python benchmarks/bench_moe.py --modes plain --formats bf16,int8 --batch 4 --layers 8
    PYTHONPATH=src .venv/bin/python benchmarks/bench_moe.py --experts 64 --per-token 8 --features 384  # many small
"""
from __future__ import annotations

import argparse

import torch

import splice
from splice.cli_options import QUANT_SCHEMES

from bench_format_turns import FORMATS, MORE_SCHEMES, add_turn_arguments, formats_of, summary, turns
from bench_gemv_rates import at_least, positive


def build(hidden: int, features: int, experts: int, layers: int, vocab: int, per_token: int = 2) -> torch.nn.Module:
    """A random Mixtral of these sizes in bf16 (heads of 64, a quarter as many key/value heads, ``per_token`` experts
    a token)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    heads = max(1, hidden // 64)
    config = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=features, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), num_local_experts=experts,
                           num_experts_per_tok=per_token, max_position_embeddings=4096)
    torch.manual_seed(0)
    return MixtralForCausalLM(config).to(torch.bfloat16).eval()


MODES = ("plain", "inject")


def engine_for(model: torch.nn.Module, mode: str, fmt: str):
    options = {"dtype": "bf16"} if fmt == "bf16" else {**QUANT_SCHEMES, **MORE_SCHEMES}[fmt]
    return splice.init_inference(model, replace_with_kernel_inject=mode == "inject", **options)


def modes_of(text: str) -> list[str]:
    """An argparse type: comma-separated modes of :data:`MODES`, else an error naming the value."""
    modes = text.split(",")
    if not modes or any(mode not in MODES for mode in modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct modes of {', '.join(MODES)}")
    return modes


def weight_mib(engine) -> float:
    """MiB of the engine's parameters and buffers (the quantized layers hold their weights as buffers)."""
    tensors = {id(t): t for t in [*engine.module.parameters(), *engine.module.buffers()]}
    return sum(t.nbytes for t in tensors.values()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", type=formats_of, default=formats_of("bf16,int8,int4-sym"),
                        help=f"comma-separated, the first the others are compared with; of {', '.join(FORMATS)}")
    parser.add_argument("--hidden", type=at_least(64), default=1024)
    parser.add_argument("--features", type=at_least(64), default=2816, help="each expert's intermediate size")
    parser.add_argument("--experts", type=at_least(2), default=8)
    parser.add_argument("--per-token", type=positive, default=2, help="experts a token is routed to")
    parser.add_argument("--layers", type=positive, default=4)
    parser.add_argument("--vocab", type=at_least(128), default=32000)
    parser.add_argument("--modes", type=modes_of, default=modes_of("plain,inject"),
                        help="comma-separated: plain (no kernel injection), inject")
    add_turn_arguments(parser, batch=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [(mode, fmt) for mode in args.modes for fmt in args.formats]
    sizes = (args.hidden, args.features, args.experts, args.layers, args.vocab, args.per_token)
    engines = {f"{mode}:{fmt}": engine_for(build(*sizes), mode, fmt) for mode, fmt in rows}
    prompt = torch.randint(100, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    times = turns(engines, prompt, args.new, args.rounds)
    print(f"Mixtral shape: hidden {args.hidden}, {args.experts} experts of {args.features} features "
          f"({args.per_token} a token), "
          f"{args.layers} layers, vocab {args.vocab}; batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
          f"{args.rounds} rounds, {args.threads} threads")
    first = next(iter(engines))
    print(f"{'row':<16} {'MiB':>8} {'ms a step':>10} {'tok/s':>9} {'x ' + first:>16} {'range':>13}")
    for name, ms, tok_s, ratio, low, high in summary(times, args.batch):
        print(f"{name:<16} {weight_mib(engines[name]):>8.0f} {ms:>10.2f} {tok_s:>9.1f} {ratio:>15.3f}x "
              f"{low:>6.3f}-{high:.3f}x")


if __name__ == "__main__":
    main()
