"""The data that describes one architecture family, and the per-model numbers read from a model's config.

A record says *where* things are and *which variant* a family uses; it holds no code. The generic fused block
(``splice.layers.block``) and the fuse step read it, and :func:`tensor_parallel_plan` reads the family's
tensor-parallel plan off it (as transformers keeps ``base_model_tp_plan`` on its configs).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..tp.plan import Rule, TPPlan
from ..tp.split import Heads


@dataclass(frozen=True)
class ArchRecord:
    """One architecture family. Paths are dotted attribute paths; block paths are relative to one decoder layer.

    A block path may list alternatives, ``"ln_attn|input_layernorm"``: the first the layer has is used (Falcon's
    configs switch between them); an optional path the layer lacks (or holds None) means the part is absent. Fields
    that name a config key (``parallel``, ``norm_before``, ``alibi``) take the variant from the model's config.
    Biases are taken from the checkpoint's linears (present or not), tied embeddings from the shared lm_head; HF
    ``Conv1D`` linears (GPT-2) and ``nn.Linear`` subclasses become plain ``nn.Linear`` when fused.

    An ``encoder`` (BERT) attends bidirectionally, keeps no KV cache and gets no decode runtime: only its layers are
    fused, its embeddings, pooler and task heads stay the model's own. Its model paths are relative to the base model
    (``model.base_model``), so one record serves the bare model and every task model around it (:func:`rooted`).
    """

    model_type: str
    encoder: bool = False
    # where the model's parts live, from the ``*ForCausalLM`` module (an encoder: from its base model)
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str | None = "model.norm"
    lm_head: str | None = "lm_head"  # None: no output head the runtime decodes with (encoders)
    # learned absolute positions added to the token embeddings, looked up at ``position + position_offset`` (OPT: 2)
    position_embed: str | None = None
    position_offset: int = 0
    embed_norm: str | None = None  # a norm on the embeddings (BLOOM)
    project_in: str | None = None  # OPT's word_embed_proj_dim projections around the blocks
    project_out: str | None = None
    # attention projections: separate q/k/v, or one fused ``qkv`` laid out ``qkv_layout``: "contiguous" [q; k; v],
    # or "grouped": per key/value head [its query heads, k, v] (per-head [q k v] when every head has its own k/v)
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    qkv: str | None = None
    qkv_layout: str = "contiguous"
    o: str = "self_attn.o_proj"
    # MLP: gated ``down(act(gate) * up)`` from separate gate/up or one fused ``gate_up`` [gate; up], or plain
    # ``down(act(up))`` (``gated=False``: ``up`` is fc1 / c_fc / dense_h_to_4h)
    gated: bool = True
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    gate_up: str | None = None
    down: str = "mlp.down_proj"
    # a mixture of experts: the layer's own MLP module (router, experts, any shared expert; a dense layer's MLP
    # alike), which the block calls as it is instead of the MLP above; None: the MLP above. A module that returns a
    # tuple (GPT-OSS's: the output, then its router scores) gives the block its first entry.
    moe: str | None = None
    # attention sinks: the path of a learned logit per query head that joins each query's scores in the softmax
    # (taking its share of the probability, with no value: GPT-OSS's ``self_attn.sinks``); None: none
    sinks: str | None = None
    # norms: "rms" (``norm_offset`` 1.0 means the checkpoint stores ``weight - 1``: y = norm(x) * (1 + w)) or "layer"
    # (the model's own LayerNorm modules, with their biases). ``mlp_norm`` absent: a parallel block's MLP reads the
    # attention norm's output; in a sequential pre-norm block an absent norm reads its input as it is (OLMo 2 normalises
    # the branch outputs alone). ``attn_out_norm`` / ``mlp_out_norm``: norms on the branch outputs (Gemma 2/3, OLMo 2).
    # ``norm_scale_float``: the RMSNorms scale by their weight in float32 and round once (OLMo 2), as offset norms do.
    norm: str = "rms"
    attn_norm: str | None = "input_layernorm"
    mlp_norm: str | None = "post_attention_layernorm"
    attn_out_norm: str | None = None
    mlp_out_norm: str | None = None
    norm_offset: float = 0.0
    norm_scale_float: bool = False
    eps_key: str = "rms_norm_eps"
    # RMSNorm on q and k before rotary (qk-norm), or None: per head (``qk_norm_width`` "head": one head's weight, every
    # head normalised alone) or over each whole projection ("projection": every head of q, of k, at once; OLMo 2)
    q_norm: str | None = None
    k_norm: str | None = None
    qk_norm_width: str = "head"
    # the config key of a bound q, k and v are clamped to after their projections (and qk-norm), or None (OLMo)
    clip_qkv_key: str | None = None
    # residual layout: parallel ``x + attn(n1(x)) + mlp(n2(x))`` (True, or config keys any of which makes it so);
    # ``norm_before`` False (or a config key that is False) puts each norm after its residual add (post-norm)
    parallel: bool | tuple[str, ...] = False
    norm_before: bool | str = True
    # positions: "rotary", "learned" (``position_embed``), "alibi" or "none"; ``alibi_key``: a config key that
    # switches a rotary family to ALiBi (Falcon); ``alibi_scaled``: the bias is scaled with the scores (Falcon);
    # ``alibi_bf16``: the HF model rounds each slope and each slope times the key's position in its row to bf16,
    # whatever the model's dtype, and folds that bias into its mask (Falcon)
    positions: str = "rotary"
    alibi_key: str | None = None
    alibi_scaled: bool = False
    alibi_bf16: bool = False
    rotary_interleaved: bool = False  # GPT-J: rotate every two features instead of the two halves
    # the rotation computed in float32 and rounded once (OLMo, OLMo 2, Cohere), with cos and sin kept in float32
    # (``rotary_tables_float``: OLMo, OLMo 2) or rounded to the model's dtype first (Cohere)
    rotary_float: bool = False
    rotary_tables_float: bool = False
    # how much of each head the family's HF attention rotates: the whole head, where its default rope never reads
    # partial_rotary_factor (Llama, Gemma, Falcon, ...); the config's partial_rotary_factor (``partial_rotary``: Phi,
    # Phi-3, GPT-NeoX's rotary_pct); or the number of features the config key ``rotary_dim_key`` names (GPT-J)
    partial_rotary: bool = False
    rotary_dim_key: str | None = None
    # the config key naming the MLP activation, or the activation itself when the config names none (BLOOM)
    activation_key: str = "hidden_act"
    activation: str | None = None
    # multiply token embeddings by sqrt(hidden_size)
    embed_scale: bool = False
    # config keys of Granite's multipliers: the token embeddings' (a float, not rounded to the model's dtype first),
    # the branch outputs' before each residual add, the attention scores' scale, and the final logits' divisor; and of
    # the final logits' multiplier (Cohere's logit_scale)
    embed_multiplier_key: str | None = None
    residual_multiplier_key: str | None = None
    attn_scale_key: str | None = None
    logits_divisor_key: str | None = None
    logits_multiplier_key: str | None = None
    # honour the config's sliding window (``window_key``), on the layers ``layer_types_key`` lists as
    # ``window_layer_type`` when the config has that list (else on every layer)
    sliding_window: bool = False
    window_key: str = "sliding_window"
    layer_types_key: str = "layer_types"
    window_layer_type: str = "sliding_attention"
    # rotary on the layers ``layer_types_key`` lists as this type alone, no positions on the others (Cohere 2's
    # full-attention layers); None: rotary on every layer
    rotary_layer_type: str | None = None
    # the family's HF model passes cos and sin for half of each rotated head (GPT-OSS): the block's HF path takes its
    # own table's rows instead, as for every-two rotary
    hf_rotary_halves: bool = False
    # a fixed score scale where the family has one its config does not state (GPT-Neo: 1), else read from the config
    attn_scale: float | None = None
    # the config key of the attention scores' soft-cap, None where the family's attention never applies one
    attn_softcap_key: str | None = "attn_logit_softcapping"
    # config values the fused block cannot express: ``((key, value), ...)`` refused at plan time
    refuse: tuple[tuple[str, Any], ...] = ()
    # how the family's Hugging Face model calls a decoder layer: the names of its positional arguments after the
    # hidden states, whether it expects a tuple back, and whether its ALiBi bias comes folded into the mask (Falcon)
    hf_args: tuple[str, ...] = ()
    hf_returns_tuple: bool = False
    hf_alibi_in_mask: bool = False
    hf_window_in_mask: bool = True  # False: the HF layer applies its sliding window itself (GPT-Neo)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters: ``rope_type`` is transformers' name ("default", "linear", "llama3", "yarn", ...);
    ``partial_factor`` the share of each head the family's HF attention rotates; ``layer_type`` names the entry of a
    per-layer-type ``rope_parameters`` it came from (Gemma 3), else None."""

    theta: float
    rope_type: str
    partial_factor: float
    max_positions: int  # the longest table the rope type can give without a runtime rescale
    layer_type: str | None = None


