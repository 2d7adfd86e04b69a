"""compile: a compiled static decode step (``compile_decode``) and CUDA graph replay (``enable_cuda_graph``: the
decode step's graphs here; ``engine(...)`` calls' graphs are the engine's).

Only the decode step is compiled: one token per row at a tensor position, attending over the filled slots of the
static KV cache rounded up to a power of two (at least ``layers.causal_lm.MIN_ATTENDED``; the cache's mask hides the
empty ones), so a step's cost follows the context in use, not ``max_out_tokens``, and its shapes change only at those
lengths: one graph per length and batch size, compiled the first time a decode step reaches it. Prefill and everything
else stay eager. Under tensor parallelism each rank compiles its own step; dynamo traces the row-parallel all-reduces
and the vocab-parallel all-gather into the graph as functional collectives (no graph breaks).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from . import Stage, StepReport


@dataclass(frozen=True)
class CompileReport(StepReport):
    compiled: bool
    cuda_graphs: bool = False
    decode_graphs: bool = False  # the decode step's graphs too: a kernel-injected model's native generate loop

    def summary(self) -> str:
        said = []
        if self.compiled:
            said.append("decode step compiled with torch.compile (static shapes, one graph per attended length: the "
                        "filled slots rounded up to a power of two; each compiles when first reached, cached by "
                        "torch's inductor cache); a step whose blocks all run in one native call runs eagerly "
                        "(runtime.compile_native_steps = True compiles it too)")
        if self.cuda_graphs and self.decode_graphs:
            said.append("CUDA graphs replay the decode step (one per batch size and attended length) and engine(...) "
                        "calls (one per argument signature), each captured when first called")
        elif self.cuda_graphs:
            said.append("CUDA graphs replay engine(...) calls (one per argument signature), each captured when first "
                        "called; generate runs transformers' loop without them (no kernel injection, so no native "
                        "decode step)")
        return "; ".join(said) or "no graph capture (compile_decode=False, enable_cuda_graph=False)"


def compile_decode(stage: Stage, plan: Plan) -> tuple[Stage, CompileReport]:
    if plan.compile_decode:
        stage.runtime.compile_decode(cpp_wrapper=plan.tp_size == 1)
    decode_graphs = plan.cuda_graph and stage.runtime is not None
    if decode_graphs:
        stage.runtime.capture_graphs()
    return stage, CompileReport("compile", plan.compile_decode, plan.cuda_graph, decode_graphs)
