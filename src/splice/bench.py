"""``splice bench``: HF eager ``generate`` vs splice (plain and kernel-injected), one after another in one process.

For each configuration (dtype x batch) the model is loaded once; each mode generates ``--new`` tokens from the same
random ``--prompt``-token prompt, the modes in one order whatever order ``--modes`` names them in (hf, plain, then
inject, which changes the model in place). Reported: prefill ms, decode tokens/s (after the first new token), ms/token,
peak RSS during the run, speedup over HF eager, and a roofline: the machine's read bandwidth (the fastest of the probes
read before the rows and after each row, each streaming 1 GiB on 2 MiB pages on every thread in a few read patterns)
divided by the bytes a decode step reads (weights as stored, quantized or not, the lm_head included; and the KV cache
slots attention reads), and each row's share of it ("% of bw"); "% around" is the row's share of the faster of the two
readings right before and after it, the bandwidth its phase of the host gave. The report keeps every probe reading, and
the table's head names the slowest beside the fastest (and says when they are far apart: the host's load moved during
the run, and "% of bw" understates the rows that ran in its slow stretches).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import cli_options, native
from .arch.record import head_size
from .cli_options import BENCH_PROMPT, MODES, QUANT_SCHEMES, split_commas
from .machine import describe_cpu
from .native.memory import gather_on_huge_pages

#: Defined with the other options in splice.cli_options, which the command line imports without torch; named here too,
#: with MODES and QUANT_SCHEMES, for the tests and benchmarks that take them from splice.bench.
add_bench_parser = cli_options.add_bench_parser

LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)


@dataclass
class Row:
    model: str
    dtype: str
    batch: int
    mode: str
    prefill_ms: float
    decode_tok_s: float
    ms_per_token: float
    peak_rss_mb: float
    speedup: float
    roofline_tok_s: float
    first_run_s: float = float("nan")  # inject+compile: the first generate call, compiling included
    step_bytes: int = 0  # bytes one decode step reads (weights, KV cache)
    prompt: int = 0  # prompt tokens (the context the decode steps start from)
    around_gbs: float = float("nan")  # the faster of the probe readings right before and after the row
    graphs: int | None = None  # compiled rows: decode-step graphs compiled by the row's end (0: every step eager)

    @property
    def bandwidth_share(self) -> float:
        """Decode speed as a share of the roofline: the step's bytes over its time, against the read bandwidth."""
        return self.decode_tok_s / self.roofline_tok_s if self.roofline_tok_s else math.nan

    @property
    def bandwidth_share_around(self) -> float:
        """The step's bytes over its time against ``around_gbs``: the share of what the host gave while it ran."""
        return self.decode_tok_s / self.batch * self.step_bytes / (self.around_gbs * 1e9)


class BandwidthProbe:
    """The read bandwidth probe's readings in a run, in order (``read`` takes one more)."""

    def __init__(self) -> None:
        self.readings: list[float] = []

    def read(self) -> float:
        self.readings.append(read_bandwidth_gbs())
        return self.readings[-1]

    def around(self) -> float:
        """After a row: a reading, and the faster of it and the one before the row."""
        before = self.readings[-1]
        return max(before, self.read())


def run_bench(args: argparse.Namespace) -> int:
    modes, schemes, dtypes = check_arguments(args)
    check_outputs(args)  # before the runs: a bad destination would otherwise fail after every row was timed
    check_model(args.model)  # before the kernel build and the probe, which take seconds
    args.isa_levels = _isa_levels(args.isa)  # the levels this machine runs: known once the kernels are built
    warn_if_oversubscribed(args.threads)
    native.available()  # build (once per machine) and load the native kernels before anything is timed
    if args.threads:
        torch.set_num_threads(args.threads)
    probe = BandwidthProbe()
    probe.read()  # and after each row
    rows: list[Row] = []
    args.profiles = []  # bench_configuration and bench_quantized add one per kernel-injected run with --profile
    with _kernel_names(args.profile and args.compile):
        for context in args.context or [args.prompt]:
            at_context = argparse.Namespace(**{**vars(args), "prompt": context})
            for dtype in dtypes:
                for batch in args.batch:
                    plain_rows = bench_configuration(at_context, dtype, batch, modes, probe)
                    hf_speed = next((r.decode_tok_s for r in plain_rows if r.mode == "hf"), float("nan"))
                    rows += plain_rows + bench_quantized(at_context, dtype, batch, schemes, probe, hf_speed)
    readings = probe.readings
    rows, _ = against_the_fastest_probe(rows, readings)
    machine = machine_info(readings)  # the same fastest reading, and every other
    print(describe_machine(machine))
    print(format_table(rows))
    settings = {"prompt": args.context or args.prompt, "new": args.new, "compile": args.compile}
    report = {"machine": machine, "settings": settings,
              "results": [{**asdict(r), "bandwidth_share": r.bandwidth_share,
                           "bandwidth_share_around": r.bandwidth_share_around} for r in rows]}
    if args.profile:
        print(format_profiles(args.profiles))
        report["profiles"] = args.profiles
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


