"""Rotary position embeddings from a precomputed cos/sin table, applied in place (the ``rotate_half`` layout)."""
from __future__ import annotations

from typing import Any

import torch

from ..arch.record import RopeSpec


class RopeTable:
    """``cos`` and signed ``sin`` (``[-sin, sin]`` over the two halves) for positions ``0 .. length-1``."""

    def __init__(self, cos: torch.Tensor, sin_signed: torch.Tensor):
        self.cos = cos
        self.sin = sin_signed

    @property
    def length(self) -> int:
        return self.cos.shape[0]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [batch, seq]`` -> cos, sin of shape ``[batch, seq, 1, rotary_dim]`` (broadcast over heads)."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)


def inverse_frequencies(spec: RopeSpec, config: Any, head_dim: int, device) -> tuple[torch.Tensor, float]:
    """``inv_freq`` and the attention scaling, as transformers computes them for this rope type."""
    if spec.rope_type == "default":
        dim = int(head_dim * spec.partial_factor)
        inv_freq = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if spec.rope_type not in ROPE_INIT_FUNCTIONS:
        allowed = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
        raise ValueError(f"rope_type={spec.rope_type!r} is not supported; allowed: {allowed}")
    if spec.layer_type is not None:
        return ROPE_INIT_FUNCTIONS[spec.rope_type](config, device, layer_type=spec.layer_type)
    return ROPE_INIT_FUNCTIONS[spec.rope_type](config, device)


def build_table(spec: RopeSpec, config: Any, head_dim: int, length: int, dtype, device) -> RopeTable:
    """The table for ``length`` positions; raises if the rope type rescales itself below that length."""
    if length > spec.max_positions:
        raise ValueError(
            f"rope_type={spec.rope_type!r} changes its frequencies past {spec.max_positions} positions, so a static "
            f"table of {length} positions would differ from the model; allowed: max_out_tokens <= {spec.max_positions}"
        )
    inv_freq, scaling = inverse_frequencies(spec, config, head_dim, device)
    freqs = torch.arange(length, device=device).float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return RopeTable(cos.to(dtype), signed_sin(sin.to(dtype)))


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``[s, s]`` -> ``[-s, s]``: folds ``rotate_half``'s negation into the table."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def interleaved_to_halves(rotary_dim: int) -> torch.Tensor:
    """The feature order that turns GPT-J's every-two rotation (pairs ``2i, 2i+1``) into the ``rotate_half`` one
    (pairs ``i, i + rotary_dim / 2``): even features first, then odd. Applied to the q and k projections' rows of
    each head it leaves every q.k product unchanged."""
    return torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)])


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x = x * cos + rotate_half(x) * sin`` in place on the first ``rotary_dim`` features of ``x [..., head_dim]``."""
    rotary_dim = cos.shape[-1]
    part = x if rotary_dim == x.shape[-1] else x[..., :rotary_dim]
    swapped = torch.roll(part, rotary_dim // 2, dims=-1).mul_(sin_signed)
    part.mul_(cos).add_(swapped)
    return x


def apply_rotary_float_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary_` computed in float32 and rounded to ``x``'s dtype once, ``cos`` and ``sin`` as given
    (float32 tables for OLMo and OLMo 2, tables rounded to the model's dtype for Cohere), as those families do."""
    rotary_dim = cos.shape[-1]
    part = x if rotary_dim == x.shape[-1] else x[..., :rotary_dim]
    wide = part.float()
    part.copy_(wide * cos + torch.roll(wide, rotary_dim // 2, dims=-1) * sin_signed)
    return x
