"""``benchmarks/bench_step_calls.py``: a compiled decode step's calls and the time between them."""
from __future__ import annotations

import pytest
import torch

import splice

from .arch.tiny_models import build_family
from .benchmark_scripts import load_benchmark


def load_script():
    return load_benchmark("bench_step_calls")


def test_kernel_names_of_every_layer_sum_together():
    script = load_script()
    assert script.kernel_name("graph_0_cpp_fused_add_mul_3_kernel_17") == "graph_0_cpp_fused_add_mul_3"
    assert script.kernel_name("splice_kernels::int4_dot_gemv") == "splice_kernels::int4_dot_gemv"


@pytest.mark.parametrize("batch", (1, 3))  # --batch: prompts decoded together
def test_a_compiled_step_is_its_calls_and_the_time_between_them(batch):
    """Every decode step is counted (the prefill left out), each layer's attention is one call a step, and the calls
    and the time between them fit inside the step."""
    script = load_script()
    model = build_family("llama")
    engine = splice.init_inference(model, replace_with_kernel_inject=True, compile_decode=True, max_out_tokens=64)
    prompt = torch.randint(0, model.config.vocab_size, (batch, 6))
    with torch.inference_mode():
        engine.generate(prompt, max_new_tokens=3, do_sample=False)
    steps, step_ms, between_ms, times, counts = script.step_calls(engine, prompt, 5)
    assert steps == 4
    assert counts and all(ms >= 0 for ms in times.values()) and between_ms >= 0
    assert sum(times.values()) + between_ms <= step_ms * 1.01
    attention = [name for name in counts if "attention" in name and not name.startswith("graph_")]
    assert attention and sum(counts[name] for name in attention) == model.config.num_hidden_layers
