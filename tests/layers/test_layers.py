"""The fused block's pieces against the Hugging Face modules they replace."""
from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from splice.arch import lookup, model_dims
from splice.layers.kv_cache import StaticKVCache
import splice
from splice import native
from splice.layers.norm import NATIVE_ROWS, RMSNorm
from splice.layers.rotary import apply_rotary_, build_table

from ..arch.tiny_models import build_family, family_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama(dtype):
    hf = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    torch.nn.init.normal_(hf.weight)
    x = torch.randn(2, 5, 64).to(dtype)
    ours = RMSNorm(hf.weight, 1e-5)
    assert ours.weight.data_ptr() == hf.weight.data_ptr()  # moved, not copied
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=1e-6 if dtype == torch.float32 else 0)


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_rms_norm_of_decode_rows_in_one_native_call_rounds_as_llama():
    """bf16 decode rows on the native call: HF's values but where a float32 sum of squares in another order rounds
    the normed value the other way (one bf16 step, rarely, and the weight's product rounded after it); a prompt's
    rows (more than NATIVE_ROWS) take the eager ops, exactly."""
    hf = LlamaRMSNorm(1000, eps=1e-6).bfloat16().requires_grad_(False)
    torch.nn.init.normal_(hf.weight)
    ours = RMSNorm(hf.weight, 1e-6)
    ours.native_rows = True
    rows = (torch.randn(4, 4, 1000, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    expected, got = hf(rows), ours(rows)
    assert (got == expected).float().mean() > 0.99
    steps = (got.float() - expected.float()).abs() / expected.float().abs().clamp_min(1e-30)
    assert steps.max() <= 2 ** -6  # at most two bf16 rounding steps apart
    prompt = torch.randn(1, NATIVE_ROWS + 1, 1000).bfloat16()
    assert torch.equal(ours(prompt), hf(prompt))
    with pytest.raises(RuntimeError, match=r"rms_norm: x must be contiguous bf16 \[\.\.\., n\] and weight bf16 \[n\]"):
        torch.ops.splice_kernels.rms_norm(rows, hf.weight[:10], 1e-6)


def test_the_kernels_step_puts_bf16_blocks_norms_on_the_native_call_only():
    for dtype, native_rows in ((torch.bfloat16, native.available()), (torch.float32, False)):
        engine = splice.init_inference(build_family("qwen3", dtype=dtype), dtype=dtype,
                                       replace_with_kernel_inject=True, max_out_tokens=16)
        norms = [m for m in engine.module.modules() if isinstance(m, RMSNorm)]
        assert norms and all(norm.native_rows == native_rows for norm in norms), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_offset_matches_gemma(dtype):
    hf = GemmaRMSNorm(64, eps=1e-6).to(dtype)
    torch.nn.init.normal_(hf.weight)
    x = torch.randn(2, 5, 64).to(dtype)
    torch.testing.assert_close(RMSNorm(hf.weight, 1e-6, offset=1.0)(x), hf(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rotary_table_and_in_place_apply_match_llama(rope):
    config = family_config("llama")
    config.rope_parameters = {**rope, "rope_theta": 10000.0}
    dims = model_dims(lookup(config), config)
    table = build_table(dims.rope, config, dims.head_dim, 40, torch.float32, "cpu")
    positions = torch.tensor([[0, 3, 7, 39], [1, 2, 30, 31]])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    q, k = torch.randn(2, 4, 4, 16), torch.randn(2, 2, 4, 16)  # [batch, heads, seq, head_dim]
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    table_cos, table_sin = table.lookup(positions)  # [batch, seq, 1, dim]
    qk = torch.cat([q, k], dim=1).transpose(1, 2).clone()  # [batch, seq, heads, head_dim]
    apply_rotary_(qk, table_cos, table_sin)
    torch.testing.assert_close(qk[:, :, :4].transpose(1, 2), q_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(qk[:, :, 4:].transpose(1, 2), k_ref, rtol=0, atol=1e-6)


def test_partial_rotary_leaves_the_rest_untouched():
    config = family_config("phi3")
    dims = model_dims(lookup(config), config)
    table = build_table(dims.rope, config, dims.head_dim, 8, torch.float32, "cpu")
    x = torch.randn(1, 3, 2, dims.head_dim)
    rotated = apply_rotary_(x.clone(), *table.lookup(torch.tensor([[1, 2, 3]])))
    assert torch.equal(rotated[..., dims.rotary_dim:], x[..., dims.rotary_dim:])
    assert not torch.equal(rotated[..., : dims.rotary_dim], x[..., : dims.rotary_dim])


def test_dynamic_rope_refuses_a_table_past_its_original_length():
    config = family_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    dims = model_dims(lookup(config), config)
    with pytest.raises(ValueError, match="dynamic"):
        build_table(dims.rope, config, dims.head_dim, 1000, torch.float32, "cpu")


def test_kv_cache_writes_in_place_and_masks():
    cache = StaticKVCache(n_layers=2, batch=2, kv_heads=1, max_len=6, head_dim=4, dtype=torch.float32, device="cpu")
    keys_ptr = cache.keys.data_ptr()
    cache.start(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    k = torch.ones(2, 1, 3, 4)
    out_k, _ = cache.update(1, k, 2 * k, torch.arange(3), kv_len=3)
    assert out_k.shape == (2, 1, 3, 4) and cache.keys.data_ptr() == keys_ptr and cache.keys[0].abs().sum() == 0
    mask = cache.mask(torch.arange(3), kv_len=3)
    assert mask[0, 0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    assert mask[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    cache.mark(torch.tensor([3]))
    assert cache.mask(torch.tensor([3]), kv_len=4, window=2)[1, 0].tolist() == [[False, False, True, True]]


@pytest.mark.parametrize("heads", [4, 6, 12, 32])
def test_alibi_slopes_match_bloom(heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    from splice.layers.block import alibi_slopes

    torch.testing.assert_close(alibi_slopes(heads), _get_alibi_slopes(heads, "cpu"), rtol=1e-6, atol=0)


def test_alibi_in_bf16_keeps_its_precision_deep_into_the_context():
    """BLOOM at 1500 tokens in bf16 against the unmodified model in fp32: a bias counted from slot 0 reaches hundreds
    there, which bf16 rounds by whole units (logits off by ~40 % of their std in the prompt, ~13 % in decode); counted
    from the query it stays within bf16's rounding of the rest."""
    import copy

    import splice

    from ..arch.tiny_models import build_family

    model = build_family("bloom")
    ids = torch.randint(3, 128, (1, 1500), generator=torch.Generator().manual_seed(0))
    greedy = dict(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    engine = splice.init_inference(copy.deepcopy(model), dtype=torch.bfloat16, replace_with_kernel_inject=True,
                                   max_out_tokens=1508)
    with torch.inference_mode():
        expected, got = model(ids).logits[0, -64:], engine(ids).logits[0, -64:].float()
        expected_steps = torch.stack(model.generate(ids, **greedy).logits)
        got_steps = torch.stack(engine.generate(ids, **greedy).logits).float()
    assert ((got - expected).abs().max() / expected.std()).item() < 0.1
    assert ((got_steps - expected_steps).abs().max() / expected_steps.std()).item() < 0.06


def test_gptj_every_two_rotation_is_rotate_half_on_permuted_features():
    """Permuting q and k by ``interleaved_to_halves`` turns GPT-J's rotation into splice's in-place one and keeps
    every q.k product."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rotary
    from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions

    from splice.layers.rotary import interleaved_to_halves, signed_sin

    rotary_dim, positions = 8, torch.arange(6)
    sin, cos = create_sinusoidal_positions(16, rotary_dim)[positions].chunk(2, dim=-1)
    q, k = torch.randn(2, 1, 6, 3, rotary_dim).unbind(0)  # [batch, seq, heads, dim]
    expected = (gptj_rotary(q, sin[None], cos[None]) * gptj_rotary(k, sin[None], cos[None])).sum(-1)
    order = interleaved_to_halves(rotary_dim)
    table_cos = torch.cat([cos, cos], -1)[None, :, None]
    table_sin = signed_sin(torch.cat([sin, sin], -1))[None, :, None]
    q2, k2 = q[..., order].clone(), k[..., order].clone()
    apply_rotary_(q2, table_cos, table_sin)
    apply_rotary_(k2, table_cos, table_sin)
    torch.testing.assert_close((q2 * k2).sum(-1), expected)


def test_grouped_qkv_rows_reorder_to_contiguous():
    """Per KV group ``[q0 q1 k v]`` (Falcon's new architecture; per head ``[q k v]`` when groups have one query head)
    becomes ``[q0 q1 q2 q3; k0 k1; v0 v1]``."""
    from splice.steps.fuse import grouped_to_contiguous

    rows = grouped_to_contiguous(n_q=4, n_kv=2, head_dim=1).tolist()
    assert rows == [0, 1, 4, 5, 2, 6, 3, 7]
    assert grouped_to_contiguous(n_q=2, n_kv=2, head_dim=2).tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_rms_norm_with_offset_matches_gemma3(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from splice.layers.norm import HeadRMSNorm

    q_norm, k_norm = Gemma3RMSNorm(16, eps=1e-6).to(dtype), Gemma3RMSNorm(16, eps=1e-6).to(dtype)
    torch.nn.init.normal_(q_norm.weight)
    torch.nn.init.normal_(k_norm.weight)
    x = torch.randn(2, 5, 3 + 1, 16).to(dtype)
    ours = HeadRMSNorm(q_norm.weight, k_norm.weight, 3, 1, 1e-6, offset=1.0)(x)
    torch.testing.assert_close(ours, torch.cat([q_norm(x[:, :, :3]), k_norm(x[:, :, 3:])], dim=2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_scaling_in_float32_matches_olmo2(dtype):
    """OLMo 2 multiplies by its weight in float32 and rounds once; Llama rounds, then multiplies (its bf16 results
    differ: the scale_float norm must be OLMo 2's, bit for bit)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    hf = Olmo2RMSNorm(64, eps=1e-6).to(dtype)
    torch.nn.init.normal_(hf.weight)
    x = (3 * torch.randn(4, 5, 64)).to(dtype)
    torch.testing.assert_close(RMSNorm(hf.weight, 1e-6, scale_float=True)(x), hf(x), rtol=0, atol=0)
    if dtype == torch.bfloat16:
        assert not torch.equal(RMSNorm(hf.weight, 1e-6)(x), hf(x))


def test_projection_rms_norm_matches_olmo2s_q_and_k_norms():
    """Each of q and k normalised over all its heads at once (OLMo 2's q_norm over num_heads * head_dim features)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from splice.layers.norm import ProjectionRMSNorm

    q_norm, k_norm = Olmo2RMSNorm(3 * 16, eps=1e-6), Olmo2RMSNorm(16, eps=1e-6)
    torch.nn.init.normal_(q_norm.weight)
    torch.nn.init.normal_(k_norm.weight)
    x = torch.randn(2, 5, 3 + 1, 16)
    ours = ProjectionRMSNorm(q_norm.weight, k_norm.weight, 3, 1e-6, scale_float=True)(x)
    expected = torch.cat([q_norm(x[:, :, :3].flatten(2)).view(2, 5, 3, 16), k_norm(x[:, :, 3:].flatten(2))[:, :, None]],
                         dim=2)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    per_head = torch.cat([q_norm(x[:, :, :3].flatten(2)), k_norm(x[:, :, 3:].flatten(2))], dim=2)
    assert ours.shape == (2, 5, 4, 16) and torch.equal(ours.flatten(2), per_head)


def test_rotary_in_float32_matches_olmo2_in_bf16():
    """OLMo 2 keeps cos and sin in float32 and rounds the rotated bf16 q and k once; splice's float32 table and
    apply_rotary_float_ give its bits, where the bf16 in-place rotation (Llama's rounding) does not."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RotaryEmbedding
    from transformers.models.olmo2.modeling_olmo2 import apply_rotary_pos_emb as olmo2_rotary

    from splice.layers.rotary import apply_rotary_float_

    config = family_config("olmo2")
    dims = model_dims(lookup(config), config)
    assert dims.rotary_float
    table = build_table(dims.rope, config, dims.head_dim, 40, torch.float32, "cpu")
    positions = torch.tensor([[0, 3, 7, 39], [1, 2, 30, 31]])
    cos, sin = Olmo2RotaryEmbedding(config)(torch.zeros(1, dtype=torch.bfloat16), positions)
    assert cos.dtype == torch.float32
    q, k = torch.randn(2, 4, 4, 16).bfloat16(), torch.randn(2, 2, 4, 16).bfloat16()  # [batch, heads, seq, dim]
    q_ref, k_ref = olmo2_rotary(q, k, cos, sin)
    qk = torch.cat([q, k], dim=1).transpose(1, 2).clone()  # [batch, seq, heads, head_dim]
    apply_rotary_float_(qk, *table.lookup(positions))
    assert torch.equal(qk[:, :, :4].transpose(1, 2), q_ref) and torch.equal(qk[:, :, 4:].transpose(1, 2), k_ref)
    rounded = torch.cat([q, k], dim=1).transpose(1, 2).clone()
    apply_rotary_(rounded, *build_table(dims.rope, config, dims.head_dim, 40, torch.bfloat16, "cpu").lookup(positions))
    assert not torch.equal(rounded[:, :, :4].transpose(1, 2), q_ref)


@pytest.mark.parametrize("name", ["silu", "swish", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh",
                                  "gelu", "gelu_python", "relu"])
def test_activations_match_hugging_faces(name):
    """Each activation name the fused block takes gives transformers' function of that name, up to fp32 rounding."""
    from transformers.activations import ACT2FN

    from splice.layers.block import activation

    x = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 6
    torch.testing.assert_close(activation(name)(x), ACT2FN[name](x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_sinks_is_gpt_oss_eager_attention(dtype):
    """The fused block's attention with sinks against GPT-OSS's own eager attention function on the same q, k, v (two
    query heads a KV head), sinks and causal mask (HF's at the dtype's minimum, splice's at -inf): bit for bit."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from splice.layers.block import additive_mask, attend_with_sinks

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 7, 16, generator=generator).to(dtype) for heads in (4, 2, 2))
    sinks = torch.randn(4, generator=generator).to(dtype)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    hf_mask = torch.zeros(1, 1, 7, 7, dtype=dtype).masked_fill(~causal, torch.finfo(dtype).min)
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    expected, _ = eager_attention_forward(module, q, k, v, hf_mask, scaling=0.25)
    got = attend_with_sinks(q, k, v, additive_mask(causal[None, None], 7, 7, dtype, q.device), 0.25, sinks)
    assert torch.equal(got.transpose(1, 2), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["sinks", "capped"])
def test_attention_that_forms_every_score_takes_long_prompts_in_query_chunks(monkeypatch, dtype, name):
    """Soft-capped attention and attention with sinks hold at most ``SCORE_ELEMENTS`` scores at once: a prompt past
    that goes in chunks of queries (here 3 of 2 x 4 x 23 keys: 8 chunks, the last short), each with its rows of the
    mask, and gives what the whole prompt at once gives (up to the matmuls' float rounding); the matmuls are never
    handed more queries than a chunk."""
    from splice.layers import block

    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, heads, 23, 16, generator=generator).to(dtype) for heads in (4, 2, 2))
    mask = block.additive_mask(torch.ones(23, 23, dtype=torch.bool).tril()[None, None], 23, 23, dtype, q.device)
    sinks = torch.randn(4, generator=generator).to(dtype)
    attend = {"sinks": lambda: block.attend_with_sinks(q, k, v, mask, 0.25, sinks),
              "capped": lambda: block.attend_capped(q, k, v, mask, 0.25, 5.0)}[name]
    whole = attend()
    monkeypatch.setattr(block, "SCORE_ELEMENTS", 2 * 4 * 23 * 3)
    queries = []
    real_matmul = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: queries.append(a.shape[2]) or real_matmul(a, b))
    chunked = attend()
    assert max(queries) == 3 and len(queries) == 16
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)  # a matmul of fewer rows may round differently
