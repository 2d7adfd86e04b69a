"""Safetensors checkpoints: header reading, checking against a model, streaming into a meta-device model."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM

from splice.checkpoint import (
    check_checkpoint,
    checkpoint_files,
    checkpoint_shapes,
    has_meta_tensors,
    load_checkpoint,
    load_policy_files,
)

from .conftest import build_tiny, tiny_llama_config

IDS = torch.tensor([[5, 17, 33, 9, 71, 4, 1, 2]])
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def meta_model(config, dtype=torch.float32):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def save(model, folder, **kwargs):
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


@pytest.fixture
def saved(tmp_path):
    """A saved tiny llama and the reference loaded the normal (transformers) way."""
    config = tiny_llama_config()
    save(build_tiny(config), tmp_path)
    return config, tmp_path, AutoModelForCausalLM.from_pretrained(tmp_path).eval()


# ---------------------------------------------------------------------------------------------------------------------
# Loading into a meta model


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"rope_parameters": LLAMA3_ROPE}],
                         ids=["untied", "tied", "llama3-rope"])
@pytest.mark.parametrize("layout", ["folder", "file", "index"])
def test_meta_load_is_bit_identical_to_transformers(tmp_path, overrides, layout):
    config = tiny_llama_config(**overrides)
    sharded = {"max_shard_size": "40KB"} if layout == "index" else {}
    save(build_tiny(config), tmp_path, **sharded)
    source = {"folder": tmp_path, "file": tmp_path / "model.safetensors",
              "index": tmp_path / "model.safetensors.index.json"}[layout]
    if layout == "index":
        assert len(checkpoint_files(source)) > 1 and not (tmp_path / "model.safetensors").exists()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()

    model = meta_model(config)
    assert load_checkpoint(model, source, "cpu") is model

    assert not has_meta_tensors(model)
    assert torch.equal(logits(model), logits(reference))
    for name, buffer in reference.named_buffers():  # non-persistent ones (rotary inv_freq) recomputed exactly
        assert torch.equal(model.get_buffer(name), buffer), name
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in checkpoint_shapes(source)


FAMILIES = {  # tiny configs whose meta loading exercises different buffers and checkpoint names
    "gpt2": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128),  # no rotary
    "gpt_neox": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=128, rotary_pct=0.25),  # saved as embed_out
    "gptj": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=128),  # embed_positions
    "gemma": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128),  # embed_scale buffer
    "falcon": dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   new_decoder_architecture=False, multi_query=True),
}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_meta_load_is_bit_identical_across_families(tmp_path, model_type):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **FAMILIES[model_type])
    save(build_tiny(config), tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model = load_checkpoint(meta_model(config), tmp_path, "cpu")
    assert torch.equal(logits(model), logits(reference))
    for name, buffer in reference.named_buffers():
        assert torch.equal(model.get_buffer(name), buffer), name


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_meta_load_stacks_per_expert_tensors_as_transformers_does(tmp_path, family):
    """A Hugging Face mixture-of-experts checkpoint holds each expert's weights apart (Mixtral's experts.N.w1/w2/w3,
    Qwen's experts.N.gate_proj/...); the model holds them stacked (experts.gate_up_proj, experts.down_proj), which
    transformers' conversion ops make: loaded into a meta model, bit for bit what from_pretrained gives."""
    from tests.arch.tiny_models import build, tiny_config

    save(build(family), tmp_path)
    stored = checkpoint_shapes(tmp_path)
    assert any(".experts.0." in name for name in stored) and not any(name.endswith("gate_up_proj") for name in stored)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    match = check_checkpoint(meta_model(tiny_config(family)), tmp_path)
    assert match.ok and len(match.conversions) == 2 * reference.config.num_hidden_layers  # gate_up and down
    model = load_checkpoint(meta_model(tiny_config(family)), tmp_path, "cpu")
    assert not has_meta_tensors(model)
    assert torch.equal(logits(model), logits(reference))
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_init_inference_fills_a_meta_mixture_of_experts_and_injects_its_kernels(tmp_path):
    import splice
    from tests.arch.tiny_models import build, tiny_config

    save(build("qwen2_moe"), tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    engine = splice.init_inference(meta_model(tiny_config("qwen2_moe")), checkpoint=str(tmp_path),
                                   dtype=torch.float32, replace_with_kernel_inject=True)
    with torch.no_grad():
        expected = reference.generate(IDS, max_new_tokens=8, do_sample=False)
        assert torch.equal(engine.generate(IDS, max_new_tokens=8, do_sample=False), expected)
        assert torch.allclose(engine(IDS).logits, reference(IDS).logits, atol=1e-5)


def _without(folder, out, drop=(), replace=None):
    """The checkpoint in ``folder`` written to ``out`` without the tensors ``drop`` names, ``replace`` changing some."""
    from safetensors.torch import load_file

    state = {k: v for k, v in load_file(folder / "model.safetensors").items() if k not in drop}
    state.update(replace or {})
    save_file(state, out)
    return out


def test_an_expert_missing_or_misshapen_is_refused_before_the_model_changes(tmp_path):
    from tests.arch.tiny_models import build, tiny_config

    folder = save(build("mixtral"), tmp_path / "hf")
    stored = checkpoint_shapes(folder)
    expert = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    missing = _without(folder, tmp_path / "missing.safetensors", drop=[expert])
    model = meta_model(tiny_config("mixtral"))
    made_from = r"\(3 of \.experts\.\*\.w1\.weight, 4 of \.experts\.\*\.w3\.weight\)"
    with pytest.raises(ValueError, match=r"cannot make: model\.layers\.1\.mlp\.experts\.gate_up_proj from 7 tensors "
                                         + made_from) as error:
        load_checkpoint(model, missing, "cpu")
    assert "missing from the checkpoint" not in str(error.value)
    assert all(p.is_meta for p in model.parameters())
    shape = stored[expert][0]
    bad = _without(folder, tmp_path / "bad.safetensors", replace={expert: torch.zeros(shape[1], shape[0])})
    with pytest.raises(ValueError, match=r"transformers' weight conversion \(fusing or splitting\) cannot make: "
                                         r"model\.layers\.1\.mlp\.experts\.gate_up_proj from 8 tensors"):
        load_checkpoint(model, bad, "cpu")
    assert all(p.is_meta for p in model.parameters())


def test_meta_load_converts_to_the_model_dtype(saved):
    config, folder, reference = saved
    model = meta_model(config, dtype=torch.bfloat16)
    load_checkpoint(model, folder, torch.device("cpu"))
    for name, param in reference.named_parameters():
        assert model.get_parameter(name).dtype == torch.bfloat16
        assert torch.equal(model.get_parameter(name), param.to(torch.bfloat16)), name


def test_load_into_a_normal_model_overwrites_its_weights(saved):
    config, folder, reference = saved
    model = build_tiny(config, seed=123)
    assert not torch.equal(logits(model), logits(reference))
    load_checkpoint(model, folder, "cpu")
    assert torch.equal(logits(model), logits(reference))


def test_list_of_files_and_load_policy(tmp_path):
    config = tiny_llama_config()
    save(build_tiny(config), tmp_path, max_shard_size="40KB")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))

    by_list = load_checkpoint(meta_model(config), [tmp_path / s for s in shards], "cpu")
    policy_files = load_policy_files({"type": "ds_model", "checkpoints": shards}, base_dir=tmp_path)
    by_policy = load_checkpoint(meta_model(config), policy_files, "cpu")
    policy_json = tmp_path / "policy.json"
    policy_json.write_text(json.dumps({"type": "ds_model", "checkpoints": shards}))
    by_json = load_checkpoint(meta_model(config), policy_json, "cpu")

    for model in (by_list, by_policy, by_json):
        assert torch.equal(logits(model), logits(reference))


