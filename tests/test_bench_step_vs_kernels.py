"""``benchmarks/bench_step_vs_kernels.py``: a compiled step against its kernels, each against the bandwidth probe."""
from __future__ import annotations

import pytest
import torch

import splice
from splice import native
from splice.cli_options import QUANT_SCHEMES

from .arch.tiny_models import build_family
from .benchmark_scripts import load_benchmark

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


def injected(quant: str):
    model = build_family("llama", dtype=torch.bfloat16)
    options = {} if quant == "bf16" else QUANT_SCHEMES[quant]
    return model, splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=64, **options)


@needs_native
@pytest.mark.parametrize("quant", ("int4-sym", "int8", "bf16"))
def test_the_step_gemvs_are_every_block_s_four_and_the_lm_head_with_their_bytes(quant):
    bench = load_benchmark("bench_step_vs_kernels")
    model, engine = injected(quant)
    runtime = engine.runtime
    calls = bench.step_gemvs(runtime)
    assert len(calls) == 4 * model.config.num_hidden_layers + 1
    linears = [getattr(block, name) for block in runtime.blocks for name in ("qkv", "o", "gate_up", "down")]
    linears.append(runtime.lm_head)
    for (call, width, nbytes), linear in zip(calls, linears):
        assert width == linear.in_features
        expected = linear.weight_nbytes() if hasattr(linear, "weight_nbytes") else linear.weight.nbytes
        assert nbytes == expected > 0
        x = torch.randn(1, width).bfloat16()
        with torch.inference_mode():
            assert torch.equal(call(x), linear(x))  # the kernel the layer itself runs


@needs_native
def test_generate_s_time_a_token_leaves_the_prefill_out():
    bench = load_benchmark("bench_step_vs_kernels")
    model, engine = injected("int4-sym")
    prompt = torch.randint(0, model.config.vocab_size, (1, 6))
    streamer = bench.TokenTimes()
    with torch.inference_mode():
        engine.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, streamer=streamer)
        assert len(streamer.times) == 6  # the prompt, then each new token
        assert streamer.times == sorted(streamer.times)
        assert bench.ms_per_token(engine, prompt, 5) > 0


def test_a_share_is_the_read_speed_over_the_probe_s(monkeypatch):
    bench = load_benchmark("bench_step_vs_kernels")
    assert bench.share(50_000_000, 2.0, 50.0) == pytest.approx(0.5)  # 25 GB/s against 50
    readings = iter([40.0, 60.0])
    monkeypatch.setattr(bench, "read_bandwidth_gbs", lambda gib, repeats: next(readings))
    assert bench.beside_the_probe(lambda: 3.0) == (3.0, 50.0)  # the mean of the readings before and after


@pytest.mark.parametrize("argv, named", [(["--rounds", "0"], "--rounds: '0'"), (["--new", "1"], "--new: '1'"),
                                         (["--calls", "x"], "--calls: 'x'"), (["--threads", "-2"], "'-2'")])
def test_bad_counts_are_refused_naming_the_value(argv, named, monkeypatch, capsys):
    bench = load_benchmark("bench_step_vs_kernels")
    monkeypatch.setattr("sys.argv", ["bench_step_vs_kernels.py", *argv])
    with pytest.raises(SystemExit):
        bench.main()
    assert named in capsys.readouterr().err
