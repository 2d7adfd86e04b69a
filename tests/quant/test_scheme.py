"""QuantConfig: validation and the mapping from splice's (DeepSpeed-style) InferenceConfig."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from splice.arch.families import RECORDS
from splice.config import SpliceIgnoredOptionWarning, resolve_config
from splice.quant import QuantConfig
from splice.quant.layers import Int8DynamicLinear, Int8WeightOnlyLinear
from splice.quant.scheme import is_qkv_projection


def _from(**kwargs):
    return QuantConfig.from_inference_config(resolve_config(kwargs))


def test_no_quantization_by_default():
    assert _from() is None
    assert _from(dtype="bf16") is None


@pytest.mark.parametrize("dtype", [torch.int8, "int8", "torch.int8"])
def test_int8_dtype_is_int8_weight_only_per_channel(dtype):
    config = _from(dtype=dtype)
    assert config == QuantConfig(bits=8, lm_head_int8=True) and config.kind == "int8_weight_only"
    assert config.group_for(576) is None


def test_deepspeed_keys_map_to_the_scheme():
    config = _from(quant={"enabled": True, "weight": {"num_bits": 4, "q_groups": 9, "q_type": "asymmetric"}})
    assert config.kind == "int4_weight_only" and not config.symmetric
    assert config.group_for(576) == 64  # in_features / q_groups
    assert _from(quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 128}}).group_for(4096) == 128
    assert _from(quant={"enabled": True, "weight": {"num_bits": 4}}).group_for(576) == 32  # the int4 default
    assert _from(quant={"enabled": True, "activation": {"enabled": True}}).kind == "int8_dynamic"
    assert not _from(quant={"enabled": True, "qkv": {"enabled": False}}).quantize_qkv


@pytest.mark.parametrize("quant, message", [
    ({"weight": {"num_bits": 8, "q_type": "asymmetric"}}, "asymmetric"),
    ({"weight": {"num_bits": 4, "group_size": 48}}, "group_size=48"),
    ({"weight": {"num_bits": 4}, "activation": {"enabled": True}}, "num_bits=4"),
    ({"activation": {"enabled": True, "q_type": "asymmetric"}}, "q_type='asymmetric'"),
    ({"weight": {"group_size": 64}, "activation": {"enabled": True}}, "per output channel"),
    ({"weight": {"enabled": False}, "activation": {"enabled": True}}, "weight.enabled=False"),
    ({"weight": {"num_bits": 4, "q_dtype": "int8"}}, "q_dtype"),
])
def test_unsupported_values_raise_naming_value_and_choices(quant, message):
    with pytest.raises(ValueError, match="allowed") as error:
        _from(quant={"enabled": True, **quant})
    assert message in str(error.value)


def test_int8_dtype_contradicting_num_bits_raises():
    with pytest.raises(ValueError, match="num_bits=4"):
        _from(dtype="int8", quant={"enabled": True, "weight": {"num_bits": 4}})


def test_q_groups_must_divide_in_features():
    with pytest.raises(ValueError, match="q_groups=7 does not divide in_features=576"):
        QuantConfig(q_groups=7).group_for(576)
    with pytest.raises(ValueError, match="int4 group sizes"):
        QuantConfig(bits=4, q_groups=3).group_for(576)  # groups of 192


@pytest.mark.parametrize("config, allowed", [
    (QuantConfig(group_size=1000), "a group_size that fits every quantized layer (at most 64 here), or no group_size "
                                   "(one scale per output channel)"),
    (QuantConfig(bits=4, group_size=128), "an int4 group_size that fits (32, 64)"),
])
def test_a_group_wider_than_the_layer_raises_naming_value_width_and_choices(config, allowed):
    """A group wider than the layer would be zero-padded to the group: stored bytes that hold nothing."""
    with pytest.raises(ValueError, match="allowed") as error:
        config.group_for(64)
    assert f"group_size={config.group_size}" in str(error.value) and "in_features=64" in str(error.value)
    assert allowed in str(error.value)


def test_a_group_as_wide_as_the_layer_is_allowed():
    assert QuantConfig(group_size=64).group_for(64) == 64
    assert QuantConfig(bits=4, group_size=64).group_for(64) == 64


def test_round_trips_through_a_dict():
    config = QuantConfig(bits=4, group_size=64, symmetric=False, quantize_lm_head=True)
    assert QuantConfig.from_dict(config.to_dict()) == config


# ---------------------------------------------------------------- dtype=int8 applies the quant section (DeepSpeed)
def _int8_engine(model, quant, **kwargs):
    import splice

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may be dropped with a mere warning either
        return splice.init_inference(model, dtype="int8", quant=quant, device="cpu", **kwargs)


def _layer(engine, name="self_attn.q_proj"):
    return engine.module.get_submodule(f"model.layers.0.{name}")


@pytest.mark.parametrize("weight, group_for", [
    ({"group_size": 16}, lambda in_features: 16),
    ({"q_groups": 4}, lambda in_features: in_features // 4),  # groups per output row
])
def test_int8_dtype_honours_the_weight_grouping(tiny_llama, weight, group_for):
    engine = _int8_engine(tiny_llama, {"weight": weight})
    for name in ("self_attn.q_proj", "mlp.down_proj"):  # in_features 64 and 128
        layer = _layer(engine, name)
        group = group_for(layer.in_features)
        assert isinstance(layer, Int8WeightOnlyLinear) and layer.grouped and layer.group == group
        saved = layer.state_dict()["qweight"]  # the groups, however the layer keeps them for its kernel
        assert saved.shape == (layer.in_features // group, layer.out_features, group) and saved.dtype == torch.int8


def test_int8_dtype_honours_activation_quantization(tiny_llama):
    engine = _int8_engine(tiny_llama, {"activation": {"enabled": True}})
    assert type(_layer(engine)) is Int8DynamicLinear
    assert engine.step_report("quantize").quant.kind == "int8_dynamic"


def test_int8_dtype_honours_qkv_left_in_float(tiny_llama):
    engine = _int8_engine(tiny_llama, {"qkv": {"enabled": False}})
    for name in ("q_proj", "k_proj", "v_proj"):
        assert type(_layer(engine, f"self_attn.{name}")) is nn.Linear
    assert isinstance(_layer(engine, "self_attn.o_proj"), Int8WeightOnlyLinear)


def test_int8_dtype_honours_q_type_and_q_dtype(tiny_llama):
    engine = _int8_engine(tiny_llama, {"weight": {"q_type": "symmetric", "q_dtype": "int8", "group_size": 32}})
    layer = _layer(engine)
    assert layer.state_dict()["qweight"].dtype == torch.int8 and layer.grouped and layer.group == 32


@pytest.mark.parametrize("quant, message", [
    ({"weight": {"num_bits": 4}}, "dtype=torch.int8 contradicts quant.weight.num_bits=4"),
    ({"weight": {"q_type": "asymmetric"}}, "q_type='asymmetric'"),
    ({"weight": {"q_dtype": "uint8"}}, "q_dtype=torch.uint8"),
    ({"weight": {"calibration_ids": [[1, 2, 3]]}}, "calibration_ids"),
    ({"weight": {"q_groups": 3}}, "q_groups=3"),
    ({"weight": {"group_size": 1000}}, "layer model.layers.0.self_attn.q_proj (in_features=64): group_size=1000"),
    ({"weight": {"enabled": False}}, "quant.weight.enabled=False"),
    ({"enabled": False, "weight": {"group_size": 16}}, "quant.weight.group_size=16"),
    ({"enabled": False, "qkv": {"enabled": False}}, "quant.qkv.enabled=False"),
])
def test_int8_dtype_with_quant_settings_it_cannot_apply_raises_before_the_model_changes(tiny_llama, quant, message):
    before = {name: tensor.clone() for name, tensor in tiny_llama.state_dict().items()}
    modules = [type(module) for module in tiny_llama.modules()]
    with pytest.raises(ValueError, match="allowed") as error:
        _int8_engine(tiny_llama, quant)
    assert message in str(error.value)
    assert [type(module) for module in tiny_llama.modules()] == modules
    after = tiny_llama.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_quant_enabled_false_with_int8_dtype_alone_is_per_channel():
    assert _from(dtype="int8", quant={"enabled": False}) == QuantConfig(bits=8, lm_head_int8=True)
    assert _from(dtype="int8", quant={"enabled": False, "quantize_lm_head": False}) == QuantConfig(bits=8)


def test_int8_dtype_maps_each_quant_key_as_quant_enabled_does():
    for quant in ({"weight": {"group_size": 16}}, {"weight": {"q_groups": 4}}, {"activation": {"enabled": True}},
                  {"qkv": {"enabled": False}}, {"quantize_lm_head": True}):
        assert _from(dtype="int8", quant=quant) == _from(quant={"enabled": True, **quant}) != _from(dtype="int8")


def test_quant_settings_without_quantization_warn():
    with pytest.warns(SpliceIgnoredOptionWarning, match=r"quant.weight.group_size=16 has no effect.*quant.enabled"):
        assert _from(dtype="bf16", quant={"weight": {"group_size": 16}}) is None
    with pytest.warns(SpliceIgnoredOptionWarning, match=r"quant.activation.enabled=True"):
        assert _from(quant={"enabled": False, "activation": {"enabled": True}}) is None


@pytest.mark.parametrize("fields, message", [
    ({"bits": 4, "symmetric": "false"}, "symmetric='false' must be a bool"),  # truthy: it meant symmetric
    ({"bits": 4, "group_size": 32.0}, "group_size=32.0 must be an int"),
    ({"group_size": True}, "group_size=True must be an int"),
    ({"bits": 8.0}, "bits=8.0 must be an int; allowed: 8, 4"),
    ({"q_groups": 2.0}, "q_groups=2.0 must be an int"),
    ({"activations": 1}, "activations=1 must be a bool"),
])
def test_values_of_the_wrong_type_are_refused_naming_value_and_choices(fields, message):
    with pytest.raises(TypeError, match="allowed") as error:
        QuantConfig(**fields)
    assert message in str(error.value)


def test_activation_settings_error_says_activations_are_rounded_per_block():
    with pytest.raises(ValueError, match="per row and block of 32"):
        _from(quant={"enabled": True, "activation": {"enabled": True, "q_groups": 4}})


def test_symmetric_defaults_to_the_most_accurate_scheme_for_the_width():
    """The direct API picks what init_inference picks with no q_type: asymmetric int4 (its zero points reproduce the
    weights more closely), symmetric int8 (the int8 kernels take no zero point); an explicit value wins."""
    assert QuantConfig(bits=4).symmetric is False and QuantConfig(bits=4, group_size=32).symmetric is False
    assert QuantConfig().symmetric is True and QuantConfig(bits=8).symmetric is True
    assert QuantConfig(bits=4, symmetric=True).symmetric is True
    from_init = QuantConfig.from_inference_config(resolve_config(quant={"enabled": True, "weight": {"num_bits": 4}}))
    assert from_init.symmetric is QuantConfig(bits=4).symmetric


# ---------------------------------------------------------------- quant.qkv.enabled=False: which linears are q/k/v
def _in_layer(record, path):
    return f"{record.layers}.0.{path}"


@pytest.mark.parametrize("record", RECORDS, ids=lambda record: record.model_type)
def test_the_qkv_projections_of_every_known_family_are_recognised_and_nothing_else(record):
    """Each architecture record names its q/k/v (or fused qkv), output and MLP projections."""
    qkv = [record.qkv] if record.qkv else [record.q, record.k, record.v]
    others = [record.o, record.down] + ([record.gate_up] if record.gate_up else [record.up, record.gate])
    assert all(is_qkv_projection(_in_layer(record, path)) for path in qkv)
    assert not any(is_qkv_projection(_in_layer(record, path)) for path in others)


@pytest.mark.parametrize("name", [
    "encoder.block.0.layer.0.SelfAttention.q", "decoder.block.0.layer.1.EncDecAttention.v",  # T5 and its kin
    "encoder.layer.0.attention.attn.k",  # MPNet
    "model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa",  # DeepSeek's latent attention
    "transformer.blocks.0.attn.Wqkv", "transformer.h.0.attn.qkv_proj", "transformer.layer.0.attention.q_lin",
    "deberta.encoder.layer.0.attention.self.in_proj", "model.layers.0.linear_attn.in_proj_qkvz",
])
def test_qkv_projections_of_other_architectures_are_recognised(name):
    assert is_qkv_projection(name)


@pytest.mark.parametrize("name", [
    "encoder.block.0.layer.0.SelfAttention.o", "encoder.block.0.layer.1.DenseReluDense.wo",  # T5's output, MLP
    "backbone.layers.0.mixer.in_proj",  # Mamba's input projection feeds its convolution
    "model.layers.0.mlp.q", "k", "transformer.layer.0.attention.out_lin",
])
def test_other_linears_are_not_taken_for_qkv_projections(name):
    assert not is_qkv_projection(name)


def test_a_bare_q_counts_inside_a_module_whose_class_is_an_attention():
    class CrossAttention(nn.Module):
        pass

    assert is_qkv_projection("blocks.0.mix.q", parent=CrossAttention())
    assert not is_qkv_projection("blocks.0.mix.q", parent=nn.Module())
