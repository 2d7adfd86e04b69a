"""The pipeline's steps, one file each. A step is ``apply(stage, plan) -> (stage, report)``: it applies its part of the
frozen :class:`splice.plan.Plan` to the model (and, after fusing, its decode runtime) and says what it did as data.
Steps import no other step; what a later step needs is in the plan or in the stage an earlier step returned.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ..layers.causal_lm import SpliceCausalLM


@dataclass(frozen=True)
class Stage:
    """What the pipeline has built so far: the model and, once fused, its decode runtime."""

    model: nn.Module
    runtime: SpliceCausalLM | None = None

    def with_(self, **changes: Any) -> Stage:
        return replace(self, **changes)


@dataclass(frozen=True)
class StepReport:
    """What one step did. Subclasses add fields; ``summary()`` is the sentence logs and ``splice info`` print."""

    step: str

    def summary(self) -> str:
        raise NotImplementedError