def test_meta_load_keeps_non_persistent_buffers_that_had_values(tmp_path):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 3.0), persistent=False)

    real = Scaled()
    save_file(real.state_dict(), tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = Scaled()
    model.scale = torch.full((4,), 3.0)  # a real buffer on an otherwise meta module
    load_checkpoint(model, tmp_path, "cpu")
    assert torch.equal(model.scale, torch.full((4,), 3.0))
    assert torch.equal(model.linear.weight, real.linear.weight)


def test_buffers_recomputed_by_init_buffers_or_refused(tmp_path):
    class WithInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("table", torch.arange(4.0), persistent=False)

        def init_buffers(self):
            self.table.copy_(torch.arange(4.0))

    class WithoutInit(WithInit):
        init_buffers = None

    save_file(WithInit().state_dict(), tmp_path / "model.safetensors")
    with torch.device("meta"):
        good, bad = WithInit(), WithoutInit()
    load_checkpoint(good, tmp_path, "cpu")
    assert torch.equal(good.table, torch.arange(4.0))
    with pytest.raises(ValueError, match=r"non-persistent buffer.*'table'"):
        load_checkpoint(bad, tmp_path, "cpu")
    assert all(t.is_meta for t in bad.state_dict(keep_vars=True).values()) and bad.table.is_meta  # untouched


# ---------------------------------------------------------------------------------------------------------------------
# Headers and mismatches


def test_checkpoint_shapes_match_the_state_dict(saved):
    config, folder, reference = saved
    shapes = checkpoint_shapes(folder)
    assert shapes == {name: (tuple(t.shape), t.dtype) for name, t in reference.state_dict().items()}


def test_different_hidden_size_raises_and_leaves_the_model_meta(saved):
    _, folder, _ = saved
    model = meta_model(tiny_llama_config(hidden_size=32))
    with pytest.raises(ValueError, match=r"wrong shape: model\.embed_tokens\.weight \(checkpoint \[128, 64\] vs "
                                         r"model \[128, 32\]\)"):
        load_checkpoint(model, folder, "cpu")
    assert all(p.is_meta for p in model.parameters())


def test_missing_and_unexpected_tensors_raise_and_leave_the_model_unchanged(saved, tmp_path):
    config, folder, reference = saved
    state = dict(reference.state_dict())
    state.pop("model.norm.weight")
    state["model.extra.weight"] = torch.zeros(2)
    save_file(state, tmp_path / "broken.safetensors")
    model = build_tiny(config, seed=7)
    before = {name: p.clone() for name, p in model.state_dict().items()}

    for call in (check_checkpoint, lambda m, p: load_checkpoint(m, p, "cpu")):
        with pytest.raises(ValueError) as error:
            call(model, tmp_path / "broken.safetensors")
        assert "1 missing from the checkpoint: model.norm.weight" in str(error.value)
        assert "1 unexpected in the checkpoint: model.extra.weight" in str(error.value)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())


