"""What the command line needs without torch: the default model, ``splice bench``'s modes and quantization schemes,
the ``bench`` subcommand's options, and this process's rank under torchrun (its error handling reads it).

``splice --help`` and argparse errors build the whole parser; importing torch (through ``splice.bench`` or
``splice.models``) for that would make them take seconds. ``splice.bench`` and ``splice.models`` import these names
from here.
"""
from __future__ import annotations

import argparse
import os

#: The model ``splice generate | serve | info | bench`` run when none is given (a built-in of ``splice.models``).
DEFAULT_MODEL = "smollm2-135m-instruct"

MODES = ("hf", "plain", "inject")
BENCH_PROMPT = 128  # splice bench's prompt tokens unless --prompt or --context says
#: ``--quant`` schemes: init_inference options for each, run kernel-injected on a freshly loaded model.
QUANT_SCHEMES = {
    "int8": {"dtype": "int8"},
    "int8-g64": {"quant": {"enabled": True, "weight": {"num_bits": 8, "group_size": 64}}},
    "w8a8": {"quant": {"enabled": True, "activation": {"enabled": True}}},
    "int4": {"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 32, "q_type": "asymmetric"}}},
    "int4-sym": {"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 32, "q_type": "symmetric"}}},
    "int4-g128": {"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 128}}},
}


def add_bench_parser(subparsers) -> None:
    from .cli import POSITIVE_INT, checked  # here, not at the top: splice.cli imports this module

    positive_ints = checked(positive_int_list, bool, "comma-separated integers >= 1")
    parser = subparsers.add_parser("bench", help="time HF eager vs splice (plain, kernel-injected) side by side")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a name or folder splice.load accepts, or 'llama-1b' (random TinyLlama-shaped weights)")
    parser.add_argument("--dtype", default="fp32", help="comma-separated: fp32,bf16 (default fp32)")
    parser.add_argument("--batch", type=positive_ints, default=[1], help="comma-separated batch sizes (default 1)")
    parser.add_argument("--prompt", type=POSITIVE_INT, default=BENCH_PROMPT,
                        help=f"prompt tokens (default {BENCH_PROMPT})")
    parser.add_argument("--context", type=positive_ints,
                        help="comma-separated prompt lengths to run each configuration at, e.g. 128,1024,4096,8192 "
                             "(long-context rows; default: --prompt); max_out_tokens is each length plus --new")
    parser.add_argument("--new", type=POSITIVE_INT, default=64, help="new tokens (default 64)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--repeat", type=POSITIVE_INT, default=2, help="timed runs per mode, best kept (default 2)")
    parser.add_argument("--quant", default="", help=f"comma-separated quantized rows to add: {','.join(QUANT_SCHEMES)} "
                        "(kernel-injected, each on a fresh copy of the model; on the plain model, rows "
                        "plain+<scheme>, for a family kernel injection has no record for)")
    parser.add_argument("--compile", action="store_true",
                        help="also run the injected (and quantized) models with their decode step compiled "
                             "(compile_decode=True)")
    parser.add_argument("--threads", type=POSITIVE_INT, help="torch threads (default: torch's own choice)")
    parser.add_argument("--isa", default="", help="comma-separated levels of splice's native kernels (avx2, avx512, "
                        "amx) to time every kernel-injected row at, side by side (rows named mode@level; default: "
                        "the active level only)")
    parser.add_argument("--profile", action="store_true",
                        help="also break one decode step of each kernel-injected run into stages (QKV, attention, o, "
                             "gate+up, down GEMVs, norms, rotary, lm_head, sampling, other), printed and in the JSON; "
                             "with --compile, inductor names its kernels for the profiler (a check per kernel)")
    parser.add_argument("--json", default="splice-bench.json", help="where to write the results (JSON)")
    parser.add_argument("--plot", help="also draw the decode tokens/s bars to this image file (needs matplotlib)")
    parser.set_defaults(run=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    """Runs ``splice bench``: the runner (torch, the native kernels) is imported only once the command runs."""
    from .bench import run_bench

    return run_bench(args)


def split_commas(text: str) -> list[str]:
    """``"a, b,"`` -> ``["a", "b"]``: the non-empty parts of a comma-separated option."""
    return [part.strip() for part in text.split(",") if part.strip()]


def positive_int_list(text: str) -> list[int]:
    """``"1,4"`` -> ``[1, 4]``; an empty list (refused by the caller) for anything but integers >= 1."""
    values = [int(part) for part in split_commas(text)]  # ValueError for a non-integer
    return values if values and min(values) >= 1 else []


def launched_rank() -> int:
    """This process's global rank under torchrun (from its environment, so known before any group exists), else 0."""
    return int(os.environ.get("RANK", 0)) if "WORLD_SIZE" in os.environ else 0
