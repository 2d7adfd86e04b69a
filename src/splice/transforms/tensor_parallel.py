"""Tensor parallelism: make a plan, shard the model by it, load each rank's checkpoint slices.

The plan comes from (first match): a splice tensor-parallel checkpoint's manifest (``checkpoint=.../splice_tp.json``),
the user's ``injection_policy``, or AutoTP's data-flow analysis. :func:`splice.tp.apply.apply_plan` applies it.

With ``tp_size > 1`` this step owns checkpoint loading: a meta model is sharded on meta, materialised at its per-rank
size and filled with its slices only (placement then just moves it). ``save_mp_checkpoint_path`` writes the shards.
Shard first, then quantize: see :mod:`splice.tp.layers` for the contract with the quantization step.
Fused-block TP comes from the pipeline order: this step shards the HF model, then kernel injection fuses each rank's
q/k/v and gate/up shards (the ``qkv`` and ``halves`` layouts by construction) and keeps o/down row-parallel, so a
fused block does exactly two all-reduces.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..checkpoint import check_checkpoint, has_meta_tensors, materialize, parameter_bytes
from ..tp.apply import apply_plan
from ..tp.autotp import autotp_plan, trace_model
from ..tp.loading import load_shard, load_slices, manifest_plan, read_manifest, save_shards
from ..tp.plan import TPPlan, verify
from ..tp.policy import policy_plan
from . import placement

PLAN_KEY = "tp_plan"
LOADED_KEY = "checkpoint_loaded"
#: ``ctx.extras[OWNER_KEY] == "tensor_parallel"``: this step loads the checkpoint; placement must only move the model.
OWNER_KEY = "checkpoint_owner"


def check(model: nn.Module, config, ctx) -> None:
    """Validate sizes and make (and verify) the plan; nothing is changed. The plan is kept in ``ctx.extras``."""
    tp = tp_size(config, ctx)
    if tp == 1:
        if config.save_mp_checkpoint_path:
            raise ValueError(f"save_mp_checkpoint_path={config.save_mp_checkpoint_path!r} writes tensor-parallel "
                             "shards and needs tensor_parallel.tp_size > 1; at tp_size=1 save the model with "
                             "save_pretrained instead")
        return
    plan = make_plan(model, config, tp)
    verify(plan, model, tp)
    source = placement.checkpoint_source(config)
    if source is not None:
        if not _manifest(source):
            check_checkpoint(model, source)  # headers only, against the unsharded model
        ctx.extras[OWNER_KEY] = "tensor_parallel"
    ctx.extras[PLAN_KEY] = plan


def owns_checkpoint(ctx) -> bool:
    """True when this step loads the checkpoint (tp_size > 1 and a checkpoint given): placement must then only move
    the model (it can test ``ctx.extras.get("checkpoint_owner") == "tensor_parallel"`` without importing this)."""
    return ctx.extras.get(OWNER_KEY) == "tensor_parallel"


def shard_model(model: nn.Module, config, ctx) -> nn.Module:
    tp = tp_size(config, ctx)
    if tp == 1:
        ctx.record("tensor_parallel", "skipped (tp_size=1)")
        return model
    plan = ctx.extras.get(PLAN_KEY) or make_plan(model, config, tp)
    total = parameter_bytes(model)
    shards = apply_plan(model, plan, ctx.parallel, config.tensor_parallel.tp_grain_size)
    loaded = _load(model, shards, config, ctx)
    if config.save_mp_checkpoint_path:
        save_shards(model, plan, ctx.parallel, config.save_mp_checkpoint_path)
    ctx.parallel.sync_rng()
    share = parameter_bytes(model) / max(total, 1)
    ctx.record("tensor_parallel", f"rank {ctx.parallel.rank}/{tp}, {plan.source} plan, {len(plan.rules)} rules; "
                                  f"parameters {share:.2f}x of the whole model{loaded}")
    return model


def tp_size(config, ctx) -> int:
    """The effective tensor-parallel size; the config and the context must agree."""
    wanted, have = config.tensor_parallel.tp_size, ctx.parallel.world_size
    given_group = config.tensor_parallel.tp_group is not None or config.tensor_parallel.mpu is not None
    if wanted != have and not (given_group and wanted == 1):
        raise ValueError(f"tensor_parallel.tp_size={wanted}, but this process's parallel context has {have} rank(s); "
                         f"launch {wanted} processes with `torchrun --nproc-per-node {wanted}` so init_inference can "
                         "build the group, or pass tp_group")
    return have


def make_plan(model: nn.Module, config, tp: int) -> TPPlan:
    """The manifest's plan, else the injection_policy's, else AutoTP's."""
    manifest = _manifest(placement.checkpoint_source(config))
    if manifest is not None:
        return manifest_plan(manifest, tp)
    trace = trace_model(model)
    if config.injection_policy:
        return policy_plan(model, config.injection_policy, trace)
    return autotp_plan(model, trace)


def describe_plan(model: nn.Module, tp_size: int, injection_policy: dict | None = None) -> str:
    """The plan splice would apply at ``tp_size`` (for ``splice info --tp N``); runs nothing distributed."""
    trace = trace_model(model)
    plan = policy_plan(model, injection_policy, trace) if injection_policy else autotp_plan(model, trace)
    verify(plan, model, tp_size)
    return plan.describe()


def _manifest(source) -> dict | None:
    return read_manifest(source) if isinstance(source, Path) else None


def _load(model: nn.Module, shards, config, ctx) -> str:
    path = placement.checkpoint_source(config)
    if path is None:
        return ""
    if has_meta_tensors(model):
        materialize(model, torch.device("cpu") if config.keep_module_on_host else torch.device(ctx.device))
    manifest = _manifest(path)
    if manifest is not None:
        load_shard(model, manifest, ctx.parallel.rank)
    else:
        load_slices(model, shards, path)
    ctx.extras[LOADED_KEY] = str(path)
    return f"; loaded this rank's slices from {path}"

