"""One ``apply_plan`` for every plan: replace each covered module by its rank's shard.

Works the same on real weights and on the meta device (slicing a meta tensor gives a meta tensor of the local
shape), so a meta model can be sharded first and then filled from a checkpoint with :mod:`splice.tp.loading`. It
returns a :data:`ShardMap` saying, for each tensor of the sharded model, which slice of which unsharded tensor it is.
Tied tensors (an lm_head sharing the embedding) stay one tensor: the same source sliced the same way is reused.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from itertools import chain

import torch
from torch import nn

from ..distributed import ParallelContext
from .autotp import fused_layout, trace_model
from .layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelLinear, local_embedding, plain_linear
from ..layers.conv1d import in_out_features, is_conv1d
from ..layers.experts import experts_features, up_name
from .plan import Rule, TPPlan, experts_grain, matches, verify
from .split import Heads, HeadShare, Ranges, grained, head_share, layout_ranges, row_order, span, width

#: Attributes HF attention modules read for their head counts, and what each means. Set per rank on the module,
#: only where the attribute exists and holds the model-wide value; the shared model config is never touched.
HEAD_ATTRIBUTES = {"num_heads": "n_q", "num_attention_heads": "n_q", "n_head": "n_q", "n_heads": "n_q",
                   "num_key_value_heads": "n_kv", "num_kv_heads": "n_kv", "num_key_value_groups": "group",
                   "split_size": "q_width", "inner_dim": "q_width", "embed_dim": "q_width"}
#: Head counts some attention forwards read from ``self.config`` (Phi-3's ``num_attention_heads``): such a module gets
#: a :class:`LocalConfig` view, the shared config object itself is never written.
CONFIG_HEADS = {"num_attention_heads": "n_q", "num_key_value_heads": "n_kv"}
#: Attention inputs that can hold one plane per query head of the whole model (ALiBi's bias, alone or folded into
#: the mask), by name -> the ranks such a tensor has: a 3-D one is ``[batch x heads, ...]`` (BLOOM's ``alibi``, MPT's
#: ``position_bias``), a 4-D one ``[batch, heads, q, k]`` (Falcon's ``attention_mask``). A tensor of those ranks
#: whose head dimension holds the model's query heads is cut to the rank's heads before the call; any other (a mask
#: shared by all heads, T5's bias already made from the rank's own heads) is passed as it is.
PER_HEAD_INPUTS = {"alibi": (3,), "position_bias": (3, 4), "attention_mask": (4,)}


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
    resolved = verify(plan, model, ctx.world_size, run_shards=False)
    sharder = _Sharder(ctx, grain, plan.vocab_grain or grain)
    for name, rule in resolved.items():
        if rule.style != "replicate":
            model.set_submodule(name, sharder.shard(name, model.get_submodule(name), rule))
    for name, module in list(model.named_modules()):
        heads = next((h for p, h in plan.attention.items() if matches(p, name)), None)
        if heads is not None:
            share = head_share(heads, ctx.world_size, ctx.rank)
            sharder.per_head_parameters(name, module, heads, share)
            localize_heads(module, heads, share)
    return sharder.slices


class _Sharder:
    def __init__(self, ctx: ParallelContext, grain: int, vocab_grain: int):
        self.ctx, self.grain, self.vocab_grain = ctx, grain, vocab_grain
        self.slices: ShardMap = {}
        self._made: dict[tuple, nn.Parameter] = {}

    def shard(self, name: str, module: nn.Module, rule: Rule) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return self.embedding(name, module) if rule.style == "vocab" else self.embedding_columns(name, module, rule)
        styles = {"column": self.column, "row": self.row, "vocab": self.vocab, "experts": self.experts}
        return styles[rule.style](name, module, rule)

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

    def experts(self, name: str, module: nn.Module, rule: Rule) -> nn.Module:
        """An experts module (3-D weights, one matrix per expert) keeps the rank's intermediate features of every
        expert: those outputs of its gate/up weight, those inputs of its down weight. Its output is then the rank's
        part of a sum over those features, summed over the group after its forward (a hook). Same module, same
        parameter names; an ``intermediate_dim`` attribute holding the whole width is set to the rank's."""
        first = up_name(module)
        up_dim, down_dim = (2, 1) if module.is_transposed else (1, 2)  # where the intermediate features lie
        features = experts_features(module)
        grain = experts_grain(features, self.ctx.world_size, self.grain)
        up_ranges = self.ranges(rule.layout, getattr(module, first).shape[up_dim], grain=grain)
        down_ranges = self.ranges("plain", features, grain=grain)
        setattr(module, first, self.take(name, module, first, up_dim, up_ranges, as_linear=False))
        module.down_proj = self.take(name, module, "down_proj", down_dim, down_ranges, as_linear=False)
        if getattr(module, "intermediate_dim", None) == features:
            module.intermediate_dim = width(down_ranges)
        module.register_forward_hook(_summed_over(self.ctx))
        return module

    def per_head_parameters(self, name: str, module: nn.Module, heads: Heads, share: HeadShare) -> None:
        """An attention module's own parameters holding one value per query head (GPT-OSS's attention sinks, added
        to each head's scores) cut to the rank's heads, as its q projection is."""
        for attr, tensor in list(module.named_parameters(recurse=False)):
            if tensor.dim() == 1 and tensor.shape[0] == heads.n_q:
                setattr(module, attr, self.take(name, module, attr, 0, (share.q,), as_linear=False))

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
        return grained(rows, self.ctx.world_size, self.vocab_grain)

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


