"""Config variants real checkpoints use that the families' tiny models (``tiny_models.VARIANTS``) leave at their
defaults: each is either fused exactly (the unmodified model's fp32 logits and greedy tokens) or refused before any
change, naming the value."""
from __future__ import annotations

import copy

import pytest
import torch

import splice

from .tiny_models import build_tiny, family_config, padded_batch, randomised_vectors

GREEDY = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)


def build_variant(name: str, **overrides):
    """The tiny model of family ``name`` from its config with ``overrides`` set before the model is built."""
    config = family_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    return randomised_vectors(build_tiny(config), seed=0)


def assert_matches_the_reference(reference, engine) -> None:
    ids, mask = padded_batch(batch=3, length=10)
    real = mask.bool()
    with torch.inference_mode():
        for prompt, prompt_mask in ((ids[:1], mask[:1]), (ids, mask)):
            expected = reference(prompt, attention_mask=prompt_mask).logits[real[: len(prompt)]]
            got = engine(prompt, attention_mask=prompt_mask).logits[real[: len(prompt)]]
            assert ((expected - got).abs().max() / expected.std()).item() < 1e-4
            assert torch.equal(engine.generate(prompt, attention_mask=prompt_mask, **GREEDY),
                               reference.generate(prompt, attention_mask=prompt_mask, **GREEDY))


def test_gemma3_scores_are_not_soft_capped_as_in_hugging_faces_gemma3():
    """Gemma 3's attention never applies ``attn_logit_softcapping`` (its final logits do take
    ``final_logit_softcapping``), so a config that sets it still gets uncapped scores."""
    reference = build_variant("gemma3_text", attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    assert_matches_the_reference(reference, engine)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3_text"])
def test_bidirectional_gemma_is_refused_before_any_change(name):
    """``use_bidirectional_attention=True`` (embedding Gemmas) attends to later tokens, which the causal fused block
    and its KV cache cannot."""
    model = build_variant(name)
    model.config.use_bidirectional_attention = True
    layer = type(model.model.layers[0])
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=64)
    assert type(model.model.layers[0]) is layer


def test_a_rope_that_rescales_itself_on_one_layer_type_limits_max_out_tokens():
    """A per-layer-type rope (Gemma 3) whose global layers' dynamic rope rescales past 32 positions: max_out_tokens
    past that is refused at init, whichever layer type comes first."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000000.0}}
    model = build_variant("gemma3_text", rope_parameters=rope, max_position_embeddings=32)
    with pytest.raises(ValueError, match=r"max_out_tokens=64 exceeds 32, past which rope_type='dynamic'"):
        splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=64)
    assert type(model.model.layers[0]).__name__ == "Gemma3DecoderLayer"


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
def test_a_model_loaded_for_attention_whose_masks_the_block_cannot_read_is_refused(implementation):
    """flex_attention hands the layers a BlockMask and flash attention the 2-D padding mask; the fused block applies
    sdpa's and eager's masks only."""
    model = build_variant("llama")
    model.config._attn_implementation = implementation
    with pytest.raises(ValueError, match=f"attn_implementation='{implementation}'.*allowed: attn_implementation="):
        splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=64)
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"


def test_a_longrope_configs_original_context_is_read_where_transformers_4_keeps_it():
    """A transformers 4.x Phi-3 config keeps ``original_max_position_embeddings`` beside ``rope_scaling``, not in it:
    past it the model switches to the long factors, so a static table is exact only up to it."""
    from types import SimpleNamespace

    from splice.arch.record import rope_spec

    config = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=256, original_max_position_embeddings=32,
                             rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    assert rope_spec(config).max_positions == 32
