"""Every family record beyond the Llama-like six (whose parity tests are in ``tests/steps/test_fuse.py`` and
``tests/test_generation.py``), in each variant its config switches (see ``tiny_models.VARIANTS``), against the
unmodified Hugging Face model with the same random weights: fp32 logits within 1e-4 (scaled by the logit std) and 48
greedy tokens identical, batch 1 and a left-padded batch of 3. For every family: bf16 native kernels and
int8 / int4 weights; for some, the compiled decode step. Configs the fused block cannot express are refused before
any change."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

import splice
from splice.generation import prefill_positions
from splice.layers.block import SpliceBlock
from splice.steps.fuse import inject

from .tiny_models import (FAMILIES, NEW_FAMILIES, VARIANTS, assert_bf16_injection_close_to_hf, build_family, build_tiny,
                          padded_batch, randomised_vectors, tiny_config)

GREEDY = dict(max_new_tokens=48, do_sample=False, eos_token_id=None)


def scaled_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    return ((reference - value).abs().max() / reference.std()).item()


def native_logits(runtime, ids, mask):
    cache = runtime.new_cache(ids.shape[0])
    cache.start(mask)
    return runtime.forward(ids, prefill_positions(mask), torch.arange(ids.shape[1]), cache, ids.shape[1],
                           last_only=False)


def positions_for(model, mask) -> dict:
    """Left-padded rows need mask-aware positions where the HF forward would count pads (learned positions)."""
    return {"position_ids": prefill_positions(mask)} if "position_ids" in inspect.signature(model.forward).parameters \
        else {}


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_the_reference(name):
    reference = build_family(name)
    model = copy.deepcopy(reference)
    runtime = inject(model, max_out_tokens=64)
    assert all(isinstance(block, SpliceBlock) for block in runtime.blocks)
    ids, mask = padded_batch(batch=3, length=12)
    real, extra = mask.bool(), positions_for(reference, mask)
    with torch.inference_mode():
        expected = reference(ids[:1]).logits
        assert scaled_error(expected, model(ids[:1]).logits) < 1e-4  # HF forward through the fused blocks
        assert scaled_error(expected, native_logits(runtime, ids[:1], mask[:1])) < 1e-4  # splice's native path
        expected = reference(ids, attention_mask=mask, **extra).logits[real]
        assert scaled_error(expected, model(ids, attention_mask=mask, **extra).logits[real]) < 1e-4
        assert scaled_error(expected, native_logits(runtime, ids, mask)[real]) < 1e-4


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_tokens_match_the_reference(name):
    """splice's decode loop gives the reference's 48 greedy tokens, and so does Hugging Face's own generate (its
    cache, through the fused blocks) on the padded batch."""
    reference = build_family(name)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    ids, mask = padded_batch(batch=3, length=10)
    with torch.inference_mode():
        for prompt, prompt_mask in ((ids[:1], mask[:1]), (ids, mask)):
            expected = reference.generate(prompt, attention_mask=prompt_mask, **GREEDY)
            assert torch.equal(engine.generate(prompt, attention_mask=prompt_mask, **GREEDY), expected)
        assert torch.equal(engine.module.generate(ids, attention_mask=mask, **GREEDY), expected)


@pytest.mark.parametrize("name", sorted(set(FAMILIES) | set(VARIANTS)))
def test_right_padded_greedy_tokens_match_the_reference(name):
    """A right-padded batch gets the reference's greedy tokens (which Hugging Face takes, for a right-padded row, from
    the last pad's query), in the native loop: ALiBi counts each row's real tokens, sliding windows stay while no
    row's pads fill a window (the tiny models' windows are 4 and 6, the batch below has 3 pads at most)."""
    reference = build_family(name)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    ids, mask = padded_batch(batch=2, length=10, side="right")
    options = dict(GREEDY, max_new_tokens=24)
    hf_generate = engine.module.generate
    calls = []
    engine.module.generate = lambda *args, **kwargs: calls.append(1) or hf_generate(*args, **kwargs)
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=mask, **options)
        assert torch.equal(engine.generate(ids, attention_mask=mask, **options), expected)
    assert not calls  # splice's own loop, not Hugging Face's generate on the fused model


#: ALiBi models on prompts past 256 positions, where bf16 stops holding every position (and, from 16 heads, every
#: slope): (family, config overrides)
LONG_ALIBI = [("falcon:alibi", {}), ("falcon:alibi", {"num_attention_heads": 16}), ("bloom", {})]


@pytest.mark.parametrize("name, overrides", LONG_ALIBI, ids=["falcon_alibi", "falcon_alibi_16_heads", "bloom"])
def test_alibi_generate_logits_match_the_reference_on_long_prompts(name, overrides):
    """The native loop's logits, prefill and every decode step, on a 400-token prompt, a left-padded batch and a
    right-padded one, a row 150 pads shorter, match the reference's, and so do those of Hugging Face's generate on the
    fused model on the right-padded batch: Falcon's HF model rounds ALiBi's bias to bf16 at each key's position in its
    row, BLOOM's keeps it exact; both count a right-padded row's new tokens from its last real token."""
    reference = randomised_vectors(build_tiny(tiny_config(name, **overrides)), seed=0)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=404)
    ids = torch.randint(3, 128, (2, 400), generator=torch.Generator().manual_seed(0))
    left, right = torch.ones_like(ids), torch.ones_like(ids)
    left[1, :150] = 0
    right[1, -150:] = 0
    options = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                   return_dict_in_generate=True)
    hf_generate = engine.module.generate
    calls = []
    engine.module.generate = lambda *args, **kwargs: calls.append(1) or hf_generate(*args, **kwargs)
    batches = [(ids[:1], left[:1]), (ids.masked_fill(left == 0, 0), left), (ids.masked_fill(right == 0, 0), right)]
    with torch.inference_mode():
        for prompt, mask in batches:
            expected = reference.generate(prompt, attention_mask=mask, **options)
            got = engine.generate(prompt, attention_mask=mask, **options)
            assert torch.equal(got.sequences, expected.sequences)
            assert scaled_error(torch.stack(expected.logits, 1), torch.stack(got.logits, 1)) < 1e-4
        assert not calls  # splice's own loop, not Hugging Face's generate on the fused model
        got = hf_generate(prompt, attention_mask=mask, **options)  # the fused blocks' HF path, right-padded
        assert scaled_error(torch.stack(expected.logits, 1), torch.stack(got.logits, 1)) < 1e-4


def test_bloom_bf16_right_padded_is_no_further_from_fp32_than_hf_bf16():
    """BLOOM in bf16 on a right-padded batch of 1500 positions (a row 600 pads shorter), native loop and the fused
    blocks' HF path: the logits' error against the unmodified fp32 model is no larger than the unmodified bf16
    model's own (whose bias, slope times position rounded to bf16, is off by units there)."""
    reference = build_family("bloom")
    reference_bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, dtype=torch.bfloat16,
                                   max_out_tokens=1504)
    ids = torch.randint(3, 128, (2, 1500), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -600:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    options = dict(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                   return_dict_in_generate=True)

    def logits(model, generate=None):
        return torch.stack((generate or model.generate)(ids, attention_mask=mask, **options).logits, 1).float()

    with torch.inference_mode():
        expected = logits(reference)
        hf_bf16_error = scaled_error(expected, logits(reference_bf16))
        for got in (logits(engine), logits(engine.module)):
            assert scaled_error(expected, got) <= hf_bf16_error


@pytest.mark.slow
def test_falcon_alibi_bias_is_hf_bias_eager_and_compiled():
    """The rounded bias equals the one Falcon's HF model builds, bit for bit, for 32 heads (slopes bf16 does not hold)
    over a left-padded batch of 3000 positions, also compiled (inductor computes a bf16 product in fp32 and would drop
    its rounding)."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    from splice.layers.block import alibi_slopes, rounded_alibi_bias

    mask = torch.ones(2, 3000, dtype=torch.long)
    mask[1, :700] = 0
    expected = build_alibi_tensor(mask, 32, torch.float32).view(2, 32, 1, 3000) / 8
    real = mask.bool()[:, None, None].expand_as(expected)
    for bias in (rounded_alibi_bias, torch.compile(rounded_alibi_bias)):
        assert torch.equal(bias(alibi_slopes(32), mask.bool(), 1 / 8)[real], expected[real])


@pytest.mark.parametrize("name", FAMILIES + NEW_FAMILIES)
def test_bf16_kernels_agree_with_the_bf16_reference(name):
    reference = build_family(name, dtype=torch.bfloat16)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, dtype=torch.bfloat16,
                                   max_out_tokens=64)
    assert_bf16_injection_close_to_hf(reference, engine)


@pytest.mark.parametrize("name", FAMILIES + NEW_FAMILIES)
@pytest.mark.parametrize("quant", [{"dtype": torch.int8},
                                   {"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 32}}}],
                         ids=["int8", "int4"])
def test_quantized_weights_agree_with_the_reference(name, quant):
    """Integer weights on the fused projections stay close to fp32 HF: logits within the scheme's rounding error and
    the next-token argmax mostly the same, over enough tokens that one token does not decide it. Tiny random weights
    round badly at 4 bits, hence int4's looser bounds; a broken kernel misses both by far."""
    reference = build_family(name)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64,
                                   **quant)
    assert engine.step_report("quantize").quant.quantized
    ids, mask = padded_batch(batch=4, length=40)  # ~140 tokens: one token more or less moves agreement by < 1 %
    real, extra = mask.bool(), positions_for(reference, mask)
    with torch.inference_mode():
        expected = reference(ids, attention_mask=mask, **extra).logits[real]
        got = engine(ids, attention_mask=mask, **extra).logits[real]
    int8 = "dtype" in quant
    relative = ((got.float() - expected).norm() / expected.norm()).item()
    agreement = (expected.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert relative < (0.05 if int8 else 0.3), relative
    assert agreement > (0.9 if int8 else 0.6), agreement


@pytest.mark.parametrize("name, tables", [("olmo", torch.float32), ("olmo2", torch.float32), ("olmo3", torch.float32),
                                          ("cohere", torch.bfloat16), ("cohere2", torch.bfloat16)])
def test_families_rotating_in_float32_decode_on_their_own_tables(name, tables):
    """OLMo's rotary tables stay float32, Cohere's are rounded to bf16, and both rotate their bf16 q and k in float32
    (rounded once), in the decode runtime as in the HF path: bf16 greedy tokens agree with the bf16 reference's."""
    reference = build_family(name, dtype=torch.bfloat16)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, dtype=torch.bfloat16,
                                   max_out_tokens=64)
    assert engine.runtime.blocks[0].layout.rotary_float and engine.runtime.rope(0).cos.dtype == tables
    ids, mask = padded_batch()
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)[:, ids.shape[1]:]
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)[:, ids.shape[1]:]
    assert (expected == got).float().mean() > 0.9


