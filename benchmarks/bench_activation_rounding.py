"""What rounding the activations costs on the decode path, with its uncertainty: SmolLM2-135M-Instruct, each scheme's
weights once with splice's integer dot products (activations rounded per row and block) and once with float products
(``SPLICE_NATIVE_DOT=0``), every token run as a decode step through the KV cache so every GEMV call has one row per
window, over many windows of the licence texts this machine has.

The perplexity difference between two computations this close swings by more than the +0.3 % budget from one
512-token text to another; what tells a real cost from that swing is the number of windows. Printed per scheme: the
mean KL divergence of the next-token distribution (float products || integer), and the perplexity change with a 95 %
interval from the spread of the windows' mean log-likelihood differences (each window is one sample)::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_activation_rounding.py
    PYTHONPATH=src .venv/bin/python benchmarks/bench_activation_rounding.py --schemes int8 --windows 96
"""
from __future__ import annotations

import argparse
import copy
import glob
import math
import os
import statistics
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from splice import native
from splice.kernel_choice import dot_products
from splice.models import load
from splice.quant import QuantConfig, QuantizedLinear, quantize

from bench_gemv_rates import at_least  # argparse counts that name a bad value

SCHEMES = {
    "int8": QuantConfig(),
    "int8-g64": QuantConfig(group_size=64),
    "int4-g32-asym": QuantConfig(bits=4, group_size=32, symmetric=False),
    "int4-g32-sym": QuantConfig(bits=4, group_size=32, symmetric=True),
}
LICENCES = Path("/usr/share/common-licenses")


def licence_texts(min_bytes: int = 6_000) -> list[str]:
    """Every distinct licence text of ``min_bytes`` or more the OS or Python installed."""
    paths = sorted(LICENCES.glob("*")) + sorted(map(Path, glob.glob(
        sysconfig.get_paths()["purelib"] + "/*.dist-info/LICEN[CS]E*")))
    texts: list[str] = []
    for path in paths:
        if path.is_file() and not path.is_symlink() and path.stat().st_size >= min_bytes:
            text = path.read_text(encoding="utf-8", errors="ignore")
            if text not in texts:
                texts.append(text)
    return texts


