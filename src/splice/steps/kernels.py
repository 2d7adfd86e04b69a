"""kernels: make each linear of a fused model compute with the kernel the plan chose for its kind, and say which;
the same for the fused decoder blocks' decode-step attention (``plan.attention_kernel``) and for their decode steps
in native calls (``plan.layer_kernel``: the blocks whose structure and layers allow it, ``layers.native_layer``).

Fusing and quantizing produce weights; ``splice.kernel_choice`` decided (in ``plan.resolve``) how each kind of linear
computes. This step wraps each plain float linear of the fused blocks and the lm_head (the ones quantization left in
float, or all of them; an encoder's task heads stay the model's own) in its kernel's layer: splice's native bf16 GEMV
(``layers.native_linear``, plain weights gathered on 2 MiB pages, nothing copied), or a oneDNN-packed weight (``layers.packed_linear``, 16-bit weights where
the native kernels do not run; a tied lm_head stays as it is), or for fp16 on a CPU without fp16 arithmetic a
layer that widens the weight to fp32 for prompts (``layers.widened_linear``). A mixture of experts' block (its
layer's own MLP module) has its plain linears wrapped the same way, and on the native GEMV each float expert's
matrices too (one layer per expert on its slice of the 3-D weight). Quantized layers were built for their kernel by
the quantize step (``plan.quant_kernel``); the report names both choices and their reasons. Where decode steps run in
native calls, the blocks' RMSNorms take one for a step's rows too (``layers.norm``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers.block import SpliceBlock
from ..layers.causal_lm import SpliceCausalLM
from ..layers.experts import experts_matrices, experts_of_linears
from ..layers.native_layer import attention_unfit_reason, unfit_reason
from ..layers.native_linear import NativeLinear
from ..layers.norm import RMSNorm
from ..layers.packed_linear import PackedLinear
from ..layers.widened_linear import WidenedLinear
from ..native.memory import SMALL_TENSOR_BYTES, gather_on_huge_pages
from ..plan import Plan
from ..quant import QuantizedLinear
from ..tp.layers import RowParallelLinear, VocabParallelLinear, plain_linear
from . import Stage, StepReport

WRAPPERS = {"native": NativeLinear, "packed": PackedLinear, "widened": WidenedLinear}
#: The wrappers that keep the plain weight (so a tied lm_head can share the embedding table through them).
PLAIN_WEIGHT_WRAPPERS = (NativeLinear, WidenedLinear)
KERNEL_NAMES = {"native": "splice's native kernels", "packed": "oneDNN-packed weights",
                "widened": "torch's fp16 GEMV, an fp32 GEMM on widened weights for prompts", "torch": "torch's kernels"}


@dataclass(frozen=True)
class LinearKernels:
    """How one kind of linear computes: ``linears`` is "float" or a quantization kind ("int4_weight_only", ...)."""

    linears: str
    count: int  # layers of that kind in the model (float: those wrapped; 0 when none were)
    kernel: str  # "native", "packed", "widened", "torch"
    reason: str

    def summary(self) -> str:
        return f"{self.count} {self.linears} linears on {KERNEL_NAMES[self.kernel]} ({self.reason})"


@dataclass(frozen=True)
class KernelsReport(StepReport):
    float_linears: LinearKernels
    quantized_linears: LinearKernels | None  # None without quantization
    huge_page_bytes: int  # float weights gathered on 2 MiB pages for the native GEMV
    attention: str | None = None  # the decode steps' attention and why (None: no fused decoder blocks)
    layers: str | None = None  # how the decode steps' blocks run, and why (None: no fused decoder blocks)
    small_huge_page_bytes: int = 0  # the blocks' norms and biases gathered on 2 MiB pages (small_step_tensors)

    def summary(self) -> str:
        pages = f", weights on 2 MiB pages ({self.huge_page_bytes / 2**20:.0f} MiB)" if self.huge_page_bytes else ""
        parts = [self.float_linears.summary() + pages]
        if self.quantized_linears is not None:
            parts.append(self.quantized_linears.summary())
        if self.attention is not None:
            parts.append(f"attention: {self.attention}")
        if self.layers is not None:
            parts.append(f"blocks: {self.layers}")
        if self.small_huge_page_bytes:
            parts.append(f"norms and biases on 2 MiB pages ({self.small_huge_page_bytes / 2**10:.0f} KiB)")
        return "; ".join(parts)


def select_kernels(stage: Stage, plan: Plan) -> tuple[Stage, KernelsReport]:
    kind = plan.quant.kind if plan.quant is not None else None
    quantized = sum(isinstance(m, QuantizedLinear) and m.kind == kind for m in stage.model.modules())
    choice = plan.float_kernel
    wrapper = WRAPPERS.get(choice.kernel)
    wrapped, moved = 0, 0
    fused = plan.fuse
    if fused and wrapper is not None:
        wrapped = wrap_linears(stage.model, stage.runtime, wrapper)
        if wrapper is NativeLinear:
            moved = gather_on_huge_pages([m.weight for m in stage.model.modules() if isinstance(m, NativeLinear)])
    if not fused:
        floats = LinearKernels("float", 0, "torch", "not fused (replace_with_kernel_inject=False): the model's own "
                                                    "layers")
    elif wrapped:
        floats = LinearKernels("float", wrapped, choice.kernel, choice.reason)
    else:
        reason = choice.reason if wrapper is None else "no plain float linear left to wrap"
        floats = LinearKernels("float", 0, "torch", reason)
    quant = None
    if plan.quant is not None:
        quant = LinearKernels(plan.quant.kind, quantized, plan.quant_kernel.kernel, plan.quant_kernel.reason)
    attention = layers = None
    small = 0
    if fused and stage.runtime is not None:
        for block in stage.runtime.blocks:
            block.native_attention = plan.attention_kernel.native
        for norm in [*stage.runtime.blocks.modules(), stage.runtime.norm]:
            if isinstance(norm, RMSNorm):  # the blocks' own small ops for decode rows
                norm.native_rows = plan.layer_kernel.native
        attention = plan.attention_kernel.reason
        layers = choose_native_layers(stage.runtime.blocks, plan)
        small = gather_on_huge_pages(small_step_tensors(stage.runtime))
    return stage, KernelsReport("kernels", floats, quant, moved, attention, layers, small)


def small_step_tensors(runtime: SpliceCausalLM) -> list:
    """The decoder blocks' and the final norm's small parameters and buffers (norm weights, biases: under
    SMALL_TENSOR_BYTES each), which a decode step reads between streaming the weights: on 4 KiB pages each would
    cost a page walk from memory every step (the streamed weights evict the page tables' cache lines); gathered
    together they share a 2 MiB page. The large ones are gathered with their kernel's weights."""
    modules = [*runtime.blocks, runtime.norm] if runtime.norm is not None else list(runtime.blocks)
    return [t for module in modules for t in (*module.parameters(), *module.buffers()) if t.nbytes < SMALL_TENSOR_BYTES]


def choose_native_layers(blocks, plan: Plan) -> str:
    """Mark the blocks whose decode steps run in native calls (``plan.layer_kernel``, on native attention, where
    ``unfit_reason`` finds nothing against it); say how many did and why the others did not."""
    choice = plan.layer_kernel
    if not choice.native:
        return choice.reason
    if not plan.attention_kernel.native:
        return "each block's own ops (decode steps do not attend on splice's attention kernel)"
    reasons = {}
    for block in blocks:
        reason = unfit_reason(block)
        block.native_layer = reason is None
        if reason is not None and block.moe is not None:  # its MLP elsewhere: its attention half in a call maybe
            attention_reason = attention_unfit_reason(block)
            block.native_attention_half = attention_reason is None
            reason += f"; nor its attention: {attention_reason}" if attention_reason else "; its attention in one"
        if reason is not None:
            reasons.setdefault(reason, block.layer_idx)
    taken = sum(block.native_layer for block in blocks)
    if not reasons:
        return f"{choice.reason} (all {taken})"
    others = "; ".join(f"{reason} (block {index})" for reason, index in reasons.items())
    return f"{taken} of {len(blocks)} in native calls, the others their own ops: {others}"


def wrap_linears(model: nn.Module, runtime: SpliceCausalLM | None, wrapper: type[nn.Module]) -> int:
    """Swap the fused blocks' plain ``nn.Linear`` layers (a mixture of experts' own ones included, and with the
    native GEMV its float experts: :func:`native_experts`) and the runtime's lm_head for ``wrapper(linear)``; returns
    how many. Without a runtime (an encoder) only the blocks' linears are wrapped.

    Under tensor parallelism the row- and vocab-parallel wrappers keep their all-reduce / all-gather: only the plain
    linear inside them is wrapped. A tied lm_head shares the embedding table, which a lookup needs in the plain
    layout: only the wrappers that keep that layout (:data:`PLAIN_WEIGHT_WRAPPERS`) take it over.
    """
    count = 0
    blocks = runtime.blocks if runtime is not None else [m for m in model.modules() if isinstance(m, SpliceBlock)]
    for block in blocks:
        for name in ("qkv", "o", "gate_up", "down"):
            count += wrap_in(block, name, wrapper)
        if block.moe is not None:  # a mixture of experts' own linears (shared expert, dense MLP, gates), its experts
            count += sum(wrap_in(parent, name, wrapper) for parent, name in child_linears(block.moe))
            if wrapper is NativeLinear:
                count += native_experts(block.moe)
    if runtime is None:
        return count
    head = runtime.lm_head
    tied_ok = wrapper in PLAIN_WEIGHT_WRAPPERS
    if isinstance(head, VocabParallelLinear):
        if tied_ok or head.linear.weight is not runtime.embed.weight:
            count += wrap_in(head, "linear", wrapper)
    elif type(head) is nn.Linear and (tied_ok or head.weight is not runtime.embed.weight):
        runtime.lm_head = wrapper(head)
        model.set_output_embeddings(runtime.lm_head)
        count += 1
    return count


def native_experts(module: nn.Module) -> int:
    """Give every float experts module inside ``module`` (transformers' experts interface: 3-D weights) one native
    bf16 GEMV per expert and matrix, each on its expert's slice of the weight (gathered on 2 MiB pages first, nothing
    copied; :func:`~splice.layers.experts.experts_of_linears`); returns how many linears that made."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            weights = experts_matrices(child)
            if weights is None or any(w.dtype != torch.bfloat16 or not w[0].is_contiguous()
                                      for w, _ in weights.values()):
                continue
            gather_on_huge_pages([t for pair in weights.values() for t in pair if t is not None])
            setattr(parent, name, experts_of_linears(child, lambda w, b: NativeLinear(plain_linear(w, b))))
            count += sum(len(w) for w, _ in weights.values())
    return count


def child_linears(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, name) of every plain or row-parallel linear inside ``module``."""
    return [(parent, name) for parent in module.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear or isinstance(child, RowParallelLinear)]


def wrap_in(parent: nn.Module, name: str, wrapper: type[nn.Module]) -> int:
    """Wrap ``parent.<name>`` (or the plain linear inside a row-parallel wrapper); 1 if wrapped, else 0."""
    module = getattr(parent, name)
    if isinstance(module, RowParallelLinear):
        parent, name, module = module, "linear", module.linear
    if type(module) is not nn.Linear or module.weight.numel() == 0:
        return 0
    setattr(parent, name, wrapper(module))
    return 1
