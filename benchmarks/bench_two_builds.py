"""The working tree's decode GEMVs against another revision's, in one process, taking turns. The host's read bandwidth
moves by half within seconds, so two builds timed in two processes (or two runs) differ by the host more than by the
change; here the revision's ``gemv.cpp`` is built under an op namespace of its own (``splice_kernels_base``), set to the
working tree's kernel settings (level, weight streams, work stealing, software prefetch), and both builds read the same
weights from memory (llama-1b's fused layer shapes, on 2 MiB pages) in alternating order, each round between two
readings of the bandwidth probe. ``--set NAME=VALUE`` then changes one setting of the working tree's build alone, so the
same source compares two settings the same way (``--set software_prefetch=4``: int4's software prefetch in every pass
against none; ``--set software_prefetch_rows=0,0,3``: int4's from three rows of x), and ``--attention-keys N`` adds each
block's decode attention over a bf16 KV cache of N keys (llama-1b's 32 query and 4 KV heads), as a step calls it between
the block's GEMVs. Per kind and row count it prints the median of the rounds' speed ratios (working tree over base),
overall and split at the median probe reading (the host's high and low phases), and each build's median share of the
probe::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_two_builds.py --base HEAD --kinds int4-sym,int8 --rows 1 8
    PYTHONPATH=src .venv/bin/python benchmarks/bench_two_builds.py --kinds int4-sym --set software_prefetch=4
    PYTHONPATH=src .venv/bin/python benchmarks/bench_two_builds.py --kinds int4-sym --attention-keys 4096
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from splice import native
from splice.models import cache_subfolder
from splice.native.memory import gather_on_huge_pages

from bench_gemv_rates import KINDS, at_least, call, operands, positive, weight_bytes
from bench_quant import FUSED, HEAD_DIM, HEADS, KV_HEADS
from bench_read_sizes import best_gbs

BASE_NAMESPACE = "splice_kernels_base"
SOURCE = "src/splice/native/gemv.cpp"
#: The kernel settings both builds run with: the working tree's, copied to the base (getter; setter is set_<name>).
SETTINGS = ("isa", "weight_streams", "work_stealing", "software_prefetch", "software_prefetch_rows", "avx_vnni")
LIST_SETTINGS = ("software_prefetch_rows",)  # an integer per kind of weight (bf16, int8, int4)
LIBRARY_MACROS = ("TORCH_LIBRARY(splice_kernels,", "TORCH_LIBRARY_IMPL(splice_kernels,")


def renamed_source(text: str, namespace: str = BASE_NAMESPACE) -> str:
    """``gemv.cpp``'s text with its op library registered as ``namespace``; SystemExit where the text does not
    register ``splice_kernels`` exactly once of each kind (then it is not a revision this script can build)."""
    for macro in LIBRARY_MACROS:
        if text.count(macro) != 1:
            raise SystemExit(f"the base's {SOURCE} has {text.count(macro)} '{macro}' (this script needs one)")
        text = text.replace(macro, macro.replace("splice_kernels", namespace))
    return text


def base_source(revision: str) -> str:
    """``gemv.cpp`` at ``revision`` of the repository this script lives in."""
    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(["git", "show", f"{revision}:{SOURCE}"], cwd=root, capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--base {revision!r}: git show could not read {SOURCE} there: {shown.stderr.strip()}")
    return shown.stdout


def load_base(text: str, label: str):
    """The ops of ``text`` (a renamed ``gemv.cpp``), built once per machine and source like the working tree's."""
    folder = cache_subfolder("kernels", "base-sources")
    source = folder / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.cpp"
    if not source.exists():
        source.write_text(text)
    native.build_library(source, BASE_NAMESPACE, native.CFLAGS, native.LDFLAGS, what=f"the kernels of {label}")
    return getattr(torch.ops, BASE_NAMESPACE)


def match_settings(base, here) -> dict[str, object]:
    """Copies every setting in SETTINGS that both builds have from ``here`` to ``base``; returns what was copied."""
    copied = {}
    for name in SETTINGS:
        getter = "avx_vnni_ready" if name == "avx_vnni" else name
        if all(hasattr(ops, getter) and hasattr(ops, f"set_{name}") for ops in (base, here)):
            copied[name] = getattr(here, getter)()
            getattr(base, f"set_{name}")(copied[name])
    return copied


def parse_setting(text: str) -> tuple[str, int | list[int]]:
    """``NAME=VALUE`` of --set: a setting in SETTINGS and an integer (booleans as 0 or 1), or for one of
    LIST_SETTINGS integers separated by commas."""
    name, _, value = text.partition("=")
    parts = value.split(",") if name in LIST_SETTINGS else [value]
    if name not in SETTINGS or not all(part.strip().lstrip("-").isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=INTEGER with NAME one of {', '.join(SETTINGS)} "
                                         f"(INTEGER,INTEGER,... for {', '.join(LIST_SETTINGS)})")
    numbers = [int(part) for part in parts]
    return name, numbers if name in LIST_SETTINGS else numbers[0]