@dataclass(frozen=True)
class ModelDims:
    """The per-model numbers and variants the fused block needs, read from the model's config (never written back)."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float | None
    activation: str
    windows: tuple[int | None, ...]  # sliding window per layer (None: full attention)
    # every layer's rope; where layers differ (``layer_ropes``), the one with the fewest positions a static table
    # can hold, which bounds max_out_tokens
    rope: RopeSpec
    layer_ropes: tuple[RopeSpec, ...] = ()  # per layer, when layers differ (Gemma 3's local and global layers)
    unrotated: tuple[int, ...] = ()  # layers without positions where the model has rotary (Cohere 2's global ones)
    positions: str = "rotary"  # "rotary", "learned", "alibi" or "none"
    parallel: bool = False
    norm_before: bool = True
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    scale_by_layer: bool = False  # GPT-2's scale_attn_by_inverse_layer_idx: scores / (layer index + 1)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    position_limit: int | None = None  # learned positions: the table's length
    clip_qkv: float | None = None  # q, k and v clamped to [-clip_qkv, clip_qkv] (OLMo's clip_qkv)
    rotary_float: bool = False  # rotary in float32, rounded once (the record's rotary_float)
    rotary_tables_float: bool = False  # its cos and sin in float32 (the record's rotary_tables_float)
    embed_multiplier: float | None = None  # token embeddings times this float (Granite's embedding_multiplier)
    residual_multiplier: float | None = None  # branch outputs times this before their residual adds
    logits_divisor: float | None = None  # final logits divided by this (Granite's logits_scaling)
    logits_multiplier: float | None = None  # final logits times this (Cohere's logit_scale)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_factor)

    def layer_rope(self, index: int) -> RopeSpec:
        return self.layer_ropes[index] if self.layer_ropes else self.rope

    def layer_scale(self, index: int) -> float:
        scale = self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale
        return scale / (index + 1) if self.scale_by_layer else scale


#: the record fields that are paths from the model's root (the others are relative to one layer)
MODEL_PATHS = ("layers", "embed", "final_norm", "lm_head", "position_embed", "embed_norm", "project_in", "project_out")


def rooted(record: ArchRecord, model: Any) -> ArchRecord:
    """``record`` with its model paths from ``model``'s root: an encoder's paths are relative to the base model, which
    a task model (``BertForMaskedLM``) holds under ``base_model_prefix``; a decoder record is returned as it is."""
    base = getattr(model, "base_model", model)
    if not record.encoder or base is model:
        return record
    prefix = model.base_model_prefix
    return replace(record, **{name: f"{prefix}.{getattr(record, name)}" for name in MODEL_PATHS
                              if getattr(record, name) is not None})


def text_config(config: Any) -> Any:
    """The config of the language model: a multimodal config's text part (Gemma 3), else the config itself."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def model_dims(record: ArchRecord, config: Any) -> ModelDims:
    """Read :class:`ModelDims` from a transformers config (its text part), as the family's modeling code does."""
    config = text_config(config)
    n_heads = config.num_attention_heads
    head_dim = head_size(config)
    alibi = record.positions == "alibi" or bool(record.alibi_key and getattr(config, record.alibi_key, False))
    ropes = layer_ropes(record, config, head_dim)
    return ModelDims(
        hidden=config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=kv_heads(config, n_heads),
        head_dim=head_dim,
        eps=getattr(config, record.eps_key, None),
        activation=record.activation or getattr(config, record.activation_key),
        windows=layer_windows(record, config),
        rope=min(ropes, key=lambda spec: spec.max_positions),
        layer_ropes=ropes if len(set(ropes)) > 1 else (),
        unrotated=unrotated_layers(record, config),
        positions="alibi" if alibi else record.positions,
        parallel=config_flag(record.parallel, config),
        norm_before=config_flag(record.norm_before, config),
        attn_scale=(record.attn_scale if record.attn_scale is not None
                    else attention_scale(config, record.attn_scale_key)),
        scale_by_layer=bool(getattr(config, "scale_attn_by_inverse_layer_idx", False)),
        attn_softcap=getattr(config, record.attn_softcap_key, None) if record.attn_softcap_key else None,
        final_softcap=getattr(config, "final_logit_softcapping", None),
        position_limit=learned_positions(record, config),
        clip_qkv=getattr(config, record.clip_qkv_key, None) if record.clip_qkv_key else None,
        rotary_float=record.rotary_float,
        rotary_tables_float=record.rotary_tables_float,
        embed_multiplier=config_multiplier(config, record.embed_multiplier_key),
        residual_multiplier=config_multiplier(config, record.residual_multiplier_key),
        logits_divisor=config_multiplier(config, record.logits_divisor_key),
        logits_multiplier=config_multiplier(config, record.logits_multiplier_key),
    )


