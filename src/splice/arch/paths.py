"""Dotted module paths as the records write them, and the check that a model has the parts its record names."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..layers.conv1d import in_out_features


def get_path(root: nn.Module, path: str, *default) -> Any:
    """The attribute at dotted ``path`` (``default``, when given, for a missing step; None past a None step)."""
    for name in path.split("."):
        root = getattr(root, name, *default)
        if root is None:
            return None
    return root


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """A Hugging Face model's input embedding; None for a model without ``get_input_embeddings`` and for one whose
    inputs are not tokens (transformers' Wav2Vec2 raises ``NotImplementedError`` from it)."""
    try:
        return model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def optional_path(root: nn.Module, path: str | None) -> Any:
    """The module at the first of ``path``'s ``|`` alternatives that ``root`` has (and is not None), else None."""
    for option in (path or "").split("|"):
        module = get_path(root, option, None) if option else None
        if module is not None:
            return module
    return None


def set_path(root: nn.Module, path: str, value: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_path(root, parent) if parent else root, name, value)


def misfits(record, dims, model: nn.Module) -> list[str]:
    """What in ``model`` does not fit the fused block as its record and config describe it: parts the record names
    that its first decoder layer lacks, then attention projections whose widths are not the config's heads."""
    missing = missing_parts(record, dims.parallel, model)
    if missing:
        return [f"no {path}" for path in missing]
    layer, hd = get_path(model, record.layers)[0], dims.head_dim
    if record.qkv:
        widths = {record.qkv: (dims.n_heads + 2 * dims.n_kv_heads) * hd}
    else:
        widths = {record.q: dims.n_heads * hd, record.k: dims.n_kv_heads * hd, record.v: dims.n_kv_heads * hd}
    return [f"{record.layers}.0.{path} gives {in_out_features(get_path(layer, path))[1]} features where "
            f"{dims.n_heads} query and {dims.n_kv_heads} key/value heads of {hd} need {width}"
            for path, width in widths.items() if in_out_features(get_path(layer, path))[1] != width]


def missing_parts(record, parallel: bool, model: nn.Module) -> list[str]:
    """The parts ``record`` needs that ``model`` (its first decoder layer for block parts) does not have."""
    roots = (record.layers, record.embed, record.lm_head) if record.lm_head else (record.layers, record.embed)
    missing = [path for path in roots if optional_path(model, path) is None]
    if missing:
        return missing
    layer = get_path(model, record.layers)[0]
    attention = [record.qkv] if record.qkv else [record.q, record.k, record.v]
    if record.moe:
        mlp = [record.moe]
    elif record.gated:
        mlp = [record.gate_up, record.down] if record.gate_up else [record.gate, record.up, record.down]
    else:
        mlp = [record.up, record.down]
    # a norm the record names must be there; one it names as None the family does not have (OLMo 2's inputs)
    norms = [record.attn_norm] if parallel else [record.attn_norm, record.mlp_norm]
    needed = [*attention, record.o, *mlp, *(path for path in norms if path is not None)]
    return [f"{record.layers}.0.{path}" for path in needed if not path or optional_path(layer, path) is None]