#: Modes that change the model they run on (injection replaces its layers in place): run after every other mode.
MODES_CHANGING_THE_MODEL = ("inject",)
#: ``--dtype`` values by their short names: the float dtypes a model is loaded in (int8 is a ``--quant`` scheme).
BENCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The model name bench accepts besides those splice.load does: random weights in TinyLlama-1.1B's shape.
LLAMA_1B_NAME = "llama-1b"
#: Options only kernel-injected runs (``inject`` in --modes, or a --quant row) honour, and what each would do.
INJECTED_ONLY = {"profile": "profiled", "compile": "compiled", "isa": "timed at another level of the native kernels"}


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """(modes in the order they run, --quant schemes, dtypes by short name), the options checked before anything is
    loaded or built (--isa's levels need the native kernels: run_bench checks them after the model). Raises
    ValueError naming the option, the bad value and what is allowed."""
    modes = in_run_order(_choices(args.modes, MODES, "--modes"))
    schemes = _choices(args.quant, tuple(QUANT_SCHEMES), "--quant") if args.quant else []
    dtypes = bench_dtypes(args.dtype)
    if args.profile and args.new < 3:
        raise ValueError(f"--profile with --new {args.new}; allowed: --new >= 3 (the prefill is left out of the "
                         "decode step's profile)")
    check_injected_only_options(args, modes, schemes)
    check_prompt_beside_context(args)
    return modes, schemes, dtypes


def in_run_order(modes: list[str]) -> list[str]:
    """``modes`` in a fixed order, whatever order --modes names them in: those that leave the model as it is first
    (each row then times the model its mode names), those that change it last; so the rows come out the same."""
    return sorted(modes, key=lambda mode: (mode in MODES_CHANGING_THE_MODEL, MODES.index(mode)))


def bench_dtypes(text: str) -> list[str]:
    """``--dtype``'s values by their short names (any name splice's dtype setting takes for one of BENCH_DTYPES is
    accepted); raises ValueError for an empty list, another dtype or one given twice."""
    from .config import parse_dtype

    short = {dtype: name for name, dtype in BENCH_DTYPES.items()}

    def short_name(value: str) -> str:
        try:
            return short.get(parse_dtype(value), value)
        except ValueError:
            return value

    def parses_to_int8(value: str) -> bool:
        try:
            return parse_dtype(value) == torch.int8
        except ValueError:
            return False

    values = split_commas(text)
    hint = "; int8 is a quantization: --quant int8 runs it" if any(map(parses_to_int8, values)) else ""
    names = [short_name(value) for value in values]
    _check_values(names, tuple(BENCH_DTYPES), "--dtype", text, " (or another name of one, as float32 or bfloat16)",
                  hint)
    return names


def check_injected_only_options(args: argparse.Namespace, modes: list[str], schemes: list[str]) -> None:
    """An option of INJECTED_ONLY with no kernel-injected run to act on would be ignored (and --compile recorded in
    the JSON though nothing was compiled): refused."""
    if "inject" in modes or schemes:
        return
    found = _injected_only_given(args)
    if found:
        given, option, effect = found
        raise ValueError(f"{given} with --modes {','.join(modes)} and no --quant: nothing would be {effect}; "
                         f"allowed: --modes including inject, or --quant with a scheme (or no --{option})")