#: (family, smallest attended length, max_out_tokens, new tokens, the attended lengths compiled). ALiBi,
#: soft-capped, interleaved-rotary, post-norm (learned positions and OPT's projections in the graph) and local-window
#: blocks cross a change of the attended length (16, then 32 slots); every other family and variant compiles one.
COMPILED_CASES = [
    *[(name, 16, 64, 16, {16, 32}) for name in ("bloom", "falcon:alibi", "gemma2", "gptj", "opt:post_norm",
                                                 "gpt_neo")],
    *[(name, 32, 32, 12, {32}) for name in (
        "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt_neox", "gpt_neox:sequential", "gpt2", "opt", "phi",
        "falcon", "falcon:new_architecture", "gemma3_text", "gemma3", "gpt_bigcode", "mixtral", "qwen2_moe",
        "qwen3_moe", "olmo", "olmo2", "olmo3", "olmoe", "starcoder2", "stablelm:parallel", "granite", "granitemoe",
        "cohere", "cohere2", "gpt_oss")],
]


@pytest.mark.slow
@pytest.mark.parametrize("name, min_attended, max_out_tokens, new_tokens, lengths", COMPILED_CASES,
                         ids=[case[0] for case in COMPILED_CASES])
def test_compiled_decode_gives_the_reference_tokens(name, min_attended, max_out_tokens, new_tokens, lengths):
    """compile_decode=True gives the unmodified model's greedy tokens on every decoder family."""
    reference = build_family(name)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=max_out_tokens)
    engine.runtime.min_attended = min_attended
    ids, mask = padded_batch(batch=3, length=10)
    options = dict(GREEDY, max_new_tokens=new_tokens)
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=mask, **options)
    assert torch.equal(engine.generate(ids, attention_mask=mask, **options), expected)
    assert {key[1] for key in engine.runtime._compiled_keys} == lengths


