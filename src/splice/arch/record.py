"""The data that describes one architecture family, and the per-model numbers read from a model's config.

A record says *where* things are and *which variant* a family uses; it holds no code. The generic fused block
(``splice.layers.block``) and the fuse step read it, and :func:`tensor_parallel_plan` reads the family's
tensor-parallel plan off it (as transformers keeps ``base_model_tp_plan`` on its configs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..tp.plan import Rule, TPPlan
from ..tp.split import Heads


@dataclass(frozen=True)
class ArchRecord:
    """One architecture family. Paths are dotted attribute paths; block paths are relative to one decoder layer.

    Biases are taken from the checkpoint's linears (present or not), tied embeddings from the shared lm_head.
    """

    model_type: str
    # where the model's parts live, from the ``*ForCausalLM`` module
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    # attention projections: separate q/k/v, or one fused ``qkv`` laid out [q; k; v]
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    qkv: str | None = None
    o: str = "self_attn.o_proj"
    # MLP projections: separate gate/up, or one fused ``gate_up`` laid out [gate; up]
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    gate_up: str | None = None
    down: str = "mlp.down_proj"
    # norms (RMSNorm); ``norm_offset`` 1.0 means the checkpoint stores ``weight - 1`` (y = norm(x) * (1 + w))
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    norm_offset: float = 0.0
    eps_key: str = "rms_norm_eps"
    # per-head RMSNorm on q and k before rotary (qk-norm), or None
    q_norm: str | None = None
    k_norm: str | None = None
    # the config key naming the MLP activation
    activation_key: str = "hidden_act"
    # multiply token embeddings by sqrt(hidden_size)
    embed_scale: bool = False
    # honour ``config.sliding_window`` (and ``config.layer_types`` when present)
    sliding_window: bool = False


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters: ``rope_type`` is transformers' name ("default", "linear", "llama3", "yarn", ...)."""

    theta: float
    rope_type: str
    partial_factor: float
    max_positions: int  # the longest table the rope type can give without a runtime rescale


@dataclass(frozen=True)
class ModelDims:
    """The per-model numbers the fused block needs, read from the model's config (never written back)."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    activation: str
    windows: tuple[int | None, ...]  # sliding window per layer (None: full attention)
    rope: RopeSpec

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_factor)


def model_dims(record: ArchRecord, config: Any) -> ModelDims:
    """Read :class:`ModelDims` from a transformers config, as the family's modeling code does."""
    n_heads = config.num_attention_heads
    return ModelDims(
        hidden=config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
        eps=getattr(config, record.eps_key),
        activation=getattr(config, record.activation_key),
        windows=layer_windows(record, config),
        rope=rope_spec(config),
    )


def layer_windows(record: ArchRecord, config: Any) -> tuple[int | None, ...]:
    """The sliding window of each layer: ``layer_types`` picks the layers when the config has it."""
    n_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) if record.sliding_window else None
    layer_types = getattr(config, "layer_types", None)
    if window is None or layer_types is None:
        return (window,) * n_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types[:n_layers])


def rope_spec(config: Any) -> RopeSpec:
    """Rotary parameters from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    max_positions = _rescale_limit(rope_type, params, config)
    return RopeSpec(theta=float(theta), rope_type=rope_type, partial_factor=float(partial), max_positions=max_positions)


def _rescale_limit(rope_type: str, params: dict, config: Any) -> int:
    """Rope types that change their frequencies with the running length ("dynamic", "longrope") match a fixed table
    only up to the original context; the others have no limit of their own."""
    if rope_type == "dynamic":
        return config.max_position_embeddings
    if rope_type == "longrope":
        return params.get("original_max_position_embeddings", config.max_position_embeddings)
    return 2**62


def tensor_parallel_plan(record: ArchRecord, config: Any) -> TPPlan:
    """The family's tensor-parallel plan: embedding and lm_head split by vocabulary, q/k/v (or the fused qkv) and
    gate/up (or gate_up) column-parallel by heads and halves, o and down row-parallel (two all-reduces a block)."""
    dims = model_dims(record, config)
    heads = Heads(dims.n_heads, dims.n_kv_heads, dims.head_dim)
    block = f"{record.layers}.*"
    rules = {record.embed: Rule("vocab")}
    if record.qkv:
        rules[f"{block}.{record.qkv}"] = Rule("column", "qkv", heads)
    else:
        rules[f"{block}.{record.q}"] = Rule("column", "q", heads)
        rules.update({f"{block}.{path}": Rule("column", "kv", heads) for path in (record.k, record.v)})
    rules[f"{block}.{record.o}"] = Rule("row", "q", heads)
    if record.gate_up:
        rules[f"{block}.{record.gate_up}"] = Rule("column", "halves")
    else:
        rules.update({f"{block}.{path}": Rule("column") for path in (record.gate, record.up)})
    rules[f"{block}.{record.down}"] = Rule("row")
    rules[record.lm_head] = Rule("vocab")
    attention = {f"{block}.{record.o.rpartition('.')[0]}": heads}
    return TPPlan(rules, attention, [block], source="record")