def _injected_only_given(args: argparse.Namespace) -> tuple[str, str, str] | None:
    """The first option of INJECTED_ONLY given, as (how it was given, its name, what it would do), or None."""
    for option, effect in INJECTED_ONLY.items():
        value = getattr(args, option)
        if value:
            return (f"--{option}" if value is True else f"--{option} {value}"), option, effect
    return None


def injectable(model: torch.nn.Module) -> bool:
    """Whether kernel injection has a record for ``model``'s family."""
    from .arch import find

    return find(getattr(model, "config", None)) is not None


def check_quantized_plain(args: argparse.Namespace, model: torch.nn.Module) -> None:
    """--quant rows of a model without a kernel-injection record run on the plain model, where the options of
    INJECTED_ONLY have nothing to act on unless ``inject`` is in --modes (which then fails on injection's own
    error): refused, naming the model's family."""
    found = None if "inject" in split_commas(args.modes) else _injected_only_given(args)
    if found:
        given, option, effect = found
        raise ValueError(f"{given}: kernel injection has no record for {args.model}'s family "
                         f"({model.config.model_type!r}), so its --quant rows run on the plain model and nothing "
                         f"would be {effect}; allowed: a model of a family kernel injection takes, or no --{option}")


def check_prompt_beside_context(args: argparse.Namespace) -> None:
    """--context sets the prompt lengths, so a --prompt beside it would have no effect: refused. (A --prompt of the
    default length cannot be told apart from no --prompt here, and changes nothing either.)"""
    if args.context and args.prompt != BENCH_PROMPT:
        lengths = ",".join(map(str, args.context))
        raise ValueError(f"--prompt {args.prompt} with --context {lengths}: --context sets the prompt lengths, so "
                         f"--prompt would have no effect; allowed: one of them (--context {lengths},{args.prompt} "
                         "adds that length)")


def check_model(name: str) -> None:
    """--model names a model bench can load, found (a GGUF file converted into the cache, as loading it would) before
    the native kernels are built and the bandwidth probe runs; raises ValueError naming --model, the value and every
    kind of model bench accepts."""
    if name == LLAMA_1B_NAME:
        return
    from .models import accepted_kinds, resolve_checkpoint

    try:
        resolve_checkpoint(name)
    except ValueError as error:
        raise ValueError(f"--model: {str(error).replace(accepted_kinds(), accepted_kinds(also=(LLAMA_1B_NAME,)))}"
                         ) from None


def warn_if_oversubscribed(threads: int | None) -> None:
    """Warns when --threads is more than the CPUs this process may run on: the threads then take turns on them and
    every row runs slower. Not refused: oversubscribing can be what is being measured."""
    cpus = usable_cpus()
    if threads and threads > cpus:
        warnings.warn(f"--threads {threads} is more than the {cpus} CPUs this process may run on: the threads take "
                      "turns on them and every row runs slower than on as many threads as CPUs")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


#: Probe readings whose slowest is below this share of the fastest mean the host's load moved during the run (said
#: under the table's head).
MOVED_BANDWIDTH = 0.8


def against_the_fastest_probe(rows: list[Row], readings: list[float]) -> tuple[list[Row], float]:
    """``rows`` (their rooflines computed from ``readings[0]``) with their rooflines from the fastest of the probe's
    readings, taken before, between and after them, and that figure: on a shared machine the bandwidth moves during a
    run, and a probe read in a slow stretch would credit every row with more than its share of the bandwidth."""
    fastest = max(readings)
    return [replace(r, roofline_tok_s=r.roofline_tok_s * fastest / readings[0]) for r in rows], fastest