def unrotated_layers(record: ArchRecord, config: Any) -> tuple[int, ...]:
    """The layers that take no positions in a rotary model: those ``layer_types`` lists as another type than the
    record's ``rotary_layer_type`` (none without one)."""
    if record.rotary_layer_type is None:
        return ()
    layer_types = getattr(config, record.layer_types_key, None) or ()
    return tuple(i for i, kind in enumerate(layer_types[:config.num_hidden_layers])
                 if kind != record.rotary_layer_type)


def learned_positions(record: ArchRecord, config: Any) -> int | None:
    """The length of the family's learned position table (GPT-2's ``n_positions``, OPT's ``max_position_embeddings``);
    None where the family computes its positions (rotary, ALiBi, none)."""
    return text_config(config).max_position_embeddings if record.positions == "learned" else None


#: the attention implementations whose masks (boolean, float or None) the fused block applies as they are; others
#: hand the layers a BlockMask (flex_attention) or the 2-D padding mask (flash attention)
MASKED_ATTENTION = (None, "eager", "sdpa")


def check_fits(record: ArchRecord, config: Any) -> None:
    """Raise ``ValueError`` naming the config value the fused block cannot express for this family."""
    config = text_config(config)
    for key, value in record.refuse:
        if getattr(config, key, None) == value:
            raise ValueError(f"kernel injection cannot fuse model_type={record.model_type!r} with {key}={value!r}: "
                             f"the fused block has no such layout; use replace_with_kernel_inject=False for this model")
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in MASKED_ATTENTION:
        raise ValueError(f"kernel injection cannot fuse a model loaded with attn_implementation={implementation!r}: "
                         "the fused blocks take the boolean or float masks Hugging Face builds for sdpa and eager "
                         "attention; allowed: attn_implementation='sdpa' or 'eager'")
    if record.qk_norm_width not in ("head", "projection"):
        raise ValueError(f"record {record.model_type!r}: qk_norm_width={record.qk_norm_width!r}; allowed: head, "
                         "projection")
    if record.rotary_tables_float and not record.rotary_float:
        raise ValueError(f"record {record.model_type!r}: rotary_tables_float=True with rotary_float=False (float32 "
                         "tables rotating in the model's dtype, which no family does); allowed: rotary_tables_float "
                         "with rotary_float=True")
    if record.qkv_layout not in ("contiguous", "grouped"):
        raise ValueError(f"record {record.model_type!r}: qkv_layout={record.qkv_layout!r}; allowed: contiguous, "
                         "grouped")
    if record.positions not in ("rotary", "learned", "alibi", "none"):
        raise ValueError(f"record {record.model_type!r}: positions={record.positions!r}; allowed: rotary, learned, "
                         "alibi, none")
    if record.positions == "rotary" and not (record.alibi_key and getattr(config, record.alibi_key, False)):
        check_rotary_width(record, config)


