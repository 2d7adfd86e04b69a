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
from tests.arch.tiny_models import ENCODERS, FAMILIES, NEW_FAMILIES

CONFIGS = [QuantConfig(), QuantConfig(group_size=32), QuantConfig(bits=4, group_size=32, symmetric=False),
           QuantConfig(bits=4, group_size=32, symmetric=True), QuantConfig(activations=True)]


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.kind}-{c.group_size}{'' if c.symmetric else '-asym'}")
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


def test_an_int4_checkpoint_padded_for_cuda_loads_on_the_cpu(tmp_path):
    """A checkpoint written on a GPU holds int4 weights padded for CUDA's kernels (N to 8, K to 128): rewritten so
    here, it passes load_quantized's checks and gives the saved model's logits."""
    from safetensors.torch import save_file

    from splice.quant import kernels, qmath

    config = QuantConfig(bits=4, group_size=32, symmetric=False)
    model_config = tiny_llama_config()
    model = build_tiny(model_config)
    quantize(model, config)
    save_quantized(model, tmp_path, config)
    state = load_file(tmp_path / "model.safetensors")
    n_multiple, k_multiple = kernels.int4_padding(torch.device("cuda"), 32)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            n = -(-module.out_features // n_multiple) * n_multiple
            k = -(-module.in_features // k_multiple) * k_multiple
            state[f"{name}.qweight"] = qmath.fit_to(state[f"{name}.qweight"], (n, k // 2)).contiguous()
            state[f"{name}.scales_and_zeros"] = qmath.fit_to(state[f"{name}.scales_and_zeros"],
                                                             (k // 32, n, 2)).contiguous()
    save_file(state, tmp_path / "model.safetensors")
    loaded = load_quantized(build_tiny(model_config, seed=1), tmp_path, config)
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
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])  # rotary inv_freq recomputed
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 128, (1, 12))
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=0)
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


FAMILY_SCHEMES = {"int8": ({"dtype": torch.int8}, QuantConfig(bits=8)),
                  "int4": ({"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 32}}},
                           QuantConfig(bits=4, group_size=32, symmetric=False))}
#: other families' layouts: Conv1D (gpt2), per-head fused q/k/v (gpt_neox, bloom), one shared K/V head (falcon), an
#: encoder with a task head (bert)
#: every family kernel injection fuses, decoders and encoders
SAVED_FAMILIES = (*FAMILIES, *NEW_FAMILIES, *ENCODERS)


def _family(name: str, seed: int = 0):
    from tests.arch.tiny_models import build_encoder, build_family

    return build_encoder(name, "masked_lm", seed=seed) if name in ENCODERS else build_family(name, seed=seed)


@pytest.mark.parametrize("scheme", sorted(FAMILY_SCHEMES))
@pytest.mark.parametrize("name", SAVED_FAMILIES)
def test_other_families_round_trip(tmp_path, name, scheme):
    """``quantize`` + ``save_quantized`` + ``load_quantized`` into a skeleton of other random weights: the same logits
    on a padded batch, bit for bit."""
    from tests.arch.tiny_models import padded_batch

    config = FAMILY_SCHEMES[scheme][1]
    model = _family(name)
    quantize(model, config)
    save_quantized(model, tmp_path, config)
    loaded = load_quantized(_family(name, seed=1), tmp_path, config)
    ids, mask = padded_batch(batch=3, length=10, side="right" if name in ENCODERS else "left")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("scheme", sorted(FAMILY_SCHEMES))
@pytest.mark.parametrize("name", SAVED_FAMILIES)
def test_a_quantized_engine_reloads_into_a_float_engine(tmp_path, name, scheme):
    """A kernel-injected engine quantized by ``init_inference`` saves under its own scheme; a float engine built the
    same way (int8: bf16 activations) loads it: the same logits, and for decoders the same greedy tokens from the
    native decode loop (which must decode with the loaded head, not the skeleton's)."""
    import splice
    from tests.arch.tiny_models import padded_batch

    options, config = FAMILY_SCHEMES[scheme]
    engine = splice.init_inference(_family(name), replace_with_kernel_inject=True, max_out_tokens=64, **options)
    save_quantized(engine, tmp_path)
    assert read_scheme(tmp_path) == QuantConfig.from_inference_config(engine.inference_config)
    skeleton = splice.init_inference(_family(name, seed=1), replace_with_kernel_inject=True, max_out_tokens=64,
                                     dtype=torch.bfloat16 if scheme == "int8" else None)
    assert load_quantized(skeleton, tmp_path) is skeleton
    ids, mask = padded_batch(batch=3, length=10, side="right" if name in ENCODERS else "left")
    torch.testing.assert_close(skeleton(ids, attention_mask=mask).logits, engine(ids, attention_mask=mask).logits,
                               rtol=0, atol=0)
    if engine.runtime is not None:
        greedy = dict(max_new_tokens=8, do_sample=False)
        assert torch.equal(skeleton.generate(ids, attention_mask=mask, **greedy),
                           engine.generate(ids, attention_mask=mask, **greedy))


def test_a_kernel_injected_checkpoint_into_a_plain_model_is_refused_before_any_change(tmp_path):
    import splice

    engine = splice.init_inference(_family("gpt2"), replace_with_kernel_inject=True, dtype=torch.int8,
                                   max_out_tokens=64)
    save_quantized(engine, tmp_path)
    plain = _family("gpt2")
    with pytest.raises(ValueError, match=r"no module for: transformer\.h\.0\.qkv"):
        load_quantized(plain, tmp_path)
    assert type(plain.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    with pytest.raises(ValueError, match="was not quantized"):
        save_quantized(splice.init_inference(_family("gpt2")), tmp_path)


@pytest.mark.parametrize("other", [QuantConfig(bits=4, group_size=64), QuantConfig(bits=8),
                                   QuantConfig(bits=4, group_size=32, quantize_lm_head=True)],
                         ids=["other-group", "other-bits", "float-head-claimed-quantized"])
def test_saving_under_a_scheme_the_layers_do_not_have_is_refused_before_writing(tmp_path, other):
    """The folder would record a scheme its weights do not have, and then refuse to load."""
    model = build_tiny(tiny_llama_config())
    config = QuantConfig(bits=4, group_size=32, lm_head_int8=True)
    quantize(model, config)
    with pytest.raises(ValueError, match=r"layer .* is int\w+ with groups of .* allowed: the QuantConfig"):
        save_quantized(model, tmp_path / "out", other)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quantized_as, other, message", [
    (QuantConfig(bits=4, group_size=32), QuantConfig(bits=4, group_size=32, lm_head_int8=True),
     "layer lm_head is in float"),
    (QuantConfig(bits=4, group_size=32), QuantConfig(bits=4, group_size=32, quantize_lm_head=True),
     "layer lm_head is in float"),
    (QuantConfig(bits=8, quantize_qkv=False), QuantConfig(bits=8),
     r"layer model.layers.0.self_attn.q_proj is in float"),
    (QuantConfig(bits=8), QuantConfig(bits=8, quantize_qkv=False), r"q_proj is int8_weight_only, but .* keeps q/k/v"),
], ids=["float-head-claimed-int8", "float-head-claimed-scheme", "float-qkv-claimed-quantized",
        "quantized-qkv-claimed-float"])
def test_saving_under_a_scheme_that_would_quantize_other_layers_is_refused_before_writing(tmp_path, quantized_as,
                                                                                        other, message):
    """Float layers count too: a folder recording a head or q/k/v scheme the weights lack refuses to load under the
    scheme the model was really quantized with."""
    model = build_tiny(tiny_llama_config())
    quantize(model, quantized_as)
    with pytest.raises(ValueError, match=message + ".*allowed: the QuantConfig the model was quantized with"):
        save_quantized(model, tmp_path / "out", other)
    assert not (tmp_path / "out").exists()
    save_quantized(model, tmp_path / "ok", quantized_as)
    load_quantized(build_tiny(tiny_llama_config(), seed=1), tmp_path / "ok", quantized_as)


@pytest.mark.parametrize("overrides, message", [({"num_hidden_layers": 3}, "missing model.layers.2"),
                                                ({"vocab_size": 200}, "model.embed_tokens.weight: saved")])
def test_a_skeleton_that_does_not_fit_is_refused_before_any_change(tmp_path, overrides, message):
    """Nothing of the skeleton changes: no layer swapped for an empty quantized one, no float weight overwritten."""
    config = QuantConfig(bits=4, group_size=32)
    model = build_tiny(tiny_llama_config())
    quantize(model, config)
    save_quantized(model, tmp_path, config)
    skeleton = build_tiny(tiny_llama_config(**overrides), seed=1)
    before = {name: tensor.clone() for name, tensor in skeleton.state_dict().items()}
    with pytest.raises(ValueError, match="does not fit this model") as error:
        load_quantized(skeleton, tmp_path, config)
    assert message in str(error.value)
    assert not any(isinstance(m, QuantizedLinear) for m in skeleton.modules())
    after = skeleton.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_an_already_quantized_skeleton_is_refused_before_any_change(tmp_path):
    """Loading an int4 folder into an int8-quantized model would swap its layers under another scheme."""
    model_config = tiny_llama_config()
    model = build_tiny(model_config)
    quantize(model, QuantConfig(bits=4, group_size=32))
    save_quantized(model, tmp_path, QuantConfig(bits=4, group_size=32))
    skeleton = build_tiny(model_config, seed=1)
    quantize(skeleton, QuantConfig(bits=8))
    kinds = [type(module) for module in skeleton.modules()]
    with pytest.raises(ValueError, match="needs a float skeleton.*int8_weight_only"):
        load_quantized(skeleton, tmp_path)
    assert [type(module) for module in skeleton.modules()] == kinds


def test_a_skeleton_in_another_float_dtype_is_refused_before_any_change(tmp_path):
    """An fp32 folder loaded into a bf16 skeleton would round its norms and embeddings silently."""
    model_config = tiny_llama_config()
    model = build_tiny(model_config)
    quantize(model, QuantConfig(bits=4, group_size=32))
    save_quantized(model, tmp_path, QuantConfig(bits=4, group_size=32))
    skeleton = build_tiny(model_config, seed=1).to(torch.bfloat16)
    norm = skeleton.model.norm.weight.clone()
    with pytest.raises(ValueError, match="model.embed_tokens.weight: saved torch.float32, the model holds "
                                         "torch.bfloat16"):
        load_quantized(skeleton, tmp_path)
    assert not any(isinstance(module, QuantizedLinear) for module in skeleton.modules())
    assert torch.equal(skeleton.model.norm.weight, norm)