def test_tied_weights_need_only_one_name(tmp_path):
    config = tiny_llama_config(tie_word_embeddings=True)
    save(build_tiny(config), tmp_path)
    check_checkpoint(meta_model(config), tmp_path)  # lm_head.weight absent from the file is fine
    with pytest.raises(ValueError, match="missing from the checkpoint: lm_head.weight"):
        check_checkpoint(meta_model(tiny_llama_config(tie_word_embeddings=False)), tmp_path)


def untied_checkpoint(folder, same_values: bool):
    """A checkpoint holding both lm_head.weight and model.embed_tokens.weight, as an untied model saves it."""
    model = build_tiny(tiny_llama_config())
    if same_values:
        model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    assert "lm_head.weight" in checkpoint_shapes(save(model, folder))
    return folder


@pytest.mark.parametrize("on_meta", [True, False], ids=["meta", "real"])
def test_tied_names_saved_with_different_values_are_untied_as_transformers_does(tmp_path, caplog, on_meta):
    """A tied model given a checkpoint of an untied one (both names, different values) is untied and gets both, as
    from_pretrained does (it warns and keeps them apart); names saved with equal values stay tied."""
    config = tiny_llama_config(tie_word_embeddings=True)
    folder = untied_checkpoint(tmp_path / "untied", same_values=False)
    reference = AutoModelForCausalLM.from_pretrained(folder, config=config).eval()
    assert reference.lm_head.weight is not reference.model.embed_tokens.weight
    model = meta_model(config) if on_meta else build_tiny(config, seed=3)
    with caplog.at_level(logging.WARNING, logger="splice"):
        load_checkpoint(model, folder, "cpu")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(logits(model), logits(reference))
    assert model.all_tied_weights_keys == reference.all_tied_weights_keys == {}
    assert "lm_head.weight" in caplog.text and "model.embed_tokens.weight" in caplog.text

    caplog.clear()
    same = untied_checkpoint(tmp_path / "same", same_values=True)
    model = meta_model(config) if on_meta else build_tiny(config, seed=3)
    with caplog.at_level(logging.WARNING, logger="splice"):
        load_checkpoint(model, same, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight and not caplog.text


def test_a_splice_quantized_folder_is_named_with_its_loader(tmp_path):
    from splice.quant import QuantConfig, quantize, save_quantized

    model = build_tiny(tiny_llama_config())
    quantize(model, QuantConfig(bits=4, group_size=32))
    save_quantized(model, tmp_path, QuantConfig(bits=4, group_size=32))
    for source in (tmp_path, tmp_path / "model.safetensors"):
        with pytest.raises(ValueError, match=r"is a splice quantized checkpoint \(splice_quant\.json in "
                                             r".*splice\.quant\.load_quantized"):
            check_checkpoint(meta_model(tiny_llama_config()), source)


def test_per_layer_rotary_buffers_of_older_checkpoints_are_ignored(saved, tmp_path):
    """Older Llama conversions saved each layer's rotary inv_freq; from_pretrained ignores them, and so does splice,
    while a real unexpected tensor is still refused."""
    config, folder, reference = saved
    state = dict(reference.state_dict())
    for layer in range(config.num_hidden_layers):
        state[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, tmp_path / "old.safetensors")
    model = load_checkpoint(meta_model(config), tmp_path / "old.safetensors", "cpu")
    assert torch.equal(logits(model), logits(reference))
    state["model.layers.0.self_attn.rotary_emb.weight"] = torch.ones(8)
    save_file(state, tmp_path / "extra.safetensors")
    with pytest.raises(ValueError, match=r"1 unexpected in the checkpoint: model\.layers\.0\.self_attn\.rotary_emb"
                                         r"\.weight;"):
        check_checkpoint(meta_model(config), tmp_path / "extra.safetensors")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickles_are_refused(tmp_path, name):
    (tmp_path / name).write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"pickle checkpoint.*only safetensors"):
        checkpoint_files(tmp_path / name)
    with pytest.raises(ValueError, match=r"pickle checkpoint"):
        checkpoint_files(tmp_path)  # a folder holding only a pickle


