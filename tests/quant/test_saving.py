"""Save / reload quantized models: packed weights + scheme JSON, no re-quantization, mismatches raise."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from splice import native
from splice.quant import QuantConfig, QuantizedLinear, load_quantized, quantize, read_scheme, save_quantized
from splice.quant import api as quant_api
from tests.conftest import build_tiny, tiny_llama_config

CONFIGS = [QuantConfig(), QuantConfig(group_size=32), QuantConfig(bits=4, group_size=32, symmetric=False),
           QuantConfig(activations=True)]


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.kind}-{c.group_size}")
def test_round_trip_without_requantizing(tmp_path, monkeypatch, config):
    model_config = tiny_llama_config(tie_word_embeddings=True)
    model = build_tiny(model_config)
    quantize(model, config)
    save_quantized(model, tmp_path, config)
    assert read_scheme(tmp_path) == config
    assert json.loads((tmp_path / "splice_quant.json").read_text())["tied"] == {"lm_head.weight":
                                                                                 "model.embed_tokens.weight"}
    skeleton = build_tiny(model_config, seed=1)  # different random weights, all replaced by the loaded ones
    for handler in quant_api.HANDLERS.values():  # loading must not quantize real weights again
        monkeypatch.setattr(handler, "from_float", _forbidden)
    loaded = load_quantized(skeleton, tmp_path, config)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 128, (1, 12))
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=0)


def test_loads_into_a_meta_skeleton(tmp_path):
    model_config = tiny_llama_config(tie_word_embeddings=True)
    model = build_tiny(model_config)
    quantize(model, QuantConfig(bits=4, group_size=32))
    save_quantized(model, tmp_path, QuantConfig(bits=4, group_size=32))
    with torch.device("meta"):
        skeleton = build_tiny(model_config, seed=1)
    loaded = load_quantized(skeleton, tmp_path)
    assert not any(t.is_meta for t in loaded.state_dict().values())  # computed buffers are the loader's job
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(loaded.model.layers[1].mlp.down_proj.dequantize(),
                               model.model.layers[1].mlp.down_proj.dequantize(), rtol=0, atol=0)


def _forbidden(*args, **kwargs):
    raise AssertionError("load_quantized quantized a weight again")


def test_mismatched_scheme_raises(tmp_path):
    model = build_tiny(tiny_llama_config())
    quantize(model, QuantConfig(bits=4, group_size=32))
    save_quantized(model, tmp_path, QuantConfig(bits=4, group_size=32))
    with pytest.raises(ValueError, match="was asked for"):
        load_quantized(build_tiny(tiny_llama_config()), tmp_path, QuantConfig(bits=4, group_size=64))


def test_folder_without_scheme_raises(tmp_path):
    with pytest.raises(ValueError, match="splice_quant.json is missing"):
        load_quantized(build_tiny(tiny_llama_config()), tmp_path)


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
@pytest.mark.parametrize("config", [QuantConfig(), QuantConfig(bits=4, group_size=32, symmetric=False)],
                         ids=lambda c: f"{c.kind}-{c.group_size}")
def test_native_and_torch_kernels_load_each_others_checkpoints(tmp_path, monkeypatch, config):
    model_config = tiny_llama_config()
    model = build_tiny(model_config)
    quantize(model, config)
    save_quantized(model, tmp_path / "native", config)
    with monkeypatch.context() as patch:
        patch.setattr(native, "available", lambda: False)
        plain = load_quantized(build_tiny(model_config, seed=1), tmp_path / "native", config)
    save_quantized(plain, tmp_path / "torch", config)
    back = load_quantized(build_tiny(model_config, seed=1), tmp_path / "torch", config)
    assert [_uses_native(m) for m in (model, plain, back)] == [{True}, {False}, {True}]
    saved, resaved = load_file(tmp_path / "native/model.safetensors"), load_file(tmp_path / "torch/model.safetensors")
    assert saved.keys() == resaved.keys() and all(torch.equal(saved[k], resaved[k]) for k in saved)
    ids = torch.randint(0, 128, (1, 12))
    expected = _logits(model, ids)
    torch.testing.assert_close(_logits(back, ids), expected, rtol=0, atol=0)
    assert (_logits(plain, ids) - expected).norm() / expected.norm() < 1e-2  # torch's kernels: other rounding


def _uses_native(model) -> set[bool]:
    return {m.use_native for m in model.modules() if isinstance(m, QuantizedLinear)}
