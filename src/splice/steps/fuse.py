"""fuse (kernel injection): swap each decoder layer for splice's fused block and build the native decode runtime; an
encoder's (BERT's) layers are swapped the same way, with bidirectional attention, and get no decode runtime (an encoder
has no ``generate``, and no KV cache is kept).

Everything family-specific comes from the architecture record (``splice.arch``). Weights are moved, not copied: the
fused QKV and gate+up weights are concatenated layer by layer and each original layer is released right away, so
peak memory grows by one layer at most; the same holds for the weights rewritten once into the block's layout (a
per-KV-group q/k/v reordered to ``[q; k; v]``, GPT-J's q/k rows permuted for its rotation, an HF ``Conv1D``
transposed). (With a checkpoint memory-mapped by safetensors, the pages of the released weights are paged out of the
process right away; else they would stay resident until the file is unmapped.) Which kernel each linear then runs is
the kernels step's choice.

Under tensor parallelism this step runs after the shard step, on each rank's shards: q/k/v (or the checkpoint's fused
qkv) and gate/up are column-parallel plain linears, so fusing them gives the rank's ``[q; k; v]`` and ``[gate; up]``;
o and down stay the row-parallel wrappers that all-reduce (two all-reduces a block). Head counts come from each rank's
weights, which may be uneven (4 heads over 3 ranks) or hold replicated KV heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from .. import native
from ..arch import ArchRecord, ModelDims, model_dims, record_for
from ..arch.paths import get_path, optional_path, set_path
from ..arch.record import RopeSpec, text_config
from ..distributed import SINGLE_PROCESS, ParallelContext
from ..layers.block import BlockLayout, BlockShape, SpliceBlock, alibi_slopes
from ..layers.causal_lm import Ends, SpliceCausalLM
from ..layers.conv1d import in_out_features, is_conv1d, linear_weight
from ..layers.norm import HeadRMSNorm, ProjectionRMSNorm, RMSNorm
from ..layers.rotary import RopeTable, build_table, interleaved_to_halves
from ..plan import Plan
from ..tp.split import Heads, head_share
from . import Stage, StepReport


@dataclass(frozen=True)
class FuseReport(StepReport):
    family: str | None  # None: not fused (replace_with_kernel_inject=False)
    layers: int
    kv_cache_tokens: int
    heads_here: tuple[int, int] | None  # (query, key/value) heads on this rank, under tensor parallelism
    rank: int
    world_size: int
    encoder: bool = False  # bidirectional layers, no KV cache, no decode runtime
    moe: bool = False  # the blocks call the layers' own MLP modules (a mixture of experts)

    def summary(self) -> str:
        if self.family is None:
            return "skipped (replace_with_kernel_inject=False)"
        parallel = ""
        if self.heads_here is not None:
            rows = ("o row-parallel, each layer's MLP module as AutoTP split it (an all-reduce after o and after the "
                    "experts, and after a shared expert's down)" if self.moe else
                    "o/down row-parallel (two all-reduces a block)")
            parallel = (f"; tensor-parallel rank {self.rank}/{self.world_size}: {self.heads_here[0]} query and "
                        f"{self.heads_here[1]} KV heads here, {rows}")
        if self.encoder:
            return (f"{self.layers} {self.family} encoder layers -> SpliceBlock (bidirectional attention, one QKV "
                    f"GEMM, one MLP input GEMM, SDPA; no KV cache, no decode runtime){parallel}")
        mlp = "the layer's own mixture of experts" if self.moe else "one MLP input GEMM"
        return (f"{self.layers} {self.family} decoder layers -> SpliceBlock (one QKV GEMM, {mlp}, SDPA, static KV "
                f"cache of {self.kv_cache_tokens} tokens){parallel}")


def fuse(stage: Stage, plan: Plan) -> tuple[Stage, FuseReport]:
    parallel = plan.parallel
    if not plan.fuse:
        return stage, FuseReport("fuse", None, 0, 0, None, parallel.rank, parallel.world_size)
    record = record_for(stage.model)
    blocks = fuse_layers(stage.model, parallel)
    runtime = None if record.encoder else decode_runtime(stage.model, blocks, plan.max_out_tokens)
    shape = blocks[0].shape
    heads = (shape.n_heads, shape.n_kv_heads) if parallel.world_size > 1 else None
    cache_tokens = 0 if record.encoder else plan.max_out_tokens
    return stage.with_(runtime=runtime), FuseReport("fuse", stage.model.config.model_type, len(blocks), cache_tokens,
                                                    heads, parallel.rank, parallel.world_size, record.encoder,
                                                    record.moe is not None)


def inject(model: nn.Module, max_out_tokens: int, parallel: ParallelContext = SINGLE_PROCESS) -> SpliceCausalLM:
    """Replace the decoder layers of ``model`` (this rank's shards under ``parallel``) in place; return the native
    decode runtime over them."""
    record = record_for(model)
    if record.encoder:
        raise ValueError(f"model_type={record.model_type!r} is an encoder, which has no decode runtime; fuse its "
                         "layers with fuse_layers")
    return decode_runtime(model, fuse_layers(model, parallel), max_out_tokens)


def fuse_layers(model: nn.Module, parallel: ParallelContext = SINGLE_PROCESS) -> nn.ModuleList:
    """Replace the layers of ``model`` (this rank's shards under ``parallel``) by fused blocks in place; return them."""
    record = record_for(model)
    dims = model_dims(record, model.config)
    layers = get_path(model, record.layers)
    first_head = 0
    if parallel.world_size > 1:  # the model's numbering of this rank's first query head (ALiBi's slopes follow it)
        heads = Heads(dims.n_heads, dims.n_kv_heads, dims.head_dim)
        first_head = head_share(heads, parallel.world_size, parallel.rank).q[0]
    recorder = hidden_states_recorder(model, layers[0])
    for index in range(len(layers)):
        layers[index] = fused_block(record, dims, index, layers[index], first_head)
        if recorder is not None:
            recorder(layers[index])
    return layers


def hidden_states_recorder(model: nn.Module, layer: nn.Module):
    """What makes a fused block record ``output_hidden_states`` as ``layer`` does, or None where nothing needs to.

    transformers 5 collects a model's hidden states with forward hooks it installs, on first request, on the layer
    class its model registers (``_can_record_outputs``), which a fused block is not: the block gets the same hook.
    Models that collect hidden states in their own loop (Falcon, BLOOM) register none and need none."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder
    except ImportError:
        return None
    for owner in model.modules():
        # keyed by the class's name; earlier transformers 5 releases (the GPU check's machine has one) keep a plain
        # dict, whose ``get`` takes no module
        specs = (dict.get(_CAN_RECORD_REGISTRY, str(owner.__class__)) or {}).get("hidden_states")
        for spec in specs if isinstance(specs, list) else [specs]:
            if isinstance(spec, type):
                spec = OutputRecorder(target_class=spec)
            if isinstance(spec, OutputRecorder) and spec.layer_name is None and spec.target_class is not None \
                    and isinstance(layer, spec.target_class):
                return partial(_record_hidden_states, index=spec.index,
                               capture_initial=spec.capture_initial_hidden_state)
    return None


def _record_hidden_states(block: nn.Module, index: int, capture_initial: bool) -> None:
    block.register_forward_hook(HiddenStatesHook(index, capture_initial))


class HiddenStatesHook:
    """transformers' hidden-state recorder on a fused block, as a picklable object (transformers' hook is a closure,
    which would keep an injected model from being pickled or ``torch.save``-d): the closure is made on first call and
    dropped from the pickled state."""

    def __init__(self, index: int, capture_initial: bool):
        self.index, self.capture_initial, self._hook = index, capture_initial, None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_hook": None}

    def __call__(self, module: nn.Module, args, output):
        if self._hook is None:
            from transformers.utils.output_capturing import install_output_capuring_hook

            holder = nn.Module()  # transformers' installer registers its closure on a module: take it from there
            install_output_capuring_hook(holder, key="hidden_states", index=self.index,
                                         capture_initial_hidden_state=self.capture_initial)
            self._hook = next(iter(holder._forward_hooks.values()))
        return self._hook(module, args, output)


def decode_runtime(model: nn.Module, layers: nn.ModuleList, max_out_tokens: int) -> SpliceCausalLM:
    """The native decode runtime over a decoder's fused ``layers``: splice's own final norm and the model's ends."""
    record = record_for(model)
    dims = model_dims(record, model.config)
    if record.norm == "rms" and record.final_norm:
        norm = get_path(model, record.final_norm)
        set_path(model, record.final_norm, RMSNorm(norm.weight, dims.eps, record.norm_offset, record.norm_scale_float))
    ends = Ends(get_path(model, record.embed), get_path(model, record.lm_head),
                norm=optional_path(model, record.final_norm),
                position_embed=optional_path(model, record.position_embed), position_offset=record.position_offset,
                embed_norm=optional_path(model, record.embed_norm), project_in=optional_path(model, record.project_in),
                project_out=optional_path(model, record.project_out))
    runtime = SpliceCausalLM(text_config(model.config), dims, ends, layers, record.embed_scale, max_out_tokens)
    if (record.rotary_interleaved or record.hf_rotary_halves) and dims.positions == "rotary":
        # HF passes cos/sin in its own layout: the blocks' HF path takes splice's table
        for block in layers:
            block.rotary_table = RotaryLookup(runtime.ropes[block.layout.rope_index], runtime.config, dims.head_dim,
                                              max_out_tokens)
    return runtime


class RotaryLookup:
    """positions -> splice's cos and signed sin (``[batch, seq, 1, rotary_dim]``, in ``dtype``), the values of the
    decode runtime's table (:func:`~splice.layers.rotary.build_table` of the same rope), for a fused block's HF path.

    The block lives in the user's model, so this holds what builds the table and never the runtime: the runtime, its
    KV cache and its CUDA graphs go with the engine. The table is built on first use, at least ``length`` positions
    long (longer when asked for a position past it), and left out of a pickled model."""

    def __init__(self, rope: RopeSpec, config, head_dim: int, length: int):
        self.rope, self.config, self.head_dim, self.length = rope, config, head_dim, length
        self._table: RopeTable | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_table": None}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._table
        needed = int(positions.max()) + 1
        if table is None or table.length < needed or table.cos.dtype != dtype or table.cos.device != positions.device:
            table = self._table = build_table(self.rope, self.config, self.head_dim, max(self.length, needed), dtype,
                                              positions.device)
        return table.lookup(positions)


def fused_block(record: ArchRecord, dims: ModelDims, index: int, layer: nn.Module, first_head: int = 0) -> SpliceBlock:
    """Build one :class:`SpliceBlock` from one decoder layer, taking its weights over; ``first_head``: the model's
    number of the layer's first query head (not 0 on tensor-parallel ranks past the first)."""
    n_q, n_kv = head_counts(record, dims, layer)
    qkv = fused_qkv(record, dims, layer, n_q, n_kv)
    moe = get_path(layer, record.moe) if record.moe else None
    gate_up = down = None
    if moe is None:
        gate_up = fused_linear(layer, record.gate_up, (record.gate, record.up)) if record.gated else \
            as_linear(get_path(layer, record.up))
        down = as_linear(get_path(layer, record.down))
    shape = BlockShape(n_q, n_kv, dims.head_dim, dims.windows[index], dims.activation)
    qk_norm = qk_norms(record, dims, layer, shape) if record.q_norm else None
    attn_norm, mlp_norm, attn_out_norm, mlp_out_norm = (
        block_norm(record, dims, layer, path) for path in (record.attn_norm, record.mlp_norm, record.attn_out_norm,
                                                           record.mlp_out_norm))
    layout = BlockLayout(causal=not record.encoder, parallel=dims.parallel, norm_before=dims.norm_before,
                         gated=record.gated, rotary=dims.positions == "rotary" and index not in dims.unrotated,
                         rope_index=rope_index(dims, index),
                         scale=dims.layer_scale(index), softcap=dims.attn_softcap, hf_args=record.hf_args,
                         alibi_scaled=record.alibi_scaled, alibi_bf16=record.alibi_bf16,
                         hf_returns_tuple=record.hf_returns_tuple, hf_alibi_in_mask=record.hf_alibi_in_mask,
                         hf_window_in_mask=record.hf_window_in_mask, clip_qkv=dims.clip_qkv,
                         rotary_float=dims.rotary_float, residual_scale=dims.residual_multiplier)
    slopes = alibi_slopes(dims.n_heads)[first_head:first_head + n_q] if dims.positions == "alibi" else None
    sinks = get_path(layer, record.sinks) if record.sinks else None
    return SpliceBlock(index, shape, qkv, as_linear(get_path(layer, record.o)), gate_up, down, attn_norm, mlp_norm,
                       qk_norm, layout, attn_out_norm, mlp_out_norm, slopes, moe, sinks)


def qk_norms(record: ArchRecord, dims: ModelDims, layer: nn.Module, shape: BlockShape) -> nn.Module:
    """The layer's q and k norms as one module over the qkv rows' q and k heads: per head (:class:`HeadRMSNorm`) or
    over each whole projection (:class:`ProjectionRMSNorm`, its weights checked against the block's heads)."""
    q_weight, k_weight = get_path(layer, record.q_norm).weight, get_path(layer, record.k_norm).weight
    if record.qk_norm_width == "head":
        return HeadRMSNorm(q_weight, k_weight, shape.n_heads, shape.n_kv_heads, dims.eps, record.norm_offset)
    widths = (shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim)
    if (q_weight.numel(), k_weight.numel()) != widths:
        raise ValueError(f"{record.model_type} layer norms q and k over their whole projections, {widths[0]} and "
                         f"{widths[1]} features here, but its q_norm and k_norm weights hold {q_weight.numel()} and "
                         f"{k_weight.numel()}: a norm over every head cannot run on a share of them (tensor "
                         "parallelism); allowed: tp_size=1 for this model")
    return ProjectionRMSNorm(q_weight, k_weight, shape.n_heads, dims.eps, record.norm_scale_float)


def rope_index(dims: ModelDims, index: int) -> int:
    """Which of the model's distinct rotary tables layer ``index`` uses."""
    return (dims.layer_ropes or (dims.rope,)).index(dims.layer_rope(index))


def block_norm(record: ArchRecord, dims: ModelDims, layer: nn.Module, path: str | None) -> nn.Module | None:
    """The layer's norm at ``path`` (first of its ``|`` alternatives the layer has), as the fused block runs it: an
    RMSNorm taken over into splice's, a LayerNorm kept as the model's own module; None when the layer has none."""
    module = optional_path(layer, path)
    if module is None or record.norm == "layer":
        return module
    return RMSNorm(module.weight, dims.eps, record.norm_offset, record.norm_scale_float)


def fused_qkv(record: ArchRecord, dims: ModelDims, layer: nn.Module, n_q: int, n_kv: int) -> nn.Module:
    """One linear giving ``[q; k; v]`` with the rotary features of each q and k head in ``rotate_half`` order."""
    hd = dims.head_dim
    if record.qkv:
        qkv = as_linear(get_path(layer, record.qkv))
        if record.qkv_layout == "grouped":
            permute_rows_(qkv, grouped_to_contiguous(n_q, n_kv, hd))
    else:
        qkv = concat_linears([as_linear(get_path(layer, path)) for path in (record.q, record.k, record.v)])
    if record.rotary_interleaved and dims.positions == "rotary":
        heads = torch.arange((n_q + n_kv) * hd).view(n_q + n_kv, hd)
        heads[:, : dims.rotary_dim] = heads[:, interleaved_to_halves(dims.rotary_dim)]
        permute_rows_(qkv, torch.cat([heads.flatten(), torch.arange((n_q + n_kv) * hd, (n_q + 2 * n_kv) * hd)]))
    return qkv


def grouped_to_contiguous(n_q: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """Row order taking a per-KV-group ``[q x group, k, v]`` output to ``[q; k; v]``."""
    group = n_q // n_kv
    rows = torch.arange(n_kv * (group + 2) * head_dim).view(n_kv, group + 2, head_dim)
    return torch.cat([rows[:, :group].flatten(), rows[:, group].flatten(), rows[:, group + 1].flatten()])


def permute_rows_(linear: nn.Linear, order: torch.Tensor) -> None:
    """Reorder the output features of ``linear`` (weight rows and bias) in place of its parameters."""
    old = linear.weight.detach()
    linear.weight = nn.Parameter(old[order.to(old.device)], requires_grad=False)
    native.page_out(old)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[order.to(linear.bias.device)], requires_grad=False)


def as_linear(module: nn.Module) -> nn.Module:
    """A plain ``nn.Linear`` for an HF ``Conv1D`` (its weight transposed once) or an ``nn.Linear`` subclass (same
    parameters), so the kernels and quantization steps see one kind of linear; anything else as it is (the tensor-
    parallel wrappers, already plain inside)."""
    if type(module) is nn.Linear or not (isinstance(module, nn.Linear) or is_conv1d(module)):
        return module
    weight, bias = linear_weight(module)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.contiguous() if is_conv1d(module) else weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    if is_conv1d(module):
        native.page_out(module.weight.detach())
        module.weight = None
    return linear


def fused_linear(layer: nn.Module, fused_path: str | None, part_paths: tuple[str, ...]) -> nn.Module:
    """The checkpoint's own fused linear when the family has one, else the parts concatenated into one."""
    if fused_path:
        return as_linear(get_path(layer, fused_path))
    return concat_linears([as_linear(get_path(layer, path)) for path in part_paths])


def head_counts(record: ArchRecord, dims: ModelDims, layer: nn.Module) -> tuple[int, int]:
    """This rank's query and key/value heads in ``layer``, read from its weights (after a tensor-parallel split they
    may be uneven, e.g. 4 heads over 3 ranks, and KV heads may be replicated), never from a ratio of the config's.

    Separate projections give both counts by their widths. A checkpoint-fused ``[q; k; v]`` gives their sum only: the
    attention module's (per-rank) ``num_key_value_heads`` or ``num_key_value_groups`` splits it, else the config's
    ratio (a single process). A per-KV-group layout is split by whole groups, so the config's group size splits it.
    """
    hd = dims.head_dim
    if not record.qkv:
        n_q, n_kv = (out_features(get_path(layer, path)) // hd for path in (record.q, record.k))
    elif record.qkv_layout == "grouped":
        total = out_features(get_path(layer, record.qkv)) // hd
        group = dims.n_heads // dims.n_kv_heads
        n_kv = max(total // (group + 2), 1)
        n_q = total - 2 * n_kv
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
    return in_out_features(linear)[1]


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
