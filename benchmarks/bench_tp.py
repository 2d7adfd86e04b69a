"""Tensor-parallel benchmark: a TinyLlama-shaped 1.1B llama (random weights) saved as safetensors, then

* tp=1 (one process, 2 threads): meta model + splice's streaming checkpoint load, peak RSS, decode tokens/s;
* tp=2 (torchrun, 1 thread per rank): meta model + per-rank slice loading, peak RSS per rank, parameter bytes per
  rank / whole model, decode tokens/s (greedy; both ranks produce the same tokens, checked).

    python benchmarks/bench_tp.py                     # everything; writes benchmarks/results/bench_tp.json
    python benchmarks/bench_tp.py --layers 4          # a quicker, smaller run (same shapes per layer)

The checkpoint is cached in $SPLICE_BENCH_DIR (default /tmp/splice-bench). Peak RSS is ru_maxrss after loading
(before decoding), so it measures loading, not the decode working set.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)


def config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, **TINYLLAMA)


def prepare(folder: Path, layers: int, dtype: torch.dtype) -> Path:
    """Random weights (small normal, so activations stay finite) saved as one safetensors folder; cached."""
    from transformers import AutoModelForCausalLM

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config(layers), dtype=dtype)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(folder, max_shard_size="100GB")
    return folder


def meta_model(layers: int, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config(layers), dtype=dtype).eval()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(tp: int, folder: Path, layers: int, dtype: torch.dtype):
    """The model with its weights: tp=1 through splice's checkpoint loader, tp>1 through the shard step."""
    model = meta_model(layers, dtype)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if tp == 1:
        from splice.checkpoint import load_checkpoint

        return load_checkpoint(model, folder, "cpu", progress=False), total
    from splice.config import resolve_config
    from splice.distributed import build_parallel_context
    from splice.plan import resolve
    from splice.steps import Stage
    from splice.steps.shard import shard

    cfg = resolve_config({"tensor_parallel": {"tp_size": tp}, "checkpoint": str(folder)})
    plan = resolve(cfg, model, build_parallel_context(cfg, "cpu"), torch.device("cpu"))
    return shard(Stage(model), plan)[0].model, total


def decode(model, prompt: int, new_tokens: int) -> dict:
    """Greedy decode timed after a warm-up; tokens/s over the decode steps only (prefill subtracted)."""
    ids = torch.randint(3, 1000, (1, prompt), generator=torch.Generator().manual_seed(1))
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, **kwargs)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    return {"prefill_s": prefill, "decode_tok_s": (new_tokens - 1) / (total - prefill),
            "tokens": out[0, prompt:].tolist()}


def worker(args) -> None:
    """One rank (or the single process): load, measure, decode; print one JSON line."""
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    model, total = load(args.tp, Path(args.folder), args.layers, dtype)
    load_s = time.perf_counter() - start
    rss = peak_rss_mib()
    local = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    result = {"tp": args.tp, "rank": int(os.environ.get("RANK", 0)), "threads": args.threads, "load_s": load_s,
              "peak_rss_mib": rss, "param_mib": local / 2**20, "param_ratio": local / total,
              **decode(model, args.prompt, args.new_tokens)}
    print("RESULT " + json.dumps(result), flush=True)


def launch(args, tp: int, threads: int) -> list[dict]:
    base = ["--worker", f"--tp={tp}", f"--threads={threads}", f"--folder={args.folder}", f"--layers={args.layers}",
            f"--dtype={args.dtype}", f"--prompt={args.prompt}", f"--new-tokens={args.new_tokens}"]
    script = str(Path(__file__).resolve())
    cmd = [sys.executable, script, *base] if tp == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp}", script, *base]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "SPLICE_DIST_TIMEOUT_S": "600"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return sorted((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")),
                  key=lambda r: r["rank"])


def plot(summary: dict, path: Path) -> None:
    """Peak RSS and decode tokens/s per process, side by side (needs the ``plot`` extra: matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install splice[plot]); no plot written")
        return
    runs = [summary["tp1"], *summary["tp2"]]
    labels = [f"tp={r['tp']} rank {r['rank']}" for r in runs]
    fig, (rss, speed) = plt.subplots(1, 2, figsize=(9, 3.5))
    rss.bar(labels, [r["peak_rss_mib"] for r in runs])
    rss.set_ylabel("peak RSS after loading (MiB)")
    speed.bar(labels, [r["decode_tok_s"] for r in runs])
    speed.set_ylabel("decode tokens/s")
    fig.suptitle(summary["model"])
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--folder", default=None)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_tp.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    base = Path(os.environ.get("SPLICE_BENCH_DIR", "/tmp/splice-bench"))
    args.folder = args.folder or str(base / f"llama-1b-{args.layers}l-{args.dtype}")
    prepare(Path(args.folder), args.layers, getattr(torch, args.dtype))
    tp1 = launch(args, 1, 2)[0]
    tp2 = launch(args, 2, 1)
    summary = {
        "model": f"TinyLlama shape, {args.layers} layers, {args.dtype}, random weights", "tp1": tp1, "tp2": tp2,
        "rss_ratio_per_rank": [r["peak_rss_mib"] / tp1["peak_rss_mib"] for r in tp2],
        "param_ratio_per_rank": [r["param_ratio"] for r in tp2],
        "decode_speedup": min(r["decode_tok_s"] for r in tp2) / tp1["decode_tok_s"],
        "same_tokens": all(r["tokens"] == tp1["tokens"] for r in tp2),
        "machine": f"{os.cpu_count()} CPUs", "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    plot(summary, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("tp1", "tp2")}, indent=1))
    for r in [tp1, *tp2]:
        print(f"tp={r['tp']} rank {r['rank']}: load {r['load_s']:.1f}s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
              f"params {r['param_mib']:.0f} MiB ({r['param_ratio']:.3f}x), decode {r['decode_tok_s']:.2f} tok/s")


if __name__ == "__main__":
    main()
