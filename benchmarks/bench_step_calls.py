"""What a compiled decode step calls, and the time between its calls: torch.profiler over a greedy native generate
on a kernel-injected llama-1b (random weights), inductor's kernels named; the direct children of the compiled
graph's call are summed by name over the decode steps (the prefill left out), and the time the graph spends between
them is reported beside. Finer than ``splice bench --profile``'s stages (which put the fused kernels and the time
between calls together in "other"). Naming the kernels keeps inductor's Python wrapper, whose calls the profiler
sees; the step splice runs has the C++ wrapper, with less time between calls::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_step_calls.py --quant int4-sym
    PYTHONPATH=src .venv/bin/python benchmarks/bench_step_calls.py --quant int8 --batch 8
"""
from __future__ import annotations

import argparse
import collections

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

import splice
from splice.bench import load_model
from splice.generation import generate as native_generate
from splice.profiling import FORWARD_RANGE, _StepBoundaries

from bench_decode_attention import engine_options


def kernel_name(name: str) -> str:
    """An inductor kernel's name without its per-graph suffix, so the kernels of every layer sum together."""
    return name.split("_kernel")[0] if "cpp_fused" in name else name


def step_calls(engine, prompt: torch.Tensor, new: int) -> tuple[int, float, float, dict, dict]:
    """(decode steps, ms a step, ms a step between the graph's calls, {name: ms a step}, {name: calls a step})."""
    boundaries = _StepBoundaries(None, lambda: None, FORWARD_RANGE)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        native_generate(engine.module, engine.runtime, prompt, timer=boundaries, max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(prompt))
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    steps = [e for e in events if e.name == FORWARD_RANGE][1:]
    times, counts = collections.Counter(), collections.Counter()
    between = total = 0.0
    for step in steps:
        inside = [e for e in events if step.time_range.start <= e.time_range.start
                  and e.time_range.end <= step.time_range.end]
        graph = next(e for e in inside if "CompiledFxGraph" in e.name)
        calls = sorted((e for e in inside if e.cpu_parent is graph), key=lambda e: e.time_range.start)
        end = graph.time_range.start
        for call in calls:
            between += max(0, call.time_range.start - end) * 1e-3
            end = max(end, call.time_range.end)
            times[kernel_name(call.name)] += call.time_range.elapsed_us() * 1e-3
            counts[kernel_name(call.name)] += 1
        between += max(0, graph.time_range.end - end) * 1e-3
        total += step.time_range.elapsed_us() * 1e-3
    n = len(steps)
    return n, total / n, between / n, {k: v / n for k, v in times.items()}, {k: c // n for k, c in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="int4-sym", help="a splice bench --quant scheme, or bf16")
    parser.add_argument("--new", type=int, default=17, help="new tokens (the first is the prefill's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--top", type=int, default=20, help="calls listed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = True
    engine = splice.init_inference(load_model("llama-1b", "bf16"), replace_with_kernel_inject=True,
                                   compile_decode=True, max_out_tokens=256, **engine_options(args.quant))
    prompt = torch.randint(0, engine.module.config.vocab_size, (args.batch, 128))
    with torch.inference_mode():
        engine.generate(prompt, max_new_tokens=8, do_sample=False)  # compiles the step
    steps, step_ms, between_ms, times, counts = step_calls(engine, prompt, args.new)
    print(f"llama-1b {args.quant}, batch {args.batch}, {args.threads} threads: {steps} decode steps, "
          f"{step_ms:.2f} ms a step, {between_ms:.2f} ms of it between the compiled graph's calls")
    for name, ms in sorted(times.items(), key=lambda item: -item[1])[:args.top]:
        print(f"{ms:8.3f} ms {counts[name]:5d} calls  {name[:100]}")


if __name__ == "__main__":
    main()
