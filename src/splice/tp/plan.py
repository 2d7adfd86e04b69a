"""A tensor-parallel plan is data: module paths (with ``*`` wildcards) mapped to how each module is sharded.

``{"model.layers.*.self_attn.q_proj": Rule("column", "q", heads), "model.layers.*.self_attn.o_proj": Rule("row", "q",
heads), "lm_head": Rule("vocab"), ...}``. Styles:

- ``column``: the output features are split; no communication.
- ``row``: the input features are split; the outputs are summed over the group (one all-reduce), then the bias added.
- ``vocab``: an embedding or lm_head split by vocabulary rows (the lm_head's logits are all-gathered).
- ``replicate``: every rank keeps the whole module.
- ``experts``: a mixture-of-experts module holding every expert's weights as 3-D tensors (transformers' experts
  interface): each expert's intermediate features are split (its gate/up outputs, its down inputs), and the module's
  output, a partial sum over the rank's features, is summed over the group (one all-reduce).

The ``layout`` (see :mod:`splice.tp.split`) says how the split dimension is organised, so fused projections are split
by heads or halves rather than raw rows. ``attention`` lists the modules whose per-rank head counts must be set.
AutoTP, a user ``injection_policy`` and (later) fused blocks only differ in how they *make* a plan;
:func:`splice.tp.apply.apply_plan` applies any of them. Keys are module paths (a parameter's path minus
``.weight``/``.bias``), as in transformers' ``base_model_tp_plan``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import nn

from ..layers.conv1d import is_conv1d
from ..layers.experts import experts_features, experts_matrices
from .split import HEAD_LAYOUTS, LAYOUTS, Heads, check_heads

STYLES = ("column", "row", "vocab", "replicate", "experts")


@dataclass(frozen=True)
class Rule:
    style: str
    layout: str = "plain"
    heads: Heads | None = None

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"unknown tensor-parallel style {self.style!r}; allowed: {', '.join(STYLES)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown tensor-parallel layout {self.layout!r}; allowed: {', '.join(LAYOUTS)}")
        if self.layout in HEAD_LAYOUTS and self.heads is None:
            raise ValueError(f"layout {self.layout!r} splits by attention heads and needs heads=Heads(...)")

    def __str__(self) -> str:
        text = self.style if self.layout == "plain" else f"{self.style}({self.layout})"
        return text if self.heads is None else f"{text} heads q={self.heads.n_q} kv={self.heads.n_kv} " \
                                               f"dim={self.heads.head_dim}"


#: Plan sources whose layouts were read from a traced forward (not written down in a record or a saved manifest):
#: verify runs such a plan once on meta copies of the sharded model before it is applied.
INFERRED_SOURCES = ("autotp", "policy")


@dataclass
class TPPlan:
    """Module-path patterns -> rules; attention-module patterns -> their (model-wide) heads; the blocks whose every
    linear the plan must cover; where the plan came from; ``vocab_grain``: the unit of the vocabulary split (None:
    the tp_grain_size the plan is applied with; a manifest's plan states the one its shards were cut with)."""

    rules: dict[str, Rule]
    attention: dict[str, Heads] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)
    source: str = "user"
    vocab_grain: int | None = None

    def to_dict(self) -> dict:
        rules = {k: {key: val for key, val in asdict(r).items() if val is not None} for k, r in self.rules.items()}
        data = {"source": self.source, "blocks": list(self.blocks), "rules": rules,
                "attention": {k: asdict(h) for k, h in self.attention.items()}}
        return data if self.vocab_grain is None else {**data, "vocab_grain": self.vocab_grain}

    @classmethod
    def from_dict(cls, data: dict) -> TPPlan:
        rules = {k: Rule(r["style"], r.get("layout", "plain"), Heads(**r["heads"]) if r.get("heads") else None)
                 for k, r in data["rules"].items()}
        attention = {k: Heads(**h) for k, h in data.get("attention", {}).items()}
        return cls(rules, attention, list(data.get("blocks", [])), data.get("source", "user"),
                   data.get("vocab_grain"))

    def describe(self) -> str:
        width = max((len(k) for k in self.rules), default=0)
        lines = [f"tensor-parallel plan ({self.source}; blocks {', '.join(self.blocks) or 'none'}):"]
        lines += [f"  {pattern:<{width}}  {rule}" for pattern, rule in self.rules.items()]
        lines += [f"  {pattern:<{width}}  attention heads q={h.n_q} kv={h.n_kv} dim={h.head_dim}"
                  for pattern, h in self.attention.items()]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Matching


def matches(pattern: str, name: str) -> bool:
    """``*`` matches exactly one path segment: ``layers.*.mlp`` matches ``layers.3.mlp``."""
    parts, segments = pattern.split("."), name.split(".")
    return len(parts) == len(segments) and all(p in ("*", s) for p, s in zip(parts, segments))


def lookup(table: dict, name: str):
    """The value of the one pattern in ``table`` that matches ``name``, or None; two different matches raise."""
    found = {pattern: value for pattern, value in table.items() if matches(pattern, name)}
    if len(set(found.values())) > 1:
        raise ValueError(f"module {name!r} is matched by several different plan rules: {found}")
    return next(iter(found.values()), None)


def resolve(plan: TPPlan, model: nn.Module) -> dict[str, Rule]:
    """Module name -> rule for every module the plan covers."""
    return {name: rule for name, _ in model.named_modules() if (rule := lookup(plan.rules, name)) is not None}


def collapse(named: dict[str, object], prefixes: list[str]) -> dict[str, object]:
    """Replace block indices by ``*`` (``layers.0.q``, ``layers.1.q`` -> ``layers.*.q``) where all blocks agree."""
    grouped: dict[str, dict[str, object]] = {}
    for name, value in named.items():
        grouped.setdefault(_wildcard(name, prefixes), {})[name] = value
    out: dict[str, object] = {}
    for pattern, members in grouped.items():
        if len(set(members.values())) == 1:
            out[pattern] = next(iter(members.values()))
        else:
            out.update(members)
    return out


