"""InferenceEngine against the unmodified Hugging Face model."""
from __future__ import annotations

import copy

import pytest
import torch

import splice
from splice.engine import InferenceEngine

from .conftest import build_tiny, tiny_llama_config


@pytest.fixture
def pair():
    """A reference HF model and an identical copy handed to init_inference."""
    reference = build_tiny(tiny_llama_config())
    return reference, copy.deepcopy(reference)


PROMPTS = torch.tensor([[5, 17, 33, 9, 71, 4], [8, 3, 99, 12, 40, 6]])


def test_init_inference_returns_engine_module(pair):
    _, model = pair
    engine = splice.init_inference(model)
    assert isinstance(engine, InferenceEngine) and isinstance(engine, torch.nn.Module)
    assert engine.module is model and not engine.module.training
    assert [report.step for report in engine.reports] == ["dtype", "load", "shard", "fuse", "quantize", "kernels",
                                                          "place", "compile"]


def test_forward_matches_reference_logits(pair):
    reference, model = pair
    engine = splice.init_inference(model)
    with torch.no_grad():
        expected = reference(PROMPTS).logits
    assert torch.equal(engine(PROMPTS).logits, expected)


def test_greedy_generate_matches_hf_token_for_token(pair):
    reference, model = pair
    engine = splice.init_inference(model, max_out_tokens=64)
    expected = reference.generate(PROMPTS, max_new_tokens=24, do_sample=False)
    assert torch.equal(engine.generate(PROMPTS, max_new_tokens=24, do_sample=False), expected)


def test_beam_search_matches_hf(pair):
    reference, model = pair
    engine = splice.init_inference(model)
    kwargs = dict(max_new_tokens=12, num_beams=3, do_sample=False, early_stopping=True)
    expected = reference.generate(PROMPTS[:1], **kwargs)
    assert torch.equal(engine.generate(PROMPTS[:1], **kwargs), expected)


def test_too_long_request_raises_before_any_forward(pair):
    _, model = pair
    engine = splice.init_inference(model, max_out_tokens=16)
    engine.profile_model_time()
    with pytest.raises(ValueError, match="max_out_tokens=16"):
        engine.generate(PROMPTS, max_new_tokens=11)
    with pytest.raises(ValueError, match="max_out_tokens=16"):
        engine.generate(PROMPTS, max_length=17)
    assert engine.model_times() == []
    engine.generate(PROMPTS, max_new_tokens=10)  # exactly 16: allowed


def test_out_of_range_token_ids_raise(pair):
    _, model = pair
    engine = splice.init_inference(model)
    with pytest.raises(ValueError, match="token id 128"):
        engine(torch.tensor([[1, 128]]))
    with pytest.raises(ValueError, match="token id -1"):
        engine.generate(torch.tensor([[1, -1]]), max_new_tokens=2)
    with pytest.raises(TypeError, match="integer"):
        engine(torch.tensor([[1.0, 2.0]]))


def test_model_times_one_entry_per_forward_and_clears(pair):
    _, model = pair
    engine = splice.init_inference(model)
    with pytest.raises(RuntimeError, match="profile_model_time"):
        engine.model_times()
    engine.profile_model_time()
    engine(PROMPTS)
    engine(PROMPTS)
    times = engine.model_times()
    assert len(times) == 2 and all(t > 0 for t in times)
    assert engine.model_times() == []
    engine.generate(PROMPTS[:1], max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert len(engine.model_times()) == 5  # one prefill + four decode forwards


def test_real_model_says_paris(smollm2):
    model, tokenizer = smollm2
    engine = splice.init_inference(model)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    out = engine.generate(**inputs, max_new_tokens=4, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
    assert text.startswith(" Paris")