def test_index_naming_a_pickle_is_refused(tmp_path):
    (tmp_path / "pytorch_model-00001.bin").write_bytes(b"not read")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "pytorch_model-00001.bin"}}))
    with pytest.raises(ValueError, match="pickle checkpoint"):
        checkpoint_files(index)


#: DeepSpeed's other checkpoints JSON formats: the pre-sharded one its save_mp_checkpoint_path writes (and the
#: microsoft/bloom-deepspeed-inference-* repositories ship), and Megatron-LM's per-rank checkpoints.
DEEPSPEED_PRESHARDED = {"type": "ds_model", "version": 1.0,
                        "checkpoints": {"non_tp": ["non-tp.pt"], "tp": ["tp_00_00.pt", "tp_01_00.pt"]},
                        "parallelization": "tp", "tp_size": 2, "dtype": "float16"}
DEEPSPEED_MEGATRON = {"type": "Megatron", "checkpoints": ["mp_rank_00/model_optim_rng.pt",
                                                         "mp_rank_01/model_optim_rng.pt"], "version": 0.0}


@pytest.mark.parametrize("policy, message", [
    (DEEPSPEED_PRESHARDED, r"DeepSpeed's pre-sharded format, per-rank .pt pickles .* allowed: the original unsharded "
                           r"safetensors checkpoint .* save_mp_checkpoint_path"),
    (DEEPSPEED_MEGATRON, r"of type 'Megatron' lists Megatron-LM checkpoints .* allowed: the model converted to a "
                         r"Hugging Face safetensors checkpoint"),
], ids=["presharded", "megatron"])
def test_deepspeeds_other_checkpoint_formats_are_named(tmp_path, policy, message):
    import splice

    with pytest.raises(ValueError, match=message):
        load_policy_files(policy, base_dir=tmp_path)
    path = tmp_path / "checkpoints.json"
    path.write_text(json.dumps(policy))
    with pytest.raises(ValueError, match=message):
        checkpoint_files(path)
    model = build_tiny(tiny_llama_config())
    with pytest.raises(ValueError, match=message):  # as DeepSpeed's snippets pass it: the JSON and its base_dir
        splice.init_inference(model, checkpoint=str(path), base_dir=str(tmp_path))


