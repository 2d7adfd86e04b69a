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
    for rows, padding in ((1, 0), (3, 2)):  # one row; three rows left-padded by 0, 2 and 4
        prompt = torch.randint(3, 100, (rows, 8), generator=torch.Generator().manual_seed(0))
        mask = script.left_padded(rows, 8, padding)
        assert (mask is None) == (padding == 0)
        assert mask is None or mask.sum(-1).tolist() == [8, 6, 4]
        tokens = {}
        with torch.inference_mode():
            for way in script.WAYS:
                offered.clear()
                ms, tokens[way] = script.ms_per_token(engine, prompt, 6, way, mask)
                # a tiny model's time a token is within the noise of the one-token call the unstreamed ways subtract
                assert math.isfinite(ms) and tokens[way].shape == (rows, 14)
                assert any(offered) == (way in ("streamed", "whole"))
        assert torch.equal(tokens["streamed"], tokens["whole"]) and torch.equal(tokens["whole"], tokens["loop"])
    assert runtime.greedy_steps is offering


@pytest.mark.parametrize("argv, message", [
    (["--ways", "streamed,fast"],
     "--ways 'streamed,fast': allowed, comma-separated: streamed, whole, loop, loop-plain"),
    (["--batch", "3", "--prompt", "8", "--padded", "4"],
     "--padded 4: row 2 would be all padding; allowed: (batch - 1) x padded < prompt (8)"),
])
def test_a_bad_option_is_named(monkeypatch, capsys, argv, message):
    script = load_benchmark("bench_greedy_steps")
    monkeypatch.setattr("sys.argv", ["bench_greedy_steps.py", *argv])
    monkeypatch.setattr(script, "load_model", lambda *args: pytest.fail("loaded a model before the options' check"))
    with pytest.raises(SystemExit):
        script.main()
    assert message in capsys.readouterr().err
