"""Decode GEMVs with one of their read settings on and off: one, two and four weight streams per thread (``--compare
streams``, the default; ``native.use_weight_streams``), or static shares against threads taking each other's last
pieces (``--compare stealing``; ``native.use_work_stealing``), or a software prefetch in every GEMV against none
(``--compare prefetch``; ``native.use_software_prefetch``). First the kernels alone at one and two threads and one
and two rows (GB/s of weights read; the weights on 2 MiB pages, as a kernel-injected model's), then one engine per
format (``--model``, llama-1b by default), its decode step
compiled; the two settings take turns within each round; decode tok/s per round.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_weight_streams.py --quant int4-sym,int4,int8
    PYTHONPATH=src .venv/bin/python benchmarks/bench_weight_streams.py --compare stealing --model smollm2-135m-instruct
    PYTHONPATH=src .venv/bin/python benchmarks/bench_weight_streams.py --compare prefetch --quant bf16,int8,int4-sym
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import splice
from splice import native
from splice.bench import QUANT_SCHEMES, load_model
from splice.native.memory import gather_on_huge_pages

from bench_decode_attention import engine_options, time_contexts  # the same engines and turn-taking timing

#: llama-1b's decode GEMV shapes (out, in): fused q/k/v, o, fused gate/up, down.
LAYER_SHAPES = ((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632))


#: What --compare sets: (the setting's context manager, {label: value}, the baseline first).
SETTINGS = {
    "streams": (native.use_weight_streams, {"1 stream": 1, "2 streams": 2, "4 streams": 4}),
    "stealing": (native.use_work_stealing, {"static shares": False, "stealing": True}),
    "prefetch": (native.use_software_prefetch, {"prefetch": True, "no prefetch": False}),
}


class WithSetting:
    """An engine whose ``generate`` runs inside ``setting(value)``."""

    def __init__(self, engine, setting, value):
        self.engine, self.setting, self.value = engine, setting, value

    def generate(self, *args, **kwargs):
        with self.setting(self.value):
            return self.engine.generate(*args, **kwargs)


def model_rounds(name: str, schemes: list[str], new: int, rounds: int, compare: str = "streams") -> None:
    setting, values = SETTINGS[compare]
    labels = list(values)
    model = load_model(name, "bf16")
    vocab = model.config.vocab_size
    for scheme in schemes:
        engine = splice.init_inference(copy.deepcopy(model), replace_with_kernel_inject=True,
                                       max_out_tokens=128 + new + 8, compile_decode=True, **engine_options(scheme))
        engines = {label: WithSetting(engine, setting, value) for label, value in values.items()}
        with torch.inference_mode():
            speeds = time_contexts(engines, torch.randint(0, vocab, (1, 128)), new, rounds)
        best = {name: max(values) for name, values in speeds.items()}
        print(f"{scheme}: " + "; ".join(f"{name} " + ", ".join(f"{v:.2f}" for v in values) + " tok/s"
                                      for name, values in speeds.items()) + "; best against the first: "
              + ", ".join(f"{name} {best[name] / best[labels[0]]:.2f}x" for name in labels[1:]), flush=True)
        del engine, engines


def int4_layers(layers: int) -> list[tuple[int, torch.Tensor]]:
    """(in features, tiles) of ``layers`` llama-1b layers' random symmetric g32 int4 weights, in the native tiles
    (which hold each group's scales, alone, beside its codes)."""
    weights = []
    for n, k in LAYER_SHAPES * layers:
        q, scales = torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.randn(k // 32, n, 2).bfloat16()
        scales[..., 1] = 0
        weights.append((k, native.int4_tile_pack(q, scales)))
    return weights


def int8_layers(layers: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(in features, weight, per-channel scales) of ``layers`` llama-1b layers' random int8 weights."""
    return [(k, torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16())
            for n, k in LAYER_SHAPES * layers]


def kernel_rounds(rows: int, rounds: int = 6, compare: str = "streams") -> None:
    """int4 (symmetric g32), int8 and bf16 decode GEMVs over 11, 6 and 3 layers' worth of llama-1b weights, on 2 MiB
    pages where Linux grants them."""
    torch.manual_seed(0)
    int4, int8 = int4_layers(11), int8_layers(6)
    bf16 = [(k, torch.randn(n, k).bfloat16()) for n, k in LAYER_SHAPES * 3]
    gather_on_huge_pages([t for _, *tensors in int4 + int8 + bf16 for t in tensors])
    x = {k: torch.randn(rows, k).bfloat16() for k in (2048, 5632)}
    kernels = {
        "int4_dot_gemv": (lambda: [torch.ops.splice_kernels.int4_dot_gemv(x[k], w, 32) for k, w in int4],
                          sum(w.nbytes for _, w in int4)),
        "int8_dot_gemv": (lambda: [torch.ops.splice_kernels.int8_dot_gemv(x[k], w, s) for k, w, s in int8],
                          sum(w.nbytes + s.nbytes for _, w, s in int8)),
        "bf16_gemv": (lambda: [torch.ops.splice_kernels.bf16_gemv(x[k], w) for k, w in bf16],
                      sum(w.nbytes for _, w in bf16)),
    }
    setting, values = SETTINGS[compare]
    labels = list(values)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, (call, nbytes) in kernels.items():
            best = dict.fromkeys(labels, float("inf"))
            for round_ in range(rounds):
                for label in (labels if round_ % 2 else labels[::-1]):
                    with setting(values[label]):
                        start = time.perf_counter()
                        call()
                        best[label] = min(best[label], time.perf_counter() - start)
            print(f"{name}, {rows} row(s), {threads} thread(s): "
                  + ", ".join(f"{label} {nbytes / best[label] / 1e9:.1f} GB/s" for label in labels)
                  + "; against the first: " + ", ".join(f"{label} {best[labels[0]] / best[label]:.2f}x"
                                                        for label in labels[1:]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="int4-sym,int4,int8",
                        help=f"comma-separated splice bench --quant schemes, or bf16 ({', '.join(QUANT_SCHEMES)})")
    parser.add_argument("--model", default="llama-1b", help="as splice bench --model (default llama-1b)")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare", choices=sorted(SETTINGS), default="streams",
                        help="the setting taken on and off (default streams)")
    parser.add_argument("--kernels-only", action="store_true", help="skip the whole-model rounds")
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("needs splice's native kernels")
    schemes = [s.strip() for s in args.quant.split(",") if s.strip()]
    bad = [s for s in schemes if s != "bf16" and s not in QUANT_SCHEMES]
    if bad:
        raise SystemExit(f"--quant {','.join(bad)}: allowed bf16, {', '.join(QUANT_SCHEMES)}")
    for rows in (1, 2):
        kernel_rounds(rows, compare=args.compare)
    if not args.kernels_only:
        torch.set_num_threads(args.threads)
        model_rounds(args.model, schemes, args.new, args.rounds, args.compare)


if __name__ == "__main__":
    main()
