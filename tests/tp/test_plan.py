"""AutoTP's data-flow plans, user policies, verification and the plan as data (single process, meta models)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from splice.distributed import ParallelContext
from splice.tp.apply import apply_plan
from splice.tp.autotp import autotp_plan
from splice.tp.loading import slice_in_memory
from splice.tp.plan import Rule, TPPlan, experts_layout, verify
from splice.tp.policy import policy_plan
from splice.tp.split import Heads
from tests.arch.tiny_models import AUTOTP_FAMILIES as FAMILIES, MOE_FAMILIES, build
from tests.snippet_models import tiny_bart, tiny_t5

# family -> (attention output, fused or q layout, MLP output, expected q/kv heads)
EXPECTED = {
    "llama": ("model.layers.*.self_attn.o_proj", ("model.layers.*.self_attn.k_proj", "kv"), "model.layers.*.mlp.down_proj", (4, 2)),
    "qwen2": ("model.layers.*.self_attn.o_proj", ("model.layers.*.self_attn.q_proj", "q"), "model.layers.*.mlp.down_proj", (4, 2)),
    "gpt2": ("transformer.h.*.attn.c_proj", ("transformer.h.*.attn.c_attn", "qkv"), "transformer.h.*.mlp.c_proj", (4, 4)),
    "gpt_neox": ("gpt_neox.layers.*.attention.dense", ("gpt_neox.layers.*.attention.query_key_value", "heads"),
                 "gpt_neox.layers.*.mlp.dense_4h_to_h", (4, 4)),
    "bloom": ("transformer.h.*.self_attention.dense", ("transformer.h.*.self_attention.query_key_value", "heads"),
              "transformer.h.*.mlp.dense_4h_to_h", (4, 4)),
    "falcon": ("transformer.h.*.self_attention.dense", ("transformer.h.*.self_attention.query_key_value", "qkv"),
               "transformer.h.*.mlp.dense_4h_to_h", (4, 1)),
    "phi3": ("model.layers.*.self_attn.o_proj", ("model.layers.*.self_attn.qkv_proj", "qkv"),
             "model.layers.*.mlp.down_proj", (4, 2)),
    "gemma": ("model.layers.*.self_attn.o_proj", ("model.layers.*.self_attn.k_proj", "kv"),
              "model.layers.*.mlp.down_proj", (4, 2)),
    "opt": ("model.decoder.layers.*.self_attn.out_proj", ("model.decoder.layers.*.self_attn.q_proj", "q"),
            "model.decoder.layers.*.fc2", (4, 4)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_autotp_finds_rows_columns_and_fused_layouts_by_data_flow(family):
    plan = autotp_plan(build(family, meta=True))
    attn_out, (column, layout), mlp_out, (n_q, n_kv) = EXPECTED[family]
    assert plan.rules[attn_out].style == "row" and plan.rules[attn_out].layout == "q"
    assert plan.rules[column] == Rule("column", layout, plan.rules[attn_out].heads)
    assert (plan.rules[attn_out].heads.n_q, plan.rules[attn_out].heads.n_kv) == (n_q, n_kv)
    assert plan.rules[mlp_out] == Rule("row")
    assert sum(r.style == "vocab" for r in plan.rules.values()) == 2  # embeddings and lm_head
    assert all("*" in p for p in plan.attention) and len(plan.blocks) == 1


def test_phi3_gate_up_is_split_by_halves():
    assert autotp_plan(build("phi3", meta=True)).rules["model.layers.*.mlp.gate_up_proj"] == Rule("column", "halves")


def test_falcon_new_architecture_is_split_by_kv_groups():
    plan = autotp_plan(build("falcon", meta=True, new_decoder_architecture=True, num_kv_heads=2))
    rule = plan.rules["transformer.h.*.self_attention.query_key_value"]
    assert (rule.layout, rule.heads) == ("kv_groups", Heads(4, 2, 16))


def test_plan_round_trips_as_json_data_and_describes_itself():
    plan = autotp_plan(build("gpt2", meta=True))
    again = TPPlan.from_dict(plan.to_dict())
    assert again == plan
    lines = {line.split()[0]: line.split(None, 1)[1] for line in plan.describe().splitlines()[1:]}
    assert lines["transformer.h.*.attn.c_attn"].startswith("column(qkv) heads q=4 kv=4 dim=16")
    assert lines["lm_head"] == "vocab"


def test_verify_reports_rules_that_match_nothing_and_uncovered_linears():
    model = build("llama", meta=True)
    plan = autotp_plan(model)
    extra = TPPlan({**plan.rules, "model.layers.*.mlp.gate": Rule("column")}, plan.attention, plan.blocks)
    with pytest.raises(ValueError, match=r"rules match no module: \['model.layers.\*.mlp.gate'\]"):
        verify(extra, model, 2)
    partial = TPPlan({k: v for k, v in plan.rules.items() if "up_proj" not in k}, plan.attention, plan.blocks)
    with pytest.raises(ValueError, match=r"2 linear\(s\) uncovered: model.layers.0.mlp.up_proj, model.layers.1"):
        verify(partial, model, 2)
    wrong = TPPlan({**plan.rules, "model.layers.*.input_layernorm": Rule("column")}, plan.attention, plan.blocks)
    with pytest.raises(ValueError, match="needs a linear .* is a LlamaRMSNorm"):
        verify(wrong, model, 2)


def test_policy_gives_the_same_plan_as_autotp_and_names_bad_entries():
    model = build("llama", meta=True)
    layer = type(model.model.layers[0])
    policy = policy_plan(model, {layer: ("self_attn.o_proj", "mlp.down_proj")})
    assert policy.rules == autotp_plan(model).rules and policy.source == "policy"
    with pytest.raises(ValueError, match=r"\['mlp.down'\] name\(s\) no linear in it; its linears are \['mlp.down_proj'"):
        policy_plan(model, {layer: ("self_attn.o_proj", "mlp.down")})
    with pytest.raises(ValueError, match="row-parallel linear 'model.layers.0.self_attn.q_proj' must read only"):
        policy_plan(model, {layer: ("self_attn.q_proj", "mlp.down_proj")})
    with pytest.raises(TypeError, match="keys must be module classes"):
        policy_plan(model, {"LlamaDecoderLayer": ("self_attn.o_proj",)})


@pytest.mark.parametrize("rows, said", [
    (("self_attn.o_proj", "o_proj"), r"'self_attn.o_proj' and 'o_proj' both name the linear 'self_attn.o_proj' "
                                      r"of model.layers.0"),
    ((".mlp.down_proj", "down_proj", "o_proj"), r"'.mlp.down_proj' and 'down_proj' both name the linear "
                                                 r"'mlp.down_proj' of model.layers.0"),
    (("o_proj", "down_proj", "o_proj"), r"'o_proj' is given twice \(it names the linear 'self_attn.o_proj' of "
                                        r"model.layers.0\)"),
], ids=["path-and-suffix", "anchored-and-suffix", "same-entry-twice"])
def test_two_entries_naming_one_linear_say_so(rows, said):
    """Not "names no linear" for the entry a later one overrode: the error names both entries and their linear."""
    model = build("llama", meta=True)
    layer = type(model.model.layers[0])
    with pytest.raises(ValueError, match=rf"injection_policy for LlamaDecoderLayer: {said}; allowed: name each "
                       r"linear once"):
        policy_plan(model, {layer: rows})


@pytest.mark.parametrize("policy, error, message", [
    ({}, ValueError, r"injection_policy=\{\} names no block class.*allowed: a dict mapping block classes to the names "
                     r"of their output linears.*or injection_policy=None"),
    ([("x",)], TypeError, r"injection_policy must be a dict, got list.*allowed: a dict mapping block classes"),
], ids=["empty", "not-a-dict"])
def test_a_policy_that_is_no_mapping_of_blocks_raises(policy, error, message):
    with pytest.raises(error, match=message):
        policy_plan(build("llama", meta=True), policy)


def _meta(build_model):
    config = build_model().config
    with torch.device("meta"):
        return type(build_model())(config).eval()


def test_policy_takes_deepspeeds_name_forms():
    """DeepSpeed names a linear '<parent>.<name>' ('.fc2' for the block's own): its published T5 and BART policies
    and a leading-dot / bare-suffix llama policy give the plan AutoTP finds."""
    from tests.tp.workers import deepspeed_seq2seq_policies

    model = build("llama", meta=True)
    layer = type(model.model.layers[0])
    assert policy_plan(model, {layer: (".self_attn.o_proj", "down_proj")}).rules == autotp_plan(model).rules
    for name, build_model in (("t5", tiny_t5), ("bart", tiny_bart)):
        model = _meta(build_model)
        assert policy_plan(model, deepspeed_seq2seq_policies()[name]).rules == autotp_plan(model).rules, name


def test_policy_entries_that_name_nothing_or_two_linears_raise():
    from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer
    from transformers.models.t5.modeling_t5 import T5Block

    t5 = _meta(tiny_t5)
    with pytest.raises(ValueError, match=r"T5Block: \['CrossAttention.o'\] name\(s\) no linear in it; its linears are "
                       r"\['layer.0.SelfAttention.k', .*'layer.1.EncDecAttention.o', "):
        policy_plan(t5, {T5Block: ("SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo", "CrossAttention.o")})
    with pytest.raises(ValueError, match=r"\['.SelfAttention.o'\] name\(s\) no linear"):  # a dot: the block's own
        policy_plan(t5, {T5Block: (".SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo")})
    with pytest.raises(ValueError, match=r"BartDecoderLayer: 'out_proj' is ambiguous, it names 2 linears of "
                       r"model.decoder.layers.0: \['self_attn.out_proj', 'encoder_attn.out_proj'\]"):
        policy_plan(_meta(tiny_bart), {BartEncoderLayer: (".fc2", "out_proj"), BartDecoderLayer: (".fc2", "out_proj")})


def test_encoder_decoder_plans_split_relative_bias_and_tied_embeddings_by_the_same_rows():
    plan = autotp_plan(_meta(tiny_t5))
    bias = plan.rules["encoder.block.*.layer.0.SelfAttention.relative_attention_bias"]
    assert (bias.style, bias.layout, bias.heads) == ("column", "q", Heads(4, 4, 1))
    assert [k for k, r in plan.rules.items() if r.style == "vocab"] == ["shared", "encoder.embed_tokens",
                                                                          "decoder.embed_tokens", "lm_head"]
    assert plan.rules["decoder.block.*.layer.1.EncDecAttention.k"] == Rule("column", "q", Heads(4, 4, 8))
    tp = ParallelContext(rank=1, world_size=2)
    model = tiny_t5()
    full = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.detach().clone()
    apply_plan(model, plan, tp)
    attention = model.encoder.block[0].layer[0].SelfAttention
    assert torch.equal(attention.relative_attention_bias.weight, full[:, 2:])  # rank 1's heads 2 and 3
    assert (attention.n_heads, attention.inner_dim, attention.relative_attention_bias.embedding_dim) == (2, 16, 2)
    assert model.encoder.embed_tokens.weight is model.shared.weight is model.lm_head.linear.weight


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.skip = nn.Linear(8, 8)  # reads the stream and writes the residual directly: no row partner

    def forward(self, hidden_states, **kwargs):
        return hidden_states + self.skip(self.norm(hidden_states))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x


def test_autotp_lists_linears_it_cannot_place():
    with pytest.raises(ValueError, match=r"column-parallel linear 'layers.0.skip' must feed exactly one row"):
        autotp_plan(_Tiny())


@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon", "gemma"])
def test_shard_map_names_exactly_the_slices_each_rank_holds(family):
    """apply_plan on real weights, every rank in turn (sharding needs no communication): each sharded tensor equals
    the slice of the original its ShardMap entry names (Conv1D transposes included), and ties survive."""
    original = build(family)
    state = {k: v.clone() for k, v in original.state_dict().items()}
    plan = autotp_plan(original)
    for rank in range(3):
        model = build(family)
        shards = apply_plan(model, plan, ParallelContext(rank, 3), grain=64)
        for name, tensor in model.state_dict().items():
            expected = slice_in_memory(state, shards[name]) if name in shards else state[name]
            assert torch.equal(tensor, expected), (rank, name)
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if original.get_input_embeddings().weight is original.get_output_embeddings().weight:
            assert head.linear.weight is emb.weight


class _ScaledEmbedding(nn.Embedding):
    """Scales and offsets in its own forward (as transformers 5's Gemma embedding scales by sqrt(hidden))."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("embed_scale", torch.tensor(8.0), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale + 1.0


@pytest.mark.parametrize("tp", [2, 3])
def test_an_embedding_that_scales_in_its_forward_is_split_and_its_head_stays_tied(tp):
    """Any nn.Embedding is vocab-parallel: each rank runs the module's own forward on its rows (zeros for the ids
    it does not own), so the ranks' outputs sum to the unsharded forward; the tied lm_head shares the same rows."""
    model = build("llama", tie_word_embeddings=True)
    scaled = _ScaledEmbedding(128, 64, padding_idx=0)
    with torch.no_grad():
        scaled.weight.copy_(model.model.embed_tokens.weight)
    model.model.embed_tokens, model.lm_head.weight = scaled, scaled.weight
    ids = torch.tensor([[0, 5, 42, 43, 64, 85, 86, 127]])
    with torch.no_grad():
        expected = scaled(ids)
    plan = autotp_plan(model)
    assert plan.rules["model.embed_tokens"] == plan.rules["lm_head"] == Rule("vocab")
    total = torch.zeros_like(expected)
    for rank in range(tp):
        sharded = build("llama", tie_word_embeddings=True)
        sharded.model.embed_tokens = _ScaledEmbedding(128, 64, padding_idx=0)
        sharded.load_state_dict(model.state_dict())
        sharded.lm_head.weight = sharded.model.embed_tokens.weight
        apply_plan(sharded, plan, ParallelContext(rank, tp))
        emb = sharded.get_input_embeddings()
        assert type(emb.embedding) is _ScaledEmbedding and emb.embed_scale is emb.embedding.embed_scale
        assert sharded.get_output_embeddings().linear.weight is emb.weight  # still tied
        assert emb.embedding.padding_idx == (0 if rank == 0 else None)  # renumbered to the local rows
        emb.ctx = ParallelContext()  # this rank's part only (no group here): the group would sum the parts
        with torch.no_grad():
            total += emb(ids)
    assert torch.allclose(total, expected, atol=1e-6)


def test_head_counts_are_set_per_rank_on_modules_never_on_the_shared_config():
    """Rank 2 of 3 on a 4-query/2-KV-head model holds query heads 2,3 with KV head 1."""
    model = build("phi3")
    apply_plan(model, autotp_plan(model), ParallelContext(2, 3))
    attn = model.model.layers[0].self_attn
    assert (attn.num_key_value_heads, attn.num_key_value_groups) == (1, 2)
    assert (attn.config.num_attention_heads, attn.config.num_key_value_heads) == (2, 1)  # Phi-3 reads these
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    assert attn.config._attn_implementation == model.config._attn_implementation  # a live view
    assert attn.qkv_proj.out_features == (2 + 1 + 1) * 16


@pytest.mark.parametrize("after, layout", [
    (("view", ((1, 4, 2, 4, 16),)), "kv_groups"),  # each KV group's queries, then its key and value
    (("unflatten", ((1, 4, 4, 3, 16),)), "heads"),  # q, k and v interleaved per head
    (("split_with_sizes", ((1, 4, 4, 16), (1, 4, 2, 16), (1, 4, 2, 16))), "qkv"),
])
def test_a_first_view_to_rows_of_head_dim_is_read_through(after, layout):
    """transformers 5.25's Falcon first views its fused q/k/v output as rows of head_dim, which fits every layout; the
    op after that view tells them apart."""
    from splice.tp.autotp import Trace, fused_layout

    n_kv = 4 if layout == "heads" else 2
    rows = 4 + 2 * n_kv
    trace = Trace(out_ndim={"qkv": 3}, first_op={"qkv": ("view", ((1, 4, rows, 16),))}, next_op={"qkv": after})
    assert fused_layout("qkv", trace, Heads(4, n_kv, 16)) == layout


def _tiny(config_name: str, **overrides):
    import transformers
    from transformers import AutoModelForCausalLM

    ids = dict(vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(getattr(transformers, config_name)(**ids, **overrides)).eval()


_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=128)
REFUSED = {
    # qkv_proj viewed as 4 blocks of embed_dim / 4 (mp_num = 4 in its code): with 4 heads, a per-head [q v k] view
    "codegen": (("CodeGenConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, rotary_dim=8, n_inner=128)),
                r"fused projection 'transformer.h.0.attn.qkv_proj' is split by its 'heads' layout, but rank 0's shard "
                r"at tensor_parallel.tp_size=2 \(2 query and 2 key/value heads\) is first used by 'view' giving "
                r"shapes \[\(1, 4, 4, 24\)\], no view by those heads"),
    # an RMSNorm over the whole q projection (all heads' features)
    "olmo2": (("Olmo2Config", dict(_DECODER, num_key_value_heads=2)),
              r"AutoTP cannot shard 'model.layers.0.self_attn.q_norm' \(Olmo2RMSNorm\): it computes on the output "
              r"of \['model.layers.0.self_attn.q_proj'\] before 'model.layers.0.self_attn.o_proj' reads it.*its "
              r"weights \[\[64\]\] are not one head's \(16\)"),
    # a LayerNorm with one weight row per head
    "cohere": (("CohereConfig", dict(_DECODER, num_key_value_heads=2, use_qk_norm=True)),
               r"'model.layers.0.self_attn.q_norm' \(CohereLayerNorm\).*its weights \[\[4, 16\]\] are not one "
               r"head's"),
    # one LayerNorm module per head
    "stablelm": (("StableLmConfig", dict(_DECODER, num_key_value_heads=4, qk_layernorm=True)),
                 r"'model.layers.0.self_attn.q_layernorm.norms.0' \(LayerNorm\).*runs on fewer than all the heads "
                 r"at a time"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_autotp_refuses_what_a_rank_cannot_compute_on_its_heads(name):
    """Refused when the plan is made or verified (before anything is sharded), naming the module and why; the model
    is left as it was."""
    (config, overrides), message = REFUSED[name]
    model = _tiny(config, **overrides)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        verify(autotp_plan(model), model, 2)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(type(m).__module__.startswith("splice") for m in model.modules())


def test_the_vocabulary_is_split_in_grains():
    """tp_grain_size rounds each rank's vocabulary rows as it rounds MLP columns (1000 rows by 64: 512 + 488)."""
    for rank, rows in enumerate((512, 488)):
        model = build("llama", vocab_size=1000, tie_word_embeddings=False)
        apply_plan(model, autotp_plan(model), ParallelContext(rank, 2), grain=64)
        assert model.lm_head.linear.weight.shape[0] == model.model.embed_tokens.weight.shape[0] == rows


def test_per_head_inputs_are_cut_to_the_rank_heads():
    """ALiBi folded into a mask [batch, heads, q, k] (Falcon), [batch x heads, 1, k] (BLOOM) and [heads, 1, k] (MPT)
    give the rank its heads' planes; a mask for all heads and a bias already made of the rank's heads pass as they
    are."""
    from splice.tp.apply import rank_heads

    mask = torch.arange(2 * 4 * 3 * 3.0).reshape(2, 4, 3, 3)
    assert torch.equal(rank_heads(mask, 4, (1, 3)), mask[:, 1:3])
    flat = torch.arange(2 * 4 * 3.0).reshape(8, 1, 3)
    assert torch.equal(rank_heads(flat, 4, (2, 4)), flat.reshape(2, 4, 1, 3)[:, 2:4].reshape(4, 1, 3))
    shared, local = torch.zeros(2, 1, 3, 3), torch.zeros(2, 2, 3, 3)
    assert rank_heads(shared, 4, (0, 2)) is shared and rank_heads(local, 4, (0, 2)) is local


@dataclass(frozen=True)
class _OwnPart(ParallelContext):
    """A rank's context without a group: each rank's sums are its own part (the test adds the parts up)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_autotp_splits_every_experts_features_and_keeps_routers_and_gates_whole(family):
    """Each expert's gate/up outputs and down inputs are split by rank: the ranks' outputs of the experts module add
    up to the unsharded one, each tensor is the slice its shard map names, and Qwen2-MoE's one-output
    shared_expert_gate (it feeds no row-parallel linear) stays whole on every rank, as the router does."""
    model = build(family)
    plan = autotp_plan(model)
    assert plan.rules["model.layers.*.mlp.experts"] == Rule("experts", "halves")
    if family == "qwen2_moe":
        assert plan.rules["model.layers.*.mlp.shared_expert_gate"] == Rule("replicate")
        assert plan.rules["model.layers.*.mlp.shared_expert.down_proj"] == Rule("row")
    experts = model.model.layers[0].mlp.experts
    hidden = torch.randn(6, 64)
    top_k_index = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 1], [2, 0]])
    top_k_weights = torch.rand(6, 2)
    with torch.no_grad():
        expected = experts(hidden, top_k_index, top_k_weights)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    total = torch.zeros_like(expected)
    for rank in range(3):
        sharded = build(family)
        shards = apply_plan(sharded, plan, _OwnPart(rank, 3), grain=16)
        for name, tensor in sharded.state_dict().items():
            assert torch.equal(tensor, slice_in_memory(state, shards[name]) if name in shards else state[name]), name
        part = sharded.model.layers[0].mlp.experts
        width = part.down_proj.shape[2]
        assert part.gate_up_proj.shape[1] == 2 * width and part.intermediate_dim == width < experts.intermediate_dim
        with torch.no_grad():
            total += part(hidden, top_k_index, top_k_weights)
    assert torch.allclose(total, expected, atol=1e-6)


class _Experts(nn.Module):
    """transformers' experts interface as its decorator sets it: flags and 3-D weights."""

    def __init__(self, has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True, post_norm=False):
        super().__init__()
        self.has_gate, self.has_bias, self.is_transposed = has_gate, has_bias, is_transposed
        self.is_concatenated, self.has_post_expert_norm = is_concatenated, post_norm
        up = (4, 8, 16) if is_transposed else (4, 16, 8)
        setattr(self, "gate_up_proj" if has_gate else "up_proj", nn.Parameter(torch.zeros(up)))
        self.down_proj = nn.Parameter(torch.zeros(4, 8, 8))


@pytest.mark.parametrize("flags, layout", [
    (dict(), "halves"), (dict(is_transposed=True), "halves"), (dict(has_gate=False), "plain"),
    (dict(has_bias=True), None),  # every rank would add the down projection's bias
    (dict(is_concatenated=False), None),  # gate and up interleaved (GPT-OSS)
    (dict(post_norm=True), None),  # a norm after each expert needs all its features
])
def test_experts_are_split_only_where_the_split_computes_the_same(flags, layout):
    assert experts_layout(_Experts(**flags)) == layout
    assert experts_layout(nn.Linear(4, 4)) is None


def test_experts_whose_features_do_not_split_in_units_of_eight_are_refused_before_any_change():
    model = build("mixtral", intermediate_size=20)  # 20 features: no whole units of 8 over two ranks
    plan = autotp_plan(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts' have 20 intermediate features, which cannot "
                                         r"be split over tensor_parallel.tp_size=2 ranks in whole units of 8"):
        apply_plan(model, plan, _OwnPart(0, 2))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_attention_modules_per_head_parameters_are_cut_to_the_rank_heads():
    """GPT-OSS adds one learned logit per head to its attention scores (``sinks``): each rank keeps its heads' ones,
    recorded in the shard map; its biased experts, whose gate and up interleave, stay whole."""
    model = build("gpt_oss")
    sinks = model.model.layers[0].self_attn.sinks.detach().clone()
    plan = autotp_plan(model)
    assert not any(rule.style == "experts" for rule in plan.rules.values())
    shards = apply_plan(model, plan, ParallelContext(1, 2))
    assert torch.equal(model.model.layers[0].self_attn.sinks, sinks[2:])
    assert shards["model.layers.0.self_attn.sinks"].ranges == ((2, 4),)


def test_latent_attention_keeps_its_low_rank_downs_whole_and_splits_each_projection_by_heads():
    """DeepSeek-V3's attention: ``q_a_proj`` and ``kv_a_proj_with_mqa`` read the block's input into a few features that
    ``q_b_proj`` and ``kv_b_proj`` alone read; the downs stay whole, the ups and ``o_proj`` are split by the 4 heads,
    each at its own width (queries 16 a head, keys with values 24, the output 16)."""
    model = build("deepseek_v3")
    rules = autotp_plan(model).rules
    attention = "model.layers.*.self_attn"
    assert rules[f"{attention}.q_a_proj"] == rules[f"{attention}.kv_a_proj_with_mqa"] == Rule("replicate")
    assert rules[f"{attention}.q_b_proj"] == Rule("column", "q", Heads(4, 4, 16))
    assert rules[f"{attention}.kv_b_proj"] == Rule("column", "q", Heads(4, 4, 24))
    assert rules[f"{attention}.o_proj"] == Rule("row", "q", Heads(4, 4, 16))
    apply_plan(model, autotp_plan(build("deepseek_v3")), ParallelContext(1, 2))
    layer = model.model.layers[1].self_attn
    assert (layer.q_b_proj.out_features, layer.kv_b_proj.out_features, layer.o_proj.in_features) == (32, 48, 32)
    assert layer.q_a_proj.out_features == 32 and layer.num_heads == 2


def test_an_mlp_narrower_than_the_model_is_no_low_rank_down():
    """gate/up read the block's input into fewer features (intermediate 32 < hidden 64), and down_proj reads them
    alone: still an MLP split by columns, as its down projection writes the block's output."""
    rules = autotp_plan(build("llama", intermediate_size=32)).rules
    assert rules["model.layers.*.mlp.gate_proj"] == rules["model.layers.*.mlp.up_proj"] == Rule("column")
    assert rules["model.layers.*.mlp.down_proj"] == Rule("row")
