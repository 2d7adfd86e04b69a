"""The tensor_parallel pipeline step in one process: validation (check) needs no communication, so a two-rank
ParallelContext is enough to exercise it; sharding with real ranks is tested in tests/tp/."""
from __future__ import annotations

import json

import pytest
import torch

from splice.config import resolve_config
from splice.distributed import ParallelContext
from splice.pipeline import PipelineContext
from splice.transforms import tensor_parallel
from tests.tp.models import build

TWO_RANKS = ParallelContext(rank=0, world_size=2)


def pipeline_ctx(parallel=TWO_RANKS) -> PipelineContext:
    return PipelineContext(device=torch.device("cpu"), parallel=parallel)


def test_tp1_is_skipped():
    model, ctx = build("llama"), pipeline_ctx(ParallelContext())
    config = resolve_config({})
    tensor_parallel.check(model, config, ctx)
    assert tensor_parallel.shard_model(model, config, ctx) is model
    assert ctx.report == [("tensor_parallel", "skipped (tp_size=1)")]


def test_tp_size_without_a_group_says_how_to_launch():
    with pytest.raises(ValueError, match=r"tp_size=2, but this process's parallel context has 1 rank.*torchrun"):
        tensor_parallel.check(build("llama"), resolve_config({"tensor_parallel": {"tp_size": 2}}),
                              pipeline_ctx(ParallelContext()))


def test_check_makes_and_keeps_the_plan_without_touching_the_model():
    model = build("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = pipeline_ctx()
    tensor_parallel.check(model, resolve_config({"tensor_parallel": {"tp_size": 2}}), ctx)
    assert ctx.extras[tensor_parallel.PLAN_KEY].source == "autotp" and not tensor_parallel.owns_checkpoint(ctx)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear


def test_policy_errors_surface_in_check():
    model = build("llama")
    policy = {type(model.model.layers[0]): ("self_attn.out_proj",)}
    with pytest.raises(ValueError, match=r"\['self_attn.out_proj'\] name\(s\) no linear"):
        tensor_parallel.check(model, resolve_config({"tensor_parallel": {"tp_size": 2}, "injection_policy": policy}),
                              pipeline_ctx())


def test_with_a_checkpoint_this_step_owns_loading(tmp_path):
    build("llama").save_pretrained(tmp_path)
    ctx = pipeline_ctx()
    tensor_parallel.check(build("llama", meta=True),
                          resolve_config({"tensor_parallel": {"tp_size": 2}, "checkpoint": str(tmp_path)}), ctx)
    assert tensor_parallel.owns_checkpoint(ctx) and ctx.extras["checkpoint_owner"] == "tensor_parallel"


def test_checkpoint_that_does_not_fit_raises_in_check(tmp_path):
    build("llama", hidden_size=32, head_dim=8).save_pretrained(tmp_path)
    config = resolve_config({"tensor_parallel": {"tp_size": 2}, "checkpoint": str(tmp_path)})
    with pytest.raises(ValueError, match="does not match the model"):
        tensor_parallel.check(build("llama", meta=True), config, pipeline_ctx())


def test_saved_shards_reload_only_at_their_tp_size(tmp_path):
    (tmp_path / "splice_tp.json").write_text(json.dumps(
        {"format": "splice-tp/1", "tp_size": 2, "files": [], "plan": {"rules": {}}}))
    config = resolve_config({"tensor_parallel": {"tp_size": 3}, "checkpoint": str(tmp_path / "splice_tp.json")})
    with pytest.raises(ValueError, match=r"saved for tensor_parallel.tp_size=2, but tp_size=3"):
        tensor_parallel.check(build("llama", meta=True), config, pipeline_ctx(ParallelContext(0, 3)))


def test_describe_plan_prints_every_rule():
    text = tensor_parallel.describe_plan(build("gpt2", meta=True), 2)
    assert text.startswith("tensor-parallel plan (autotp; blocks transformer.h.*)")
    assert "transformer.h.*.attn.c_attn" in text and "column(qkv)" in text and "lm_head" in text
    with pytest.raises(ValueError, match="tp_size=8 is larger than the model's 4 attention heads"):
        tensor_parallel.describe_plan(build("gpt2", meta=True), 8)


def test_save_mp_checkpoint_path_needs_tp(tmp_path):
    import splice
    from tests.conftest import build_tiny, tiny_llama_config

    with pytest.raises(ValueError, match="save_mp_checkpoint_path.*tp_size > 1"):
        splice.init_inference(build_tiny(tiny_llama_config()), save_mp_checkpoint_path=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
