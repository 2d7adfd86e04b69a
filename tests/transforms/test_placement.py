"""The placement transform: move the model, or materialise a meta model from a checkpoint."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from splice.config import resolve_config
from splice.pipeline import PipelineContext
from splice.transforms import placement

from ..conftest import build_tiny, tiny_llama_config

IDS = torch.tensor([[5, 17, 33, 9, 71, 4, 1, 2]])
CPU = torch.device("cpu")


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).eval()


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def run(model, config, device=CPU):
    """Check then apply, as the pipeline does."""
    ctx = PipelineContext(device=device)
    placement.check(model, config, ctx)
    return placement.place_model(model, config, ctx), ctx


@pytest.fixture
def saved(tmp_path):
    config = tiny_llama_config(tie_word_embeddings=True)
    build_tiny(config).save_pretrained(tmp_path)
    return config, tmp_path, AutoModelForCausalLM.from_pretrained(tmp_path).eval()


def test_meta_model_is_materialised_from_the_checkpoint(saved):
    config, folder, reference = saved
    model, ctx = run(meta_model(config), resolve_config({"checkpoint": str(folder)}))
    assert torch.equal(logits(model), logits(reference))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    [(step, what)] = ctx.report
    assert step == "placement"
    assert "on cpu" in what and "materialised from meta" in what and str(folder) in what and "MiB" in what


def test_relative_checkpoint_is_resolved_against_base_dir(saved):
    config, folder, reference = saved
    model, _ = run(meta_model(config), resolve_config({"checkpoint": folder.name, "base_dir": str(folder.parent)}))
    assert torch.equal(logits(model), logits(reference))


def test_load_policy_dict(saved):
    config, folder, reference = saved
    policy = {"type": "ds_model", "checkpoints": ["model.safetensors"], "version": 1.0}
    model, _ = run(meta_model(config), resolve_config({"checkpoint": policy, "base_dir": str(folder)}))
    assert torch.equal(logits(model), logits(reference))


def test_checkpoint_config_dir_is_an_alternative_source(saved):
    config, folder, reference = saved
    settings = SimpleNamespace(checkpoint=None, base_dir="", keep_module_on_host=False,
                               checkpoint_config=SimpleNamespace(checkpoint_dir=str(folder), base_dir=None))
    model, _ = run(meta_model(config), settings)
    assert torch.equal(logits(model), logits(reference))


def test_normal_model_gets_the_checkpoint_weights(saved):
    config, folder, reference = saved
    model, ctx = run(build_tiny(config, seed=5), resolve_config({"checkpoint": str(folder)}))
    assert torch.equal(logits(model), logits(reference))
    assert "weights loaded from checkpoint" in ctx.report[0][1] and "meta" not in ctx.report[0][1]


def test_model_without_checkpoint_moves_to_the_target_device(tiny_llama):
    # The meta device stands in for an accelerator: the target is honoured unless keep_module_on_host.
    model, ctx = run(tiny_llama, resolve_config({}), device=torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())
    assert "on meta" in ctx.report[0][1] and "no checkpoint" in ctx.report[0][1]


def test_keep_module_on_host_leaves_the_model_on_cpu(tiny_llama):
    expected = logits(tiny_llama)
    model, ctx = run(tiny_llama, resolve_config({"keep_module_on_host": True}), device=torch.device("meta"))
    assert all(p.device == CPU for p in model.parameters())
    assert torch.equal(logits(model), expected)
    assert "on cpu (keep_module_on_host)" in ctx.report[0][1]


def test_keep_module_on_host_materialises_a_meta_model_on_cpu(saved):
    config, folder, reference = saved
    settings = resolve_config({"checkpoint": str(folder), "keep_module_on_host": True})
    model, _ = run(meta_model(config), settings, device=torch.device("meta"))
    assert all(p.device == CPU for p in model.parameters())
    assert torch.equal(logits(model), logits(reference))


def test_meta_model_without_checkpoint_raises():
    model = meta_model(tiny_llama_config())
    with pytest.raises(ValueError, match=r"meta device.*checkpoint="):
        placement.check(model, resolve_config({}), PipelineContext(device=CPU))


def test_mismatched_checkpoint_raises_in_check_before_anything_changes(saved):
    _, folder, _ = saved
    model = meta_model(tiny_llama_config(hidden_size=32, tie_word_embeddings=True))
    with pytest.raises(ValueError, match=r"does not match the model.*wrong shape"):
        placement.check(model, resolve_config({"checkpoint": str(folder)}), PipelineContext(device=CPU))
    assert all(p.is_meta for p in model.parameters())


def test_missing_checkpoint_raises_in_check(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match="does not exist"):
        placement.check(tiny_llama, resolve_config({"checkpoint": str(tmp_path / "nope")}), PipelineContext(device=CPU))


def test_init_inference_materialises_a_meta_model(saved):
    import splice

    config, folder, reference = saved
    engine = splice.init_inference(meta_model(config), checkpoint=str(folder))
    assert any(step == "placement" and "materialised from meta" in what for step, what in engine.report)
    assert torch.equal(logits(engine.module), logits(reference))
