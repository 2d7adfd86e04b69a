"""The compiled decode step with inductor's C++ wrapper (splice's default on CPU) against its Python wrapper: two
engines from one llama-1b-shaped model, compiled each way, taking turns; decode tok/s per round.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_compiled_wrapper.py --quant int4
"""
from __future__ import annotations

import argparse
import copy

import torch

import splice
from splice.bench import QUANT_SCHEMES, load_model

from bench_decode_attention import engine_options, time_contexts  # the same engines and turn-taking timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", choices=sorted(QUANT_SCHEMES), help="a splice bench --quant scheme (default bf16)")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("llama-1b", "bf16")
    options = engine_options(args.quant)
    engines = {}
    for wrapper in ("C++", "Python"):
        engine = splice.init_inference(copy.deepcopy(model), replace_with_kernel_inject=True,
                                       max_out_tokens=128 + args.new + 8, **options)
        engine.runtime.compile_decode(cpp_wrapper=wrapper == "C++")
        engines[wrapper] = engine
    del model
    with torch.inference_mode():
        speeds = time_contexts(engines, torch.randint(0, 32000, (1, 128)), args.new, args.rounds)
    for name, values in speeds.items():
        print(f"{name} wrapper: " + ", ".join(f"{v:.2f}" for v in values) + " tok/s")


if __name__ == "__main__":
    main()
