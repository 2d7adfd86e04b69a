"""``benchmarks/bench_greedy_steps.py``: greedy decoding's native steps against the loop's own, in turns."""
from __future__ import annotations

import math

import pytest
import torch

import splice
from splice import native

from .arch.tiny_models import build_family
from .benchmark_scripts import load_benchmark


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_every_way_times_its_tokens_and_the_native_ways_give_the_loop_s():
    """Each way gives a time a token and its tokens; the ways with a minimum length give the same ones, and only the
    native ways are offered native greedy steps (the engine's own offer is put back after each)."""
    script = load_benchmark("bench_greedy_steps")
    engine = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, max_out_tokens=64,
                                   dtype=torch.bfloat16)
    runtime = engine.runtime
    offer, offered = runtime.greedy_steps, []

    def offering(*args):
        steps = offer(*args)
        offered.append(steps is not None)
        return steps

    runtime.greedy_steps = offering
    prompt = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    tokens = {}
    with torch.inference_mode():
        for way in script.WAYS:
            offered.clear()
            ms, tokens[way] = script.ms_per_token(engine, prompt, 6, way)
            # a tiny model's time a token is within the noise of the one-token call the unstreamed ways subtract
            assert math.isfinite(ms) and tokens[way].shape == (1, 14)
            assert any(offered) == (way in ("streamed", "whole"))
    assert torch.equal(tokens["streamed"], tokens["whole"]) and torch.equal(tokens["whole"], tokens["loop"])
    assert runtime.greedy_steps is offering


def test_a_way_it_does_not_know_is_named(monkeypatch, capsys):
    script = load_benchmark("bench_greedy_steps")
    monkeypatch.setattr("sys.argv", ["bench_greedy_steps.py", "--ways", "streamed,fast"])
    with pytest.raises(SystemExit):
        script.main()
    error = capsys.readouterr().err
    assert "--ways 'streamed,fast': allowed, comma-separated: streamed, whole, loop, loop-plain" in error