def bench_configuration(args, dtype: str, batch: int, modes: list[str], probe: BandwidthProbe) -> list[Row]:
    """Load once; run each mode on the same prompt, in :func:`in_run_order` (injection last: it changes the model in
    place). The rooflines from the probe's first reading (against_the_fastest_probe rescales them), each row's probe
    read after it."""
    import splice

    bandwidth = probe.readings[0]
    model = load_model(args.model, dtype)
    if args.quant and not injectable(model):
        check_quantized_plain(args, model)  # before any row is timed
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, model.config.vocab_size, (batch, args.prompt), generator=generator)
    weights = weight_bytes_per_step(model)
    rows, hf_speed = [], None
    for mode in in_run_order(modes):
        if mode == "hf":
            engine, generate = None, model.generate
        else:
            engine = splice.init_inference(model, replace_with_kernel_inject=(mode == "inject"),
                                           max_out_tokens=args.prompt + args.new)
            generate = engine.generate
        runs = [mode]
        if mode == "inject" and args.compile:
            runs.append("inject+compile")  # the same injected model, its decode step compiled afterwards
        for run in runs:
            first_s = float("nan")
            if run == "inject+compile":
                engine.runtime.compile_decode()
                first_s = time_first_run(generate, prompt, args.new)
            for name, level in _runs_at_levels(run, args.isa_levels if run.startswith("inject") else []):
                with _native_level(level):
                    prefill_ms, tok_s, peak = time_generate(generate, prompt, args.new, args.repeat)
                hf_speed = tok_s if run == "hf" else hf_speed
                step = weights + kv_bytes_per_step(model, batch, attended_slots(args, slots_run(engine, run, batch)))
                rows.append(Row(args.model, dtype, batch, name, prefill_ms, tok_s, 1e3 / tok_s * batch, peak,
                                tok_s / hf_speed if hf_speed else float("nan"), batch * bandwidth * 1e9 / step,
                                first_s, step, args.prompt, probe.around(), compiled_graphs(engine, run)))
            if run.startswith("inject") and args.profile:
                args.profiles.append(profile_run(engine, prompt, args, (args.model, dtype, batch, run)))
    del model
    engine = generate = None  # noqa: F841 — the model lives on through these until collected
    gc.collect()
    return rows


def bench_quantized(args, dtype: str, batch: int, schemes: list[str], probe: BandwidthProbe, hf_speed: float
                    ) -> list[Row]:
    """One quantized row per scheme (and one compiled, with ``--compile``): kernel-injected, or on the plain model
    for a model kernel injection has no record for (a mixture of experts, say; rows ``plain+<scheme>``); speedup is
    against the HF eager row of the same dtype/batch. The probe as bench_configuration's."""
    import splice

    bandwidth = probe.readings[0]
    rows = []
    for scheme in schemes:
        model = load_model(args.model, dtype)
        inject = injectable(model)  # else bench_configuration has checked the options
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(100, model.config.vocab_size, (batch, args.prompt), generator=generator)
        engine = splice.init_inference(model, replace_with_kernel_inject=inject, max_out_tokens=args.prompt + args.new,
                                       **QUANT_SCHEMES[scheme])
        weights = stored_weight_bytes(engine.module)
        mode = "inject" if inject else "plain"
        for run in [f"{mode}+{scheme}"] + ([f"{mode}+{scheme}+compile"] if args.compile else []):
            first_s = float("nan")
            if run.endswith("+compile"):
                engine.runtime.compile_decode()
                first_s = time_first_run(engine.generate, prompt, args.new)
            for name, level in _runs_at_levels(run, args.isa_levels if inject else []):
                with _native_level(level):
                    prefill_ms, tok_s, peak = time_generate(engine.generate, prompt, args.new, args.repeat)
                slots = attended_slots(args, slots_run(engine, run, batch))
                step = weights + kv_bytes_per_step(engine.module, batch, slots)
                rows.append(Row(args.model, dtype, batch, name, prefill_ms, tok_s, 1e3 / tok_s * batch, peak,
                                tok_s / hf_speed, batch * bandwidth * 1e9 / step, first_s, step, args.prompt,
                                probe.around(), compiled_graphs(engine, run)))
            if args.profile:
                args.profiles.append(profile_run(engine, prompt, args, (args.model, dtype, batch, run)))
        del engine, model
        gc.collect()
    return rows