#: rope types whose transformers init function gives frequencies for the whole head whatever partial_rotary_factor
#: says (zero past the factor: those features stay unrotated)
WHOLE_HEAD_ROPE_TYPES = ("default", "proportional")


def check_rotary_width(record: ArchRecord, config: Any) -> None:
    """Raise ``ValueError`` where the family's HF attention rotates the whole head but transformers' scaled rope
    (linear, dynamic, yarn, llama3, longrope) reads partial_rotary_factor and gives cos/sin for only part of it: the
    unmodified model fails there, so there is nothing to match."""
    if record.partial_rotary or record.rotary_dim_key:
        return
    head_dim = head_size(config)
    for spec in layer_ropes(replace(record, partial_rotary=True), config, head_dim):
        if int(head_dim * spec.partial_factor) < head_dim and spec.rope_type not in WHOLE_HEAD_ROPE_TYPES:
            raise ValueError(
                f"kernel injection cannot fuse model_type={record.model_type!r} with rope_type={spec.rope_type!r} and "
                f"partial_rotary_factor={spec.partial_factor}: Hugging Face's {record.model_type} attention rotates "
                f"the whole head, but that rope type gives cos/sin for part of it, so the unmodified model fails; "
                f"allowed: partial_rotary_factor=1.0 with that rope type (rope_type='default' rotates the whole head "
                f"whatever the factor)")


