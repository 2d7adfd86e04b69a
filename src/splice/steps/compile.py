"""compile: a compiled static decode step (``compile_decode``). CUDA graph capture (``enable_cuda_graph``) is not
built; the config refuses it.

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

    def summary(self) -> str:
        if self.compiled:
            return ("decode step compiled with torch.compile (static shapes, one graph per attended length: the filled "
                    "slots rounded up to a power of two; each compiles when first reached, cached by torch's inductor "
                    "cache)")
        return "no graph capture (compile_decode=False)"


def compile_decode(stage: Stage, plan: Plan) -> tuple[Stage, CompileReport]:
    if plan.compile_decode:
        stage.runtime.compile_decode()
    return stage, CompileReport("compile", plan.compile_decode)
