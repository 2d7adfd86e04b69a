"""shard: split the model over the tensor-parallel ranks by the plan's TP plan, and load each rank's slices.

With a checkpoint, a meta model is sharded on meta, materialised at its per-rank size and filled with its own slices
only (a splice tensor-parallel checkpoint: its own shard file). ``save_mp_checkpoint_path`` writes the shards. Shard
first, then fuse and quantize: kernel injection then fuses each rank's q/k/v and gate/up shards and keeps o/down
row-parallel (two all-reduces a block), and each rank quantizes its own shard.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint import has_meta_tensors, materialize, parameter_bytes
from ..plan import Plan
from ..tp.apply import apply_plan
from ..tp.loading import load_shard, load_slices, save_shards
from . import Stage, StepReport


@dataclass(frozen=True)
class ShardReport(StepReport):
    rank: int
    world_size: int
    plan_source: str | None  # "autotp", "policy", "manifest"; None at tp_size 1
    rules: int
    parameter_share: float  # this rank's parameters over the whole model's
    loaded_from: str | None

    def summary(self) -> str:
        if self.plan_source is None:
            return "skipped (tp_size=1)"
        loaded = f"; loaded this rank's slices from {self.loaded_from}" if self.loaded_from else ""
        return (f"rank {self.rank}/{self.world_size}, {self.plan_source} plan, {self.rules} rules; parameters "
                f"{self.parameter_share:.2f}x of the whole model{loaded}")


def shard(stage: Stage, plan: Plan) -> tuple[Stage, ShardReport]:
    model, parallel = stage.model, plan.parallel
    if plan.tp_plan is None:
        return stage, ShardReport("shard", parallel.rank, parallel.world_size, None, 0, 1.0, None)
    total = parameter_bytes(model)
    shards = apply_plan(model, plan.tp_plan, parallel, plan.tp_grain_size)
    loaded = None
    if plan.checkpoint_loader == "shard":
        if has_meta_tensors(model):
            materialize(model, plan.home)
        if plan.tp_manifest is not None:  # the manifest the plan was checked against, read once by resolve
            load_shard(model, plan.tp_manifest, parallel.rank)
        else:
            load_slices(model, shards, plan.checkpoint)
        loaded = str(plan.checkpoint)
    if plan.save_shards_to:
        save_shards(model, plan.tp_plan, parallel, plan.save_shards_to, plan.tp_grain_size)
    parallel.sync_rng()
    share = parameter_bytes(model) / max(total, 1)
    return stage, ShardReport("shard", parallel.rank, parallel.world_size, plan.tp_plan.source,
                              len(plan.tp_plan.rules), share, loaded)