@dataclass(frozen=True)
class Round:
    probe: float  # GB/s, the mean of the readings before and after
    base: float   # GB/s of weights
    here: float


def rounds(base, here, kind: str, rows: int, layers: int, count: int, shapes=None,
           attention_keys: int = 0) -> list[Round]:
    """``count`` rounds: the probe, both builds over every matrix once (the order reversed every other round), the
    probe again. With ``attention_keys``, every FUSED block's four GEMVs are followed by a decode attention over a KV
    cache of its own, whose bytes count with the weights'."""
    shapes = list(FUSED.values()) * layers if shapes is None else shapes
    weights = [operands(kind, n, k) for n, k in shapes]
    caches = [torch.randn(2, rows, KV_HEADS, attention_keys, HEAD_DIM).bfloat16()
              for _ in range(len(shapes) // len(FUSED) if attention_keys else 0)]
    probe = torch.ones(sum(weight_bytes(w) for w in weights + caches), dtype=torch.uint8)
    gather_on_huge_pages([t for w in weights for t in w] + caches + [probe])
    inputs = [torch.randn(rows, k).bfloat16() for _, k in shapes]
    query = torch.randn(rows, HEADS, 1, HEAD_DIM).bfloat16()
    size = sum(weight_bytes(w) for w in weights) + sum(c.nbytes for c in caches)

    def one_pass(ops) -> None:
        for i, (x, weight) in enumerate(zip(inputs, weights)):
            call(kind, x, weight, ops)
            if caches and i % len(FUSED) == len(FUSED) - 1:
                cache = caches[i // len(FUSED)]
                ops.decode_attention(query, cache[0], cache[1], None, HEAD_DIM ** -0.5)

    out = []
    for i in range(count):
        before = best_gbs([probe], rounds=1)
        speeds = {}
        for name, ops in ((("base", base), ("here", here)))[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            one_pass(ops)
            speeds[name] = size / (time.perf_counter() - start) / 1e9
        out.append(Round((before + best_gbs([probe], rounds=1)) / 2, speeds["base"], speeds["here"]))
    return out


def summary(results: list[Round]) -> str:
    """The median ratio here / base over all rounds and over the rounds at or above / below the median probe, and
    each build's median share of the probe."""
    cut = statistics.median(r.probe for r in results)
    parts = {"all": results, f"probe >= {cut:.1f} GB/s": [r for r in results if r.probe >= cut],
             "below": [r for r in results if r.probe < cut]}
    ratios = "  ".join(f"{label} {statistics.median(r.here / r.base for r in part):.3f} ({len(part)})"
                       for label, part in parts.items() if part)
    shares = (f"base {statistics.median(r.base / r.probe for r in results):.3f}, "
              f"here {statistics.median(r.here / r.probe for r in results):.3f} of the probe")
    return f"here / base: {ratios}; {shares}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to time the working tree against")
    parser.add_argument("--kinds", default="int4-sym,int4,int8", help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--rows", type=positive, nargs="+", default=[1], help="rows of x (batch)")
    parser.add_argument("--layers", type=positive, default=8, help="llama-1b blocks' weights read a round")
    parser.add_argument("--rounds", type=at_least(2), default=41)
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--attention-keys", type=at_least(0), default=0,
                        help="each block's decode attention over this many keys too (0: GEMVs only)")
    parser.add_argument("--set", type=parse_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="a kernel setting of the working tree's build alone (after both take its settings)")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds {args.kinds!r}: {', '.join(unknown)} unknown; allowed: {', '.join(KINDS)}")
    if not native.available():
        raise SystemExit("splice's native kernels are not available here")
    base = load_base(renamed_source(base_source(args.base)), f"revision {args.base}")
    here = torch.ops.splice_kernels
    print(f"settings of both builds: {match_settings(base, here)}")
    for name, value in args.set:
        getattr(here, f"set_{name}")(bool(value) if name in ("work_stealing", "avx_vnni") else value)
        print(f"the working tree's build alone: {name} = {value}")
    torch.set_num_threads(args.threads)
    for kind in kinds:
        for rows in args.rows:
            results = rounds(base, here, kind, rows, args.layers, args.rounds, attention_keys=args.attention_keys)
            attention = f", attention over {args.attention_keys} keys" if args.attention_keys else ""
            print(f"{kind}, {rows} row(s), {args.layers} llama-1b blocks{attention}, {args.rounds} rounds: "
                  f"{summary(results)}", flush=True)


if __name__ == "__main__":
    main()