def test_nonexistent_or_unknown_paths_raise(tmp_path):
    with pytest.raises(ValueError, match=r"'.*no-such-dir' does not exist"):
        checkpoint_files(tmp_path / "no-such-dir")
    with pytest.raises(ValueError, match="has neither model.safetensors nor"):
        checkpoint_files(tmp_path)
    (tmp_path / "weights.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="not a safetensors checkpoint"):
        checkpoint_files(tmp_path / "weights.npz")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors' does not exist"):
        checkpoint_files(index)


@pytest.mark.parametrize("damage", [lambda data: data[: len(data) // 2], lambda data: b"garbage" * 10])
def test_corrupt_checkpoint_raises_naming_the_file(tmp_path, damage):
    model = build_tiny(tiny_llama_config())
    model.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(ValueError, match="model.safetensors.*not a readable safetensors file"):
        check_checkpoint(build_tiny(tiny_llama_config()), tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# OnDevice


@pytest.mark.parametrize("model_type", ["llama", "gemma", "gpt2"])
def test_on_device_dtype_wins_over_the_dtype_a_config_names(tmp_path, model_type):
    """A config read from a checkpoint names its dtype (float32 here), and transformers builds in it unless told
    otherwise; ``OnDevice(dtype=...)`` makes the model in its own dtype anyway, as DeepSpeed's does, and it then loads
    as Hugging Face's from_pretrained in that dtype."""
    from transformers import AutoConfig

    import splice

    config = tiny_llama_config() if model_type == "llama" else AutoConfig.for_model(model_type, **FAMILIES[model_type])
    save(build_tiny(config), tmp_path)
    saved_config = AutoConfig.from_pretrained(tmp_path)
    assert saved_config.dtype == torch.float32
    with splice.OnDevice(dtype=torch.bfloat16, device="meta"):
        model = AutoModelForCausalLM.from_config(saved_config).eval()
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and has_meta_tensors(model)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    load_checkpoint(model, tmp_path, "cpu")
    assert torch.equal(logits(model), logits(reference))
    for name, buffer in reference.named_buffers():
        assert model.get_buffer(name).dtype == buffer.dtype and torch.equal(model.get_buffer(name), buffer), name


def test_on_device_leaves_explicit_dtypes_and_other_constructors_alone():
    import splice

    with splice.OnDevice(dtype=torch.float16, device="meta"):
        made = torch.empty(2), torch.zeros(2, dtype=torch.float32), torch.arange(3), torch.ones(2).float()
    assert [(t.dtype, t.device.type) for t in made] == [(torch.float16, "meta"), (torch.float32, "meta"),
                                                       (torch.int64, "meta"), (torch.float32, "meta")]
    with splice.OnDevice(dtype=torch.float16, device="meta", enabled=False):
        assert torch.empty(2).dtype == torch.float32 and torch.empty(2).device.type == "cpu"
