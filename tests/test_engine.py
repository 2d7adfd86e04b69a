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


def test_deepspeed_engine_attributes(pair):
    """What code written for DeepSpeed's engine reads from it."""
    _, model = pair
    engine = splice.init_inference(model, tensor_parallel={"tp_size": 1})
    assert engine._config is engine.inference_config
    assert engine.mp_world_size == 1 and engine.mp_group is None and engine.mpu is None
    assert engine.injection_dict is None


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


@pytest.mark.parametrize("inject", [False, True])
def test_outputs_are_ordinary_tensors_the_caller_may_change(pair, inject):
    """As the model's own outputs (no_grad, not inference_mode): code such as ``logits /= temperature`` works."""
    reference, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=inject, max_out_tokens=32)
    with torch.no_grad():
        expected = reference(PROMPTS).logits
    logits = engine(PROMPTS).logits
    logits /= 2.0
    torch.testing.assert_close(logits, expected / 2.0)
    for options in (dict(), dict(return_dict_in_generate=True, output_scores=True)):
        output = engine.generate(PROMPTS, max_new_tokens=3, do_sample=False, **options)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        assert not sequences.is_inference()
        sequences[:, -1] = 0
        if options:
            assert not any(score.is_inference() for score in output.scores)


def test_only_plain_arguments_key_a_cuda_graph():
    """A call with a stateful argument (a Cache, which every run changes) never goes through a graph's warm-up."""
    from transformers import DynamicCache

    from splice.engine import _capturable

    ids = PROMPTS
    assert _capturable((ids,), dict(attention_mask=ids, use_cache=False, output_hidden_states=True))
    assert not _capturable((ids,), dict(past_key_values=DynamicCache()))
    assert not _capturable(((ids, ids),), {})


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


def hf_forward_count(model, ids, **kwargs) -> int:
    """How many times Hugging Face's generate calls the model: what DeepSpeed's forward hooks time."""
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    with torch.inference_mode():
        model.generate(ids, **kwargs)
    handle.remove()
    return len(calls)


@pytest.mark.parametrize("compile_decode", [False, True])
def test_model_times_native_loop_counts_prefill_and_each_decode_step(pair, compile_decode, fresh_compiles):
    reference, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, compile_decode=compile_decode,
                                   max_out_tokens=32)
    engine.profile_model_time(use_cuda_events=False)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert hf_forward_count(reference, PROMPTS, **kwargs) == 6
    engine.generate(PROMPTS, **kwargs)
    times = engine.model_times()
    assert len(times) == 6 and all(t > 0 for t in times)  # the prefill, then five decode steps
    assert engine.model_times() == []
    engine(PROMPTS)  # a plain call is one forward
    assert len(engine.model_times()) == 1


def test_model_times_native_loop_stops_counting_with_the_rows(pair):
    """A request that ends early at eos gives as many entries as Hugging Face's loop makes forwards."""
    reference, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    engine.profile_model_time()
    first = int(reference.generate(PROMPTS[:1], max_new_tokens=3, do_sample=False)[0, -1])
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=first, pad_token_id=0)
    forwards = hf_forward_count(reference, PROMPTS[:1], **kwargs)
    assert forwards < 10
    engine.generate(PROMPTS[:1], **kwargs)
    assert len(engine.model_times()) == forwards


def test_model_times_hf_fallback_counts_its_forwards(pair):
    reference, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    engine.profile_model_time()
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, no_repeat_ngram_size=2)  # not native
    engine.generate(PROMPTS, **kwargs)
    assert len(engine.model_times()) == hf_forward_count(reference, PROMPTS, **kwargs) == 5


def test_profile_model_time_refuses_a_non_boolean(pair):
    engine = splice.init_inference(pair[1])
    with pytest.raises(TypeError, match="use_cuda_events='yes'"):
        engine.profile_model_time(use_cuda_events="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("use_cuda_events", [True, False])
def test_model_times_on_cuda(pair, use_cuda_events):
    _, model = pair
    engine = splice.init_inference(model.cuda(), replace_with_kernel_inject=True, max_out_tokens=32)
    engine.profile_model_time(use_cuda_events=use_cuda_events)
    engine.generate(PROMPTS.cuda(), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    times = engine.model_times()
    assert len(times) == 4 and all(t > 0 for t in times)


def test_real_model_says_paris(smollm2):
    model, tokenizer = smollm2
    engine = splice.init_inference(model)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    out = engine.generate(**inputs, max_new_tokens=4, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
    assert text.startswith(" Paris")
