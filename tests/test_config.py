"""InferenceConfig: DeepSpeed keys, aliases, deprecated names, merging, readable errors, support table."""
from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch

from splice.config import (
    DEPRECATED,
    FIELD_SUPPORT,
    HONOURED,
    IGNORED,
    UNSUPPORTED,
    InferenceConfig,
    SpliceDeprecationWarning,
    SpliceIgnoredOptionWarning,
    TensorParallelConfig,
    field_reference,
    field_support,
    reference_markdown,
    resolve_config,
)


def resolve_quietly(config=None, **kwargs) -> InferenceConfig:
    """resolve_config, failing the test on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return resolve_config(config, **kwargs)


# ---------------------------------------------------------------- sources and merging
def test_defaults():
    config = resolve_quietly()
    assert config.dtype is None
    assert config.replace_with_kernel_inject is False
    assert config.tensor_parallel.tp_size == 1 and config.tensor_parallel.tp_grain_size == 64
    assert config.quant.enabled is None and config.quant.weight.num_bits == 8
    assert config.quant.activation.enabled is False
    assert config.moe.enabled is False and config.zero.enabled is False
    assert config.max_out_tokens == 1024 and config.device is None


def test_dict_source():
    config = resolve_quietly({"dtype": "bf16", "tensor_parallel": {"tp_size": 2}, "max_out_tokens": 64})
    assert config.dtype == torch.bfloat16
    assert config.tensor_parallel.tp_size == 2
    assert config.max_out_tokens == 64


def test_json_file_source(tmp_path: Path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"dtype": "torch.float16", "tp": {"tp_size": 2}, "quant": {"enabled": True}}))
    for source in (path, str(path)):
        config = resolve_quietly(source)
        assert config.dtype == torch.float16
        assert config.tensor_parallel.tp_size == 2
        assert config.quant.enabled is True


def test_missing_json_file_names_path(tmp_path: Path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match="nope.json"):
        resolve_config(missing)


def test_invalid_json_names_path(tmp_path: Path):
    path = tmp_path / "broken.json"
    path.write_text("{dtype: fp16")
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        resolve_config(str(path))


def test_json_must_be_an_object(tmp_path: Path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json.*JSON object"):
        resolve_config(path)


def test_bad_config_type_raises_type_error():
    with pytest.raises(TypeError) as info:
        resolve_config(42)
    assert "int" in str(info.value) and "dict" in str(info.value) and "InferenceConfig" in str(info.value)


def test_kwargs_only():
    config = resolve_quietly(dtype=torch.float32, kernel_inject=True, max_tokens=32)
    assert config.dtype == torch.float32
    assert config.replace_with_kernel_inject is True
    assert config.max_out_tokens == 32


def test_kwargs_merge_on_top_of_dict():
    config = resolve_quietly({"dtype": "fp16"}, max_out_tokens=100, tp={"tp_size": 4})
    assert config.dtype == torch.float16
    assert config.max_out_tokens == 100
    assert config.tensor_parallel.tp_size == 4


def test_equal_duplicate_is_fine():
    config = resolve_quietly({"max_out_tokens": 8, "tp": {"tp_size": 2}}, max_out_tokens=8,
                             tensor_parallel={"tp_size": 2})
    assert config.max_out_tokens == 8 and config.tensor_parallel.tp_size == 2


def test_equal_dtype_spelled_differently_is_fine():
    assert resolve_quietly({"dtype": "fp16"}, dtype=torch.half).dtype == torch.float16


def test_conflicting_duplicate_names_key_and_both_values():
    with pytest.raises(ValueError) as info:
        resolve_config({"max_out_tokens": 8}, max_out_tokens=16)
    message = str(info.value)
    assert "max_out_tokens" in message and "8" in message and "16" in message


def test_conflict_through_alias():
    with pytest.raises(ValueError) as info:
        resolve_config({"replace_with_kernel_inject": False}, kernel_inject=True)
    message = str(info.value)
    assert "replace_with_kernel_inject" in message and "True" in message and "False" in message


def test_alias_and_name_in_one_dict_with_different_values():
    with pytest.raises(ValueError, match="max_tokens.*max_out_tokens|max_out_tokens.*max_tokens"):
        resolve_config({"max_tokens": 8, "max_out_tokens": 9})


def test_inference_config_passed_alone_is_validated_again_into_a_new_object():
    base = resolve_quietly(dtype="bf16")
    resolved = resolve_config(base)
    assert resolved == base and resolved is not base  # the engine keeps no reference to the caller's object


@pytest.mark.parametrize("field, value, match", [
    ("device", "meta", "'meta' is not a device"),
    ("max_out_tokens", -5, "max_out_tokens"),
    ("dtype", torch.float64, "float64"),
])
def test_a_field_assigned_after_validation_is_checked_when_resolved(field, value, match):
    config = InferenceConfig()
    setattr(config, field, value)  # pydantic does not check assignments
    with pytest.raises(ValueError, match=match):
        resolve_config(config)


def test_a_field_assigned_as_text_is_parsed_when_resolved():
    config = InferenceConfig()
    config.dtype = "fp16"
    assert resolve_config(config).dtype == torch.float16


def test_a_key_assigned_inside_a_default_section_is_checked_when_resolved():
    config = InferenceConfig()
    config.zero.enabled = True
    with pytest.raises(ValueError, match="zero.enabled=True is not supported"):
        resolve_config(config)
    config = InferenceConfig()
    config.use_triton = True
    with pytest.warns(SpliceIgnoredOptionWarning, match="use_triton=True has no effect"):
        resolve_config(config)


@pytest.mark.parametrize("given, kwargs", [
    ({"device": "cpu"}, {"device": torch.device("cpu")}),
    ({"quant": {"weight": {"q_dtype": "int8"}}}, {"quant": {"weight": {"q_dtype": torch.int8}}}),
    ({"checkpoint": "/tmp/model"}, {"checkpoint": Path("/tmp/model")}),
    ({"moe": False}, {"moe": {"enabled": False}}),
])
def test_one_value_spelled_two_ways_is_not_given_twice(given, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolve_config(given, **kwargs)


@pytest.mark.parametrize("kwargs, key", [
    ({"max_out_tokens": True}, "max_out_tokens"),
    ({"tensor_parallel": {"tp_size": True}}, "tensor_parallel.tp_size"),
    ({"quant": {"weight": {"num_bits": True}}}, "quant.weight.num_bits"),
])
def test_a_bool_where_a_number_is_wanted_raises(kwargs, key):
    with pytest.raises(ValueError, match=f"'{key}': True is a bool; allowed: a number"):
        resolve_config(**kwargs)


def test_an_empty_checkpoint_path_raises():
    with pytest.raises(ValueError, match="empty path is not a checkpoint"):
        resolve_config(checkpoint="")


def test_q_groups_beside_group_size_warns_that_it_is_overridden():
    with pytest.warns(SpliceIgnoredOptionWarning, match="q_groups=2 has no effect.*group_size=64"):
        resolve_config(quant={"enabled": True, "weight": {"num_bits": 4, "q_groups": 2, "group_size": 64}})


def test_inference_config_plus_kwargs():
    base = resolve_quietly(dtype="bf16", tensor_parallel={"tp_size": 2})
    merged = resolve_quietly(base, max_out_tokens=77)
    assert merged.dtype == torch.bfloat16
    assert merged.tensor_parallel.tp_size == 2
    assert merged.max_out_tokens == 77
    assert base.max_out_tokens == 1024  # the original is untouched
    with pytest.raises(ValueError, match="dtype"):
        resolve_config(base, dtype="fp32")


def test_user_dict_is_not_mutated():
    user = {
        "kernel_inject": True, "mp_size": 2, "moe": {"num_experts": [4]}, "ep_size": 1,
        "tp": {"tp_grain_size": 32}, "quant": {"weight": {"num_bits": 4}}, "dtype": "fp16",
    }
    before = copy.deepcopy(user)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = resolve_config(user, max_out_tokens=5)
    assert user == before
    assert config.tensor_parallel.tp_size == 2 and config.tensor_parallel.tp_grain_size == 32


def test_direct_construction_gives_readable_errors():
    with pytest.raises(ValueError, match="unknown config key 'max_out_token'; did you mean 'max_out_tokens'"):
        InferenceConfig(max_out_token=3)
    with pytest.raises(ValueError, match="tp_size"):
        TensorParallelConfig(tp_size=0)


# ---------------------------------------------------------------- aliases and deprecated names
@pytest.mark.parametrize("alias, name, value, read", [
    ("kernel_inject", "replace_with_kernel_inject", True, lambda c: c.replace_with_kernel_inject),
    ("tp", "tensor_parallel", {"tp_size": 3}, lambda c: c.tensor_parallel.tp_size == 3),
    ("ckpt_config", "checkpoint_config", {}, lambda c: c.checkpoint_config.checkpoint_dir is None),
    ("injection_dict", "injection_policy", {"Block": ("o_proj", "down_proj")},
     lambda c: c.injection_policy == {"Block": ("o_proj", "down_proj")}),
    ("max_tokens", "max_out_tokens", 9, lambda c: c.max_out_tokens == 9),
])
def test_alias(alias, name, value, read):
    assert read(resolve_quietly(**{alias: value}))
    assert read(resolve_quietly(**{name: value}))


@pytest.mark.parametrize("alias, name, value, attribute", [
    ("tm", "triangular_masking", False, "triangular_masking"),
    ("min_tokens", "min_out_tokens", 4, "min_out_tokens"),
    ("args", "config", {"hidden_size": 8}, "config"),
])
def test_alias_of_ignored_option(alias, name, value, attribute):
    for key in (alias, name):
        with pytest.warns(SpliceIgnoredOptionWarning, match=attribute):
            config = resolve_config({key: value})  # a dict: resolve_config's own `config` parameter takes that name
        assert getattr(config, attribute) == value


def test_nested_aliases():
    with pytest.warns(SpliceIgnoredOptionWarning):
        config = resolve_config(moe={"num_experts": [8], "expert_group": "g"})
    assert config.moe.moe_experts == [8] and config.moe.ep_group == "g"


@pytest.mark.parametrize("old, value, read", [
    ("mp_size", 2, lambda c: c.tensor_parallel.tp_size),
    ("mpu", "MPU", lambda c: c.tensor_parallel.mpu),
    ("ep_size", 4, lambda c: c.moe.ep_size),
    ("ep_group", "EG", lambda c: c.moe.ep_group),
    ("expert_group", "EG", lambda c: c.moe.ep_group),
    ("ep_mp_group", "EMG", lambda c: c.moe.ep_mp_group),
    ("expert_mp_group", "EMG", lambda c: c.moe.ep_mp_group),
    ("moe_experts", [2, 4], lambda c: c.moe.moe_experts),
    ("moe_type", "residual", lambda c: c.moe.type),
])
def test_deprecated_name_warns_and_moves(old, value, read):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = resolve_config(**{old: value})
    deprecations = [w for w in caught if issubclass(w.category, SpliceDeprecationWarning)]
    assert len(deprecations) == 1
    assert old in str(deprecations[0].message) and DEPRECATED[old] in str(deprecations[0].message)
    assert read(config) == value
    assert old not in InferenceConfig.model_fields  # no stray top-level field


@pytest.mark.parametrize("old, new_section, new_key, value", [
    ("mp_size", "tensor_parallel", "tp_size", 2),
    ("mpu", "tensor_parallel", "mpu", "MPU"),
    ("ep_size", "moe", "ep_size", 2),
    ("ep_group", "moe", "ep_group", "G"),
    ("expert_group", "moe", "ep_group", "G"),
    ("ep_mp_group", "moe", "ep_mp_group", "G"),
    ("expert_mp_group", "moe", "ep_mp_group", "G"),
    ("moe_experts", "moe", "moe_experts", [2]),
    ("moe_type", "moe", "type", "residual"),
])
def test_deprecated_and_new_together_raise(old, new_section, new_key, value):
    with pytest.raises(ValueError) as info:
        resolve_config({old: value, new_section: {new_key: value}})
    assert old in str(info.value) and f"{new_section}.{new_key}" in str(info.value)


def test_deprecated_with_new_given_through_section_alias():
    with pytest.raises(ValueError, match="mp_size"):
        resolve_config({"mp_size": 2}, tp={"tp_size": 2})


def test_deprecated_moe_name_with_moe_bool():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = resolve_config(moe=False, ep_size=2)
    assert config.moe.enabled is False and config.moe.ep_size == 2


# ---------------------------------------------------------------- unknown keys
def test_unknown_top_level_key_suggests():
    with pytest.raises(ValueError, match=r"unknown config key 'max_out_token'; did you mean 'max_out_tokens'\?"):
        resolve_config(max_out_token=3)


@pytest.mark.parametrize("config, unknown, suggestion", [
    ({"tensor_parallel": {"tp_sise": 2}}, "tensor_parallel.tp_sise", "tensor_parallel.tp_size"),
    ({"tp": {"tp_grain": 2}}, "tensor_parallel.tp_grain", "tensor_parallel.tp_grain_size"),
    ({"quant": {"weight": {"numbits": 4}}}, "quant.weight.numbits", "quant.weight.num_bits"),
    ({"moe": {"ep_sise": 2}}, "moe.ep_sise", "moe.ep_size"),
])
def test_unknown_nested_key_suggests(config, unknown, suggestion):
    with pytest.raises(ValueError) as info:
        resolve_config(config)
    assert f"unknown config key '{unknown}'" in str(info.value)
    assert f"did you mean '{suggestion}'" in str(info.value)


@pytest.mark.parametrize("config, unknown, suggestion", [
    ({"tp_size": 2}, "tp_size", "did you mean 'tensor_parallel.tp_size'?"),
    ({"tp_grain_size": 32}, "tp_grain_size", "did you mean 'tensor_parallel.tp_grain_size'?"),
    ({"checkpoint_dir": "x"}, "checkpoint_dir", "did you mean 'checkpoint_config.checkpoint_dir'?"),
    ({"quant": {"num_bits": 4}}, "quant.num_bits",
     "did you mean 'quant.weight.num_bits' or 'quant.activation.num_bits'?"),
])
def test_a_section_key_given_a_level_too_high_names_its_place(config, unknown, suggestion):
    """A key that lives inside a section (DeepSpeed's tensor_parallel.tp_size as a top-level tp_size) is pointed to
    its place rather than to the nearest spelling at this level ('mp_size', 'training_mp_size')."""
    with pytest.raises(ValueError) as info:
        resolve_config(config)
    assert f"unknown config key '{unknown}'; {suggestion}" in str(info.value)


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ValueError, match="unknown config key 'zzz'.*valid keys here:.*max_out_tokens"):
        resolve_config(zzz=1)


def test_deepspeed_zero_offload_key_is_explained():
    with pytest.raises(ValueError, match="zero.offload_param.*ZeRO-Inference"):
        resolve_config(zero={"offload_param": {"device": "cpu"}})


@pytest.mark.parametrize("key, value, hint", [
    ("quantization_setting", (True, 8), r"no longer takes it either; quantize with dtype=torch\.int8 and "
                                         r"quant=\{'weight': \{'q_groups': N\}\}"),
    ("fp16", {"enabled": True}, r"deepspeed\.initialize \(training\) key.*use dtype=torch\.float16"),
    ("bf16", {"enabled": True}, r"deepspeed\.initialize \(training\) key.*use dtype=torch\.bfloat16"),
    ("zero_optimization", {"stage": 3}, r"training\) key.*does not implement ZeRO-Inference"),
    ("train_batch_size", 8, r"training\) key.*input's first dimension"),
])
def test_keys_deepspeed_rejects_too_say_what_to_use(key, value, hint):
    with pytest.raises(ValueError, match=rf"unknown config key '{key}'; .*{hint}"):
        resolve_config({key: value})


def test_a_training_key_inside_a_section_is_an_ordinary_unknown_key():
    with pytest.raises(ValueError, match=r"unknown config key 'tensor_parallel\.fp16'; valid keys here: enabled"):
        resolve_config(tensor_parallel={"fp16": {"enabled": True}})


# ---------------------------------------------------------------- "auto"
def test_top_level_auto_means_the_default_as_in_deepspeed(tmp_path):
    """DeepSpeed's config models drop top-level keys whose value is "auto" (keeping replace_method's), so a
    Hugging Face-style config with "auto" values takes the defaults; nothing warns."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"dtype": "auto", "max_out_tokens": "auto", "replace_with_kernel_inject": "auto",
                                "tensor_parallel": {"tp_size": 1}, "replace_method": "auto"}))
    config = resolve_quietly(str(path))
    assert config.dtype is None and config.max_out_tokens == 1024 and config.replace_with_kernel_inject is False
    assert config.model_fields_set == {"tensor_parallel", "replace_method"}
    assert resolve_quietly(max_tokens="auto", kernel_inject="auto") == resolve_quietly()


