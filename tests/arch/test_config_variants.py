"""Config variants real checkpoints use that the families' tiny models (``tiny_models.VARIANTS``) leave at their
defaults: each is either fused exactly (the unmodified model's fp32 logits and greedy tokens) or refused before any
change, naming the value."""
from __future__ import annotations

import copy

import pytest
import torch

import splice
from splice.arch.families import RECORDS
from splice.generation import prefill_positions

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


#: every decoder family whose record puts rotary positions in the block (each has a tiny config of its name)
ROTARY_FAMILIES = sorted(record.model_type for record in RECORDS if record.positions == "rotary" and not record.encoder)
#: the families whose Hugging Face attention rotates only ``partial_rotary_factor`` of each head (their rotary classes
#: and attention read it); the others' default rope rotates the whole head whatever the factor (GPT-J: rotary_dim)
HF_ROTATES_PART = ("gpt_neox", "phi", "phi3", "stablelm")


def with_partial_factor(config, factor: float, where: str):
    """``config`` with ``partial_rotary_factor`` set in its (text part's) ``rope_parameters``, each per-layer-type
    entry included, or as the top-level attribute a transformers 4 config carries."""
    text = config.get_text_config()
    if where == "top_level":
        text.partial_rotary_factor = factor
        return config
    params = text.rope_parameters
    entries = [value for value in params.values() if isinstance(value, dict)] or [params]
    for entry in entries:
        entry["partial_rotary_factor"] = factor
    return config


def assert_native_generate_matches(reference, engine, options: dict) -> None:
    """splice's own decode loop (never Hugging Face's generate on the fused model) gives the reference's greedy tokens
    on one prompt and on a left-padded batch, and its prefill the logits of the reference's first step."""
    hf_generate, decode_step = engine.module.generate, engine.runtime.decode_step
    calls = {"hf": 0, "native": 0}

    def count(key, function):
        return lambda *args, **kwargs: calls.__setitem__(key, calls[key] + 1) or function(*args, **kwargs)

    engine.module.generate, engine.runtime.decode_step = count("hf", hf_generate), count("native", decode_step)
    ids, mask = padded_batch(batch=3, length=10)
    with torch.inference_mode():
        for prompt, prompt_mask in ((ids[:1], mask[:1]), (ids, mask)):
            expected = reference.generate(prompt, attention_mask=prompt_mask, **options)
            assert torch.equal(engine.generate(prompt, attention_mask=prompt_mask, **options), expected)
        logits = dict(max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True)
        expected = reference.generate(ids, attention_mask=mask, **logits).logits[0]
        got = engine.runtime.forward(ids, prefill_positions(mask), torch.arange(ids.shape[1]),
                                     cache_for(engine, mask), ids.shape[1])
    assert calls["hf"] == 0 and calls["native"] > 0
    assert ((expected - got).abs().max() / expected.std()).item() < 1e-4


def cache_for(engine, mask):
    """A fresh native KV cache for the rows of ``mask``, started on their padding."""
    cache = engine.runtime.new_cache(mask.shape[0])
    cache.start(mask)
    return cache


#: (family, where its config gets the factor); GPT-J's config has no rope_parameters, and GPT-OSS's yarn rope reads a
#: factor in either place, which its whole-head attention then fails on (refused: the test below)
PARTIAL_CASES = [(name, where) for name in ROTARY_FAMILIES for where in ("rope_parameters", "top_level")
                 if (name, where) != ("gptj", "rope_parameters") and name != "gpt_oss"]


@pytest.mark.parametrize("name, where", PARTIAL_CASES, ids=[f"{name}-{where}" for name, where in PARTIAL_CASES])
def test_partial_rotary_factor_rotates_what_hugging_faces_model_rotates(name, where):
    """A config's ``partial_rotary_factor`` (0.25) is honoured only where the family's Hugging Face model applies it:
    splice's native loop builds its rotary table itself, and gives the reference's tokens and logits either way."""
    from splice.arch import lookup, model_dims

    config = with_partial_factor(family_config(name), 0.25, where)
    reference = randomised_vectors(build_tiny(config), seed=0)
    dims = model_dims(lookup(config), config)
    if name == "gptj":
        assert dims.rotary_dim == config.rotary_dim
    elif name in HF_ROTATES_PART and where == "rope_parameters":
        assert dims.rotary_dim == dims.head_dim // 4
    elif name not in HF_ROTATES_PART:
        assert dims.rotary_dim == dims.head_dim
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    assert_native_generate_matches(reference, engine, GREEDY)


def test_a_scaled_rope_on_part_of_the_head_matches_where_hugging_face_rotates_part():
    """GPT-NeoX applies the factor with every rope type: a linear rope on a quarter of each head matches."""
    config = family_config("gpt_neox")
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.25}
    reference = randomised_vectors(build_tiny(config), seed=0)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    assert_native_generate_matches(reference, engine, GREEDY)


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "gpt_oss"])
def test_a_scaled_rope_on_part_of_a_head_hugging_face_rotates_whole_is_refused_before_any_change(name):
    """Llama's attention (and Gemma 3's global layers', GPT-OSS's) rotates the whole head, but transformers' linear
    rope reads partial_rotary_factor and gives cos/sin for half of it: the unmodified model fails, so there is nothing
    to match; the default rope type, which rotates the whole head, is fused (above)."""
    config = family_config(name)
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    if name == "gemma3_text":
        config.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": linear}
    else:
        config.rope_parameters = linear
    model = randomised_vectors(build_tiny(config), seed=0)
    with pytest.raises(RuntimeError, match="must match the size"):
        model(torch.tensor([[1, 5, 9]]))
    with pytest.raises(ValueError, match=r"rope_type='linear' and partial_rotary_factor=0\.5.*allowed: "):
        splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=64)
    assert all(type(layer).__name__.endswith("DecoderLayer") for layer in model.model.layers)


@pytest.mark.parametrize("name, key, value", [("gpt_neox", "hidden_act", "gelu_fast"),
                                              ("gpt2", "activation_function", "gelu_python")])
def test_gelu_activations_under_other_names_are_fused(name, key, value):
    """transformers' ``gelu_fast`` (the tanh GELU with sqrt(2 / pi) written to 10 digits) and ``gelu_python`` (the
    exact GELU) are fused as the GELUs they are."""
    reference = build_variant(name, **{key: value})
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    assert_matches_the_reference(reference, engine)
