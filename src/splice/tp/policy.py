"""A plan from a user ``injection_policy`` (DeepSpeed's format, alias ``injection_dict``).

``{LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}``: in every module of that class, the named linears are
row-parallel (all-reduce after them) and every other linear is column-parallel. The user gives the roles; how the
columns group with their row and how fused projections split (by heads / halves) comes from the same traced data
flow AutoTP uses, so both produce the same kind of plan.
"""
from __future__ import annotations

from torch import nn

from .autotp import Trace, find_blocks, plan_from_roles, trace_model
from .plan import TPPlan, linear_like


def policy_plan(model: nn.Module, policy: dict, trace: Trace | None = None) -> TPPlan:
    """The plan for ``injection_policy`` ``policy``; raises naming any class or linear name that matches nothing."""
    if not isinstance(policy, dict) or not policy:
        raise TypeError(f"injection_policy must be a non-empty dict of module class -> row-parallel linear names, "
                        f"got {policy!r}")
    roles: dict[str, str] = {}
    blocks: list[str] = []
    for cls, rows in policy.items():
        instances = _instances(model, cls)
        for block in instances:
            roles.update(_roles_in(model, block, cls, _names(cls, rows)))
        blocks += instances
    return plan_from_roles(model, trace or trace_model(model), roles, blocks, source="policy")


def _names(cls, rows) -> tuple[str, ...]:
    rows = (rows,) if isinstance(rows, str) else rows
    if not isinstance(rows, (tuple, list)) or not rows or not all(isinstance(r, str) for r in rows):
        raise TypeError(f"injection_policy[{getattr(cls, '__name__', cls)}] must be a tuple of linear names "
                        f"(e.g. ('self_attn.o_proj', 'mlp.down_proj')), got {rows!r}")
    return tuple(rows)


def _instances(model: nn.Module, cls) -> list[str]:
    if not isinstance(cls, type):
        raise TypeError(f"injection_policy keys must be module classes (e.g. LlamaDecoderLayer), got {cls!r}")
    found = [name for name, module in model.named_modules() if isinstance(module, cls)]
    if not found:
        try:
            blocks, _ = find_blocks(model)
            kinds = sorted({type(model.get_submodule(b)).__name__ for b in blocks})
        except ValueError:
            kinds = []
        raise ValueError(f"injection_policy class {cls.__name__} matches no module of {type(model).__name__}; "
                         f"its block classes: {kinds}")
    return found


def _roles_in(model: nn.Module, block: str, cls: type, rows: tuple[str, ...]) -> dict[str, str]:
    inner = {name[len(block) + 1:]: name for name, m in model.named_modules()
             if linear_like(m) and name.startswith(block + ".")}
    unknown = [r for r in rows if r not in inner]
    if unknown:
        raise ValueError(f"injection_policy for {cls.__name__}: {unknown} name(s) no linear in it; its linears are "
                         f"{sorted(inner)}")
    return {full: "row" if rel in rows else "column" for rel, full in inner.items()}
