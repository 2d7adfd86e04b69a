"""``benchmarks/bench_activation_rounding.py``: the decode path's integer products against float ones, windows of
text as samples."""
from __future__ import annotations

import math
import os

import pytest
import torch

from splice import native

from .arch.tiny_models import build_family
from .benchmark_scripts import load_benchmark

needs_native = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")


class CountingTokenizer:
    """Each text's ids are its length's worth of the text's first character code, so a window tells its text."""

    def __call__(self, text: str, return_tensors: str):
        return type("Encoded", (), {"input_ids": torch.full((1, len(text)), ord(text[0]))})()


def test_windows_take_each_text_in_turn_and_never_overlap():
    bench = load_benchmark("bench_activation_rounding")
    ids = bench.windows(CountingTokenizer(), ["a" * 10, "b" * 4, "c" * 7], length=3, count=5)
    assert ids.shape == (5, 3)
    assert [chr(int(row[0])) for row in ids] == ["a", "b", "c", "a", "c"]  # b has one window of 3, c two, a three
    assert bench.windows(CountingTokenizer(), ["ab"], length=3, count=4).shape == (0, 3)


def test_interval_is_the_mean_loss_as_perplexity_with_its_spread():
    bench = load_benchmark("bench_activation_rounding")
    change, low, high = bench.interval([0.01, 0.03])
    half = 1.96 * math.sqrt(2e-4) / math.sqrt(2)
    assert change == pytest.approx(math.expm1(0.02))
    assert (low, high) == (pytest.approx(math.expm1(0.02 - half)), pytest.approx(math.expm1(0.02 + half)))


@needs_native
def test_integer_and_float_products_differ_a_little_and_the_setting_is_restored(monkeypatch):
    monkeypatch.delenv("SPLICE_NATIVE_DOT", raising=False)
    bench = load_benchmark("bench_activation_rounding")
    model = build_family("llama", dtype=torch.bfloat16)
    ids = torch.randint(3, 128, (3, 12), generator=torch.Generator().manual_seed(0))
    kl, losses = bench.measure(model, bench.SCHEMES["int8"], ids, batch=2)
    assert "SPLICE_NATIVE_DOT" not in os.environ
    assert len(losses) == 3 and 0 < kl < 0.05
    assert bench.quantized(model, bench.SCHEMES["int8"], False).model.layers[0].mlp.down_proj.use_dot_products == 0
    assert bench.quantized(model, bench.SCHEMES["int8"], True).model.layers[0].mlp.down_proj.use_dot_products > 0


@needs_native
def test_the_exact_reference_multiplies_the_same_weights_in_float32():
    bench = load_benchmark("bench_activation_rounding")
    model = build_family("llama", dtype=torch.bfloat16)
    reference = bench.exact(model, bench.SCHEMES["int8-g64"])
    floating = bench.quantized(model, bench.SCHEMES["int8-g64"], False)
    exact_down, down = reference.model.layers[0].mlp.down_proj, floating.model.layers[0].mlp.down_proj
    assert isinstance(exact_down, bench.ExactProduct) and torch.equal(exact_down.weight, down.dequantize().float())
    x = torch.randn(2, down.in_features, dtype=torch.bfloat16)
    torch.testing.assert_close(exact_down(x).float(), down(x).float(), rtol=0.02, atol=0.02)
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    kl, losses = bench.compare(reference, floating, ids, batch=2)
    assert 0 <= kl < 0.05 and len(losses) == 2


@needs_native
def test_measure_takes_the_exact_product_as_its_reference(monkeypatch):
    bench = load_benchmark("bench_activation_rounding")
    model = build_family("llama", dtype=torch.bfloat16)
    references = []
    compare = bench.compare
    monkeypatch.setattr(bench, "compare", lambda base, other, ids, batch: references.append(base) or compare(
        base, other, ids, batch))
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    kl, losses = bench.measure(model, bench.SCHEMES["int8"], ids, batch=2, reference="exact")
    assert isinstance(references[0].model.layers[0].mlp.down_proj, bench.ExactProduct)
    assert 0 < kl < 0.05 and len(losses) == 2
