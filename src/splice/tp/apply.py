"""One ``apply_plan`` for every plan: replace each covered module by its rank's shard.

Works the same on real weights and on the meta device (slicing a meta tensor gives a meta tensor of the local
shape), so a meta model can be sharded first and then filled from a checkpoint with :mod:`splice.tp.loading`. It
returns a :data:`ShardMap` saying, for each tensor of the sharded model, which slice of which unsharded tensor it is.
Tied tensors (an lm_head sharing the embedding) stay one tensor: the same source sliced the same way is reused.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed import ParallelContext
from .layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelLinear, local_embedding, plain_linear
from ..layers.conv1d import in_out_features, is_conv1d
from .plan import Rule, TPPlan, matches, verify
from .split import Heads, HeadShare, Ranges, balanced, head_share, layout_ranges, span

#: Attributes HF attention modules read for their head counts, and what each means. Set per rank on the module,
#: only where the attribute exists and holds the model-wide value; the shared model config is never touched.
HEAD_ATTRIBUTES = {"num_heads": "n_q", "num_attention_heads": "n_q", "n_head": "n_q", "n_heads": "n_q",
                   "num_key_value_heads": "n_kv", "num_kv_heads": "n_kv", "num_key_value_groups": "group",
                   "split_size": "q_width", "inner_dim": "q_width", "embed_dim": "q_width"}
#: Head counts some attention forwards read from ``self.config`` (Phi-3's ``num_attention_heads``): such a module gets
#: a :class:`LocalConfig` view, the shared config object itself is never written.
CONFIG_HEADS = {"num_attention_heads": "n_q", "num_key_value_heads": "n_kv"}
#: Attention inputs with one slice per query head (ALiBi biases): sliced to the rank's heads before the call.
PER_HEAD_INPUTS = ("alibi",)


@dataclass(frozen=True)
class Slice:
    """Where a sharded tensor comes from: ``ranges`` of dimension ``dim`` of the unsharded tensor ``source``
    (``dim=None``: all of it), transposed afterwards for ``Conv1D`` weights (stored ``[in, out]``)."""

    source: str
    dim: int | None = None
    ranges: Ranges = ()
    transpose: bool = False


ShardMap = dict[str, Slice]


def apply_plan(model: nn.Module, plan: TPPlan, ctx: ParallelContext, grain: int = 64) -> ShardMap:
    """Shard ``model`` in place by ``plan`` for ``ctx``'s rank; return the shard map. Verifies the plan first."""
    resolved = verify(plan, model, ctx.world_size)
    sharder = _Sharder(ctx, grain)
    for name, rule in resolved.items():
        if rule.style != "replicate":
            model.set_submodule(name, sharder.shard(name, model.get_submodule(name), rule))
    for name, module in model.named_modules():
        heads = next((h for p, h in plan.attention.items() if matches(p, name)), None)
        if heads is not None:
            localize_heads(module, heads, head_share(heads, ctx.world_size, ctx.rank))
    return sharder.slices


