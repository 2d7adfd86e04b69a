"""One decode step, side by side and interleaved: HF eager (DynamicCache) vs splice's injected step vs the weights'
bare GEMVs (the bandwidth floor). Interleaving round by round makes the ratios trustworthy on a shared machine.

    python benchmarks/decode_step.py --dtype bf16 --threads 1 --json decode_step.json
    python benchmarks/decode_step.py --dtype bf16 --compile    # adds the compiled step (compile_decode=True)
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import splice
from splice.bench import load_model
from splice.generation import prefill_positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="as splice bench: a name, folder or llama-1b")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--compile", action="store_true", help="also time the compiled step (compile_decode=True)")
    parser.add_argument("--json", default="decode_step.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reference = load_model(args.model, args.dtype)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True,
                                   max_out_tokens=args.prompt + 8)
    steps = {"gemv": gemv_step(reference), "hf": hf_step(reference, args.prompt),
             "splice": splice_step(engine.runtime, args.prompt)}
    if args.compile:
        compiled = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True,
                                         compile_decode=True, max_out_tokens=args.prompt + 8)
        steps["splice_compiled"] = splice_step(compiled.runtime, args.prompt)
        start = time.perf_counter()
        with torch.inference_mode():
            steps["splice_compiled"]()
        compile_s = time.perf_counter() - start
    best = {name: float("inf") for name in steps}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                best[name] = min(best[name], time.perf_counter() - start)
    result = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "best_ms": {k: round(v * 1e3, 2) for k, v in best.items()},
              "splice_speedup_over_hf": round(best["hf"] / best["splice"], 3)}
    if args.compile:
        result["compiled_speedup_over_hf"] = round(best["hf"] / best["splice_compiled"], 3)
        result["first_compiled_step_s"] = round(compile_s, 1)
    print(json.dumps(result, indent=2))
    with open(args.json, "w") as out:
        json.dump(result, out, indent=2)


def prompt_ids(length: int) -> torch.Tensor:
    return torch.randint(100, 30000, (1, length), generator=torch.Generator().manual_seed(0))


def gemv_step(model):
    """Every weight matrix a decode step reads, times one vector: no attention, norms or Python."""
    weights = [p for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name]
    weights.append(model.get_output_embeddings().weight)
    inputs = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights]
    return lambda: [F.linear(x, w) for x, w in zip(inputs, weights)]


def hf_step(model, prompt: int):
    ids = prompt_ids(prompt)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    token, position = torch.tensor([[5]]), torch.tensor([[prompt]])

    def step():
        model(token, cache=cache, use_cache=True, position_ids=position)
        cache.crop(-1)
    return step


def splice_step(runtime, prompt: int):
    ids = prompt_ids(prompt)
    mask = torch.ones_like(ids)
    cache = runtime.cache_for(1)
    cache.start(mask)
    with torch.inference_mode():
        runtime.forward(ids, prefill_positions(mask), cache.slot_ids[:prompt], cache, prompt)
    token, position, slot = torch.tensor([[5]]), torch.tensor([[prompt]]), torch.tensor([prompt])
    cache.mark(slot)
    return lambda: runtime.decode_step(token, position, slot, cache, prompt + 1)


if __name__ == "__main__":
    main()
