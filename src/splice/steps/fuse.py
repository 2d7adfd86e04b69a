"""fuse (kernel injection): swap each decoder layer for splice's fused block and build the native decode runtime.

Everything family-specific comes from the architecture record (``splice.arch``). Weights are moved, not copied: the
fused QKV and gate+up weights are concatenated layer by layer and each original layer is released right away, so
peak memory grows by one layer at most. (With a checkpoint memory-mapped by safetensors, the pages of the released
q/k/v/gate/up weights are paged out of the process right away; else they would stay resident until the file is
unmapped.) Which kernel each linear then runs is the kernels step's choice.

Under tensor parallelism this step runs after the shard step, on each rank's shards: q/k/v (or the checkpoint's fused
qkv) and gate/up are column-parallel plain linears, so fusing them gives the rank's ``[q; k; v]`` and ``[gate; up]``;
o and down stay the row-parallel wrappers that all-reduce (two all-reduces a block). Head counts come from each rank's
weights, which may be uneven (4 heads over 3 ranks) or hold replicated KV heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import native
from ..arch import ArchRecord, ModelDims, lookup, model_dims
from ..layers.block import BlockShape, SpliceBlock
from ..layers.causal_lm import SpliceCausalLM
from ..layers.norm import HeadRMSNorm, RMSNorm
from ..plan import Plan
from . import Stage, StepReport


@dataclass(frozen=True)
class FuseReport(StepReport):
    family: str | None  # None: not fused (replace_with_kernel_inject=False)
    layers: int
    kv_cache_tokens: int
    heads_here: tuple[int, int] | None  # (query, key/value) heads on this rank, under tensor parallelism
    rank: int
    world_size: int

    def summary(self) -> str:
        if self.family is None:
            return "skipped (replace_with_kernel_inject=False)"
        parallel = ""
        if self.heads_here is not None:
            parallel = (f"; tensor-parallel rank {self.rank}/{self.world_size}: {self.heads_here[0]} query and "
                        f"{self.heads_here[1]} KV heads here, o/down row-parallel (two all-reduces a block)")
        return (f"{self.layers} {self.family} decoder layers -> SpliceBlock (fused QKV and gate+up GEMMs, SDPA, static "
                f"KV cache of {self.kv_cache_tokens} tokens){parallel}")


def fuse(stage: Stage, plan: Plan) -> tuple[Stage, FuseReport]:
    parallel = plan.parallel
    if not plan.fuse:
        return stage, FuseReport("fuse", None, 0, 0, None, parallel.rank, parallel.world_size)
    runtime = inject(stage.model, plan.max_out_tokens)
    shape = runtime.blocks[0].shape
    heads = (shape.n_heads, shape.n_kv_heads) if parallel.world_size > 1 else None
    return stage.with_(runtime=runtime), FuseReport("fuse", stage.model.config.model_type, len(runtime.blocks),
                                                    plan.max_out_tokens, heads, parallel.rank, parallel.world_size)


def inject(model: nn.Module, max_out_tokens: int) -> SpliceCausalLM:
    """Replace the decoder layers of ``model`` in place; return the native decode runtime over them."""
    record = lookup(model.config)
    dims = model_dims(record, model.config)
    layers = get_path(model, record.layers)
    for index in range(len(layers)):
        layers[index] = fused_block(record, dims, index, layers[index])
    norm = get_path(model, record.final_norm)
    set_path(model, record.final_norm, RMSNorm(norm.weight, dims.eps, record.norm_offset))
    return SpliceCausalLM(model.config, dims, get_path(model, record.embed), layers, get_path(model, record.final_norm),
                          get_path(model, record.lm_head), record.embed_scale, max_out_tokens)


def fused_block(record: ArchRecord, dims: ModelDims, index: int, layer: nn.Module) -> SpliceBlock:
    """Build one :class:`SpliceBlock` from one decoder layer, taking its weights over."""
    n_q, n_kv = head_counts(record, dims, layer)
    qkv = fused_linear(layer, record.qkv, (record.q, record.k, record.v))
    gate_up = fused_linear(layer, record.gate_up, (record.gate, record.up))
    shape = BlockShape(n_q, n_kv, dims.head_dim, dims.windows[index], dims.activation)
    qk_norm = None
    if record.q_norm:
        qk_norm = HeadRMSNorm(get_path(layer, record.q_norm).weight, get_path(layer, record.k_norm).weight,
                              shape.n_heads, shape.n_kv_heads, dims.eps)
    norms = [RMSNorm(get_path(layer, path).weight, dims.eps, record.norm_offset)
             for path in (record.attn_norm, record.mlp_norm)]
    return SpliceBlock(index, shape, qkv, get_path(layer, record.o), gate_up, get_path(layer, record.down), *norms,
                       qk_norm)


def fused_linear(layer: nn.Module, fused_path: str | None, part_paths: tuple[str, ...]) -> nn.Module:
    """The checkpoint's own fused linear when the family has one, else the parts concatenated into one."""
    if fused_path:
        return get_path(layer, fused_path)
    return concat_linears([get_path(layer, path) for path in part_paths])


def head_counts(record: ArchRecord, dims: ModelDims, layer: nn.Module) -> tuple[int, int]:
    """This rank's query and key/value heads in ``layer``, read from its weights (after a tensor-parallel split they
    may be uneven, e.g. 4 heads over 3 ranks, and KV heads may be replicated), never from a ratio of the config's.

    Separate projections give both counts by their widths. A checkpoint-fused ``[q; k; v]`` gives their sum only: the
    attention module's (per-rank) ``num_key_value_heads`` or ``num_key_value_groups`` splits it, else the config's
    ratio (a single process).
    """
    hd = dims.head_dim
    if not record.qkv:
        n_q, n_kv = (out_features(get_path(layer, path)) // hd for path in (record.q, record.k))
    else:
        total = out_features(get_path(layer, record.qkv)) // hd
        attention = get_path(layer, record.qkv.rpartition(".")[0]) if "." in record.qkv else layer
        n_kv = getattr(attention, "num_key_value_heads", None)
        groups = getattr(attention, "num_key_value_groups", None)
        if not isinstance(n_kv, int) and isinstance(groups, int):
            n_kv = total // (groups + 2)
        if not isinstance(n_kv, int):
            n_kv = total * dims.n_kv_heads // (dims.n_heads + 2 * dims.n_kv_heads)
        n_q = total - 2 * n_kv
    if n_kv < 1 or n_q < n_kv or n_q % n_kv:
        raise ValueError(f"cannot fuse attention with {n_q} query heads over {n_kv} key/value heads of size {hd} "
                         f"(model: {dims.n_heads} query, {dims.n_kv_heads} key/value heads); the query heads must be "
                         "a positive multiple of the key/value heads")
    return n_q, n_kv


def out_features(linear: nn.Module) -> int:
    return linear.weight.shape[0]


def concat_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the outputs of ``linears`` one after the other; the originals are emptied."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(lin.out_features)
                          for b, lin in zip(biases, linears)])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    for lin in linears:  # free the originals now, not when the old layer is collected (memory-mapped: page out)
        native.page_out(lin.weight.detach())
        lin.weight = None
        lin.bias = None
    return fused


def get_path(root: nn.Module, path: str) -> Any:
    for name in path.split("."):
        root = getattr(root, name)
    return root


def set_path(root: nn.Module, path: str, value: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_path(root, parent) if parent else root, name, value)