def config_flag(value: bool | str | tuple[str, ...], config: Any) -> bool:
    """A record variant: a fixed bool, or config keys any of which (when true) turns it on."""
    if isinstance(value, bool):
        return value
    keys = (value,) if isinstance(value, str) else value
    return any(bool(getattr(config, key, False)) for key in keys)


def kv_heads(config: Any, n_heads: int) -> int:
    """Key/value heads under transformers' names: Falcon's ``num_kv_heads`` (its new architecture; the key its
    attention reads, where newer configs also derive ``num_key_value_heads`` from it), ``num_key_value_heads``, or
    ``multi_query`` (one shared head), else one per query head."""
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1
    for key in ("num_kv_heads", "num_key_value_heads"):
        value = getattr(config, key, None)
        if value:
            return value
    return n_heads


def config_multiplier(config: Any, key: str | None) -> float | None:
    """The float the config key ``key`` holds, None where the record names no key or the value is 1 (no change)."""
    value = getattr(config, key, None) if key else None
    return None if value is None or value == 1 else float(value)


def attention_scale(config: Any, key: str | None = None) -> float | None:
    """The score scale the config asks for: the value of the record's ``attn_scale_key`` (Granite's
    ``attention_multiplier``), ``query_pre_attn_scalar ** -0.5`` (Gemma 2/3), 1 when ``scale_attn_weights`` is False
    (GPT-2), else None (1 / sqrt(head_dim))."""
    if key and getattr(config, key, None) is not None:
        return float(getattr(config, key))
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if scalar:
        return float(scalar) ** -0.5
    if getattr(config, "scale_attn_weights", True) is False:
        return 1.0
    return None


def layer_windows(record: ArchRecord, config: Any) -> tuple[int | None, ...]:
    """The sliding window of each layer: ``layer_types`` picks the layers when the config has it."""
    n_layers = config.num_hidden_layers
    window = getattr(config, record.window_key, None) if record.sliding_window else None
    layer_types = getattr(config, record.layer_types_key, None)
    if window is None or layer_types is None:
        return (window,) * n_layers
    return tuple(window if kind == record.window_layer_type else None for kind in layer_types[:n_layers])


