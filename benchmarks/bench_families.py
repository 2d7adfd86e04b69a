"""HF eager against splice kernel-injected (and its compiled decode step) on model shapes of the families beyond Llama.

Random weights, built from transformers' config classes (nothing is downloaded), bf16, one process, rows side by
side: for each shape and batch size, HF eager ``generate``, then the same model injected, then its decode step
compiled. Decoder shapes:

    gpt2-124m     GPT-2 small (12 layers, hidden 768, 12 heads, vocab 50257, HF Conv1D, learned positions)
    pythia-410m   GPT-NeoX as Pythia-410M (24 layers, hidden 1024, 16 heads, rotary_pct 0.25, parallel residual)
    granite-135m  Granite in SmolLM2-135M's shape (30 layers, hidden 576, 9 / 3 heads) with Granite 3's multipliers

The injected rows run each family's decode as splice chooses (``splice info`` says how); ``--own-ops`` adds a row
with the native decode calls switched off (``SPLICE_NATIVE_LAYER=0``: each block's own ops), to show what they add.

Decode tokens/s (after the first token, over the batch) and prefill ms use ``splice.bench.time_generate`` (best of
``--repeat`` after a warm-up)::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_families.py                      # both shapes, batch 1 and 8
    PYTHONPATH=src .venv/bin/python benchmarks/bench_families.py --shapes gpt2-124m --batch 1 --threads 1
    PYTHONPATH=src .venv/bin/python benchmarks/bench_families.py --shapes granite-135m --batch 1 --threads 2 --own-ops
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = {
    "gpt2-124m": ("GPT2Config", dict(n_positions=1024)),
    "pythia-410m": ("GPTNeoXConfig", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                          intermediate_size=4096, vocab_size=50304, rotary_pct=0.25,
                                          use_parallel_residual=True, max_position_embeddings=2048)),
    "granite-135m": ("GraniteConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                           num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                           max_position_embeddings=2048, tie_word_embeddings=True,
                                           embedding_multiplier=12.0, attention_multiplier=0.015625,
                                           residual_multiplier=0.22, logits_scaling=2.0)),
}


def build(shape: str) -> torch.nn.Module:
    import transformers

    config_class, overrides = SHAPES[shape]
    config = getattr(transformers, config_class)(**overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


def run(shape: str, batch: int, prompt: int, new: int, repeat: int, own_ops: bool = False) -> list[dict]:
    import copy
    import os
    from unittest import mock

    import splice
    from splice.bench import time_generate

    model = build(shape)
    ids = torch.randint(100, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    rows = []
    prefill, tok_s, _ = time_generate(model.generate, ids, new, repeat)
    rows.append({"shape": shape, "batch": batch, "mode": "hf", "prefill_ms": prefill, "decode_tok_s": tok_s})
    if own_ops:
        with mock.patch.dict(os.environ, {"SPLICE_NATIVE_LAYER": "0"}):
            engine = splice.init_inference(copy.deepcopy(model), dtype=torch.bfloat16, replace_with_kernel_inject=True,
                                           max_out_tokens=prompt + new)
        prefill, tok_s, _ = time_generate(engine.generate, ids, new, repeat)
        rows.append({"shape": shape, "batch": batch, "mode": "inject, own ops", "prefill_ms": prefill,
                     "decode_tok_s": tok_s})
        del engine
    engine = splice.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True,
                                   max_out_tokens=prompt + new)
    prefill, tok_s, _ = time_generate(engine.generate, ids, new, repeat)
    rows.append({"shape": shape, "batch": batch, "mode": "inject", "prefill_ms": prefill, "decode_tok_s": tok_s})
    engine.runtime.compile_decode()
    prefill, tok_s, _ = time_generate(engine.generate, ids, new, repeat)
    rows.append({"shape": shape, "batch": batch, "mode": "inject+compile", "prefill_ms": prefill,
                 "decode_tok_s": tok_s})
    for row in rows:
        row["speedup"] = row["decode_tok_s"] / rows[0]["decode_tok_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--new", type=int, default=32, help="new tokens (default 32)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per row, best kept (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--own-ops", action="store_true",
                        help="add a row with the native decode calls off (SPLICE_NATIVE_LAYER=0)")
    parser.add_argument("--json", default="bench_out/families.json", help="where to write the results")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes {','.join(unknown)}: allowed values are {', '.join(SHAPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from splice import native

    native.available()  # build and load the native kernels before anything is timed
    rows = [row for shape in shapes for batch in args.batch
            for row in run(shape, batch, args.prompt, args.new, args.repeat, args.own_ops)]
    print(f"{'shape':<12} {'batch':>5} {'mode':<15} {'prefill ms':>10} {'decode tok/s':>12} {'vs HF':>6}")
    for row in rows:
        print(f"{row['shape']:<12} {row['batch']:>5} {row['mode']:<15} {row['prefill_ms']:>10.1f} "
              f"{row['decode_tok_s']:>12.2f} {row['speedup']:>5.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "prompt": args.prompt,
                                           "new": args.new, "rows": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
