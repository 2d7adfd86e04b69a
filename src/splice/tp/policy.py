"""A plan from a user ``injection_policy`` (DeepSpeed's format, alias ``injection_dict``).

``{LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}``: in every module of that class, the named linears are
row-parallel (all-reduce after them) and every other linear is column-parallel. The user gives the roles; how the
columns group with their row and how fused projections split (by heads / halves) comes from the same traced data
flow AutoTP uses, so both produce the same kind of plan.

An entry names a linear by its path inside the block, or by the end of that path in whole segments, as DeepSpeed's
published policies do: ``"SelfAttention.o"`` is T5's ``layer.0.SelfAttention.o``; a leading dot anchors the path at the
block (``".fc2"``: the block's own ``fc2``). An entry must name a linear in at least one module of its class (T5's
``"EncDecAttention.o"`` exists only in decoder blocks), and at most one linear of any block (``"out_proj"`` in a BART
decoder layer could be ``self_attn.out_proj`` or ``encoder_attn.out_proj``: ambiguous, so it raises). Each linear is
named once: two entries naming the same one (``"self_attn.o_proj"`` and ``"o_proj"``) raise too.
"""
from __future__ import annotations

from torch import nn

from .autotp import Trace, find_blocks, plan_from_roles, trace_model
from .plan import TPPlan, linear_like


#: What an injection_policy may be, for the errors about one that is not.
ALLOWED = ("a dict mapping block classes to the names of their output linears (e.g. {LlamaDecoderLayer: "
           "('self_attn.o_proj', 'mlp.down_proj')}), or injection_policy=None for kernel injection's plan or AutoTP")


def check_policy(policy: object) -> None:
    """Raise unless ``policy`` is a dict with at least one entry: a ``TypeError`` for another type, a ``ValueError``
    for an empty dict (it names no block, so it would shard nothing)."""
    if not isinstance(policy, dict):
        raise TypeError(f"injection_policy must be a dict, got {type(policy).__name__}: {policy!r}; allowed: {ALLOWED}")
    if not policy:
        raise ValueError(f"injection_policy={policy!r} names no block class, so it says nothing to shard; allowed: "
                         f"{ALLOWED}")


def policy_plan(model: nn.Module, policy: dict, trace: Trace | None = None) -> TPPlan:
    """The plan for ``injection_policy`` ``policy``; raises naming any class or linear name that matches nothing."""
    check_policy(policy)
    roles: dict[str, str] = {}
    blocks: list[str] = []
    for cls, rows in policy.items():
        instances = _instances(model, cls)
        entries = _names(cls, rows)
        linears = {block: _linears_in(model, block) for block in instances}
        used: set[str] = set()
        for block, inner in linears.items():
            rows_here = _rows_in(inner, entries, cls, block)
            used.update(rows_here.values())
            roles.update({full: "row" if rel in rows_here else "column" for rel, full in inner.items()})
        unknown = [e for e in entries if e not in used]
        if unknown:
            names = sorted({rel for inner in linears.values() for rel in inner})
            raise ValueError(f"injection_policy for {cls.__name__}: {unknown} name(s) no linear in it; its linears are "
                             f"{names}; an entry is a linear's path in the block or the end of it in whole segments "
                             "('SelfAttention.o', 'down_proj'), a leading dot anchoring it at the block ('.fc2')")
        blocks += instances
    return plan_from_roles(model, trace or trace_model(model), roles, blocks, source="policy")


def entry_matches(entry: str, path: str) -> bool:
    """Whether policy ``entry`` names the linear at ``path`` inside its block (see the module docstring)."""
    if entry.startswith("."):
        return path == entry[1:]
    return path == entry or path.endswith("." + entry)


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


def _linears_in(model: nn.Module, block: str) -> dict[str, str]:
    """Path inside ``block`` -> full name, for every linear in it."""
    return {name[len(block) + 1:]: name for name, m in model.named_modules()
            if linear_like(m) and name.startswith(block + ".")}


def _rows_in(inner: dict[str, str], entries: tuple[str, ...], cls: type, block: str) -> dict[str, str]:
    """Path inside the block -> the entry naming it, for the linears ``entries`` name in this block; raises for an
    entry naming more than one, and for two entries naming the same one (the second would silently take it over)."""
    rows: dict[str, str] = {}
    for entry in entries:
        hits = [rel for rel in inner if entry_matches(entry, rel)]
        if len(hits) > 1:
            raise ValueError(f"injection_policy for {cls.__name__}: {entry!r} is ambiguous, it names {len(hits)} "
                             f"linears of {block}: {hits}; allowed: one entry per linear, by a path that ends in only "
                             f"one of them (e.g. {hits[0]!r})")
        for rel in hits:
            if rel in rows:
                raise ValueError(_named_twice(cls, block, rel, rows[rel], entry))
            rows[rel] = entry
    return rows


def _named_twice(cls: type, block: str, rel: str, first: str, second: str) -> str:
    """The error for two entries (or one entry given twice) that name the same linear of ``block``."""
    linear = f"the linear {rel!r} of {block}"
    said = (f"{first!r} is given twice (it names {linear})" if first == second
            else f"{first!r} and {second!r} both name {linear}")
    return f"injection_policy for {cls.__name__}: {said}; allowed: name each linear once (keep one of the two)"
