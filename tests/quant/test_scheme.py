"""QuantConfig: validation and the mapping from splice's (DeepSpeed-style) InferenceConfig."""
from __future__ import annotations

import pytest
import torch

from splice.config import resolve_config
from splice.quant import QuantConfig


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


def test_round_trips_through_a_dict():
    config = QuantConfig(bits=4, group_size=64, symmetric=False, quantize_lm_head=True)
    assert QuantConfig.from_dict(config.to_dict()) == config