def profile_run(engine, prompt: torch.Tensor, args, names: tuple[str, str, int, str]) -> dict:
    """One decode step of a kernel-injected run broken into stages (:func:`splice.profiling.profile_decode`), as
    the JSON's ``profiles`` hold it: with the prompt length (``prompt``, as in the results), which tells apart the
    runs of one configuration at each ``--context`` length."""
    from .profiling import profile_decode

    profile = profile_decode(engine, prompt, args.new)
    model, dtype, batch, mode = names
    return {"model": model, "dtype": dtype, "batch": batch, "prompt": prompt.shape[1], "mode": mode,
            **asdict(profile)}


def _kernel_names(on: bool):
    """Inductor's kernels named for torch.profiler (``cpp.enable_kernel_profile``) while inside, when ``on``."""
    from contextlib import nullcontext

    if not on:
        return nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch({"cpp.enable_kernel_profile": True})


def format_profiles(profiles: list[dict]) -> str:
    """Each profiled run's decode step, stage by stage: ms and share of the step; then each run's notes. A column is
    named ``<mode> b<batch> <dtype> p<prompt tokens>``."""
    from .profiling import STAGES

    names = [f"{p['mode']} b{p['batch']} {p['dtype']} p{p['prompt']}" for p in profiles]
    width = max([18] + [len(n) for n in names])
    lines = ["decode step by stage (ms per step, share of the step; columns: mode, batch, dtype, prompt tokens)",
             f"{'stage':<10} " + " ".join(f"{n:>{width}}" for n in names)]
    lines.append("-" * len(lines[-1]))
    for stage in (*STAGES, "step"):
        cells = []
        for p in profiles:
            ms = p["step_ms"] if stage == "step" else p["stages"][stage]
            cells.append(f"{ms:>{width - 7}.3f} {100 * ms / p['step_ms']:>5.1f}%")
        lines.append(f"{stage:<10} " + " ".join(cells))
    for name, p in zip(names, profiles):
        lines += [f"{name}: {note}" for note in p["notes"]]
    return "\n".join(lines)


def _isa_levels(text: str) -> list[str]:
    """``--isa``: levels of the native kernels this machine runs (empty: time at the active level only)."""
    if not text:
        return []
    from . import native

    return _choices(text, native.supported_isas(), "--isa (the levels this machine runs)")


def _runs_at_levels(run: str, levels: list[str]) -> list[tuple[str, str | None]]:
    """(row name, native level) for one run: ``mode@level`` per level, or the mode alone at the active level."""
    return [(f"{run}@{level}", level) for level in levels] or [(run, None)]


def _native_level(level: str | None):
    from contextlib import nullcontext

    from . import native

    return nullcontext() if level is None else native.use_isa(level)


def stored_weight_bytes(model) -> int:
    """:func:`weight_bytes_per_step` plus the quantized layers' buffers (their packed weights and scales)."""
    from .quant import QuantizedLinear

    packed = sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, QuantizedLinear)
                 for b in m.buffers())
    return weight_bytes_per_step(model) + packed


def attended_slots(args, run: str) -> float:
    """KV-cache slots one decode step reads, on average over the run's decode steps: eager steps and HF's attend over
    the tokens so far; the compiled step over those rounded up to its attended length (a power of two from
    ``MIN_ATTENDED``, at most ``max_out_tokens`` = prompt + new)."""
    from .layers.causal_lm import attended_length

    filled = [args.prompt + step for step in range(1, args.new)] or [args.prompt]
    if run.endswith("compile"):
        filled = [attended_length(length, args.prompt + args.new) for length in filled]
    return sum(filled) / len(filled)


def compiled_graphs(engine, run: str) -> int | None:
    """The decode-step graphs a compiled run's engine has compiled so far; None for other runs."""
    return engine.runtime.graphs_compiled if run.endswith("compile") else None


def slots_run(engine, run: str, batch: int) -> str:
    """``run`` as :func:`attended_slots` reads it: a compiled run whose steps of ``batch`` rows are each one native
    call runs them eagerly (``SpliceCausalLM.step_runs_natively``), over the tokens so far."""
    return "eager" if run.endswith("compile") and engine.runtime.step_runs_natively(batch) else run


