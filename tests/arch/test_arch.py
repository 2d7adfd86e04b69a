"""Architecture records: the registry, and the numbers read from each family's config."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from splice.arch import REGISTRY, lookup, model_dims, supported

from .tiny_models import FAMILIES, NORMS_OVER_HEADS, VARIANTS, family_config


def test_every_family_has_a_record():
    assert set(FAMILIES) <= set(supported())
    for model_type, record in REGISTRY.items():
        assert record.model_type == model_type


def test_unknown_model_type_raises_listing_supported():
    with pytest.raises(ValueError, match="mamba") as error:
        lookup(SimpleNamespace(model_type="mamba"))
    for model_type in FAMILIES:
        assert model_type in str(error.value)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_dims_follow_the_config(model_type):
    config = family_config(model_type)
    dims = model_dims(lookup(config), config)
    assert (dims.hidden, dims.n_heads, dims.n_kv_heads) == (64, 4, 2)
    assert dims.head_dim == (getattr(config, "head_dim", None) or 16)
    assert len(dims.windows) == config.num_hidden_layers


def test_variants_are_read_from_the_config():
    mistral = family_config("mistral")
    assert model_dims(lookup(mistral), mistral).windows == (6, 6)
    qwen2 = family_config("qwen2")  # max_window_layers=1: layer 0 full, layer 1 sliding
    assert model_dims(lookup(qwen2), qwen2).windows == (None, 6)
    phi3 = family_config("phi3")
    assert model_dims(lookup(phi3), phi3).rotary_dim == 8
    gemma = family_config("gemma")
    dims = model_dims(lookup(gemma), gemma)
    assert dims.activation == "gelu_pytorch_tanh" and lookup(gemma).norm_offset == 1.0
    cohere2 = family_config("cohere2")  # a sliding-window layer with rotary, a full-attention one without positions
    dims = model_dims(lookup(cohere2), cohere2)
    assert dims.windows == (6, None) and dims.unrotated == (1,) and dims.positions == "rotary"
    assert model_dims(lookup(mistral), mistral).unrotated == ()


def test_rope_parameters_of_transformers_4_are_read():
    config = SimpleNamespace(model_type="llama", rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0},
                             max_position_embeddings=128)
    from splice.arch.record import rope_spec

    spec = rope_spec(config)
    assert (spec.theta, spec.rope_type, spec.partial_factor) == (5e5, "linear", 1.0)


def test_a_transformers_4_partial_factor_is_read_at_the_top_level_only_where_the_family_applies_it():
    """A 4.x config (Phi-3's) keeps ``partial_rotary_factor`` beside ``rope_theta``: read there for a family whose HF
    attention rotates part of each head; a family that rotates the whole head never reads it."""
    from splice.arch.record import rope_spec

    config = SimpleNamespace(rope_theta=1e4, rope_scaling=None, partial_rotary_factor=0.5, max_position_embeddings=64)
    assert rope_spec(config, partial_rotary=True).partial_factor == 0.5
    assert rope_spec(config).partial_factor == 1.0


def test_dynamic_rope_limits_the_static_table():
    config = family_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    assert model_dims(lookup(config), config).rope.max_positions == config.max_position_embeddings


def shares(rule, size: int, tp: int) -> list:
    """What each of ``tp`` ranks gets of a dimension of ``size`` under ``rule`` (None: replicated)."""
    from splice.tp.split import layout_ranges, merge

    if rule is None or rule.style == "replicate":
        return [None] * tp
    return [merge(list(layout_ranges(rule.layout, size, tp, rank, rule.heads))) for rank in range(tp)]


#: AutoTP traces a text-only forward, so the multimodal Gemma 3's vision tower never runs and AutoTP cannot place it;
#: with kernel injection the record's plan serves it (tests/tp/test_inject_tp.py). A mixture of experts' record has
#: no plan of its own (AutoTP's serves it); norms over every head refuse both (below).
@pytest.mark.parametrize("name", [name for name in FAMILIES + VARIANTS
                                  if name.split(":")[0] not in ("gemma3", *NORMS_OVER_HEADS)
                                  and not REGISTRY[name.split(":")[0]].moe])
def test_the_record_tensor_parallel_plan_is_autotps(name):
    """Each record carries its family's tensor-parallel plan; AutoTP, analysing the model's data flow, must find the
    same one (what every rank gets of every module at tp=2 and tp=3, attention heads, blocks) for every family and
    variant: per-head and per-KV-group fused q/k/v, multi-query (the shared K/V head replicated, query heads split),
    Conv1D. Layouts that name the same split differently (``kv`` with as many KV as query heads, one KV group's
    ``kv_groups``) count as the same; a linear a plan leaves out is replicated."""
    from splice.arch import tensor_parallel_plan
    from splice.tp.autotp import autotp_plan, trace_model
    from splice.tp.plan import resolve

    from .tiny_models import build_family

    model = build_family(name)
    record_plan = tensor_parallel_plan(lookup(model.config), model.config)
    found = autotp_plan(model, trace_model(model))
    from_record, from_autotp = resolve(record_plan, model), resolve(found, model)
    modules = dict(model.named_modules())
    for module in sorted(set(from_record) | set(from_autotp)):
        weight = modules[module].weight
        size = weight.shape[1] if type(modules[module]).__name__ == "Conv1D" else weight.shape[0]
        a, b = from_record.get(module), from_autotp.get(module)
        assert (a and a.style) == (b and b.style) or None in (a, b) and "replicate" in (a and a.style, b and b.style)
        for tp in (2, 3):
            assert shares(a, size, tp) == shares(b, size, tp), (module, tp, a, b)
    assert record_plan.attention == found.attention and record_plan.blocks == found.blocks
    assert record_plan.source == "record"


@pytest.mark.parametrize("change, message", [
    ({"qk_norm_width": "heads"}, "qk_norm_width='heads'; allowed: head, projection"),
    ({"rotary_tables_float": True}, "rotary_tables_float=True with rotary_float=False"),
])
def test_a_record_with_a_variant_the_block_does_not_have_is_refused(change, message):
    from dataclasses import replace

    from splice.arch import check_fits

    config = family_config("llama")
    check_fits(lookup(config), config)
    with pytest.raises(ValueError, match=rf"record 'llama': {re.escape(message)}"):
        check_fits(replace(lookup(config), **change), config)


@pytest.mark.parametrize("name", NORMS_OVER_HEADS)
def test_norms_over_every_head_refuse_tensor_parallelism_in_either_plan(name):
    """OLMo 2's q and k norms span every head of their projections: the record's plan refuses to split them, naming the
    norms and what is allowed, and AutoTP refuses them too (OLMoE's record has no plan: AutoTP's refusal serves it)."""
    from splice.arch import tensor_parallel_plan
    from splice.tp.autotp import autotp_plan, trace_model
    from splice.tp.plan import verify

    from .tiny_models import build_family

    model = build_family(name)
    record = lookup(model.config)
    if not record.moe:
        with pytest.raises(ValueError, match=rf"model_type='{name}' normalises each whole q and k projection "
                                             r"\(self_attn\.q_norm, self_attn\.k_norm\).*allowed: tp_size=1"):
            tensor_parallel_plan(record, model.config)
    with pytest.raises(ValueError, match=r"self_attn\.q_norm.*are not one head's"):
        verify(autotp_plan(model, trace_model(model)), model, 2)