def test_a_config_the_block_cannot_express_is_refused_before_any_change():
    model = build_family("bloom")
    model.config.apply_residual_connection_post_layernorm = True
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm=True"):
        splice.init_inference(model, replace_with_kernel_inject=True)
    assert type(model.transformer.h[0]).__name__ == "BloomBlock"


@pytest.mark.parametrize("name, key, layer", [("stablelm", "qk_layernorm", "StableLmDecoderLayer"),
                                              ("cohere", "use_qk_norm", "CohereDecoderLayer")])
def test_per_head_qk_layernorms_are_refused_before_any_change(name, key, layer):
    """One LayerNorm module a head (StableLM's qk_layernorm) or a weight row a head (Cohere's use_qk_norm) is not a
    qk-norm the fused block computes."""
    model = build_tiny(tiny_config(name, **{key: True}))
    with pytest.raises(ValueError, match=f"model_type='{name}' with {key}=True"):
        splice.init_inference(model, replace_with_kernel_inject=True)
    assert type(model.model.layers[0]).__name__ == layer


def test_a_layer_without_the_parts_its_record_names_is_refused_before_any_change():
    model = build_family("gpt2")
    del model.transformer.h[0].ln_2
    with pytest.raises(ValueError, match=r"no transformer\.h\.0\.ln_2"):
        splice.init_inference(model, replace_with_kernel_inject=True)
    assert type(model.transformer.h[1]).__name__ == "GPT2Block"


