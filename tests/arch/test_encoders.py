"""The encoder records (BERT, RoBERTa, DistilBERT) against the unmodified Hugging Face model with the same random
weights: their layers become splice's fused block (bidirectional attention, post-norm), their embeddings, pooler and
heads stay the model's own, and no decode runtime is built. fp32 last hidden states (and pooler output, and task-head
logits) within 1e-4 scaled by their std, batch 1 and a right-padded batch of 3; the fill-mask pipeline with
``pipe.model = engine`` gives the unmodified pipeline's top 5; bf16 native kernels, int8 and int4 weights agree."""
from __future__ import annotations

import copy

import pytest
import torch

import splice
from splice.arch import record_for
from splice.layers.block import SpliceBlock
from splice.layers.native_linear import NativeLinear
from splice.layers.native_linear import can_use_native

from ..snippet_models import wordpiece_tokenizer
from .tiny_models import ENCODERS, build_encoder, padded_batch

TEXTS = ["the capital of france is [MASK] .", "paris is a [MASK] in europe", "[MASK] is the capital"]


def scaled_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    return ((reference - value).abs().max() / reference.std()).item()


def injected(reference, **config):
    return splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, **config)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ENCODERS)
def test_hidden_states_match_the_reference(name, attention):
    """The bare model (pooler included for BERT and RoBERTa), with the boolean masks HF builds for SDPA and the
    additive float masks it builds for eager attention."""
    reference = build_encoder(name, _attn_implementation=attention)
    engine = injected(reference)
    layers = record_for(engine.module).layers
    assert all(isinstance(block, SpliceBlock) and not block.layout.causal
               for block in engine.module.get_submodule(layers))
    assert engine.runtime is None and "encoder layers" in engine.step_report("fuse").summary()
    ids, mask = padded_batch(batch=3, length=12, side="right")
    real = mask.bool()
    with torch.inference_mode():
        expected, got = reference(ids[:1]), engine(ids[:1])
        assert scaled_error(expected.last_hidden_state, got.last_hidden_state) < 1e-4
        expected, got = reference(ids, attention_mask=mask), engine(ids, attention_mask=mask)
        assert scaled_error(expected.last_hidden_state[real], got.last_hidden_state[real]) < 1e-4
        if name != "distilbert":
            assert scaled_error(expected.pooler_output, got.pooler_output) < 1e-4


@pytest.mark.parametrize("name", ENCODERS)
def test_sequence_classification_logits_match_the_reference(name):
    reference = build_encoder(name, "sequence_classification")
    engine = injected(reference)
    ids, mask = padded_batch(batch=3, length=12, side="right")
    with torch.inference_mode():
        expected, got = reference(ids, attention_mask=mask).logits, engine(ids, attention_mask=mask).logits
    assert expected.shape == (3, 2) and scaled_error(expected, got) < 1e-4


def test_task_models_and_the_bare_model_share_one_record():
    """The record's model paths are relative to the base model: rooted at a task model, they go through its
    ``base_model_prefix``."""
    assert record_for(build_encoder("bert")).layers == "encoder.layer"
    assert record_for(build_encoder("bert", "masked_lm")).layers == "bert.encoder.layer"
    assert record_for(build_encoder("distilbert", "sequence_classification")).layers == "distilbert.transformer.layer"


@pytest.mark.parametrize("name", ENCODERS)
def test_fill_mask_pipeline_gives_the_unmodified_pipelines_top5(name):
    """``pipe.model = engine`` in the fill-mask pipeline, one text at a time and as a padded batch; and
    ``engine(**tokenizer(texts, padding=True, return_tensors="pt"))`` (token type ids included for BERT) returns what
    the model returns."""
    from transformers import pipeline

    tokenizer = wordpiece_tokenizer()
    reference = build_encoder(name, "masked_lm", vocab_size=len(tokenizer))
    expected = pipeline("fill-mask", model=reference, tokenizer=tokenizer, top_k=5)
    pipe = pipeline("fill-mask", model=copy.deepcopy(reference), tokenizer=tokenizer, top_k=5)
    pipe.model = splice.init_inference(pipe.model, replace_with_kernel_inject=True)
    assert type(pipe.model).__name__ == "InferenceEngine"
    for want, got in zip(expected(TEXTS, batch_size=3), pipe(TEXTS, batch_size=3)):
        assert [w["token"] for w in want] == [g["token"] for g in got]
        assert [w["score"] for w in want] == pytest.approx([g["score"] for g in got], abs=1e-5)
    assert [w["token"] for w in expected(TEXTS[0])] == [g["token"] for g in pipe(TEXTS[0])]
    inputs = tokenizer(TEXTS, padding=True, return_tensors="pt", return_token_type_ids=name == "bert")
    assert inputs["attention_mask"].min() == 0  # the batch is padded
    with torch.inference_mode():
        want, got = reference(**inputs), pipe.model(**inputs)
    assert type(want) is type(got)
    real = inputs["attention_mask"].bool()
    assert scaled_error(want.logits[real], got.logits[real]) < 1e-4