def kv_bytes_per_step(model, batch: int, slots: float) -> int:
    """Keys and values one decode step reads: every layer's K and V over ``slots`` positions, per sequence."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = head_size(config)
    element = 4 if model.dtype == torch.float32 else 2
    return int(2 * config.num_hidden_layers * kv_heads * head_dim * element * slots * batch)


def time_first_run(generate, prompt: torch.Tensor, new: int) -> float:
    """Seconds of one generate call (the first one after compile_decode: it compiles)."""
    start = time.perf_counter()
    generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(prompt))
    return time.perf_counter() - start


def time_generate(generate, prompt: torch.Tensor, new: int, repeat: int, warm_up: bool = True
                  ) -> tuple[float, float, float]:
    """(prefill ms, decode tokens/s over the batch excluding the first token, peak RSS MiB): the best of ``repeat``
    runs after a warm-up run (which also compiles, when asked; ``warm_up=False`` for a caller that warmed up already);
    on a shared machine the best run is the least noisy."""
    from .streaming import StepClock  # here, not at the top: transformers' streamers would slow every `splice` start

    options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(prompt))
    if warm_up:
        generate(prompt, **options, streamer=StepClock())
    prefill, decode, peak = float("inf"), 0.0, 0.0
    for _ in range(max(1, repeat)):
        clock = StepClock()
        with RssPeak() as rss:
            generate(prompt, **options, streamer=clock)
        prefill = min(prefill, clock.prefill_ms)
        decode = max(decode, clock.decode_steps_per_s * prompt.shape[0])
        peak = max(peak, rss.peak_mb)
    return prefill, decode, peak


class RssPeak:
    """The peak resident set size while the block runs: Linux's own high-water mark (``VmHWM``), reset on entry
    through ``/proc/self/clear_refs``. A sampling thread would wake 100 times a second and steal time from the
    kernels being timed on a 2-core machine; it is only the fallback where the reset is not allowed."""

    def __enter__(self):
        self.peak_mb = current_rss_mb()
        self._thread = None
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
        except OSError:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak_mb = max(self.peak_mb, current_rss_mb())

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self.peak_mb = max(self.peak_mb, current_rss_mb(), _status_mb("VmHWM:"))


def current_rss_mb() -> float:
    return _status_mb("VmRSS:")


def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status in MiB (nan where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


#: The native probe's read patterns (streams side by side, software prefetch): which reads fastest differs between CPUs
#: (on an AMD Zen 3, four streams a power of two apart read at two thirds of what one stream without prefetch reads).
PROBE_PATTERNS = ((4, True), (2, True), (1, False))


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Memory read bandwidth in GB/s, the best of ``repeats`` reads of ``gib`` GiB on every thread in each of the
    native streaming read's patterns (``splice_kernels.stream_read``: :data:`PROBE_PATTERNS`, taking turns), or
    where the native kernels are not available an fp32 GEMV. The buffer sits on 2 MiB pages where Linux grants them,
    as the weights of a kernel-injected model do (``native.memory``): on 4 KiB pages the same read is slower (a TLB
    miss every 4 KiB), which would understate the bandwidth and overstate each row's share of it."""
    cols = 8192
    matrix = torch.ones(int(gib * 2**30) // (4 * cols), cols)
    gather_on_huge_pages([matrix])
    vector = torch.ones(cols)
    if native.available():
        reads = [lambda s=s, p=p: torch.ops.splice_kernels.stream_read(matrix, s, p) for s, p in PROBE_PATTERNS]
    else:
        reads = [lambda: torch.mv(matrix, vector)]
    best = float("inf")
    for _ in range(repeats):
        for read in reads:
            start = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - start)
    return matrix.numel() * 4 / best / 1e9


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every parameter, except an input embedding that is not also the
    output head (a lookup reads a few rows only)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is embedding
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embedding.numel() * embedding.element_size()


def load_model(name: str, dtype: str):
    import splice

    if name == LLAMA_1B_NAME:
        from transformers import AutoModelForCausalLM

        from .config import parse_dtype

        return AutoModelForCausalLM.from_pretrained(llama_1b_folder(), dtype=parse_dtype(dtype),
                                                    local_files_only=True).eval()
    return splice.load(name, dtype=dtype)[0]