def _wildcard(name: str, prefixes: list[str]) -> str:
    for prefix in prefixes:
        head = prefix + "."
        if name.startswith(head):
            index, _, rest = name[len(head):].partition(".")
            return f"{head}*" + (f".{rest}" if rest else "")
    return name


# --------------------------------------------------------------------------------------------------------------------
# Verification


def linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` or transformers' ``Conv1D`` (a linear with a transposed weight)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def experts_layout(module: nn.Module) -> str | None:
    """How an experts module's first weight lays out its intermediate features, where tensor parallelism can split
    them: ``halves`` (every expert's ``gate_up_proj`` is ``[gate | up]``), ``plain`` (an ``up_proj`` alone); None for
    any other module, and for experts whose split would change what they compute: a bias on the down projection
    (each rank would add it), a norm after each expert, gate and up interleaved."""
    if experts_matrices(module) is None or getattr(module, "has_post_expert_norm", False):
        return None
    if module.has_bias or (module.has_gate and not module.is_concatenated):
        return None
    return "halves" if module.has_gate else "plain"


#: The unit an experts module's intermediate features are split in (at the least): a rank's share of a 2-byte
#: weight then spans whole 16-byte strides, which grouped matrix products (transformers' ``grouped_mm`` experts)
#: need of their operands.
EXPERTS_GRAIN = 8


def experts_grain(features: int, tp: int, grain: int) -> int:
    """The unit the features are split in: ``grain`` (tp_grain_size) where it divides them into ``tp`` parts or
    more, else :data:`EXPERTS_GRAIN`."""
    return grain if features % grain == 0 and features // grain >= tp else EXPERTS_GRAIN


def _check_experts_split(name: str, module: nn.Module, tp: int) -> None:
    features = experts_features(module)
    if features % EXPERTS_GRAIN or features // EXPERTS_GRAIN < tp:
        raise ValueError(f"the experts of {name!r} have {features} intermediate features, which cannot be split "
                         f"over tensor_parallel.tp_size={tp} ranks in whole units of {EXPERTS_GRAIN} (what grouped "
                         f"expert products need); allowed: tp_size <= {features // EXPERTS_GRAIN} where the features "
                         f"are a multiple of {EXPERTS_GRAIN}, else tp_size=1")


def block_linears(model: nn.Module, blocks: list[str]) -> list[str]:
    """Linears inside any module whose path matches one of the ``blocks`` patterns."""
    names = [name for name, _ in model.named_modules()]
    roots = [n for n in names if any(matches(b, n) for b in blocks)]
    return [name for name, m in model.named_modules() if linear_like(m) and any(_inside(name, r) for r in roots)]


def verify(plan: TPPlan, model: nn.Module, tp: int, run_shards: bool = True) -> dict[str, Rule]:
    """Check the plan against the model; return module name -> rule. Raises ValueError listing rules that match
    nothing, linears in blocks that no rule covers, rules on the wrong kind of module, and head counts ``tp`` cannot
    split; with ``run_shards``, a plan whose layouts were inferred (:data:`INFERRED_SOURCES`) is also run once as
    ranks would hold it (:func:`splice.tp.apply.check_sharded_forward`), so a layout the trace could not tell
    apart from another one is refused here rather than failing, or computing garbage, after sharding."""
    resolved = resolve(plan, model)
    modules = dict(model.named_modules())
    unused = [p for p in plan.rules if not any(matches(p, n) for n in modules)]
    unused += [p for p in plan.attention if not any(matches(p, n) for n in modules)]
    if unused:
        raise ValueError(f"tensor-parallel plan rules match no module: {unused}; modules with weights include: "
                         f"{_sample([n for n, m in modules.items() if linear_like(m)])}")
    uncovered = [n for n in block_linears(model, plan.blocks) if n not in resolved]
    if uncovered:
        raise ValueError(f"tensor-parallel plan leaves {len(uncovered)} linear(s) uncovered: {_sample(uncovered)}; "
                         "give each a rule (column, row, replicate)")
    for name, rule in resolved.items():
        _check_kind(name, modules[name], rule)
        if rule.style == "experts":
            _check_experts_split(name, modules[name], tp)
        if rule.heads is not None:
            check_heads(rule.heads, tp)
    for heads in plan.attention.values():
        check_heads(heads, tp)
    if run_shards and tp > 1 and plan.source in INFERRED_SOURCES:
        from .apply import check_sharded_forward  # apply builds on this module

        check_sharded_forward(model, plan, tp)
    return resolved


def _check_kind(name: str, module: nn.Module, rule: Rule) -> None:
    if rule.style == "experts":
        if experts_layout(module) != rule.layout:
            raise ValueError(f"tensor-parallel rule {rule} for {name!r} ({type(module).__name__}) needs an experts "
                             f"module whose weights tensor parallelism can split as {rule.layout!r}; this module's "
                             f"layout: {experts_layout(module)} (see splice.tp.plan.experts_layout)")
        return
    embedding_rule = rule.style in ("vocab", "replicate") or (rule.style == "column" and rule.heads is not None)
    ok = linear_like(module) or (embedding_rule and isinstance(module, nn.Embedding))
    if not ok:
        raise ValueError(f"tensor-parallel rule {rule} for {name!r} needs a linear (or an embedding for 'vocab', "
                         f"'replicate' or a per-head 'column'), but {name!r} is a {type(module).__name__}")


def _inside(name: str, prefix: str) -> bool:
    return name.startswith(prefix + ".")


def _sample(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