def head_size(config: Any) -> int:
    """The attention head size: the config's ``head_dim``, else the hidden size over the heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_ropes(record: ArchRecord, config: Any, head_dim: int) -> tuple[RopeSpec, ...]:
    """The rotary parameters of each layer: one spec for all, or one per layer type when ``rope_parameters`` is keyed
    by layer type (Gemma 3). The record says how much of each head rotates (:attr:`ArchRecord.partial_rotary`,
    :attr:`ArchRecord.rotary_dim_key`)."""
    params = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None)
    n_layers = config.num_hidden_layers
    partial = record.partial_rotary
    if layer_types and all(isinstance(params.get(kind), dict) for kind in set(layer_types)):
        specs = {kind: rope_spec(config, kind, partial_rotary=partial) for kind in set(layer_types)}
        ropes = tuple(specs[kind] for kind in layer_types[:n_layers])
    else:
        ropes = (rope_spec(config, partial_rotary=partial),) * n_layers
    rotary_dim = getattr(config, record.rotary_dim_key, None) if record.rotary_dim_key else None
    if rotary_dim:
        ropes = tuple(replace(spec, partial_factor=rotary_dim / head_dim) for spec in ropes)
    return ropes


def rope_spec(config: Any, layer_type: str | None = None, partial_rotary: bool = False) -> RopeSpec:
    """Rotary parameters from ``rope_parameters`` (transformers 5; ``layer_type`` picks a per-layer-type entry) or
    ``rope_theta``/``rope_scaling`` (4.x). ``partial_rotary``: the family's HF attention rotates only the config's
    ``partial_rotary_factor`` of each head (in ``rope_parameters``, or at the config's top level in 4.x); otherwise
    the whole head, as the default rope of most families does whatever the factor says."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = 1.0
    if partial_rotary:
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    max_positions = _rescale_limit(rope_type, params, config)
    return RopeSpec(theta=float(theta), rope_type=rope_type, partial_factor=float(partial),
                    max_positions=max_positions, layer_type=layer_type)


def _rescale_limit(rope_type: str, params: dict, config: Any) -> int:
    """Rope types that change their frequencies with the running length ("dynamic", "longrope") match a fixed table
    only up to the original context; the others have no limit of their own. A 4.x longrope config (Phi-3) keeps its
    original context at the config's top level, where transformers 4.x reads it."""
    if rope_type == "dynamic":
        return config.max_position_embeddings
    if rope_type == "longrope":
        return (params.get("original_max_position_embeddings")
                or getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)
    return 2**62


def tensor_parallel_plan(record: ArchRecord, config: Any) -> TPPlan:
    """The family's tensor-parallel plan: a decoder's embedding and lm_head split by vocabulary, q/k/v (or the fused
    qkv, by its layout) and the MLP's input projections column-parallel by heads and halves, o and down row-parallel
    (two all-reduces a block). Everything else (norms, position embeddings, OPT's projections; an encoder's embeddings,
    pooler and task heads) is replicated. ``record``'s paths must be rooted at the model (:func:`rooted`). A mixture
    of experts' record has none (its layers' MLP modules differ: AutoTP plans them): ``ValueError``."""
    if record.moe:
        raise ValueError(f"record {record.model_type!r} calls each layer's own MLP module ({record.moe}), which the "
                         "record does not describe: AutoTP plans its tensor parallelism")
    if record.q_norm and record.qk_norm_width == "projection":
        raise ValueError(f"model_type={record.model_type!r} normalises each whole q and k projection ({record.q_norm}, "
                         f"{record.k_norm}): one rank's share of the heads cannot compute that norm, so tensor "
                         "parallelism cannot split its attention; allowed: tp_size=1 for this model")
    dims = model_dims(record, config)
    heads = Heads(dims.n_heads, dims.n_kv_heads, dims.head_dim)
    block = f"{record.layers}.*"
    rules = {} if record.encoder else {record.embed: Rule("vocab")}
    if record.qkv:
        rules[f"{block}.{record.qkv}"] = Rule("column", fused_qkv_layout(record, heads), heads)
    else:
        rules[f"{block}.{record.q}"] = Rule("column", "q", heads)
        rules.update({f"{block}.{path}": Rule("column", "kv", heads) for path in (record.k, record.v)})
    rules[f"{block}.{record.o}"] = Rule("row", "q", heads)
    if not record.gated:
        rules[f"{block}.{record.up}"] = Rule("column")
    elif record.gate_up:
        rules[f"{block}.{record.gate_up}"] = Rule("column", "halves")
    else:
        rules.update({f"{block}.{path}": Rule("column") for path in (record.gate, record.up)})
    rules[f"{block}.{record.down}"] = Rule("row")
    if not record.encoder:
        rules[record.lm_head] = Rule("vocab")
    attention = {f"{block}.{(record.qkv or record.q).rpartition('.')[0]}": heads}
    return TPPlan(rules, attention, [block], source="record")


def fused_qkv_layout(record: ArchRecord, heads: Heads) -> str:
    """The tensor-parallel layout of a checkpoint-fused q/k/v: ``qkv`` for [q; k; v]; for per-KV-group layouts,
    ``heads`` when each head has its own k/v, else ``kv_groups`` (one shared K/V head included)."""
    if record.qkv_layout == "contiguous":
        return "qkv"
    return "heads" if heads.n_q == heads.n_kv else "kv_groups"