def llama_1b_folder() -> Path:
    """A random-weight Llama with TinyLlama-1.1B dimensions, built and saved (bf16) once in splice's cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .models import cache_dir, cache_subfolder, exclusive_lock

    folder = cache_dir() / "bench-llama-1b"
    if (folder / "config.json").exists():
        return folder
    # two first runs at once: one builds it, the other waits and takes it
    with exclusive_lock(cache_subfolder("locks") / f"{folder.name}.lock", lambda: print(
            f"splice: waiting for another process to save {folder.name}...", file=sys.stderr, flush=True)):
        if (folder / "config.json").exists():
            return folder
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B)).to(torch.bfloat16)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # a killed run's
        model.save_pretrained(tmp)
        os.replace(tmp, folder)
    return folder


def format_table(rows: list[Row]) -> str:
    """The rows as a text table. "vs float" puts each quantized row beside the same run's float row of the same mode
    (``inject+int4+compile`` against ``inject+compile``); "-" where a figure was not measured."""
    width = max([len("mode")] + [len(r.mode) for r in rows])
    header = (f"{'model':<24} {'dtype':<5} {'batch':>5} {'prompt':>6} {'mode':<{width}} {'prefill ms':>10} "
              f"{'decode tok/s':>12} "
              f"{'ms/token':>9} {'peak RSS MB':>11} {'speedup':>8} {'vs float':>8} {'roofline tok/s':>14} "
              f"{'% of bw':>7} {'% around':>8} {'first run s':>11}")
    float_speed = {(r.model, r.dtype, r.batch, r.prompt, r.mode): r.decode_tok_s for r in rows}
    lines = [header, "-" * len(header)]
    for r in rows:
        base = float_speed.get((r.model, r.dtype, r.batch, r.prompt, _float_mode(r.mode)))
        vs_float = r.decode_tok_s / base if base and _float_mode(r.mode) != r.mode else math.nan
        lines.append(f"{r.model[:24]:<24} {r.dtype:<5} {r.batch:>5} {r.prompt:>6} {r.mode:<{width}} "
                     f"{r.prefill_ms:>10.1f} {r.decode_tok_s:>12.2f} {r.ms_per_token:>9.1f} "
                     f"{r.peak_rss_mb:>11.0f} "
                     f"{_ratio(r.speedup):>8} {_ratio(vs_float):>8} {r.roofline_tok_s:>14.2f} "
                     f"{100 * r.bandwidth_share:>6.0f}% {_percent(r.bandwidth_share_around):>8} "
                     f"{_number(r.first_run_s):>11}")
    eager = sorted({r.mode for r in rows if r.graphs == 0})
    if eager:
        lines.append(f"{', '.join(eager)}: no graph compiled; every decode step was one native call, which a compiled "
                     "engine runs eagerly (runtime.compile_native_steps = True compiles it)")
    return "\n".join(lines)


def _float_mode(mode: str) -> str:
    """``inject+int4+compile`` -> ``inject+compile``: the mode without its quantization scheme."""
    return "+".join(part for part in mode.split("+") if part not in QUANT_SCHEMES)


def _ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def _number(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _percent(share: float) -> str:
    return "-" if math.isnan(share) else f"{100 * share:.0f}%"


def check_outputs(args: argparse.Namespace) -> None:
    """``--json`` and ``--plot`` name files that can be written, ``--plot`` in a format matplotlib (importable)
    draws; raises ValueError naming the option and the path."""
    check_writable(args.json, "--json")
    if args.plot:
        pyplot()
        from matplotlib.backend_bases import FigureCanvasBase

        suffix = Path(args.plot).suffix.lstrip(".").lower()  # none: savefig's default format
        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix and suffix not in formats:
            raise ValueError(f"--plot {args.plot}: matplotlib cannot draw .{suffix} files; allowed: a file ending in "
                             f"{', '.join('.' + f for f in sorted(formats))}")
        check_writable(args.plot, "--plot")


def check_writable(path: str, flag: str) -> None:
    """Opens ``path`` for appending (so an existing file is left as it is), removing it again if it is new."""
    target = Path(path).expanduser()
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot write there ({error.strerror}); allowed: a file in an existing "
                         "folder this user can write to") from None
    if not existed:
        target.unlink(missing_ok=True)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ValueError(f"--plot needs matplotlib ({error.name} is missing); allowed: after pip install "
                         "'splice[plot]', or no --plot") from None
    return plt


def plot(rows: list[Row], path: str) -> None:
    plt = pyplot()

    def config(r: Row) -> tuple:
        return r.model, r.dtype, r.batch, r.prompt

    configs = sorted({config(r) for r in rows}, key=str)
    modes = list(dict.fromkeys(r.mode for r in rows))
    width = 0.8 / (len(modes) + 1)
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(configs)) + 2, 4))
    for i, mode in enumerate(modes):
        values = [next((r.decode_tok_s for r in rows if config(r) == c and r.mode == mode), 0) for c in configs]
        ax.bar([k + i * width for k in range(len(configs))], values, width, label=mode)
    roof = [next(r.roofline_tok_s for r in rows if config(r) == c) for c in configs]
    ax.bar([k + len(modes) * width for k in range(len(configs))], roof, width, label="roofline", color="lightgray")
    ax.set_xticks([k + width * len(modes) / 2 for k in range(len(configs))])
    ax.set_xticklabels([f"{m}\n{d} batch {b}, prompt {p}" for m, d, b, p in configs])
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def machine_info(readings: list[float]) -> dict:
    """The machine section of the report from every probe reading of the run: the read bandwidth the rooflines divide
    is the fastest, and all of them are kept, so a reader sees how far the host's bandwidth moved while the rows ran."""
    return {"cpu": describe_cpu()["model"], "threads": torch.get_num_threads(),
            "torch": torch.__version__, "read_bandwidth_gbs": round(max(readings), 2),
            "bandwidth_readings_gbs": [round(r, 2) for r in readings],
            "bandwidth_probe": _native_probe() if native.available() else "fp32 GEMV (torch.mv)",
            "bandwidth_probe_pages": "2 MiB" if native.huge_pages_supported() else "4 KiB"}


