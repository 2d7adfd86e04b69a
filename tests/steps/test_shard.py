"""The shard step in one process: resolving its plan needs no communication, so a two-rank ParallelContext is
enough to exercise it; sharding with real ranks is tested in tests/tp/."""
from __future__ import annotations

import json

import pytest
import torch

from splice.config import SpliceIgnoredOptionWarning
from splice.distributed import ParallelContext
from splice.plan import describe_tensor_parallel
from splice.steps.shard import shard
from splice.tp.autotp import autotp_plan
from tests.arch.tiny_models import build

from .plans import plan_for, run_step

TWO_RANKS = ParallelContext(rank=0, world_size=2)


def test_tp1_is_skipped():
    model = build("llama")
    stage, report = run_step(shard, model)
    assert stage.model is model
    assert report.plan_source is None and report.summary() == "skipped (tp_size=1)"


def test_tp_size_without_a_group_says_how_to_launch():
    with pytest.raises(ValueError, match=r"tp_size=2, but this process's parallel context has 1 rank.*torchrun"):
        plan_for(build("llama"), tensor_parallel={"tp_size": 2})


def test_the_plan_holds_the_verified_tp_plan_without_touching_the_model():
    model = build("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_for(model, TWO_RANKS, tensor_parallel={"tp_size": 2})
    assert plan.tp_plan.source == "autotp" and plan.checkpoint_loader is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear


def test_policy_errors_surface_when_resolving():
    model = build("llama")
    policy = {type(model.model.layers[0]): ("self_attn.out_proj",)}
    with pytest.raises(ValueError, match=r"\['self_attn.out_proj'\] name\(s\) no linear"):
        plan_for(model, TWO_RANKS, tensor_parallel={"tp_size": 2}, injection_policy=policy)


def _llama_policy(model, *rows):
    return {type(model.model.layers[0]): rows or ("self_attn.o_proj", "mlp.down_proj")}


@pytest.mark.parametrize("policy, message", [
    (lambda m: _llama_policy(m, "self_attn.out_proj"), r"\['self_attn.out_proj'\] name\(s\) no linear"),
    (lambda m: {torch.nn.GRU: ("x",)}, r"injection_policy class GRU matches no module"),
    (lambda m: {"LlamaDecoderLayer": ("self_attn.o_proj",)}, r"keys must be module classes.*'LlamaDecoderLayer'"),
], ids=["unknown-linear", "unknown-class", "class-as-string"])
def test_tp1_policy_is_checked_as_at_tp2_before_the_model_changes(policy, message):
    import splice

    model = build("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((ValueError, TypeError), match=message):
        splice.init_inference(model, injection_policy=policy(model))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear


def test_tp1_valid_policy_warns_that_it_has_no_effect():
    model = build("llama")
    with pytest.warns(SpliceIgnoredOptionWarning, match=r"injection_policy=\{LlamaDecoderLayer: \('self_attn.o_proj', "
                      r"'mlp.down_proj'\)\} has no effect at tensor_parallel.tp_size=1.*needs tp_size > 1"):
        plan = plan_for(model, injection_policy=_llama_policy(model))
    assert plan.tp_plan is None


EMPTY_POLICY = r"injection_policy=\{\} names no block class.*allowed: a dict mapping block classes to the names of " \
               r"their output linears.*or injection_policy=None for kernel injection's plan or AutoTP"


@pytest.mark.parametrize("key", ["injection_policy", "injection_dict"])
def test_tp1_empty_policy_raises_before_the_model_changes(key, recwarn):
    import splice

    model = build("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=EMPTY_POLICY):
        splice.init_inference(model, **{key: {}})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert not [w for w in recwarn if issubclass(w.category, SpliceIgnoredOptionWarning)]


@pytest.mark.parametrize("kernel_inject", [False, True], ids=["autotp", "record"])
def test_tp2_empty_policy_raises_instead_of_another_plan(kernel_inject):
    with pytest.raises(ValueError, match=EMPTY_POLICY):
        plan_for(build("llama"), TWO_RANKS, tensor_parallel={"tp_size": 2}, injection_policy={},
                 replace_with_kernel_inject=kernel_inject)
    with pytest.raises(ValueError, match=EMPTY_POLICY):
        describe_tensor_parallel(build("llama", meta=True), 2, {})


def _saved_shards(folder, plan):
    (folder / "splice_tp.json").write_text(json.dumps(
        {"format": "splice-tp/1", "tp_size": 2, "files": [], "plan": plan.to_dict()}))
    return str(folder / "splice_tp.json")


def test_saved_shards_take_a_policy_that_splits_as_they_do(tmp_path, recwarn):
    model = build("llama", meta=True)
    checkpoint = _saved_shards(tmp_path, autotp_plan(model))
    plan = plan_for(model, TWO_RANKS, tensor_parallel={"tp_size": 2}, checkpoint=checkpoint,
                    injection_policy=_llama_policy(model))
    assert plan.tp_plan.source == "autotp" and plan.checkpoint_loader == "shard"
    assert not [w for w in recwarn if issubclass(w.category, SpliceIgnoredOptionWarning)]


def test_saved_shards_refuse_a_policy_that_splits_otherwise(tmp_path):
    model = build("llama", meta=True)
    stored = autotp_plan(model)
    stored.rules["lm_head"] = type(stored.rules["lm_head"])("replicate")
    checkpoint = _saved_shards(tmp_path, stored)
    with pytest.raises(ValueError, match=r"stored tensor-parallel plan \(autotp\), which splits differently from "
                       r"injection_policy=\{LlamaDecoderLayer: .*lm_head: stored replicate, policy vocab; allowed: no "
                       r"injection_policy"):
        plan_for(model, TWO_RANKS, tensor_parallel={"tp_size": 2}, checkpoint=checkpoint,
                 injection_policy=_llama_policy(model))
    with pytest.raises(ValueError, match=r"\['self_attn.out_proj'\] name\(s\) no linear"):
        plan_for(model, TWO_RANKS, tensor_parallel={"tp_size": 2}, checkpoint=checkpoint,
                 injection_policy=_llama_policy(model, "self_attn.out_proj"))


def test_with_a_checkpoint_the_shard_step_loads_it(tmp_path):
    build("llama").save_pretrained(tmp_path)
    plan = plan_for(build("llama", meta=True), TWO_RANKS, tensor_parallel={"tp_size": 2}, checkpoint=str(tmp_path))
    assert plan.checkpoint_loader == "shard" and plan.checkpoint == tmp_path


def test_checkpoint_that_does_not_fit_raises_when_resolving(tmp_path):
    build("llama", hidden_size=32, head_dim=8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not match the model"):
        plan_for(build("llama", meta=True), TWO_RANKS, tensor_parallel={"tp_size": 2}, checkpoint=str(tmp_path))


def test_saved_shards_reload_only_at_their_tp_size(tmp_path):
    (tmp_path / "splice_tp.json").write_text(json.dumps(
        {"format": "splice-tp/1", "tp_size": 2, "files": [], "plan": {"rules": {}}}))
    with pytest.raises(ValueError, match=r"saved for tensor_parallel.tp_size=2, but tp_size=3"):
        plan_for(build("llama", meta=True), ParallelContext(0, 3), tensor_parallel={"tp_size": 3},
                 checkpoint=str(tmp_path / "splice_tp.json"))


def test_describe_plan_prints_every_rule():
    text = describe_tensor_parallel(build("gpt2", meta=True), 2)
    assert text.startswith("tensor-parallel plan (autotp; blocks transformer.h.*)")
    assert "transformer.h.*.attn.c_attn" in text and "column(qkv)" in text and "lm_head" in text
    with pytest.raises(ValueError, match="tp_size=8 is larger than the model's 4 attention heads"):
        describe_tensor_parallel(build("gpt2", meta=True), 8)


def test_save_mp_checkpoint_path_needs_tp(tmp_path):
    import splice
    from tests.conftest import build_tiny, tiny_llama_config

    with pytest.raises(ValueError, match="save_mp_checkpoint_path.*tp_size > 1"):
        splice.init_inference(build_tiny(tiny_llama_config()), save_mp_checkpoint_path=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