def test_auto_inside_a_section_is_an_invalid_value_as_in_deepspeed():
    with pytest.raises(ValueError, match=r"invalid value for 'tensor_parallel\.tp_size': 'auto'"):
        resolve_config({"tensor_parallel": {"tp_size": "auto"}})


def test_auto_against_a_value_is_a_conflict_as_in_deepspeed():
    with pytest.raises(ValueError, match=r"config key 'dtype' is given twice with different values: 'auto' in config"):
        resolve_config({"dtype": "auto"}, dtype=torch.half)


# ---------------------------------------------------------------- dtype and device
@pytest.mark.parametrize("text, expected", [
    ("fp16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
    ("fp32", torch.float32), ("float32", torch.float32), ("float", torch.float32),
    ("int8", torch.int8),
    ("FP16", torch.float16), ("torch.float16", torch.float16), ("torch.half", torch.float16),
    ("Torch.BFloat16", torch.bfloat16), ("torch.float", torch.float32), ("torch.int8", torch.int8),
])
def test_dtype_strings(text, expected):
    assert resolve_quietly(dtype=text).dtype == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_torch_dtypes(dtype):
    assert resolve_quietly(dtype=dtype).dtype == dtype


@pytest.mark.parametrize("bad", ["fp64", "float8", "", torch.float64, torch.int32, 16])
def test_bad_dtype_names_value_and_allowed(bad):
    with pytest.raises(ValueError) as info:
        resolve_config(dtype=bad)
    message = str(info.value)
    assert "dtype" in message and repr(bad) in message
    assert "fp16" in message and "bf16" in message and "fp32" in message and "int8" in message


@pytest.mark.parametrize("device, expected", [
    ("cpu", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1"), (torch.device("cuda", 1), "cuda:1"), (None, None),
])
def test_device(device, expected):
    assert resolve_quietly(device=device).device == expected


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", 3, "meta", torch.device("meta"), "mps", "xpu"])
def test_bad_device(bad):
    """Only the devices splice runs on pass: 'meta' would move the weights away for good, 'mps' / 'xpu' would fail
    inside a step with torch's own error."""
    with pytest.raises(ValueError, match="device") as info:
        resolve_config(device=bad)
    assert repr(bad) in str(info.value) and "'cpu'" in str(info.value)


# ---------------------------------------------------------------- ranges and choices
@pytest.mark.parametrize("kwargs, key, value", [
    ({"max_out_tokens": 0}, "max_out_tokens", "0"),
    ({"max_out_tokens": -1}, "max_out_tokens", "-1"),
    ({"min_out_tokens": 0}, "min_out_tokens", "0"),
    ({"tensor_parallel": {"tp_size": 0}}, "tensor_parallel.tp_size", "0"),
    ({"tensor_parallel": {"tp_grain_size": 0}}, "tensor_parallel.tp_grain_size", "0"),
    ({"quant": {"weight": {"q_groups": 0}}}, "quant.weight.q_groups", "0"),
    ({"quant": {"weight": {"group_size": 0}}}, "quant.weight.group_size", "0"),
])
def test_bad_ranges(kwargs, key, value):
    with pytest.raises(ValueError) as info:
        resolve_config(**kwargs)
    message = str(info.value)
    assert f"'{key}'" in message and value in message and "greater than" in message


@pytest.mark.parametrize("section, key, bad, choices", [
    ("weight", "num_bits", 3, ("8", "4")),
    ("weight", "q_type", "foo", ("symmetric", "asymmetric")),
    ("activation", "num_bits", 4, ("8",)),
])
def test_bad_quant_choices(section, key, bad, choices):
    with pytest.raises(ValueError) as info:
        resolve_config(quant={section: {key: bad}})
    message = str(info.value)
    assert f"quant.{section}.{key}" in message and repr(bad) in message
    assert all(choice in message for choice in choices)


def test_quant_settings_accepted():
    config = resolve_quietly(quant={"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric",
                                                                  "group_size": 32, "q_dtype": "uint8"},
                                    "qkv": {"enabled": False}})
    assert config.quant.weight.num_bits == 4 and config.quant.weight.group_size == 32
    assert config.quant.weight.q_dtype == torch.uint8 and config.quant.qkv.enabled is False


@pytest.mark.parametrize("weight, symmetric", [
    ({"num_bits": 4}, False),  # no q_type: the most accurate the int4 kernels take (they take a zero point)
    ({"num_bits": 8}, True),  # the int8 kernels take no zero point
    ({"num_bits": 4, "q_type": "symmetric"}, True),  # DeepSpeed's default, when named, is honoured
    ({"num_bits": 4, "q_type": "asymmetric"}, False),
])
def test_quant_weight_q_type_defaults_to_the_best_for_the_bit_width(weight, symmetric):
    from splice.quant import QuantConfig

    config = resolve_quietly(quant={"enabled": True, "weight": weight})
    assert config.quant.weight.q_type == weight.get("q_type")
    assert QuantConfig.from_inference_config(config).symmetric is symmetric


def test_wrong_type_names_field_value_and_allowed():
    with pytest.raises(ValueError) as info:
        resolve_config(use_triton="maybe")
    assert "use_triton" in str(info.value) and "'maybe'" in str(info.value) and "boolean" in str(info.value)
    with pytest.raises(ValueError, match="checkpoint.*3.*allowed"):
        resolve_config(checkpoint=3)


def test_checkpoint_forms(tmp_path: Path):
    assert resolve_quietly(checkpoint=str(tmp_path)).checkpoint == str(tmp_path)
    assert resolve_quietly(checkpoint=tmp_path).checkpoint == tmp_path
    assert resolve_quietly(checkpoint={"type": "ds_model"}).checkpoint == {"type": "ds_model"}


def test_tp_disabled_with_size_above_one_raises():
    resolve_quietly(tensor_parallel={"enabled": False, "tp_size": 1})
    with pytest.raises(ValueError, match="enabled=False.*tp_size=2"):
        resolve_config(tensor_parallel={"enabled": False, "tp_size": 2})


# ---------------------------------------------------------------- support: honoured / ignored / unsupported
@pytest.mark.parametrize("kwargs, path", [
    ({"use_triton": True}, "use_triton"),
    ({"triton_autotune": True}, "triton_autotune"),
    ({"transposed_mode": True}, "transposed_mode"),
    ({"replace_method": "layer"}, "replace_method"),
    ({"return_tuple": False}, "return_tuple"),
    ({"triangular_masking": False}, "triangular_masking"),
    ({"set_empty_params": True}, "set_empty_params"),
    ({"min_out_tokens": 8}, "min_out_tokens"),
    ({"config": {"a": 1}}, "config"),
    ({"injection_policy_tuple": ("o_proj",)}, "injection_policy_tuple"),
    ({"checkpoint_config": {"save_mp_checkpoint_path": "x"}}, "checkpoint_config.save_mp_checkpoint_path"),
    ({"moe": {"ep_size": 2}}, "moe.ep_size"),
    ({"quant": {"weight": {"post_init_quant": {"fc": {}}}}}, "quant.weight.post_init_quant"),
])
def test_no_effect_options_warn_by_name(kwargs, path):
    with pytest.warns(SpliceIgnoredOptionWarning, match=f"{path}=.*has no effect in splice"):
        resolve_config(kwargs)


@pytest.mark.parametrize("quant", [
    {"enabled": True, "activation": {"q_groups": 4}},
    {"activation": {"enabled": False, "q_type": "asymmetric"}},
])
def test_activation_settings_with_activations_off_warn_by_name(quant):
    """With the quant section on (quant.enabled=True, or dtype=int8) but activations off, the activation keys would
    vanish: they warn, naming each one; with activations on they apply (no warning)."""
    kwargs = {"quant": quant} if quant.get("enabled") else {"quant": quant, "dtype": torch.int8}
    with pytest.warns(SpliceIgnoredOptionWarning, match=r"quant\.activation\.(q_groups|q_type)=.*has no effect in "
                      r"splice: activations are not quantized"):
        resolve_config(**kwargs)
    resolve_quietly(quant={"enabled": True, "activation": {"enabled": True}})


@pytest.mark.parametrize("quant, given", [
    ({"enabled": True, "weight": {"enabled": False, "num_bits": 4}}, r"quant\.weight\.num_bits=4"),
    ({"enabled": True, "weight": {"enabled": False, "q_groups": 2}}, r"quant\.weight\.q_groups=2"),
    ({"enabled": True, "weight": {"enabled": False}, "qkv": {"enabled": False}}, r"quant\.qkv\.enabled=False"),
    ({"enabled": True, "weight": {"enabled": False}, "quantize_lm_head": True}, r"quant\.quantize_lm_head=True"),
])
def test_weight_settings_with_weights_off_warn_by_name(quant, given):
    """quant.enabled=True with quant.weight.enabled=False quantizes nothing: the weight, qkv and lm_head settings
    given would vanish, so they warn naming each; weight.enabled=False alone says nothing else and stays quiet."""
    with pytest.warns(SpliceIgnoredOptionWarning, match=f"{given}.*has no effect in splice: nothing is quantized "
                      r"\(quant\.weight\.enabled=False\)"):
        resolve_config(quant=quant)
    resolve_quietly(quant={"enabled": True, "weight": {"enabled": False}})


def test_ignored_options_at_default_do_not_warn():
    resolve_quietly(use_triton=False, return_tuple=True, triangular_masking=True, replace_method="auto",
                    min_out_tokens=1)


@pytest.mark.parametrize("kwargs, path", [
    ({"zero": {"enabled": True}}, "zero.enabled"),
    ({"zero": {"stage": 3}}, "zero.stage"),
    ({"moe": True}, "moe.enabled"),
    ({"moe": {"enabled": True}}, "moe.enabled"),
    ({"training_mp_size": 2}, "training_mp_size"),
])
def test_unsupported_options_raise_with_reason(kwargs, path):
    with pytest.raises(ValueError, match=f"{path}=.*not supported by splice: .+"):
        resolve_config(**kwargs)


def test_every_field_has_a_support_entry_and_description():
    for row in field_reference():
        if row.support == "deprecated":
            continue
        assert row.meaning, f"{row.key} has no description"
        if row.support != "see its fields":
            assert field_support(row.key) in (HONOURED, IGNORED, UNSUPPORTED)
        if row.support in (IGNORED, UNSUPPORTED) and row.key in FIELD_SUPPORT:
            assert row.deepspeed_difference, f"{row.key} needs a reason"


def test_field_support_entries_name_real_fields():
    config = InferenceConfig()
    for path in FIELD_SUPPORT:
        value = config
        for part in path.split("."):
            value = getattr(value, part)  # raises if the table names a field that doesn't exist


def test_field_reference_rows():
    rows = {row.key: row for row in field_reference()}
    assert rows["max_out_tokens"].aliases == ("max_tokens",)
    assert rows["max_out_tokens"].default == "1024"
    assert rows["tensor_parallel.tp_size"].support == HONOURED
    assert "fp16" in rows["dtype"].meaning and rows["dtype"].deepspeed_difference
    assert rows["mp_size"].support == "deprecated"
    markdown = reference_markdown()
    assert "| `tensor_parallel.tp_grain_size` |" in markdown and "`kernel_inject`" in markdown


def test_docs_config_table_is_current():
    from pathlib import Path

    from splice.config import reference_markdown

    docs = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    start = docs.index("<!-- config-reference:start -->\n") + len("<!-- config-reference:start -->\n")
    end = docs.index("<!-- config-reference:end -->")
    assert docs[start:end] == reference_markdown(), \
        "regenerate docs/configuration.md's table with `python -m splice.config`"


@pytest.mark.parametrize("kwargs", [
    {"mp_size": 2},  # deprecated: moved to tensor_parallel.tp_size
    {"triangular_masking": False},  # accepted, no effect
    {"quant": {"enabled": True, "activation": {"q_groups": 2}}},  # activation settings with activations off
    {"quant": {"enabled": True, "weight": {"enabled": False, "num_bits": 4}}},  # weight settings with weights off
    {"quant": {"enabled": False, "weight": {"num_bits": 4}}},  # settings of a quant section that is off
])
def test_config_warnings_point_at_the_callers_line(kwargs):
    """Each warning names the line that gave the option (this file), not the validator deep in splice or pydantic
    that noticed it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_config(**kwargs)
    ours = [w for w in caught if issubclass(w.category, (SpliceDeprecationWarning, SpliceIgnoredOptionWarning))]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno, str(w.message)) for w in ours]


def test_a_config_object_warns_once_when_built_and_not_again_when_resolved():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = InferenceConfig(use_triton=True)
        resolve_config(config)
        resolve_config(config, dtype="bf16")
    assert [str(warning.message).split(":")[0] for warning in caught] == ["use_triton=True has no effect in splice"]
    assert caught[0].filename == __file__  # at the user's line


def test_a_dict_config_resolved_again_and_again_warns_once_per_line_by_default():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            resolve_config(use_triton=True)
        config = InferenceConfig(use_triton=True)
        for _ in range(3):
            resolve_config(config)
    assert [str(warning.message).split(":")[0] for warning in caught] == ["use_triton=True has no effect in splice"] * 2
