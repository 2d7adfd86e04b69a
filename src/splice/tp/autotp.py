"""AutoTP: make a tensor-parallel plan by following the data through one forward pass.

No class names, no reprs. A tiny forward (4 tokens; on the meta device when the model has no weights yet) runs under
a ``TorchFunctionMode`` that tags every tensor with the linears it was computed from since the block input ("@in"):

- a linear whose input carries ``@in`` reads the block's input stream -> **column**;
- a linear whose input comes only from other linears of the block, and whose output reaches the block's output
  (is added back into the residual) -> **row**;
- each row linear and the columns feeding it form a group: attention when its sizes match the model's heads, else an
  MLP. A fused projection's layout (``[q|k|v]``, per-head ``[q,k,v]``, per-KV-group, ``[gate|up]``) is read from
  the first shape operation applied to its output (split, view to ``(heads, 3, dim)``, ...);
- a module with weights (a norm) between a group's columns and its row runs on one rank's heads only: allowed when
  its weights are one head's and it runs on all heads at once (Qwen3's q_norm), refused otherwise (OLMo 2's norm
  over the whole projection, Cohere's per-head weight rows, StableLM's one norm module per head).

Anything that fits none of these is reported, never guessed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from ..arch.paths import input_embeddings
from ..layers.conv1d import in_out_features
from ..layers.experts import is_experts
from .plan import Rule, TPPlan, collapse, experts_layout, linear_like
from .split import Heads

INPUT = "@in"
ATTENTION = "@attn"
_ATTENTION_OPS = ("softmax", "scaled_dot_product_attention", "flex_attention")
#: On the meta device a data-dependent check has no answer; answer as for an unpadded prompt of ones.
_META_ANSWERS = {"__bool__": True, "__contains__": False}
_SPLITS = ("split", "chunk", "__getitem__", "narrow", "split_with_sizes", "tensor_split", "unbind")
_VIEWS = ("view", "reshape", "unflatten")
#: ops that add a dimension of one, the features staying last: the layout shows in the op after them (GPT-BigCode)
_SEE_THROUGH = ("unsqueeze",)


@dataclass
class Trace:
    """What one forward showed: per linear, its input tags, size and first shape op; per block, its output tags."""

    blocks: list[str] = field(default_factory=list)
    block_lists: list[str] = field(default_factory=list)
    inputs: dict[str, frozenset] = field(default_factory=dict)
    out_ndim: dict[str, int] = field(default_factory=dict)
    first_op: dict[str, tuple[str, tuple]] = field(default_factory=dict)
    next_op: dict[str, tuple[str, tuple]] = field(default_factory=dict)  # the op on a first view's output
    block_out: dict[str, frozenset] = field(default_factory=dict)
    # modules with weights of their own that are neither linears nor embeddings (norms): per call, the tags and the
    # number of elements of their input
    weighted_inputs: dict[str, list[tuple[frozenset, int]]] = field(default_factory=dict)
    tokens: int = 4


class _Tagger(TorchFunctionMode):
    """Propagates tags (sets of linear names) from every op's tensor inputs to its tensor outputs."""

    def __init__(self, trace: Trace):
        super().__init__()
        self.trace, self.tags, self.fresh = trace, WeakTensorKeyDictionary(), WeakTensorKeyDictionary()
        self.viewed = WeakTensorKeyDictionary()  # a linear's output after its first op, a view: the linear's name

    def tags_of(self, value) -> frozenset:
        return frozenset().union(*(self.tags.get(t, frozenset()) for t in _tensors(value)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors((args, kwargs))
        if name in _META_ANSWERS and any(t.is_meta for t in inputs):
            return _META_ANSWERS[name]
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        if not outputs:
            return out
        self._note_first_use(name, inputs, outputs)
        tags = frozenset().union(*(self.tags.get(t, frozenset()) for t in inputs))
        if name in _ATTENTION_OPS and tags:
            tags |= {ATTENTION}
        for tensor in outputs:
            in_place = any(tensor is t for t in inputs)
            self.tags[tensor] = (self.tags.get(tensor, frozenset()) | tags) if in_place else tags
        return out

    def _note_first_use(self, op: str, inputs, outputs) -> None:
        shapes = tuple(tuple(o.shape) for o in outputs)
        for tensor in inputs:
            viewed = self.viewed.pop(tensor, None)
            if viewed is not None:
                self.trace.next_op.setdefault(viewed, (op, shapes))
            name = self.fresh.pop(tensor, None)
            if name is None or name in self.trace.first_op:
                continue
            if op in _SEE_THROUGH and len(outputs) == 1:
                self.fresh[outputs[0]] = name
                self.trace.out_ndim[name] = outputs[0].dim()
                continue
            self.trace.first_op[name] = (op, shapes)
            if op in _VIEWS and len(outputs) == 1:
                self.viewed[outputs[0]] = name

    def linear_pre(self, name):
        def hook(module, args):
            self.trace.inputs[name] = self.tags_of(args[0]) if args else frozenset()
        return hook

    def linear_post(self, name):
        def hook(module, args, out):
            self.tags[out] = frozenset({name})
            self.fresh[out] = name
            self.trace.out_ndim[name] = out.dim()
        return hook

    def weighted_pre(self, name):
        def hook(module, args, kwargs):
            first = _tensors((args, kwargs))[:1]
            seen = (self.tags_of(first), first[0].numel() if first else 0)
            self.trace.weighted_inputs.setdefault(name, []).append(seen)
        return hook

    def block_pre(self, name):
        def hook(module, args, kwargs):
            hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor):
                self.tags[hidden] = frozenset({INPUT})
        return hook

    def block_post(self, name):
        def hook(module, args, out):
            first = _tensors(out)[:1]
            self.trace.block_out[name] = self.tags_of(first)
        return hook


def _weighted(module: nn.Module) -> bool:
    """A module with weights of its own that is no linear or embedding (a norm, a scale)."""
    return not isinstance(module, nn.Embedding) and next(module.parameters(recurse=False), None) is not None


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def find_blocks(model: nn.Module) -> tuple[list[str], list[str]]:
    """The repeated blocks: children of every ``nn.ModuleList`` that holds linears. Returns (blocks, list paths)."""
    blocks, lists = [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and any(linear_like(m) for m in module.modules()):
            if not any(name.startswith(b + ".") for b in blocks):
                lists.append(name)
                blocks += [f"{name}.{i}" for i in range(len(module))]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (no nn.ModuleList of layers with linears); "
                         "AutoTP needs them. Give an injection_policy instead")
    return blocks, lists


def trace_model(model: nn.Module, tokens: int = 4) -> Trace:
    """Run one tiny forward and record the data flow (see the module docstring)."""
    trace = Trace(tokens=tokens)
    trace.blocks, trace.block_lists = find_blocks(model)
    tagger = _Tagger(trace)
    handles = []
    for name, module in model.named_modules():
        if linear_like(module):
            handles += [module.register_forward_pre_hook(tagger.linear_pre(name)),
                        module.register_forward_hook(tagger.linear_post(name))]
        elif _weighted(module):
            handles.append(module.register_forward_pre_hook(tagger.weighted_pre(name), with_kwargs=True))
        if name in trace.blocks:
            handles += [module.register_forward_pre_hook(tagger.block_pre(name), with_kwargs=True),
                        module.register_forward_hook(tagger.block_post(name))]
    inputs = trace_inputs(model, tokens)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), _in_eval_mode(model), _meta_experts(model), tagger:
            model(**inputs, use_cache=False)
    except Exception as e:
        raise ValueError(f"tensor parallelism traces one forward of {type(model).__name__} ({', '.join(inputs)} of "
                         f"{tokens} tokens) to find its column- and row-parallel linears, and that forward failed: "
                         f"{type(e).__name__}: {e}") from e
    finally:
        for handle in handles:
            handle.remove()
    return trace


