"""Bad input to init_inference raises before anything changes the user's model."""
from __future__ import annotations

import pytest
import torch

import splice

from .conftest import build_tiny, tiny_llama_config


def snapshot(model):
    return {name: (t.detach().clone(), t.device, t.dtype) for name, t in model.state_dict().items()}


def assert_unchanged(model, before):
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (tensor, device, dtype) in before.items():
        new, new_device, new_dtype = after[name]
        assert (new_device, new_dtype) == (device, dtype), name
        assert torch.equal(new, tensor), name


BAD_INPUTS = [
    ({"dtype": "bf16", "max_out_token": 8}, ValueError, "max_out_tokens"),
    ({"dtype": "bf16", "tensor_parallel": {"tp_size": 0}}, ValueError, "tp_size"),
    ({"dtype": "fp8"}, ValueError, "fp8"),
    ({"dtype": "bf16", "max_out_tokens": 0}, ValueError, "max_out_tokens"),
    ({"dtype": "bf16", "enable_cuda_graph": True}, ValueError, "enable_cuda_graph"),
    ({"dtype": "bf16", "checkpoint": "/nonexistent/ckpt"}, ValueError, "/nonexistent/ckpt"),
]


@pytest.mark.parametrize("config, error, message", BAD_INPUTS)
def test_bad_input_leaves_model_unchanged(config, error, message):
    model = build_tiny(tiny_llama_config())
    before = snapshot(model)
    with pytest.raises(error, match=message):
        splice.init_inference(model, config)
    assert_unchanged(model, before)


def test_mismatched_checkpoint_leaves_model_unchanged(tmp_path):
    other = build_tiny(tiny_llama_config(hidden_size=32, intermediate_size=64))
    other.save_pretrained(tmp_path)
    model = build_tiny(tiny_llama_config())
    before = snapshot(model)
    with pytest.raises(ValueError, match="shape"):
        splice.init_inference(model, dtype="bf16", checkpoint=str(tmp_path))
    assert_unchanged(model, before)


def test_not_a_module_raises():
    with pytest.raises(TypeError, match="nn.Module"):
        splice.init_inference("llama")
