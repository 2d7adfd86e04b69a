"""Kernel injection: swap each decoder layer for splice's fused block and attach the native generation path.

Everything family-specific comes from the architecture record (``splice.arch``). Weights are moved, not copied: the
fused QKV and gate+up weights are concatenated layer by layer and each original layer is released right away, so
peak memory grows by one layer at most. (With a checkpoint memory-mapped by safetensors, the pages of the released
q/k/v/gate/up weights are paged out of the process right away; else they would stay resident until the file is
unmapped.)

On CPU with bf16 weights, the block linears and the lm_head then run on splice's native GEMV
(``layers.native_linear``, plain weights, nothing copied); where those kernels are unavailable, 16-bit block linears
are packed for oneDNN instead (``layers.packed_linear``, a packed copy; a tied lm_head stays as it is). With
quantization to follow, the quantize step does this for the linears it leaves in float (:func:`wrap_float_linears`).

Under tensor parallelism this step runs after the tensor_parallel step, on each rank's shards: q/k/v (or the
checkpoint's fused qkv) and gate/up are column-parallel plain linears, so fusing them gives the rank's ``[q; k; v]``
and ``[gate; up]``; o and down stay the row-parallel wrappers that all-reduce (two all-reduces a block). Head counts
come from each rank's weights, which may be uneven (4 heads over 3 ranks) or hold replicated KV heads.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import native
from ..arch import ArchRecord, ModelDims, lookup, model_dims
from ..layers.block import BlockShape, SpliceBlock, activation
from ..layers.causal_lm import SpliceCausalLM
from ..layers.norm import HeadRMSNorm, RMSNorm
from ..layers.native_linear import NativeLinear, can_use_native
from ..native.memory import gather_on_huge_pages
from ..layers.packed_linear import PackedLinear, can_pack
from ..quant import QuantConfig
from ..tp.layers import RowParallelLinear, VocabParallelLinear
from . import tensor_parallel

RUNTIME_ATTR = "splice_runtime"


def check(model, config, ctx) -> None:
    """Validation only: a known family, real weights, an activation and rope the fused block supports."""
    if not config.replace_with_kernel_inject:
        return
    model_config = getattr(model, "config", None)
    if model_config is None:
        raise TypeError(f"kernel injection needs a transformers model with a .config, got {type(model).__name__}")
    record = lookup(model_config)
    # under tensor parallelism with a checkpoint, the tensor_parallel step (before this one) loads each rank's slices
    if not tensor_parallel.owns_checkpoint(ctx) and any(t.is_meta for t in model.parameters()):
        raise ValueError("kernel injection needs the model's weights, but some are on the meta device; "
                         "load the weights first (or use replace_with_kernel_inject=False)")
    dims = model_dims(record, model_config)
    activation(dims.activation)
    if config.max_out_tokens > dims.rope.max_positions:
        raise ValueError(f"max_out_tokens={config.max_out_tokens} exceeds {dims.rope.max_positions}, past which "
                         f"rope_type={dims.rope.rope_type!r} rescales itself; allowed: max_out_tokens <= "
                         f"{dims.rope.max_positions}")


def inject_kernels(model, config, ctx):
    if not config.replace_with_kernel_inject:
        ctx.record("inject", "skipped (replace_with_kernel_inject=False)")
        return model
    runtime = inject(model, config.max_out_tokens)
    # with quantization to follow, the quantize step wraps the linears it leaves in float (the lm_head by default)
    packed = wrap_float_linears(model, runtime, ctx.device) if QuantConfig.from_inference_config(config) is None else ""
    parallel = ""
    if ctx.parallel.world_size > 1:
        shape = runtime.blocks[0].shape
        parallel = (f"; tensor-parallel rank {ctx.parallel.rank}/{ctx.parallel.world_size}: {shape.n_heads} query and "
                    f"{shape.n_kv_heads} KV heads here, o/down row-parallel (two all-reduces a block)")
    ctx.record("inject", f"{len(runtime.blocks)} {model.config.model_type} decoder layers -> SpliceBlock (fused QKV "
                         f"and gate+up GEMMs, SDPA, static KV cache of {config.max_out_tokens} tokens)"
                         f"{packed}{parallel}")
    return model


def inject(model: nn.Module, max_out_tokens: int) -> SpliceCausalLM:
    """Replace the decoder layers of ``model`` in place; return the native path, also attached as
    ``model.splice_runtime`` (a plain attribute: not a submodule, so it adds nothing to ``state_dict``)."""
    record = lookup(model.config)
    dims = model_dims(record, model.config)
    layers = get_path(model, record.layers)
    for index in range(len(layers)):
        layers[index] = fused_block(record, dims, index, layers[index])
    norm = get_path(model, record.final_norm)
    set_path(model, record.final_norm, RMSNorm(norm.weight, dims.eps, record.norm_offset))
    runtime = SpliceCausalLM(model.config, dims, get_path(model, record.embed), layers,
                             get_path(model, record.final_norm), get_path(model, record.lm_head), record.embed_scale,
                             max_out_tokens)
    setattr(model, RUNTIME_ATTR, runtime)
    return runtime


def wrap_float_linears(model: nn.Module, runtime: SpliceCausalLM, device: torch.device) -> str:
    """Put the plain float linears of an injected model on the fastest CPU kernel for decode: splice's native bf16
    GEMV (their weights gathered on 2 MiB pages), else oneDNN-packed for 16-bit weights; returns a note for the
    report ("" when neither applies)."""
    if can_use_native(runtime.dtype, device):
        count = wrap_linears(model, runtime, NativeLinear)
        moved = gather_on_huge_pages([m.weight for m in model.modules() if isinstance(m, NativeLinear)])
        return (f"; {count} linears on splice's native bf16 GEMV"
                + (f", weights gathered on 2 MiB pages ({moved / 2**20:.0f} MiB)" if moved else ""))
    if can_pack(runtime.dtype, device):
        return f"; {wrap_linears(model, runtime, PackedLinear)} linears packed for oneDNN"
    return ""


def wrap_linears(model: nn.Module, runtime: SpliceCausalLM, wrapper: type[nn.Module]) -> int:
    """Swap the blocks' plain ``nn.Linear`` layers and the lm_head for ``wrapper(linear)``; returns how many.

    Under tensor parallelism the row- and vocab-parallel wrappers keep their all-reduce / all-gather: only the plain
    linear inside them is wrapped. A tied lm_head shares the embedding table, which a lookup needs in the plain
    layout: only :class:`NativeLinear` (which keeps that layout) takes it over.
    """
    count = 0
    for block in runtime.blocks:
        for name in ("qkv", "o", "gate_up", "down"):
            count += wrap_in(block, name, wrapper)
    head = runtime.lm_head
    tied_ok = wrapper is NativeLinear
    if isinstance(head, VocabParallelLinear):
        if tied_ok or head.linear.weight is not runtime.embed.weight:
            count += wrap_in(head, "linear", wrapper)
    elif type(head) is nn.Linear and (tied_ok or head.weight is not runtime.embed.weight):
        runtime.lm_head = wrapper(head)
        model.set_output_embeddings(runtime.lm_head)
        count += 1
    return count


def wrap_in(parent: nn.Module, name: str, wrapper: type[nn.Module]) -> int:
    """Wrap ``parent.<name>`` (or the plain linear inside a row-parallel wrapper); 1 if wrapped, else 0."""
    module = getattr(parent, name)
    if isinstance(module, RowParallelLinear):
        parent, name, module = module, "linear", module.linear
    if type(module) is not nn.Linear or module.weight.numel() == 0:
        return 0
    setattr(parent, name, wrapper(module))
    return 1


def runtime_of(model: nn.Module) -> SpliceCausalLM | None:
    """The native path of an injected model, or None."""
    return getattr(model, RUNTIME_ATTR, None) if isinstance(model, nn.Module) else None


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