def windows(tokenizer, texts: list[str], length: int, count: int) -> torch.Tensor:
    """Up to ``count`` windows of ``length`` tokens ``[count, length]``, taken from the texts in turn (the first window
    of every text, then the second, ...), none overlapping."""
    per_text = [tokenizer(text, return_tensors="pt").input_ids[0] for text in texts]
    by_text = [ids[:ids.numel() // length * length].view(-1, length) for ids in per_text]
    interleaved = [chunks[i] for i in range(max((len(c) for c in by_text), default=0))
                   for chunks in by_text if i < len(chunks)]
    return torch.stack(interleaved[:count]) if interleaved else torch.empty(0, length, dtype=torch.long)


def decode_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """``[batch, length - 1, vocab]`` float32 next-token log-probabilities, one token per forward through the KV
    cache."""
    out, cache = [], None
    with torch.no_grad():
        for i in range(ids.shape[1] - 1):
            step = model(ids[:, i:i + 1], cache=cache, use_cache=True)
            cache = step.cache
            out.append(torch.log_softmax(step.logits[:, -1].float(), -1))
    return torch.stack(out, 1)


def quantized(model, config: QuantConfig, integer_products: bool):
    """A quantized copy of ``model`` whose linears take the integer dot products or the float ones (the layers choose
    when built, from ``SPLICE_NATIVE_DOT``, which is set for that and then restored)."""
    before = os.environ.get("SPLICE_NATIVE_DOT")
    os.environ["SPLICE_NATIVE_DOT"] = "1" if integer_products else "0"
    try:
        copied = copy.deepcopy(model)
        quantize(copied, config)
        return copied
    finally:
        if before is None:
            del os.environ["SPLICE_NATIVE_DOT"]
        else:
            os.environ["SPLICE_NATIVE_DOT"] = before


class ExactProduct(nn.Module):
    """A quantized linear's weight multiplied exactly: de-quantised to float32 once, x widened to float32 each call,
    the result rounded back to x's dtype."""

    def __init__(self, linear: QuantizedLinear):
        super().__init__()
        self.weight = linear.dequantize().float()
        self.bias = None if linear.bias is None else linear.bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


def exact(model, config: QuantConfig):
    """A copy of ``model`` with ``config``'s quantized weights, each multiplied exactly (:class:`ExactProduct`)."""
    copied = quantized(model, config, False)
    for name, module in list(copied.named_modules()):
        if isinstance(module, QuantizedLinear):
            parent, _, child = name.rpartition(".")
            setattr(copied.get_submodule(parent), child, ExactProduct(module))
    return copied


def measure(model, config: QuantConfig, ids: torch.Tensor, batch: int, reference: str = "float"
            ) -> tuple[float, list[float]]:
    """(mean KL(reference || integer) per position, each window's mean log-likelihood loss of the integer products
    against the reference, in nats): ``reference`` "float" the same weights on float products, "exact" multiplied
    exactly in float32 (:func:`exact`)."""
    base = exact(model, config) if reference == "exact" else quantized(model, config, False)
    return compare(base, quantized(model, config, True), ids, batch)


def compare(reference, model, ids: torch.Tensor, batch: int) -> tuple[float, list[float]]:
    """(mean KL(reference || model) per position, each window's mean log-likelihood loss of ``model`` against the
    reference, in nats), ``batch`` windows decoded at a time."""
    kl_sum, positions, losses = 0.0, 0, []
    for start in range(0, ids.shape[0], batch):
        rows = ids[start:start + batch]
        p, q = decode_log_probs(reference, rows), decode_log_probs(model, rows)
        kl_sum += float((p.exp() * (p - q)).sum())
        positions += p.shape[0] * p.shape[1]
        targets = rows[:, 1:, None]
        loss = p.gather(-1, targets).squeeze(-1) - q.gather(-1, targets).squeeze(-1)
        losses.extend(loss.mean(1).tolist())
    return kl_sum / positions, losses


def interval(losses: list[float]) -> tuple[float, float, float]:
    """The perplexity change the mean loss gives, and its 95 % interval from the windows' spread."""
    mean = statistics.fmean(losses)
    half = 1.96 * statistics.stdev(losses) / math.sqrt(len(losses)) if len(losses) > 1 else float("nan")
    return math.expm1(mean), math.expm1(mean - half), math.expm1(mean + half)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default="int8,int8-g64,int4-g32-asym",
                        help=f"comma-separated, from: {', '.join(SCHEMES)}")
    parser.add_argument("--windows", type=at_least(2), default=48, help="windows of licence text")
    parser.add_argument("--tokens", type=at_least(2), default=256, help="tokens a window")
    parser.add_argument("--batch", type=at_least(1), default=8,
                        help="windows decoded side by side (each GEMV call then has this many rows; int4's integer "
                             "GEMV takes up to 15 at the avx512 level)")
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--reference", choices=("float", "exact"), default="float",
                        help="what the integer products are measured against: the same weights on float products "
                             "(SPLICE_NATIVE_DOT=0), or multiplied exactly in float32")
    parser.add_argument("--exact", action="store_true",
                        help="also each scheme's float products, and the bf16 model, against its weights multiplied "
                             "exactly in float32 (how far the float reference itself moves)")
    args = parser.parse_args()
    schemes = args.schemes.split(",")
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        parser.error(f"unknown scheme(s) {', '.join(unknown)}; allowed: {', '.join(SCHEMES)}")
    if not dot_products():
        raise SystemExit("splice's native integer dot products do not run here (no native kernels, or "
                         "SPLICE_NATIVE_DOT=0)")
    torch.set_num_threads(args.threads)
    model, tokenizer = load("smollm2-135m-instruct")
    model = model.to(torch.bfloat16).eval()
    texts = licence_texts()
    ids = windows(tokenizer, texts, args.tokens, args.windows)
    print(f"SmolLM2-135M-Instruct, level {native.isa()}: {ids.shape[0]} windows of {args.tokens} tokens from "
          f"{len(texts)} licence texts, {ids.shape[0] * (args.tokens - 1)} positions, {args.batch} windows a batch")
    for scheme in schemes:
        kl, losses = measure(model, SCHEMES[scheme], ids, args.batch, args.reference)
        change, low, high = interval(losses)
        print(f"{scheme}: KL({args.reference} products || integer) {kl:.5f}, perplexity {change:+.3%} "
              f"(95 % interval {low:+.3%} to {high:+.3%})", flush=True)
        if args.exact:
            reference = exact(model, SCHEMES[scheme])
            for name, other in (("integer products", quantized(model, SCHEMES[scheme], True)),
                                ("float products", quantized(model, SCHEMES[scheme], False)), ("bf16 model", model)):
                kl, losses = compare(reference, other, ids, args.batch)
                change, low, high = interval(losses)
                print(f"  {name} against the exact product: KL {kl:.5f}, perplexity {change:+.3%} "
                      f"(95 % interval {low:+.3%} to {high:+.3%})", flush=True)


if __name__ == "__main__":
    main()
