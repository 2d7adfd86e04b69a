"""Quantized linears vs bf16 on the linear stack of a TinyLlama-shaped model (llama-1b), side by side in one process.

Every transformer block's projections (hidden 2048, intermediate 5632, 32 heads, 4 KV heads) for ``--layers`` blocks,
random weights: fused into QKV, o, gate+up, down as kernel injection runs them (``--separate``: the seven of the model).
Rows: bf16 ``nn.Linear`` (torch's oneDNN linear), bf16 on splice's native GEMV, and each quantized scheme (where int8
weight-only rounds its decode rows to int16, the avx2 level without AVX-VNNI, also "int8-act8": the same layers with
int8 activations, as on other CPUs); all weights gathered on 2 MiB pages as ``init_inference`` places them. One
"step" runs every projection once on a ``[batch, in]`` input, as a decode step does (attention, norms and lm_head
left out), so at batch 1 it reads every weight once from memory. Schemes run interleaved, round after round, and the
median is kept, so load from other processes hits them alike. Writes JSON (default ``bench_out/quant.json``)::

    .venv/bin/python benchmarks/bench_quant.py                 # 22 layers, batch 1 and 8
    .venv/bin/python benchmarks/bench_quant.py --layers 4 --rounds 5 --batch 1 8 32
    .venv/bin/python benchmarks/bench_quant.py --threads 1   # steadier when other processes share the cores
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from splice import native
from splice.kernel_choice import quant_kernel
from splice.layers.native_linear import NativeLinear
from splice.native.memory import gather_on_huge_pages
from splice.quant import HANDLERS, QuantConfig

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 2048, 5632, 32, 4
HEAD_DIM = HIDDEN // HEADS
#: (out_features, in_features) of one block's projections, as the model has them ...
SEPARATE = {"q": (HIDDEN, HIDDEN), "k": (KV_HEADS * HEAD_DIM, HIDDEN), "v": (KV_HEADS * HEAD_DIM, HIDDEN),
            "o": (HIDDEN, HIDDEN), "gate": (INTERMEDIATE, HIDDEN), "up": (INTERMEDIATE, HIDDEN),
            "down": (HIDDEN, INTERMEDIATE)}
#: ... and as kernel injection fuses them (one QKV and one gate+up matrix), which is what splice's decode step runs.
FUSED = {"qkv": (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), "o": (HIDDEN, HIDDEN),
         "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
SCHEMES = {
    "int8": QuantConfig(),
    "int4-g32": QuantConfig(bits=4, group_size=32, symmetric=False),
    "int4-g128": QuantConfig(bits=4, group_size=128, symmetric=True),
    "w8a8": QuantConfig(activations=True),
}


def build_stacks(layers: int, schemes: list[str], shapes: dict[str, tuple[int, int]]) -> dict[str, list[nn.Module]]:
    """bf16 linears plus one quantized copy per scheme; block 0 is quantized, later blocks load its state (same
    values, separate memory) so building a 1B-parameter stack does not take minutes."""
    torch.manual_seed(0)
    stacks: dict[str, list[nn.Module]] = {"bf16": []}
    first: dict[str, dict[str, nn.Module]] = {name: {} for name in schemes}
    for _ in range(layers):
        for proj, (n, k) in shapes.items():
            linear = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            nn.init.normal_(linear.weight, std=0.02)
            stacks["bf16"].append(linear)
            for name in schemes:
                stacks.setdefault(name, []).append(_quantized(linear, SCHEMES[name], first[name], proj))
    if native.available():  # splice's bf16 decode path: the same weights through the native GEMV
        stacks["bf16-native"] = [NativeLinear(linear) for linear in stacks["bf16"]]
    if "int8" in stacks and quant_kernel(SCHEMES["int8"], "cpu").dot_products == 16:
        stacks["int8-act8"] = [_with_int8_activations(layer) for layer in stacks["int8"]]
    gather_on_huge_pages([t for stack in stacks.values() for m in stack for t in [*m.parameters(), *m.buffers()]
                          if t.nbytes >= 1 << 16])  # as init_inference places injected and quantized weights
    return stacks


def _quantized(linear: nn.Linear, config: QuantConfig, first: dict[str, nn.Module], proj: str) -> nn.Module:
    """The layer kernel injection builds for ``config`` here (the kernels ``kernel_choice`` picks: splice's native
    ones where they run, with integer dot products where chosen)."""
    handler, choice = HANDLERS[config.kind], quant_kernel(config, "cpu")
    kernels = {"native": choice.native, "dot_products": choice.dot_products}
    if proj not in first:
        first[proj] = handler.from_float(linear.weight.detach(), None, config, **kernels)
        return first[proj]
    layer = handler.empty(linear.in_features, linear.out_features, False, config, **kernels)
    layer.load_state_dict(first[proj].state_dict())
    return layer


def _with_int8_activations(layer: nn.Module) -> nn.Module:
    """The same int8 weight-only layer (its weights shared) with decode rows rounded to int8 per block of 32, as
    elsewhere, where the kernel choice rounds them to int16 (``kernel_choice.int16_activations``): both side by side."""
    other = copy.copy(layer)
    other.use_dot_products = 8 if layer.use_dot_products else 0
    return other


def step(stack: list[nn.Module], inputs: dict[int, torch.Tensor]) -> None:
    for layer in stack:
        layer(inputs[layer.in_features])


def weight_bytes(stack: list[nn.Module]) -> int:
    return sum(m.weight_nbytes() if hasattr(m, "weight_nbytes") else m.weight.numel() * 2 for m in stack)


def measure(stacks: dict[str, list[nn.Module]], batch: int, rounds: int) -> dict[str, float]:
    """Median ms per step for each scheme, interleaved round by round."""
    inputs = {k: torch.randn(batch, k, dtype=torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
    times: dict[str, list[float]] = {name: [] for name in stacks}
    with torch.inference_mode():
        for name, stack in stacks.items():  # warm-up
            step(stack, inputs)
        for _ in range(rounds):
            for name, stack in stacks.items():
                start = time.perf_counter()
                step(stack, inputs)
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def run(layers: int, batches: list[int], rounds: int, schemes: list[str], fused: bool = True) -> dict:
    stacks = build_stacks(layers, schemes, FUSED if fused else SEPARATE)
    sizes = {name: weight_bytes(stack) for name, stack in stacks.items()}
    rows = []
    for batch in batches:
        medians = measure(stacks, batch, rounds)
        best_bf16 = min(medians["bf16"], medians.get("bf16-native", float("inf")))
        for name, ms in medians.items():
            rows.append({"scheme": name, "batch": batch, "ms_per_step": round(ms, 2),
                         "speedup_vs_bf16": round(medians["bf16"] / ms, 2),
                         "speedup_vs_best_bf16": round(best_bf16 / ms, 2),
                         "weight_bytes": sizes[name], "bytes_vs_bf16": round(sizes[name] / sizes["bf16"], 3),
                         "weight_gb_per_s": round(sizes[name] / ms / 1e6, 1)})
            print(f"batch {batch:3d}  {name:11s} {ms:9.2f} ms/step  {medians['bf16'] / ms:5.2f}x bf16  "
                  f"{best_bf16 / ms:5.2f}x best bf16  "
                  f"{sizes[name] / 2**20:8.1f} MiB ({sizes[name] / sizes['bf16']:.3f}x)", flush=True)
    return {"model": "llama-1b linear stack (TinyLlama shapes)", "fused": fused, "layers": layers, "rounds": rounds,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.processor() or
            platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--separate", action="store_true",
                        help="the seven projections as the model has them (default: fused as injection runs them)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/quant.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.layers, args.batch, args.rounds, args.schemes, fused=not args.separate)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
