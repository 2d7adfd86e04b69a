"""Tensor parallelism as data: a plan (``plan``) made by AutoTP's data-flow analysis (``autotp``) or from a user
``injection_policy`` (``policy``), applied by one ``apply_plan`` (``apply``) with parallel layers (``layers``), split
arithmetic in ``split``, per-rank checkpoint slices and saved shards in ``loading``. The pipeline step is
``splice.steps.shard`` (the plan comes from ``splice.plan``).
"""
from .apply import ShardMap, Slice, apply_plan
from .autotp import autotp_plan, trace_model
from .plan import Rule, TPPlan, verify
from .policy import policy_plan
from .split import Heads

__all__ = ["Heads", "Rule", "ShardMap", "Slice", "TPPlan", "apply_plan", "autotp_plan", "policy_plan", "trace_model",
           "verify"]
