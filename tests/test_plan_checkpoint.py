"""``plan.checkpoint_source``: ``checkpoint`` / ``base_dir`` and their ``checkpoint_config`` counterparts combine, or
raise naming both values before the model is touched."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import splice
from splice.config import resolve_config
from splice.plan import checkpoint_source
from tests.arch.tiny_models import build_tiny, tiny_llama_config


def _source(**kwargs):
    return checkpoint_source(resolve_config(**kwargs))


def test_checkpoint_and_a_different_checkpoint_dir_raise_naming_both():
    with pytest.raises(ValueError, match="allowed") as error:
        _source(checkpoint="/tmp/ck/good", checkpoint_config={"checkpoint_dir": "/tmp/other"})
    assert "checkpoint='/tmp/ck/good'" in str(error.value)
    assert "checkpoint_config.checkpoint_dir='/tmp/other'" in str(error.value)


def test_a_load_policy_with_a_checkpoint_dir_raises():
    with pytest.raises(ValueError, match="checkpoint_config.checkpoint_dir='/tmp/other'"):
        _source(checkpoint={"type": "ds_model", "checkpoints": ["a.safetensors"]},
                checkpoint_config={"checkpoint_dir": "/tmp/other"})


@pytest.mark.parametrize("checkpoint, checkpoint_dir", [("/tmp/ck/good", "/tmp/ck/good"), ("good", "/tmp/ck/good"),
                                                        (Path("/tmp/ck/good"), "good")])
def test_checkpoint_and_checkpoint_dir_naming_the_same_path_agree(checkpoint, checkpoint_dir):
    source = _source(checkpoint=checkpoint, base_dir="/tmp/ck", checkpoint_config={"checkpoint_dir": checkpoint_dir})
    assert source == Path("/tmp/ck/good")


def test_checkpoint_config_base_dir_roots_a_relative_checkpoint():
    assert _source(checkpoint="good", checkpoint_config={"base_dir": "/tmp/ck"}) == Path("/tmp/ck/good")
    assert _source(checkpoint="/abs/good", checkpoint_config={"base_dir": "/tmp/ck"}) == Path("/abs/good")
    assert _source(checkpoint_config={"checkpoint_dir": "good", "base_dir": "/tmp/ck"}) == Path("/tmp/ck/good")


def test_the_same_base_dir_twice_is_accepted():
    assert _source(checkpoint="good", base_dir="/tmp/ck", checkpoint_config={"base_dir": "/tmp/ck/"}) == \
        Path("/tmp/ck/good")


@pytest.mark.parametrize("checkpoint", ["good", None])
def test_two_different_base_dirs_raise_naming_both(checkpoint):
    config = {"checkpoint_dir": "good"} if checkpoint is None else {}
    with pytest.raises(ValueError, match="allowed") as error:
        _source(checkpoint=checkpoint, base_dir="/tmp/a", checkpoint_config={**config, "base_dir": "/tmp/b"})
    assert "base_dir='/tmp/a'" in str(error.value) and "checkpoint_config.base_dir='/tmp/b'" in str(error.value)


@pytest.fixture
def saved(tmp_path):
    config = tiny_llama_config()
    build_tiny(config).save_pretrained(tmp_path / "good")
    return config, tmp_path


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 3]])).logits


def test_init_inference_loads_under_checkpoint_config_base_dir(saved):
    config, root = saved
    engine = splice.init_inference(build_tiny(config, seed=7), checkpoint="good", device="cpu",
                                   checkpoint_config={"base_dir": str(root)})
    assert torch.equal(_logits(engine.module), _logits(build_tiny(config)))


@pytest.mark.parametrize("options", [
    {"checkpoint_config": {"checkpoint_dir": "/tmp/other"}},
    {"base_dir": "/tmp/a", "checkpoint_config": {"base_dir": "/tmp/b"}},
])
def test_a_conflict_leaves_the_model_unchanged(saved, options):
    config, root = saved
    model = build_tiny(config, seed=7)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match="allowed"):
        splice.init_inference(model, checkpoint=str(root / "good"), device="cpu", **options)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