def _native_probe() -> str:
    """The native probe in words: ``splice native streaming read, best of 1, 2 and 4 streams a thread``."""
    counts = sorted({streams for streams, _ in PROBE_PATTERNS})
    return (f"splice native streaming read, best of {', '.join(map(str, counts[:-1]))} and {counts[-1]} streams "
            "a thread")


def describe_machine(info: dict) -> str:
    """One line for the table's head: threads and the measured read bandwidth the roofline column divides."""
    readings = info["bandwidth_readings_gbs"]
    spread = "" if len(readings) < 2 else f"; fastest of {len(readings)} readings, the slowest {min(readings):.1f}"
    line = (f"{info['cpu']}, {info['threads']} threads, torch {info['torch']}; read bandwidth "
            f"{info['read_bandwidth_gbs']:.1f} GB/s ({info['bandwidth_probe']}, {info['bandwidth_probe_pages']} pages"
            f"{spread})")
    if min(readings) < MOVED_BANDWIDTH * max(readings):
        line += ("\nthe host's read bandwidth moved during the run: the % of bw column is against its fastest reading, "
                 "% around against the readings right before and after each row; compare rows by ratios taken in one "
                 "run")
    return line


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """``text``'s comma-separated values: at least one, each of ``allowed`` and given once."""
    chosen = split_commas(text)
    _check_values(chosen, allowed, flag, text)
    return chosen


def _check_values(chosen: list[str], allowed: tuple[str, ...], flag: str, text: str, also: str = "",
                  hint: str = "") -> None:
    """Raises ValueError naming ``flag``, its ``text``, what is wrong with ``chosen`` (nothing, a value not in
    ``allowed``, a value given twice) and the allowed values (``also`` adds to them, ``hint`` ends the message)."""
    bad = [value for value in chosen if value not in allowed]
    twice = list(dict.fromkeys(value for value in chosen if chosen.count(value) > 1))
    if not chosen:
        problem = "no value given"
    elif bad:
        problem = f"{', '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not allowed"
    elif twice:
        problem = f"{', '.join(map(repr, twice))} given more than once"
    else:
        return
    raise ValueError(f"{flag}={text!r}: {problem}; allowed values are {', '.join(allowed)}{also}, each at most once"
                     f"{hint}")
