"""quantize(model, QuantConfig) on whole models: which linears it replaces, what it keeps, how outputs change."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from splice.quant import QuantConfig, QuantizedLinear, quantize, sqnr_db
from tests.conftest import build_tiny, tiny_llama_config


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("config, min_sqnr", [
    (QuantConfig(), 30), (QuantConfig(activations=True), 25), (QuantConfig(bits=4, group_size=32), 12),
])
def test_quantizes_every_block_linear_and_keeps_lm_head(tiny_llama, config, min_sqnr):
    reference = copy.deepcopy(tiny_llama)
    report = quantize(tiny_llama, config)
    linears = [n for n, m in reference.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(report.quantized + list(report.kept_float)) == sorted(linears)
    assert list(report.kept_float) == ["lm_head"]
    assert isinstance(tiny_llama.lm_head, nn.Linear) and isinstance(tiny_llama.model.embed_tokens, nn.Embedding)
    ids = torch.randint(0, 128, (2, 16))
    assert sqnr_db(_logits(reference, ids), _logits(tiny_llama, ids)) >= min_sqnr
    assert report.ratio <= (0.55 if config.bits == 8 else 0.4)
    assert config.kind in report.summary()


def test_quantize_lm_head_and_skip_qkv(tiny_llama):
    report = quantize(tiny_llama, QuantConfig(quantize_lm_head=True, quantize_qkv=False))
    assert isinstance(tiny_llama.lm_head, QuantizedLinear)
    assert isinstance(tiny_llama.model.layers[0].self_attn.q_proj, nn.Linear)
    assert sorted(report.kept_float) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2)
                                               for p in "qkv")


def test_tied_head_stays_tied():
    model = build_tiny(tiny_llama_config(tie_word_embeddings=True))
    quantize(model, QuantConfig(bits=4, group_size=32))
    assert model.lm_head.weight is model.model.embed_tokens.weight


class _SubclassedLinear(nn.Linear):
    pass


class _RowParallel(nn.Module):
    """The shape splice asks of tensor-parallel layers: a wrapper around a plain nn.Linear, collective outside it."""

    def __init__(self, linear: nn.Linear, all_reduce) -> None:
        super().__init__()
        self.linear, self.all_reduce = linear, all_reduce

    def forward(self, x):
        return self.all_reduce(self.linear(x))


def test_wrapped_parallel_linear_keeps_its_collective_and_subclasses_are_left_alone():
    calls = []

    def all_reduce(t):
        calls.append(t.shape)
        return t

    model = nn.Sequential(_RowParallel(nn.Linear(64, 32), all_reduce), _SubclassedLinear(32, 32))
    report = quantize(model, QuantConfig())
    assert report.quantized == ["0.linear"]
    assert "subclasses nn.Linear" in report.kept_float["1"]
    model(torch.randn(3, 64))
    assert calls == [torch.Size([3, 32])]


def test_rejects_other_config_types(tiny_llama):
    with pytest.raises(TypeError, match="QuantConfig"):
        quantize(tiny_llama, {"bits": 8})


def test_scheme_that_cannot_fit_a_layer_raises_before_changing_the_model(tiny_llama):
    with pytest.raises(ValueError, match="q_groups=3"):
        quantize(tiny_llama, QuantConfig(q_groups=3))  # 64 and 128 inputs
    assert not any(isinstance(m, QuantizedLinear) for m in tiny_llama.modules())


def test_quantized_int8_weights_are_not_views_so_they_can_move():
    """``quantize_int8``'s codes are a tensor of their own: a view would keep its float-shaped base alive after the
    weights are gathered on huge pages (it did: llama-1b int8 held 2.2 GB instead of 1.3 GB)."""
    from splice.quant import qmath

    q, _ = qmath.quantize_int8(torch.randn(8, 64))
    assert q._base is None and q.shape == (8, 64)
