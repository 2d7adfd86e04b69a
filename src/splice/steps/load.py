"""load: fill the model from the plan's checkpoint, when the whole checkpoint is this process's to load (tp_size 1).

A model built on the meta device is materialised straight on its home device and filled tensor by tensor, so the
weights are never held twice. Under tensor parallelism the shard step loads each rank's slices instead.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint import has_meta_tensors, load_checkpoint
from ..plan import CheckpointSource, Plan
from . import Stage, StepReport


@dataclass(frozen=True)
class LoadReport(StepReport):
    source: str | None  # None: nothing loaded here
    materialised: bool  # the model was on the meta device
    loader: str | None  # who loads the checkpoint: "load", "shard" (each rank its slices), None (no checkpoint)

    def summary(self) -> str:
        if self.loader is None:
            return "skipped (no checkpoint)"
        if self.loader == "shard":
            return "skipped (tensor parallelism: the shard step loads each rank's slices)"
        return f"{'materialised from meta and ' if self.materialised else ''}weights loaded from {self.source}"


def load_weights(stage: Stage, plan: Plan) -> tuple[Stage, LoadReport]:
    if plan.checkpoint_loader != "load":
        return stage, LoadReport("load", None, False, plan.checkpoint_loader)
    was_meta = has_meta_tensors(stage.model)
    model = load_checkpoint(stage.model, plan.checkpoint, plan.home)
    return stage.with_(model=model), LoadReport("load", source_name(plan.checkpoint), was_meta, "load")


def source_name(source: CheckpointSource) -> str:
    if isinstance(source, list):
        return f"{source[0]}" if len(source) == 1 else f"{source[0].parent} ({len(source)} files)"
    return str(source)