class _Sharder:
    def __init__(self, ctx: ParallelContext, grain: int):
        self.ctx, self.grain = ctx, grain
        self.slices: ShardMap = {}
        self._made: dict[tuple, nn.Parameter] = {}

    def shard(self, name: str, module: nn.Module, rule: Rule) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return self.embedding(name, module) if rule.style == "vocab" else self.embedding_columns(name, module, rule)
        return {"column": self.column, "row": self.row, "vocab": self.vocab}[rule.style](name, module, rule)

    def ranges(self, layout: str, size: int, heads: Heads | None = None, grain: int | None = None) -> Ranges:
        return layout_ranges(layout, size, self.ctx.world_size, self.ctx.rank, heads,
                             self.grain if grain is None else grain)

    def column(self, name: str, module: nn.Module, rule: Rule) -> nn.Module:
        ranges = self.ranges(rule.layout, in_out_features(module)[1], rule.heads)
        return plain_linear(self.take(name, module, "weight", 0, ranges), self.take(name, module, "bias", 0, ranges))

    def row(self, name: str, module: nn.Module, rule: Rule) -> nn.Module:
        ranges = self.ranges(rule.layout, in_out_features(module)[0], rule.heads)
        weight = self.take(name, module, "weight", 1, ranges, f"{name}.linear.weight")
        return RowParallelLinear(plain_linear(weight, None), self.take(name, module, "bias", None, ()), self.ctx)

    def vocab(self, name: str, module: nn.Module, rule: Rule) -> nn.Module:
        sizes = self.vocab_sizes(in_out_features(module)[1])
        ranges = (span(sizes, self.ctx.rank),)
        weight = self.take(name, module, "weight", 0, ranges, f"{name}.linear.weight")
        bias = self.take(name, module, "bias", 0, ranges, f"{name}.linear.bias")
        return VocabParallelLinear(plain_linear(weight, bias), sizes, self.ctx)

    def embedding(self, name: str, module: nn.Embedding) -> nn.Module:
        sizes = self.vocab_sizes(module.weight.shape[0])
        start, stop = span(sizes, self.ctx.rank)
        weight = self.take(name, module, "weight", 0, ((start, stop),), f"{name}.embedding.weight", as_linear=False)
        return VocabParallelEmbedding(local_embedding(module, weight, start), start, module.weight.shape[0], self.ctx)

    def embedding_columns(self, name: str, module: nn.Embedding, rule: Rule) -> nn.Module:
        """An embedding with one column per head (T5's relative position bias), cut to the rank's columns."""
        ranges = self.ranges(rule.layout, module.embedding_dim, rule.heads)
        return local_embedding(module, self.take(name, module, "weight", 1, ranges, as_linear=False), 0)

    def vocab_sizes(self, rows: int) -> list[int]:
        return balanced(rows, self.ctx.world_size)

    def take(self, name: str, module: nn.Module, attr: str, dim: int | None, ranges: Ranges,
             new_name: str | None = None, as_linear: bool = True) -> torch.Tensor | None:
        """The rank's part of ``module.<attr>`` (``dim`` counted on the ``[out, in]`` weight), recorded in the map."""
        tensor = getattr(module, attr, None)
        if tensor is None:
            return None
        transpose = as_linear and is_conv1d(module) and tensor.dim() == 2
        source_dim = None if dim is None else (1 - dim if transpose else dim)
        self.slices[new_name or f"{name}.{attr}"] = Slice(f"{name}.{attr}", source_dim, ranges, transpose)
        key = (id(tensor), source_dim, ranges, transpose)
        if key not in self._made:
            part = tensor if source_dim is None else cut(tensor, source_dim, ranges)
            self._made[key] = nn.Parameter((part.t() if transpose else part).contiguous(), requires_grad=False)
        return self._made[key]


def cut(tensor: torch.Tensor, dim: int, ranges: Ranges) -> torch.Tensor:
    """``ranges`` of ``dim`` of ``tensor``, concatenated (a view when there is one range)."""
    parts = [tensor.narrow(dim, start, stop - start) for start, stop in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)




def localize_heads(module: nn.Module, heads: Heads, share: HeadShare) -> None:
    """Set the module's head-count attributes to this rank's values; slice per-head inputs (ALiBi) to its heads."""
    model_wide = {"n_q": heads.n_q, "n_kv": heads.n_kv, "group": heads.group, "q_width": heads.n_q * heads.head_dim}
    local = {"n_q": share.n_q, "n_kv": share.n_kv, "group": share.n_q // share.n_kv,
             "q_width": share.n_q * heads.head_dim}
    for attr, meaning in HEAD_ATTRIBUTES.items():
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value == model_wide[meaning]:
            setattr(module, attr, local[meaning])
    config = getattr(module, "config", None)
    overrides = {k: local[m] for k, m in CONFIG_HEADS.items() if getattr(config, k, None) == model_wide[m]}
    if overrides:
        module.config = LocalConfig(config, overrides)
    if any(name in inspect.signature(module.forward).parameters for name in PER_HEAD_INPUTS):
        module.register_forward_pre_hook(_per_head_slicer(heads.n_q, share.q), with_kwargs=True)


def _per_head_slicer(n_q: int, q: tuple[int, int]):
    def hook(module, args, kwargs):
        for key in PER_HEAD_INPUTS:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.shape[0] % n_q == 0:
                rest = value.shape[1:]
                kwargs[key] = value.reshape(-1, n_q, *rest)[:, q[0]:q[1]].reshape(-1, *rest)
        return args, kwargs
    return hook


class LocalConfig:
    """A live view of a shared model config with a few per-rank values (head counts) on top; writes go through to
    the shared config."""

    def __init__(self, shared, overrides: dict):
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_overrides", dict(overrides))

    def __getattr__(self, name: str):
        overrides = object.__getattribute__(self, "_overrides")
        return overrides[name] if name in overrides else getattr(object.__getattribute__(self, "_shared"), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(object.__getattribute__(self, "_shared"), name, value)

    def __repr__(self) -> str:
        return f"LocalConfig({self._overrides} over {type(self._shared).__name__})"
