"""``QuantConfig``: what to quantize and how; validates itself; maps from splice's ``InferenceConfig``.

Mapping from the DeepSpeed-style keys (``InferenceConfig``):

=====================================================  ==========================================================
``dtype=torch.int8`` (or ``"int8"``)                   int8 weight-only, one scale per output channel, symmetric,
                                                       unless the keys below say otherwise (``num_bits`` must be 8)
``quant.enabled=True``                                 ``quant.weight`` / ``quant.activation`` below, any dtype
``quant.enabled`` None (the default)                   the keys below apply with ``dtype=int8``; otherwise nothing
                                                       is quantized (keys given warn), as in DeepSpeed
``quant.enabled=False``                                nothing from the keys below (with ``dtype=int8``, giving
                                                       one raises); ``dtype=int8`` alone still quantizes
``quant.weight.num_bits``                              8 or 4
``quant.weight.group_size``                            input elements per scale (int4: 32, 64, 128 or 256), at
                                                       most each quantized layer's in_features
``quant.weight.q_groups`` (no ``group_size``)          groups per output row: ``group_size = in_features / q_groups``;
                                                       1 (the default) = one scale per output channel for int8,
                                                       ``DEFAULT_INT4_GROUP`` for int4
``quant.weight.q_type``                                int8: 'symmetric'; int4: 'symmetric' or 'asymmetric';
                                                       None (the default): the most accurate the kernels take,
                                                       ``DEFAULT_SYMMETRIC`` (int4 asymmetric, int8 symmetric)
``quant.activation.enabled`` (+ ``num_bits=8``)        W8A8: int8 weights (per channel) x int8 activations,
                                                       quantized dynamically per call
``quant.activation.q_type``, ``q_groups``              'symmetric', 1: one scale per row (token) and block of
                                                       ``qmath.ACTIVATION_BLOCK`` inputs, computed per call
``quant.qkv.enabled=False``                            q/k/v projections stay in float (``is_qkv_projection``); a
                                                       model with none that splice recognises warns
=====================================================  ==========================================================

Embeddings stay in float. The output head (lm_head): in float by default; ``quantize_lm_head=True`` quantizes it with
the scheme, ``lm_head_int8=True`` (and ``quantize_lm_head=False``) with int8 per output channel whatever the scheme
(``init_inference``'s default whenever it quantizes: ``quant.quantize_lm_head`` None).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from .qmath import ACTIVATION_BLOCK

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 kernels accept
DEFAULT_INT4_GROUP = 32  # the most accurate the kernels allow (0.31x the bf16 bytes); see the README's figures
#: bits -> ``symmetric`` for a config that names no ``q_type``: the most accurate scheme the kernels take. int4 kernels
#: take a zero point per group (asymmetric reproduces weights more closely; the README's figures); int8 kernels take
#: none. DeepSpeed defaults to symmetric at every width.
DEFAULT_SYMMETRIC = {4: False, 8: True}

#: Leaf module names of q/k/v projections (fused or not) wherever they sit, across the architectures transformers
#: ships; used only for ``quant.qkv.enabled=False``. Llama-style and most others: q_proj/k_proj/v_proj; BERT-style:
#: query/key/value; GPT-NeoX, BLOOM, Falcon: query_key_value; GPT-2 and StarCoder: c_attn (q_attn: cross-attention);
#: Phi-3, CodeGen: qkv_proj; MPT, DBRX, ModernBERT: Wqkv; DistilBERT, XLM: q_lin/k_lin/v_lin; DeepSeek's latent
#: attention: q_a_proj/q_b_proj/kv_a_proj_with_mqa/kv_b_proj; splice's fused block and ViT-style models: qkv.
QKV_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "q_attn", "Wqkv", "query", "key",
             "value", "qkv", "q_lin", "k_lin", "v_lin", "kv_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
             "kv_b_proj", "query_proj", "key_proj", "value_proj", "Wq", "Wk", "Wv", "linear_q", "linear_k",
             "linear_v", "to_q", "to_k", "to_v", "to_kv", "q_head", "k_head", "v_head", "qkv_linear", "query_key",
             "in_proj_qkv", "in_proj_qkvz", "W_pack", "wqkv")

#: Leaf names that are q/k/v projections only inside an attention module (T5's and MPNet's q/k/v, DeBERTa's
#: in_proj); elsewhere they are something else (Mamba's in_proj feeds its convolution).
ATTENTION_QKV_NAMES = ("q", "k", "v", "in_proj")


def is_qkv_projection(name: str, parent: nn.Module | None = None) -> bool:
    """Whether the linear at dotted path ``name`` (inside ``parent``, where known) is a query/key/value projection."""
    parent_path, _, leaf = name.rpartition(".")
    if leaf in QKV_NAMES:
        return True
    if leaf not in ATTENTION_QKV_NAMES:
        return False
    # Inside an attention module: one of the modules on its path, or its parent's class, says so by name.
    context = parent_path + " " + ("" if parent is None else type(parent).__name__)
    return any(word in context.lower() for word in ("attention", "attn"))


@dataclass(frozen=True)
class QuantConfig:
    """A quantization scheme. ``kind`` picks the handler (see ``splice.quant.api.HANDLERS``)."""

    bits: int = 8
    group_size: int | None = None  # None: q_groups decides (1 = per output channel; int4 default group)
    q_groups: int = 1
    symmetric: bool | None = None  # None: DEFAULT_SYMMETRIC for bits (int4 asymmetric, int8 symmetric)
    activations: bool = False  # dynamic int8 activations (W8A8)
    quantize_lm_head: bool = False  # the output head in this scheme
    lm_head_int8: bool = False  # the output head in int8 per output channel (when quantize_lm_head is False)
    quantize_qkv: bool = True

    def __post_init__(self) -> None:
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", DEFAULT_SYMMETRIC.get(self.bits, True))
        _check_types(self)
        _check_choice("bits (quant.weight.num_bits)", self.bits, (8, 4))
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be a positive integer or None")
        if self.q_groups < 1:
            raise ValueError(f"q_groups={self.q_groups} must be >= 1")
        if self.bits == 4:
            _check_choice("int4 group_size", self.group_size, INT4_GROUP_SIZES + (None,))
            if self.activations:
                raise ValueError("int8 activations with num_bits=4 weights are not supported; allowed: "
                                 "num_bits=8 with activation.enabled=True (W8A8), or num_bits=4 weight-only")
        if self.bits == 8 and not self.symmetric:
            raise ValueError("q_type='asymmetric' is not supported for num_bits=8 (torch's int8 kernels take no zero "
                             "point); allowed: 'symmetric', or num_bits=4 with 'asymmetric'")
        if self.activations and (self.group_size is not None or self.q_groups != 1):
            raise ValueError(f"W8A8 needs one scale per output channel; got group_size={self.group_size}, "
                             f"q_groups={self.q_groups}; allowed: group_size=None, q_groups=1")

    def head_scheme(self) -> QuantConfig | None:
        """The scheme of the output head: this one, int8 per channel, or None (kept in float)."""
        if self.quantize_lm_head:
            return self
        return QuantConfig(bits=8) if self.lm_head_int8 else None

    @property
    def kind(self) -> str:
        if self.bits == 4:
            return "int4_weight_only"
        return "int8_dynamic" if self.activations else "int8_weight_only"

    def group_for(self, in_features: int) -> int | None:
        """Input elements per scale for a layer with ``in_features`` inputs (None: one scale per output row)."""
        if self.group_size is not None:
            self._check_group_fits(in_features)
            return self.group_size
        if self.q_groups == 1:
            return DEFAULT_INT4_GROUP if self.bits == 4 else None
        if in_features % self.q_groups:
            raise ValueError(f"q_groups={self.q_groups} does not divide in_features={in_features}; allowed: a "
                             f"divisor of every quantized layer's in_features, or set group_size")
        group = in_features // self.q_groups
        if self.bits == 4 and group not in INT4_GROUP_SIZES:
            raise ValueError(f"q_groups={self.q_groups} gives int4 groups of {group} for in_features={in_features}; "
                             f"allowed int4 group sizes: {INT4_GROUP_SIZES} (set group_size instead)")
        return group

    def _check_group_fits(self, in_features: int) -> None:
        """A group wider than the layer's inputs would be zero-padded to the group: stored bytes that hold nothing."""
        if self.group_size <= in_features:
            return
        if self.bits == 4:
            fitting = [size for size in INT4_GROUP_SIZES if size <= in_features]
            allowed = (f"an int4 group_size that fits ({', '.join(map(str, fitting))})" if fitting else
                       f"num_bits=8 (the smallest int4 group, {INT4_GROUP_SIZES[0]}, does not fit)")
        else:
            allowed = (f"a group_size that fits every quantized layer (at most {in_features} here), or no "
                       "group_size (one scale per output channel)")
        raise ValueError(f"group_size={self.group_size} is larger than the layer's in_features={in_features} (its "
                         f"weight would be zero-padded to {self.group_size} inputs per row); allowed: {allowed}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_inference_config(cls, config: Any) -> QuantConfig | None:
        """The scheme an ``InferenceConfig`` asks for, or None when it asks for no quantization."""
        quant = config.quant
        int8_dtype = config.dtype == torch.int8
        head = {"quantize_lm_head": quant.quantize_lm_head is True, "lm_head_int8": quant.quantize_lm_head is None}
        if quant.enabled is False or (quant.enabled is None and not int8_dtype):
            # The section is off (InferenceConfig refuses its settings with dtype=int8); dtype=int8 alone asks for
            # int8 weights with one scale per output channel.
            return cls(bits=8, **head) if int8_dtype else None
        weight, act = quant.weight, quant.activation
        if not weight.enabled:
            if act.enabled:
                raise ValueError("quant.activation.enabled=True with quant.weight.enabled=False is not supported; "
                                 "allowed: quantized weights alone, or weights and activations together")
            if int8_dtype:
                raise ValueError("dtype=torch.int8 quantizes the weights, which contradicts "
                                 "quant.weight.enabled=False; allowed: quant.weight.enabled=True with dtype=int8, or "
                                 "a float dtype (or None) to keep the weights in float")
            return None
        if int8_dtype and weight.num_bits != 8:
            raise ValueError(f"dtype=torch.int8 contradicts quant.weight.num_bits={weight.num_bits}; allowed: "
                             "num_bits=8 with dtype=int8, or a float dtype (or None) with num_bits=4")
        _check_q_dtype(weight)
        if act.enabled and (act.q_groups != 1 or act.q_type != "symmetric"):
            raise ValueError(f"quant.activation q_groups={act.q_groups}, q_type={act.q_type!r} is not supported; "
                             "allowed: q_groups=1, q_type='symmetric' (activations get one symmetric scale per row and "
                             f"block of {ACTIVATION_BLOCK} inputs)")
        return cls(bits=weight.num_bits, group_size=weight.group_size, q_groups=weight.q_groups,
                   symmetric=_symmetric(weight.q_type), activations=act.enabled,
                   **head,
                   quantize_qkv=quant.qkv.enabled)


def _symmetric(q_type: str | None) -> bool | None:
    """``quant.weight.q_type`` as ``QuantConfig.symmetric`` (None: its default for the width)."""
    if q_type is None:
        return None
    _check_choice("quant.weight.q_type", q_type, ("symmetric", "asymmetric", None))
    return q_type == "symmetric"


def _check_types(config: QuantConfig) -> None:
    """Integers must be ints and flags bools: ``symmetric="false"`` is truthy and would silently mean symmetric, and
    ``group_size=32.0`` fails deep inside the kernels instead of here."""
    for f in fields(config):
        value = getattr(config, f.name)
        if f.type.startswith("bool") and not isinstance(value, bool):  # symmetric's None is resolved by now
            raise TypeError(f"QuantConfig.{f.name}={value!r} must be a bool; allowed: True, False")
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if f.type.startswith("int") and not is_int and not (value is None and "None" in f.type):
            allowed = "8, 4" if f.name == "bits" else "a positive int" + (" or None" if "None" in f.type else "")
            raise TypeError(f"QuantConfig.{f.name}={value!r} must be an int; allowed: {allowed}")


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")


def _check_q_dtype(weight: Any) -> None:
    wanted = torch.int8 if weight.num_bits == 8 else torch.uint8
    q_dtype = getattr(weight, "q_dtype", None)
    if q_dtype is not None and q_dtype != wanted:
        raise ValueError(f"quant.weight.q_dtype={q_dtype} does not fit num_bits={weight.num_bits}; allowed: None or "
                         f"{wanted} (int8 weights are stored as int8, int4 weights two per uint8)")