def test_max_out_tokens_past_the_learned_positions_is_refused():
    with pytest.raises(ValueError, match="max_out_tokens=300 exceeds the 256 learned positions"):
        splice.init_inference(build_family("opt"), replace_with_kernel_inject=True, max_out_tokens=300)


def test_attention_widths_that_are_not_the_configs_heads_are_refused_before_any_change():
    model = build_family("falcon:new_architecture")
    model.config.num_kv_heads = 1  # the checkpoint's fused projection holds 2 KV heads
    with pytest.raises(ValueError, match=r"query_key_value gives 128 features where 4 query and 1 key/value heads "
                                         r"of 16 need 96"):
        splice.init_inference(model, replace_with_kernel_inject=True)
    assert type(model.transformer.h[0]).__name__ == "FalconDecoderLayer"


def test_variants_are_read_from_the_config():
    from splice.arch import lookup, model_dims

    def dims(name):
        config = build_family(name).config
        return model_dims(lookup(config), config)

    assert dims("gpt_neox").parallel and not dims("gpt_neox:sequential").parallel
    assert dims("gpt_neox").rotary_dim == 8 and dims("gptj").rotary_dim == 8
    assert not dims("opt:post_norm").norm_before and dims("opt").norm_before
    falcons = ("falcon", "falcon:new_architecture", "falcon:sequential")
    assert [dims(name).n_kv_heads for name in falcons] == [1, 2, 4]
    assert dims("falcon:alibi").positions == "alibi" and dims("falcon").positions == "rotary"
    assert dims("gpt2").layer_scale(1) == 16 ** -0.5 and dims("gpt2:layer_scaled").layer_scale(1) == 1 / 2
    gemma2 = dims("gemma2")
    assert (gemma2.attn_scale, gemma2.attn_softcap, gemma2.final_softcap) == (24 ** -0.5, 2.0, 3.0)
    assert dims("gpt_neo").windows == (None, 4) and dims("gpt_neo").layer_scale(0) == 1.0
    gemma3 = dims("gemma3_text")
    assert gemma3.windows == (6, None) and gemma3.layer_rope(0).theta != gemma3.layer_rope(1).theta


def test_gemma3_with_an_image_runs_hugging_faces_generate_on_the_fused_language_model():
    """Image inputs are not splice's decode loop's: they go to HF's generate, whose language model runs the fused
    blocks (with the image tokens' bidirectional mask HF builds), and give the reference's tokens."""
    reference = build_family("gemma3")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    ids = torch.tensor([[1, 5, 125, 127, 127, 127, 127, 126, 9, 33, 41]])  # <boi> 4 image tokens <eoi>
    image = dict(pixel_values=torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0)),
                 token_type_ids=(ids == 127).long())
    with torch.inference_mode():
        expected = reference(ids, **image).logits
        assert scaled_error(expected, engine(ids, **image).logits) < 1e-4
        options = dict(GREEDY, max_new_tokens=12)
        assert torch.equal(engine.generate(ids, **image, **options), reference.generate(ids, **image, **options))


@pytest.mark.parametrize("name", ["llama", "gpt2", "falcon", "gemma3"])
def test_forward_records_every_layers_hidden_states(name):
    """``engine(ids, output_hidden_states=True)``: the fused blocks' outputs, as the reference records its layers'
    (through transformers' hooks on the layer class, or the model's own loop: Falcon)."""
    reference = build_family(name)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    ids, mask = padded_batch(batch=3, length=10)
    real = mask.bool()
    with torch.inference_mode():
        expected = reference(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        got = engine(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(got) == len(expected) == 3
    assert all(scaled_error(want[real], have[real]) < 1e-4 for want, have in zip(expected, got))


@pytest.mark.parametrize("name", [*FAMILIES, *VARIANTS])
def test_options_outside_the_native_loop_run_hf_generate_on_the_fused_blocks(name):
    """Beam search is not in the native loop: Hugging Face's generate runs on the fused model (each block through its
    HF decoder-layer interface, HF's own KV cache) and gives the unmodified model's beams."""
    reference = build_family(name)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    ids, mask = padded_batch(batch=2, length=8)
    options = dict(max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None)
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=mask, **options)
    assert torch.equal(engine.generate(ids, attention_mask=mask, **options), expected)