def test_an_encoder_has_no_decode_runtime_and_no_generate():
    reference = build_encoder("bert", "masked_lm")
    engine = injected(reference, max_out_tokens=4096)  # no KV cache: the length bound does not apply
    assert engine.runtime is None and engine.step_report("fuse").kv_cache_tokens == 0
    assert not hasattr(engine, "generate")
    with pytest.raises(AttributeError, match="BertForMaskedLM has no generate"):
        engine.generate(torch.tensor([[5, 6, 7]]))


def test_compile_decode_on_an_encoder_is_refused_before_any_change():
    model = build_encoder("bert")
    with pytest.raises(ValueError, match="compile_decode=True .* model_type='bert' is an encoder"):
        splice.init_inference(model, replace_with_kernel_inject=True, compile_decode=True)
    assert type(model.encoder.layer[0]).__name__ == "BertLayer"


def test_a_decoder_bert_is_refused_before_any_change():
    model = build_encoder("bert")
    model.config.is_decoder = True
    with pytest.raises(ValueError, match="is_decoder=True"):
        splice.init_inference(model, replace_with_kernel_inject=True)
    assert type(model.encoder.layer[0]).__name__ == "BertLayer"


@pytest.mark.parametrize("name", ENCODERS)
def test_bf16_kernels_agree_with_the_bf16_reference(name):
    """bf16: the fused projections on splice's native linears where the CPU runs them (prompt-sized inputs go to
    ``F.linear`` inside them), hidden states close to HF's bf16 model on the real tokens of a padded batch."""
    reference = build_encoder(name, dtype=torch.bfloat16)
    engine = injected(reference, dtype=torch.bfloat16)
    floats = engine.step_report("kernels").float_linears
    if can_use_native(torch.bfloat16, torch.device("cpu")):
        assert floats.count == 4 * 2 and floats.kernel == "native"
        assert sum(isinstance(m, NativeLinear) for m in engine.module.modules()) == 4 * 2
    ids, mask = padded_batch(batch=3, length=12, side="right")
    real = mask.bool()
    with torch.inference_mode():
        expected = reference(ids, attention_mask=mask).last_hidden_state.float()[real]
        got = engine(ids, attention_mask=mask).last_hidden_state.float()[real]
    assert scaled_error(expected, got) < 0.05
    assert torch.nn.functional.cosine_similarity(expected, got, dim=-1).min() > 0.99


@pytest.mark.parametrize("name", ENCODERS)
@pytest.mark.parametrize("quant", [{"dtype": torch.int8},
                                   {"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 32}}}],
                         ids=["int8", "int4"])
def test_quantized_weights_agree_with_the_reference(name, quant):
    """Integer weights on the fused projections (and the task head's linears): masked-LM logits close to fp32 HF's
    and the argmax mostly the same over a padded batch (~100 tokens); int4 rounds tiny random weights coarsely."""
    reference = build_encoder(name, "masked_lm")
    engine = injected(reference, **quant)
    report = engine.step_report("quantize").quant
    assert report.quantized and engine.runtime is None
    ids, mask = padded_batch(batch=4, length=30, side="right")
    real = mask.bool()
    with torch.inference_mode():
        expected = reference(ids, attention_mask=mask).logits[real]
        got = engine(ids, attention_mask=mask).logits[real].float()
    int8 = "dtype" in quant
    relative = ((got - expected).norm() / expected.norm()).item()
    agreement = (expected.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert relative < (0.05 if int8 else 0.3), relative
    assert agreement > (0.9 if int8 else 0.6), agreement


@pytest.mark.parametrize("name", ENCODERS)
def test_hidden_states_of_every_layer_are_recorded_and_attention_weights_refused(name):
    """``output_hidden_states=True`` gives the reference's embeddings and every layer's output (transformers records
    them with hooks on its layer class; the fused blocks get the same hook); attention weights, which SDPA never
    forms, raise instead of coming back empty."""
    reference = build_encoder(name, "masked_lm")
    engine = injected(reference)
    ids, mask = padded_batch(batch=3, length=12, side="right")
    real = mask.bool()
    with torch.inference_mode():
        expected = reference(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        got = engine(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(got) == len(expected) == 3
    assert all(scaled_error(want[real], have[real]) < 1e-4 for want, have in zip(expected, got))
    with pytest.raises(ValueError, match="output_attentions=True needs the attention weights"):
        engine(ids, attention_mask=mask, output_attentions=True)