@contextlib.contextmanager
def _in_eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode while the tracing forward runs (no dropout draws from the user's random stream), each module's own
    training flag put back after."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


@contextlib.contextmanager
def _meta_experts(model: nn.Module) -> Iterator[None]:
    """On the meta device, transformers' experts modules run its ``batched_mm`` implementation while the tracing
    forward runs (each config's choice put back after): its default ``grouped_mm`` takes bf16 weights only on meta,
    and a meta model (filled from a checkpoint after the plan) may be in any dtype. Both compute the same products."""
    configs = {id(m.config): m.config for m in model.modules()
               if is_experts(m) and any(p.is_meta for p in m.parameters(recurse=False))}
    chosen = {key: config._experts_implementation for key, config in configs.items()
              if getattr(config, "_experts_implementation", None) == "grouped_mm"}
    for key in chosen:
        configs[key]._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        for key, implementation in chosen.items():
            configs[key]._experts_implementation = implementation


def trace_inputs(model: nn.Module, tokens: int) -> dict[str, torch.Tensor]:
    """The tracing forward's inputs: ``tokens`` ids of one, and for an encoder-decoder (T5, BART, ...) as many decoder
    ids of its decoder start token, so the decoder's blocks run too."""
    ids = torch.ones(1, tokens, dtype=torch.long, device=next(model.parameters()).device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        candidates = (getattr(config, "decoder_start_token_id", None), getattr(config, "pad_token_id", None))
        start = next((v for v in candidates if isinstance(v, int)), 0)
        inputs["decoder_input_ids"] = torch.full_like(ids, start)
    return inputs


# --------------------------------------------------------------------------------------------------------------------
# From data flow to roles, groups and rules


def roles_from_flow(trace: Trace, linears: dict[str, nn.Module]) -> dict[str, str]:
    """Linear name -> "column" or "row" by the data-flow rules; raises listing linears that fit neither."""
    roles, unclear = {}, []
    for block in trace.blocks:
        names = [n for n in linears if n.startswith(block + ".")]
        down = low_rank_downs(trace, block, names, linears)
        for name in names:
            seen = trace.inputs.get(name)
            if seen is None:
                unclear.append(f"{name} (never called in the forward pass)")
            elif name in down:
                roles[name] = "replicate"
            elif INPUT in seen or (seen - {ATTENTION} and seen - {ATTENTION} <= down):
                roles[name] = "column"
            elif seen - {ATTENTION} and seen <= {*names, ATTENTION} and name in trace.block_out.get(block, ()):
                roles[name] = "row"
            else:
                unclear.append(f"{name} (reads {sorted(seen) or 'nothing from the block'})")
    if unclear:
        raise ValueError(f"AutoTP cannot place {len(unclear)} linear(s) as column- or row-parallel: {unclear[:8]}; "
                         "give an injection_policy naming the row-parallel (output) linears")
    return roles


def low_rank_downs(trace: Trace, block: str, names: list[str], linears: dict[str, nn.Module]) -> set[str]:
    """A block's low-rank down-projections: linears that read the block's input into fewer features than it has,
    whose output other linears of the block read alone, linears that do not write the block's output themselves
    (DeepSeek's multi-head latent attention: ``q_a_proj`` and ``kv_a_proj_with_mqa`` feed ``q_b_proj`` and
    ``kv_b_proj``, whose outputs go on to attention; an MLP narrower than the model, whose down projection writes the
    block's output, is no such thing). Kept whole on every rank (their outputs are small and every head needs them),
    the linears reading them are split by heads as if they read the input."""
    narrow = {n for n in names if INPUT in trace.inputs.get(n, ()) and
              in_out_features(linears[n])[1] < in_out_features(linears[n])[0]}
    writes = trace.block_out.get(block, frozenset())
    read = [trace.inputs.get(n, frozenset()) - {ATTENTION} for n in names
            if INPUT not in trace.inputs.get(n, ()) and n not in writes]
    return {n for n in narrow if any(n in seen and seen <= narrow for seen in read)}


def without_side_gates(trace: Trace, roles: dict[str, str], linears: dict[str, nn.Module]) -> dict[str, str]:
    """``roles`` less the columns that feed no row linear and have fewer outputs than inputs: a gate or a router
    computing a few values per token from the block's input (Qwen2-MoE's ``shared_expert_gate``, a router written as
    an ``nn.Linear``). Their outputs scale or pick what the block computes, so every rank needs all of them: they are
    kept whole (replicated). A wider linear feeding no row linear still fails the grouping, as it is no such gate."""
    fed = set().union(*(trace.inputs.get(n, frozenset()) for n, r in roles.items() if r == "row"))
    side = {n for n, r in roles.items() if r == "column" and n not in fed
            and in_out_features(linears[n])[1] < in_out_features(linears[n])[0]}
    return {n: r for n, r in roles.items() if n not in side}


def groups_from_roles(trace: Trace, roles: dict[str, str]) -> dict[str, list[str]]:
    """Row linear -> the column linears that feed it (from the traced data flow). Checks every column feeds exactly
    one row and never writes into the residual directly."""
    groups = {}
    whole = {n for n, r in roles.items() if r == "replicate"}  # low-rank downs: every rank holds their outputs
    for row in (n for n, r in roles.items() if r == "row"):
        feeders = sorted(trace.inputs.get(row, frozenset()) - {INPUT, ATTENTION} - whole)
        wrong = [f for f in feeders if roles.get(f) != "column"]
        if wrong or not feeders:
            raise ValueError(f"row-parallel linear {row!r} must read only column-parallel linears' outputs, but it "
                             f"reads {sorted(trace.inputs.get(row, ())) or 'nothing'} (non-column: {wrong})")
        groups[row] = feeders
    fed = [c for cs in groups.values() for c in cs]
    block_out = frozenset().union(*trace.block_out.values()) if trace.block_out else frozenset()
    for col in (n for n, r in roles.items() if r == "column"):
        if fed.count(col) != 1 or col in block_out:
            raise ValueError(f"column-parallel linear {col!r} must feed exactly one row-parallel linear and not the "
                             f"residual stream; it feeds {fed.count(col)} row linear(s)"
                             f"{' and the residual' if col in block_out else ''}")
    return groups


def group_rules(row: str, feeders: list[str], linears: dict[str, nn.Module], trace: Trace,
                n_heads: int | None) -> tuple[dict[str, Rule], Heads | None]:
    """Rules for one row linear and its feeders: by heads if attention (softmax/SDPA) lies between them, else by
    MLP columns."""
    r_in = in_out_features(linears[row])[0]
    outs = {f: in_out_features(linears[f])[1] for f in feeders}
    if ATTENTION not in trace.inputs.get(row, ()):
        return {row: Rule("row"), **{f: _mlp_rule(f, o, r_in) for f, o in outs.items()}}, None
    try:
        heads = attention_heads(row, r_in, outs, n_heads)
    except ValueError:
        latent = latent_attention(row, r_in, outs, trace, n_heads)
        if latent is None:
            raise
        return latent
    rules = {row: Rule("row", "q", heads)}
    for f, o in outs.items():
        layout = "q" if o == heads.n_q * heads.head_dim else "kv" if o == heads.n_kv * heads.head_dim else \
            fused_layout(f, trace, heads)
        rules[f] = Rule("column", layout, heads)
    return rules, heads


def latent_attention(row: str, r_in: int, outs: dict[str, int], trace: Trace, n_heads: int | None
                     ) -> tuple[dict[str, Rule], Heads] | None:
    """Rules for attention whose projections each have a head width of their own (DeepSeek's multi-head latent
    attention: queries of ``qk_nope + qk_rope`` features a head, keys and values expanded together from the latent,
    ``qk_nope + v`` a head, the output ``v`` a head): every projection's output first viewed as the config's heads of
    its own width, each head its own key/value head. Split by heads, each projection at its width; None where the
    trace shows anything else."""
    if not n_heads or r_in % n_heads or len(outs) < 2 or any(o % n_heads for o in outs.values()):
        return None
    widths = {f: o // n_heads for f, o in outs.items()}
    for name, width in widths.items():
        op, shapes = trace.first_op.get(name, ("nothing", ()))
        if op not in _VIEWS or not shapes or tuple(shapes[0][-2:]) != (n_heads, width):
            return None
    heads = Heads(n_heads, n_heads, r_in // n_heads)
    rules = {row: Rule("row", "q", heads)}
    rules.update({name: Rule("column", "q", Heads(n_heads, n_heads, width)) for name, width in widths.items()})
    return rules, heads


def attention_heads(row: str, r_in: int, outs: dict[str, int], n_heads: int | None) -> Heads:
    """Query heads from the model config; head size and KV heads from the projections' sizes."""
    if not n_heads or r_in % n_heads:
        raise ValueError(f"attention output {row!r} has {r_in} inputs, which the model config's "
                         f"num_attention_heads={n_heads} does not divide; AutoTP needs the number of heads")
    hd = r_in // n_heads
    sizes = sorted(outs.values())
    if len(sizes) == 3 and sizes[2] == r_in and sizes[0] == sizes[1] and sizes[0] % hd == 0:
        n_kv = sizes[0] // hd
    elif len(sizes) == 1 and sizes[0] % hd == 0 and (sizes[0] // hd - n_heads) % 2 == 0:
        n_kv = (sizes[0] // hd - n_heads) // 2
    else:
        n_kv = 0
    if n_kv < 1 or n_heads % n_kv:
        raise ValueError(f"AutoTP cannot read the heads of the attention feeding {row!r}: projections "
                         f"{outs} with {n_heads} heads of size {hd}; expected q/k/v projections or one fused q/k/v")
    return Heads(n_heads, n_kv, hd)


def _mlp_rule(name: str, out: int, r_in: int) -> Rule:
    if out == r_in:
        return Rule("column")
    if out == 2 * r_in:
        return Rule("column", "halves")
    raise ValueError(f"column-parallel linear {name!r} has {out} outputs but the row-parallel linear it feeds has "
                     f"{r_in} inputs; allowed: equal, or twice (fused [gate | up])")


def fused_layout(name: str, trace: Trace, heads: Heads) -> str:
    """The layout of a fused q/k/v projection, from the first shape op applied to its output."""
    op, shapes = trace.first_op.get(name, ("nothing", ()))
    hd, nq, nkv = heads.head_dim, heads.n_q, heads.n_kv
    lead = trace.out_ndim.get(name, 1) - 1
    if op in _SPLITS and shapes and shapes[0][lead:] == (nq * hd,):
        return "qkv"
    tail = tuple(shapes[0][lead:]) if op in _VIEWS and shapes else ()
    if tail == (nq + 2 * nkv, hd):  # rows of head_dim: the op after this view tells how q, k and v interleave
        op, shapes = trace.next_op.get(name, ("nothing", ()))
        tail = tuple(shapes[0][lead:]) if op in _VIEWS and shapes else ()
        if tail not in ((nq, 3, hd), (nkv, heads.group + 2, hd)):
            return "qkv"
    if nq == nkv and tail in ((nq, 3, hd), (nq, 3 * hd)):
        return "heads"
    if tail == (nkv, heads.group + 2, hd):
        return "kv_groups"
    raise ValueError(f"AutoTP cannot tell how the fused projection {name!r} ({(nq + 2 * nkv) * hd} outputs) lays out "
                     f"its q/k/v: its output is first used by {op!r} giving shapes {list(shapes)}; give an "
                     "injection_policy or a plan")


# --------------------------------------------------------------------------------------------------------------------
# The plan


def autotp_plan(model: nn.Module, trace: Trace | None = None) -> TPPlan:
    """AutoTP's plan for ``model`` (see the module docstring)."""
    trace = trace or trace_model(model)
    linears = {n: m for n, m in model.named_modules() if linear_like(m)}
    roles = roles_from_flow(trace, linears)
    return plan_from_roles(model, trace, roles, trace.blocks, source="autotp")


def plan_from_roles(model: nn.Module, trace: Trace, roles: dict[str, str], blocks: list[str], source: str) -> TPPlan:
    """Group the roles by data flow, give each group its layouts, add vocab/replicate rules, collapse to wildcards."""
    n_heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    linears = {n: m for n, m in model.named_modules() if linear_like(m)}
    rules: dict[str, Rule] = {}
    attention: dict[str, Heads] = {}
    for row, feeders in groups_from_roles(trace, without_side_gates(trace, roles, linears)).items():
        group, heads = group_rules(row, feeders, linears, trace, n_heads)
        check_between(model, trace, row, feeders, heads)
        rules.update(group)
        if heads is not None:
            parent = common_parent([row, *feeders])
            attention[parent] = heads
            rules.update(per_head_embeddings(model, parent, heads))
    rules.update(experts_rules(model, trace, rules))
    rules.update(edge_rules(model, linears, rules))
    prefixes = trace.block_lists
    ordered = {n: rules[n] for n, _ in model.named_modules() if n in rules}
    return TPPlan(collapse(ordered, prefixes), collapse(attention, prefixes),
                  list(collapse(dict.fromkeys(blocks, True), prefixes)), source)


def experts_rules(model: nn.Module, trace: Trace, rules: dict[str, Rule]) -> dict[str, Rule]:
    """An ``experts`` rule for each experts module in a block (:func:`splice.tp.plan.experts_layout`) that reads the
    block's stream whole: its input carries no column-parallel linear's output (each rank would hold only part of
    it). Its output is summed over the ranks right after it, so whatever the block does with it next sees all of it.
    Experts that cannot be split stay whole on every rank, as any module without a rule."""
    columns = {name for name, rule in rules.items() if rule.style == "column"}
    found = {}
    for name, module in model.named_modules():
        layout = experts_layout(module)
        calls = trace.weighted_inputs.get(name, [])
        if layout is None or not calls or not any(name.startswith(block + ".") for block in trace.blocks):
            continue
        if all(INPUT in tags and not tags & columns for tags, _ in calls):
            found[name] = Rule("experts", layout)
    return found


def check_between(model: nn.Module, trace: Trace, row: str, feeders: list[str], heads: Heads | None) -> None:
    """Raise for a module with weights that computes on the column linears' outputs before their row linear reads
    them: each rank holds only its heads (or MLP columns) there. Allowed: one module per call over whole heads with
    weights of one head's size (a per-head RMSNorm, as Qwen3's q_norm), which every rank runs on its own heads."""
    for name, calls in trace.weighted_inputs.items():
        between = [(tags, numel) for tags, numel in calls if tags & set(feeders) and tags <= {*feeders, ATTENTION}]
        problem = between and _split_problem(model.get_submodule(name), [n for _, n in between], trace.tokens, heads)
        if problem:
            reads = sorted(frozenset().union(*(tags for tags, _ in between)) - {ATTENTION})
            raise ValueError(f"AutoTP cannot shard {name!r} ({type(model.get_submodule(name)).__name__}): it computes "
                             f"on the output of {reads} before {row!r} reads it, where each rank holds only its share "
                             f"of the {'heads' if heads else 'columns'}, and {problem}; allowed: "
                             "tensor_parallel.tp_size=1")


def _split_problem(module: nn.Module, numels: list[int], tokens: int, heads: Heads | None) -> str | None:
    """Why ``module`` cannot run on one rank's heads (None: it can); ``numels``: its input sizes in the trace."""
    shapes = [list(p.shape) for p in module.parameters(recurse=False)]
    if heads is None:
        return f"its weights {shapes} span the whole width (it would need the other ranks' columns)"
    if any(shape not in ([], [heads.head_dim]) for shape in shapes):
        return (f"its weights {shapes} are not one head's ({heads.head_dim}): they span every head, so it needs "
                "the other ranks' features (a norm over all heads) or weights cut by head, which AutoTP does not do")
    whole = {tokens * count * heads.head_dim for count in (heads.n_q, heads.n_kv)}
    if not set(numels) <= whole:
        return ("it runs on fewer than all the heads at a time (one module per head): a rank would run the first "
                "heads' modules on its own heads")
    return None


def per_head_embeddings(model: nn.Module, attention: str, heads: Heads) -> dict[str, Rule]:
    """Embeddings inside an attention module with one column per query head (T5's relative position bias): split by
    the rank's heads, as its q projection is, so the bias it adds to the scores has the rank's heads."""
    module = model.get_submodule(attention)
    return {f"{attention}.{name}": Rule("column", "q", Heads(heads.n_q, heads.n_kv, 1))
            for name, m in module.named_modules() if isinstance(m, nn.Embedding) and m.embedding_dim == heads.n_q}


def edge_rules(model: nn.Module, linears: dict[str, nn.Module], covered: dict[str, Rule]) -> dict[str, Rule]:
    """Vocab-parallel embedding and lm_head (found with the model's get_*_embeddings) and every embedding sharing the
    input embedding's weight (T5's and BART's encoder and decoder ``embed_tokens``), the rest replicated. A model
    without a token embedding (Wav2Vec2's get_input_embeddings raises ``NotImplementedError``) gets no input rule.

    Any ``nn.Embedding`` is split, subclasses included: the parallel embedding runs the module's own forward on its
    rows (see :class:`splice.tp.layers.VocabParallelEmbedding`), so one that scales in its forward (Gemma in
    transformers 5) is split like the others, and a tied lm_head stays tied to the same rows."""
    names = {id(m): n for n, m in model.named_modules()}
    embed = input_embeddings(model)  # the lookup the engine and calibration use, so they agree on "no embedding"
    head = getattr(model, "get_output_embeddings", lambda: None)()
    rules = {}
    for module, kind in ((embed, nn.Embedding), (head, nn.Linear)):
        if isinstance(module, kind) and id(module) in names:
            rules[names[id(module)]] = Rule("vocab")
    if isinstance(embed, nn.Embedding):  # an encoder-decoder's encoder and decoder embeddings share its weight
        rules.update({n: Rule("vocab") for n, m in model.named_modules()
                      if isinstance(m, nn.Embedding) and m is not embed and m.weight is embed.weight})
    rules.update({n: Rule("replicate") for n in linears if n not in covered and n not in rules})
    return rules


def common_parent(names: list[str]) -> str:
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for segments in zip(*parts):
        if len(set(segments)) > 1:
            break
        common.append(segments[0])
    return ".".join(common)