def _summed_over(ctx: ParallelContext):
    """A forward hook summing a module's output over the group (an experts module's partial sums)."""
    def hook(module, args, output):
        return ctx.all_reduce(output)
    return hook


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
        for key, ranks in PER_HEAD_INPUTS.items():
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.dim() in ranks:
                kwargs[key] = rank_heads(value, n_q, q)
        return args, kwargs
    return hook


def rank_heads(value: torch.Tensor, n_q: int, q: tuple[int, int]) -> torch.Tensor:
    """Query heads ``q[0]:q[1]`` of a per-head input (see :data:`PER_HEAD_INPUTS`); any other tensor as it is."""
    if value.dim() == 4:
        return value[:, q[0]:q[1]] if value.shape[1] == n_q else value
    if value.shape[0] % n_q:
        return value
    rest = value.shape[1:]
    return value.reshape(-1, n_q, *rest)[:, q[0]:q[1]].reshape(-1, *rest)


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


# --------------------------------------------------------------------------------------------------------------------
# Running a plan before it is applied


@dataclass(frozen=True)
class _ShapesOnly(ParallelContext):
    """A rank's context whose collectives give only the shape they would (for meta tensors)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_last(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return tensor.new_empty(*tensor.shape[:-1], sum(sizes))


def check_sharded_forward(model: nn.Module, plan: TPPlan, tp: int) -> None:
    """Trace meta copies of ``model`` sharded as rank 0 and rank ``tp - 1`` would hold it (the largest and smallest
    shares): raise ValueError naming the module whose forward fails there, or the fused projection whose output the
    shard's forward views otherwise than by the rank's heads. The model itself is not touched.

    The trace reads a fused projection's layout from the shapes its output is viewed to, and a model that views it
    by a width it derives in its own way (CodeGen's ``embed_dim / mp_num`` with ``mp_num = 4`` written in its code)
    looks like one that views it by heads when the numbers happen to agree; on a rank's shard they no longer do.
    Where the unsharded model cannot be traced on the meta device, nothing can be learned and nothing is raised."""
    try:
        trace_model(meta_copy(model))
    except ValueError:
        return
    fused = {name: rule for name, rule in verify(plan, model, tp, run_shards=False).items()
             if rule.style == "column" and rule.layout in FUSED_LAYOUTS}
    for rank in sorted({0, tp - 1}):
        sharded = meta_copy(model)
        apply_plan(sharded, plan, _ShapesOnly(rank, tp))
        running = _Running(sharded)
        try:
            trace = trace_model(sharded)
        except ValueError as e:
            raise _fails_on_shard(plan, rank, tp, running.innermost(sharded), e.__cause__ or e) from None
        for name, rule in fused.items():
            _check_local_layout(name, rule, trace, head_share(rule.heads, tp, rank), rank, tp)


#: What a plan that does not run on a rank's shard means, and what to do.
_NOT_SPLIT = "it is not sharded rather than sharded wrongly; allowed: tensor_parallel.tp_size=1"
FUSED_LAYOUTS = ("qkv", "heads", "kv_groups")


def _fails_on_shard(plan: TPPlan, rank: int, tp: int, where: str, cause: BaseException) -> ValueError:
    return ValueError(f"the {plan.source} tensor-parallel plan does not run on rank {rank}'s shard at "
                      f"tensor_parallel.tp_size={tp}: {where} raised {type(cause).__name__}: {cause}; the model "
                      "computes something there from a width the plan splits, in a way the trace cannot tell apart "
                      f"from a split it supports; {_NOT_SPLIT}")


def _check_local_layout(name: str, rule: Rule, trace, share: HeadShare, rank: int, tp: int) -> None:
    """Raise unless the rank's shard of the fused projection ``name`` is viewed by the rank's own heads."""
    local = Heads(share.n_q, share.n_kv, rule.heads.head_dim)
    try:
        same = row_order(fused_layout(name, trace, local), local) == row_order(rule.layout, local)
    except ValueError:  # no layout, or one that does not fit the rank's heads
        same = False
    if not same:
        op, shapes = trace.first_op.get(name, ("nothing", ()))
        raise ValueError(f"the fused projection {name!r} is split by its {rule.layout!r} layout, but rank {rank}'s "
                         f"shard at tensor_parallel.tp_size={tp} ({share.n_q} query and {share.n_kv} key/value heads) "
                         f"is first used by {op!r} giving shapes {list(shapes)}, no view by those heads: the model "
                         f"derives that view from something other than its head counts; {_NOT_SPLIT}")


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every parameter and buffer on the meta device (no data copied), in eval mode."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in chain(model.parameters(), model.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, requires_grad=False) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo).eval()


class _Running:
    """The modules running now, innermost last (forward hooks on every module): where a failure comes from."""

    def __init__(self, model: nn.Module):
        self.stack: list[str] = []
        for name, module in model.named_modules():
            module.register_forward_pre_hook(self._enter(f"{name or 'the model'} ({type(module).__name__})"))
            module.register_forward_hook(self._leave)

    def _enter(self, label: str):
        def hook(module, args):
            self.stack.append(label)
        return hook

    def _leave(self, module, args, out) -> None:
        self.stack.pop()

    def innermost(self, model: nn.Module) -> str:
        return self.stack[-1] if self.stack else type(model).__name__
