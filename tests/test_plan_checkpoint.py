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


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_save_mp_checkpoint_path_on_a_file_raises_before_any_plan(tmp_path, where):
    """A save path that is a file, or lies under one, is refused when the plan is resolved (before any step changes
    the model), naming the file; a folder that does not exist yet is fine (the shard step creates it)."""
    from splice.plan import resolve_tensor_parallel
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    path = blocker if where == "file" else blocker / "shards"
    model = build_tiny(tiny_llama_config())
    config = resolve_config({"tensor_parallel": {"tp_size": 2}, "save_mp_checkpoint_path": str(path)})
    with pytest.raises(ValueError, match=r"save_mp_checkpoint_path=.*blocker.* is a file; allowed: a folder"):
        resolve_tensor_parallel(config, model, 2, None)
    fresh = resolve_config({"tensor_parallel": {"tp_size": 2},
                           "save_mp_checkpoint_path": str(tmp_path / "new" / "shards")})
    assert resolve_tensor_parallel(fresh, model, 2, None) is not None


def test_a_sharded_checkpoint_at_tp_size_1_names_the_size_it_was_saved_for(tmp_path):
    """A splice tensor-parallel checkpoint (``splice_tp.json``) saved for 2 ranks, given at tp_size 1: the error says
    which tp_size it loads at, before the model is touched."""
    import json
    from splice.tp.autotp import autotp_plan
    from splice.tp.loading import FORMAT, MANIFEST
    model = build_tiny(tiny_llama_config())
    data = {"format": FORMAT, "tp_size": 2, "files": ["tp2-rank0.safetensors", "tp2-rank1.safetensors"], "ties": [],
            "plan": autotp_plan(model).to_dict()}
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"saved for tensor_parallel.tp_size=2, but tp_size=1; allowed: tp_size=2"):
        splice.init_inference(model, checkpoint=str(tmp_path / MANIFEST))
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


def test_resolve_reads_a_tensor_parallel_checkpoints_manifest_once(tmp_path, monkeypatch):
    """``splice_tp.json`` is read once per resolve, and the stored plan, the weight check and the grain size all come
    from that reading: a manifest replaced meanwhile (here, every later read sees one saved for another tp_size and
    tp_grain_size) cannot make the checks disagree. The plan keeps the manifest it decided by, for the shard step."""
    import json
    from splice import plan as plan_module
    from splice.distributed import ParallelContext
    from splice.tp import loading
    from splice.tp.autotp import autotp_plan
    model = build_tiny(tiny_llama_config())
    data = {"format": loading.FORMAT, "tp_size": 2, "tp_grain_size": 32, "ties": [],
            "files": ["tp2-rank0.safetensors", "tp2-rank1.safetensors"], "plan": autotp_plan(model).to_dict()}
    (tmp_path / loading.MANIFEST).write_text(json.dumps(data))
    reads = []

    def read_manifest(path):
        reads.append(path)
        manifest = loading.read_manifest(path)
        return manifest if len(reads) == 1 else {**manifest, "tp_size": 4, "tp_grain_size": 16}

    monkeypatch.setattr(plan_module, "read_manifest", read_manifest)
    config = resolve_config({"checkpoint": str(tmp_path), "tensor_parallel": {"tp_size": 2}})
    plan = plan_module.resolve(config, model, ParallelContext(0, 2), torch.device("cpu"))  # resolve runs no collective
    assert reads == [tmp_path]
    assert plan.tp_grain_size == 32 and plan.tp_manifest == {**data, "folder": str(tmp_path)}
    assert plan.tp_plan.rules == autotp_plan(model).rules and plan.checkpoint_loader == "shard"


def test_a_tied_model_given_an_untied_checkpoint_computes_what_from_pretrained_does(tmp_path):
    """A tied model (on meta) with a checkpoint saved untied (lm_head and embed_tokens differ): transformers unties
    and loads both; so does init_inference, kernel-injected or not."""
    from transformers import AutoModelForCausalLM

    build_tiny(tiny_llama_config()).save_pretrained(tmp_path)
    tied = tiny_llama_config(tie_word_embeddings=True)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, config=tied).eval()
    for inject in (False, True):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tied).eval()
        engine = splice.init_inference(model, checkpoint=str(tmp_path), replace_with_kernel_inject=inject)
        torch.testing.assert_close(_logits(engine), _logits(reference), rtol=1e-5, atol=1e-5)


def test_tied_names_with_different_values_are_refused_where_sharded_loading_cannot_untie_them(tmp_path):
    """At tp_size > 1 each rank reads one tensor for a group of tied names: checked with the checkpoint's headers,
    before any process changes its model; equal values (a tied checkpoint) pass."""
    from transformers import AutoModelForCausalLM

    from splice.plan import check_weights

    untied, tied_folder = tmp_path / "untied", tmp_path / "tied"
    build_tiny(tiny_llama_config()).save_pretrained(untied)
    build_tiny(tiny_llama_config(tie_word_embeddings=True)).save_pretrained(tied_folder, safe_serialization=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True))
    with pytest.raises(ValueError, match=r"holds tied tensors with different values \(\S+ differs from \S+\), which "
                                         r"sharded loading cannot untie; allowed: tie_word_embeddings=False"):
        check_weights(model, untied, 2, None)
    check_weights(model, untied, 1, None)  # one process unties them, as transformers does
    check_weights(model, tied_folder, 2, None)


def test_a_splice_quantized_folder_as_checkpoint_points_to_load_quantized(tmp_path):
    from splice.quant import save_quantized

    save_quantized(splice.init_inference(build_tiny(tiny_llama_config()), dtype=torch.int8), tmp_path)
    for options in ({}, {"dtype": torch.int8}):
        with torch.device("meta"):
            model = build_tiny(tiny_llama_config())
        with pytest.raises(ValueError, match=r"is a splice quantized checkpoint .*splice\.quant\.load_quantized"):
            splice.init_inference(model, checkpoint=str(tmp_path), **options)
