"""The load step (and place, which follows it in these tests): materialise a meta model from a checkpoint, or
overwrite a model's weights from one; move the model home."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from splice.steps import Stage
from splice.steps.load import load_weights
from splice.steps.place import place

from ..conftest import build_tiny, tiny_llama_config
from .plans import plan_for

IDS = torch.tensor([[5, 17, 33, 9, 71, 4, 1, 2]])
CPU = torch.device("cpu")


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).eval()


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def run(model, device=CPU, **config):
    """Resolve, then load and place, as the pipeline does; returns the model and the two reports."""
    plan = plan_for(model, device=device, **config)
    stage, loaded = load_weights(Stage(model), plan)
    stage, placed = place(stage, plan)
    return stage.model, (loaded, placed)


@pytest.fixture
def saved(tmp_path):
    config = tiny_llama_config(tie_word_embeddings=True)
    build_tiny(config).save_pretrained(tmp_path)
    return config, tmp_path, AutoModelForCausalLM.from_pretrained(tmp_path).eval()


def test_meta_model_is_materialised_from_the_checkpoint(saved):
    config, folder, reference = saved
    model, (loaded, placed) = run(meta_model(config), checkpoint=str(folder))
    assert torch.equal(logits(model), logits(reference))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (loaded.step, loaded.loader, loaded.materialised, loaded.source) == ("load", "load", True, str(folder))
    assert (placed.step, placed.device, placed.keep_module_on_host) == ("place", "cpu", False)
    assert placed.parameter_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_relative_checkpoint_is_resolved_against_base_dir(saved):
    config, folder, reference = saved
    model, _ = run(meta_model(config), checkpoint=folder.name, base_dir=str(folder.parent))
    assert torch.equal(logits(model), logits(reference))


def test_load_policy_dict(saved):
    config, folder, reference = saved
    policy = {"type": "ds_model", "checkpoints": ["model.safetensors"], "version": 1.0}
    model, _ = run(meta_model(config), checkpoint=policy, base_dir=str(folder))
    assert torch.equal(logits(model), logits(reference))


def test_checkpoint_config_dir_is_an_alternative_source(saved):
    config, folder, reference = saved
    model, _ = run(meta_model(config), checkpoint_config={"checkpoint_dir": str(folder)})
    assert torch.equal(logits(model), logits(reference))


def test_normal_model_gets_the_checkpoint_weights(saved):
    config, folder, reference = saved
    model, (loaded, _) = run(build_tiny(config, seed=5), checkpoint=str(folder))
    assert torch.equal(logits(model), logits(reference))
    assert loaded.source == str(folder) and not loaded.materialised


def test_model_without_checkpoint_moves_to_the_target_device(tiny_llama):
    # The meta device stands in for an accelerator: the target is honoured unless keep_module_on_host.
    model, (loaded, placed) = run(tiny_llama, device=torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())
    assert placed.device == "meta" and loaded.loader is None and loaded.summary() == "skipped (no checkpoint)"


def test_keep_module_on_host_leaves_the_model_on_cpu(tiny_llama):
    expected = logits(tiny_llama)
    model, (_, placed) = run(tiny_llama, device=torch.device("meta"), keep_module_on_host=True)
    assert all(p.device == CPU for p in model.parameters())
    assert torch.equal(logits(model), expected)
    assert placed.device == "cpu" and placed.keep_module_on_host


def test_keep_module_on_host_materialises_a_meta_model_on_cpu(saved):
    config, folder, reference = saved
    model, _ = run(meta_model(config), device=torch.device("meta"), checkpoint=str(folder), keep_module_on_host=True)
    assert all(p.device == CPU for p in model.parameters())
    assert torch.equal(logits(model), logits(reference))


def test_meta_model_without_checkpoint_raises():
    model = meta_model(tiny_llama_config())
    with pytest.raises(ValueError, match=r"meta device.*checkpoint="):
        plan_for(model)


def test_mismatched_checkpoint_raises_in_check_before_anything_changes(saved):
    _, folder, _ = saved
    model = meta_model(tiny_llama_config(hidden_size=32, tie_word_embeddings=True))
    with pytest.raises(ValueError, match=r"does not match the model.*wrong shape"):
        plan_for(model, checkpoint=str(folder))
    assert all(p.is_meta for p in model.parameters())


def test_missing_checkpoint_raises_in_check(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match="does not exist"):
        plan_for(tiny_llama, checkpoint=str(tmp_path / "nope"))


def test_init_inference_materialises_a_meta_model(saved):
    import splice

    config, folder, reference = saved
    engine = splice.init_inference(meta_model(config), checkpoint=str(folder))
    assert engine.step_report("load").materialised
    assert torch.equal(logits(engine.module), logits(reference))


def test_a_meta_model_with_a_checkpoint_is_loaded_before_kernel_injection(saved):
    """The checkpoint is loaded before fusing at every tp_size, so a meta model plus checkpoint= injects at tp 1."""
    import splice

    config, folder, reference = saved
    engine = splice.init_inference(meta_model(config), checkpoint=str(folder), replace_with_kernel_inject=True,
                                   max_out_tokens=32)
    assert [r.step for r in engine.reports][:4] == ["dtype", "load", "shard", "fuse"]
    ids = IDS[:, :6]
    expected = reference.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(engine.generate(ids, max_new_tokens=5, do_sample=False), expected)
