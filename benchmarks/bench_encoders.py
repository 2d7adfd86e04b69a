"""HF eager against splice kernel-injected on an encoder: sequences per second of a forward over a padded batch.

Random weights of BERT-base's shape (``BertConfig()``'s defaults: 12 layers, hidden 768, 12 heads, FFN 3072, vocab
30522), built from the config class (nothing is downloaded), one process, rows side by side: the model as
transformers runs it (its default attention, SDPA), then the same model with its layers fused by
``init_inference(replace_with_kernel_inject=True)``. Each row is the best of ``--repeat`` timings of ``--iters``
forwards after one warm-up forward, the two models' timings taking turns (so both meet the same machine load); the
batch holds full-length rows and, with ``--padded``, rows of decreasing length (a tokenizer's right padding), which
both paths must mask::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_encoders.py                      # bf16, batch 8, length 128
    PYTHONPATH=src .venv/bin/python benchmarks/bench_encoders.py --dtype fp32,bf16 --task masked_lm --threads 1
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

TASKS = {"base": "BertModel", "masked_lm": "BertForMaskedLM",
         "sequence_classification": "BertForSequenceClassification"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(task: str, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, TASKS[task])(transformers.BertConfig()).to(dtype).eval()


def inputs(batch: int, length: int, vocab: int, padded: bool) -> dict[str, torch.Tensor]:
    """Token ids and attention mask; with ``padded`` row i keeps ``length - i * length // (2 * batch)`` tokens."""
    ids = torch.randint(1000, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        for row in range(batch):
            mask[row, length - row * length // (2 * batch):] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def sequences_per_s(models: list, batch: dict[str, torch.Tensor], iters: int, repeat: int) -> list[float]:
    """Per model, the best of ``repeat`` timings of ``iters`` forwards after a warm-up, the models taking turns (a
    shared machine's best run is the least disturbed)."""
    best = [float("inf")] * len(models)
    with torch.inference_mode():
        for model in models:
            model(**batch)
        for _ in range(max(1, repeat)):
            for index, model in enumerate(models):
                start = time.perf_counter()
                for _ in range(iters):
                    model(**batch)
                best[index] = min(best[index], time.perf_counter() - start)
    return [iters * batch["input_ids"].shape[0] / seconds for seconds in best]


def run(task: str, dtype_name: str, batch: int, length: int, padded: bool, iters: int, repeat: int) -> list[dict]:
    import splice

    dtype = DTYPES[dtype_name]
    model = build(task, dtype)
    data = inputs(batch, length, model.config.vocab_size, padded)
    engine = splice.init_inference(copy.deepcopy(model), dtype=dtype, replace_with_kernel_inject=True)
    with torch.inference_mode():
        expected, got = model(**data)[0].float(), engine(**data)[0].float()
    real = data["attention_mask"].bool()
    error = float((expected[real] - got[real]).abs().max() / expected[real].std())
    rates = sequences_per_s([model, engine], data, iters, repeat)
    rows = [{"task": task, "dtype": dtype_name, "batch": batch, "length": length, "padded": padded, "mode": mode,
             "sequences_s": rate} for mode, rate in zip(("hf", "inject"), rates)]
    for row in rows:
        row["speedup"] = row["sequences_s"] / rows[0]["sequences_s"]
    rows[-1]["max_error_vs_hf"] = error  # scaled by the std of HF's output, on the real tokens
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="base", choices=sorted(TASKS), help="the head on BERT (default: base)")
    parser.add_argument("--dtype", default="bf16", help=f"comma-separated subset of {','.join(DTYPES)} (default bf16)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per forward (default 8)")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--padded", action="store_true", help="rows of decreasing length, right-padded")
    parser.add_argument("--iters", type=int, default=5, help="forwards per timing (default 5)")
    parser.add_argument("--repeat", type=int, default=3, help="timings per row, best kept (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", default="bench_out/encoders.json", help="where to write the results")
    args = parser.parse_args()
    dtypes = [d for d in args.dtype.split(",") if d]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"--dtype {','.join(unknown)}: allowed values are {', '.join(DTYPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from splice import native

    native.available()  # build and load the native kernels before anything is timed
    rows = [row for name in dtypes
            for row in run(args.task, name, args.batch, args.length, args.padded, args.iters, args.repeat)]
    print(f"{'task':<8} {'dtype':<5} {'batch':>5} {'length':>6} {'mode':<7} {'seq/s':>8} {'vs HF':>6}")
    for row in rows:
        print(f"{row['task']:<8} {row['dtype']:<5} {row['batch']:>5} {row['length']:>6} {row['mode']:<7} "
              f"{row['sequences_s']:>8.2f} {row['speedup']:>5.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
