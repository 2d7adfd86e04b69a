"""The arithmetic of sharding: which rows (or columns) of a tensor each rank owns.

Everything here is a pure function of sizes, so it is the same on every rank, on the meta device and when slicing a
checkpoint. A shard is a tuple of half-open ``(start, stop)`` ranges along one dimension; fused tensors (e.g. a
``[q | k | v]`` projection) give several ranges, concatenated in order.
"""
from __future__ import annotations

from dataclasses import dataclass

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Heads:
    """The attention shape of one block: query heads, key/value heads, head size."""

    n_q: int
    n_kv: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_q // self.n_kv


@dataclass(frozen=True)
class HeadShare:
    """The heads one rank owns: query heads ``q[0]:q[1]``, key/value heads ``kv[0]:kv[1]``."""

    q: tuple[int, int]
    kv: tuple[int, int]

    @property
    def n_q(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def n_kv(self) -> int:
        return self.kv[1] - self.kv[0]


def balanced(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` whole sizes differing by at most one, larger ones first (6 over 4: 2,2,1,1)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def grained(total: int, parts: int, grain: int) -> list[int]:
    """``total`` rows over ``parts`` in whole units of ``grain`` (balanced, larger first), the rows past the last whole
    unit on the last part (1000 over 2 by 64: 512, 488); balanced single rows when there are fewer units than parts."""
    units = total // grain
    if units < parts:
        return balanced(total, parts)
    sizes = [count * grain for count in balanced(units, parts)]
    sizes[-1] += total - units * grain
    return sizes


def span(sizes: list[int], index: int) -> tuple[int, int]:
    """The ``(start, stop)`` of part ``index`` when parts of ``sizes`` are laid end to end."""
    start = sum(sizes[:index])
    return start, start + sizes[index]


def head_share(heads: Heads, tp: int, rank: int) -> HeadShare:
    """Whole key/value groups per rank, query heads following their key/value head.

    With at least as many KV heads as ranks, KV heads are split unevenly by whole heads (6 over 4: 2,2,1,1).
    With fewer, each KV head is replicated on ``tp / n_kv`` ranks (unevenly) and its query heads split among them.
    """
    check_heads(heads, tp)
    if heads.n_kv >= tp:
        k0, k1 = span(balanced(heads.n_kv, tp), rank)
        return HeadShare((k0 * heads.group, k1 * heads.group), (k0, k1))
    ranks_per_kv = balanced(tp, heads.n_kv)
    kv, first = next((j, sum(ranks_per_kv[:j])) for j in range(heads.n_kv) if rank < sum(ranks_per_kv[: j + 1]))
    q0, q1 = span(balanced(heads.group, ranks_per_kv[kv]), rank - first)
    base = kv * heads.group
    return HeadShare((base + q0, base + q1), (kv, kv + 1))


def check_heads(heads: Heads, tp: int) -> None:
    if heads.n_kv < 1 or heads.n_q % heads.n_kv:
        raise ValueError(f"{heads.n_q} query heads cannot be grouped over {heads.n_kv} key/value heads; the number "
                         "of query heads must be a multiple of the number of key/value heads")
    if tp > heads.n_q:
        raise ValueError(f"tensor_parallel.tp_size={tp} is larger than the model's {heads.n_q} attention heads; "
                         f"allowed: 1..{heads.n_q}")


def unit_span(total: int, tp: int, rank: int, grain: int) -> tuple[int, int]:
    """A rank's part of a width split in units of ``grain`` (e.g. MLP columns by 64); falls back to single columns
    when the width is not a multiple of ``grain`` or has fewer than ``tp`` grains."""
    if total < tp:
        raise ValueError(f"a width of {total} cannot be split over tensor_parallel.tp_size={tp} ranks; "
                         f"allowed: tp_size <= {total}")
    if total % grain or total // grain < tp:
        grain = 1
    start, stop = span(balanced(total // grain, tp), rank)
    return start * grain, stop * grain


#: Layouts of the sharded dimension. ``plain``: one run of units (MLP columns, vocabulary rows). ``q``/``kv``: query or
#: key/value heads. ``qkv``: ``[q heads | k heads | v heads]``. ``heads``: per head ``[q, k, v]`` (BLOOM, GPT-NeoX).
#: ``kv_groups``: per KV group ``[its q heads, k, v]`` (Falcon's new architecture). ``halves``: ``[gate | up]``.
LAYOUTS = ("plain", "q", "kv", "qkv", "heads", "kv_groups", "halves")
HEAD_LAYOUTS = ("q", "kv", "qkv", "heads", "kv_groups")


def layout_ranges(layout: str, size: int, tp: int, rank: int, heads: Heads | None = None,
                  grain: int = 1) -> Ranges:
    """The ranges of a dimension of ``size`` that ``rank`` owns under ``layout``."""
    if layout == "plain":
        return (unit_span(size, tp, rank, grain),)
    if layout == "halves":
        start, stop = unit_span(size // 2, tp, rank, grain)
        return (start, stop), (size // 2 + start, size // 2 + stop)
    share, hd = head_share(heads, tp, rank), heads.head_dim
    if layout == "q":
        return ((share.q[0] * hd, share.q[1] * hd),)
    if layout == "kv":
        return ((share.kv[0] * hd, share.kv[1] * hd),)
    if layout == "qkv":
        k_base, v_base = heads.n_q * hd, (heads.n_q + heads.n_kv) * hd
        return ((share.q[0] * hd, share.q[1] * hd), (k_base + share.kv[0] * hd, k_base + share.kv[1] * hd),
                (v_base + share.kv[0] * hd, v_base + share.kv[1] * hd))
    if layout == "heads":
        return ((share.q[0] * 3 * hd, share.q[1] * 3 * hd),)
    if layout == "kv_groups":
        return merge(_kv_group_ranges(heads, share))
    raise ValueError(f"unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}")


def row_order(layout: str, heads: Heads) -> tuple[str, ...]:
    """The head each ``head_dim`` rows of a fused q/k/v projection belong to under ``layout`` (``"q0", "k0", ...``):
    layouts with the same order split alike (with one query head per KV head, ``heads`` is ``kv_groups``)."""
    q = [f"q{i}" for i in range(heads.n_q)]
    k, v = [f"k{j}" for j in range(heads.n_kv)], [f"v{j}" for j in range(heads.n_kv)]
    if layout == "qkv":
        return (*q, *k, *v)
    if layout == "heads":
        return tuple(row for i in range(heads.n_q) for row in (q[i], k[i], v[i]))
    if layout == "kv_groups":
        return tuple(row for j in range(heads.n_kv) for row in (*q[j * heads.group:(j + 1) * heads.group], k[j], v[j]))
    raise ValueError(f"{layout!r} is no fused q/k/v layout; allowed: qkv, heads, kv_groups")


def _kv_group_ranges(heads: Heads, share: HeadShare) -> list[tuple[int, int]]:
    hd, g = heads.head_dim, heads.group
    out = []
    for kv in range(*share.kv):
        base = kv * (g + 2) * hd
        q0, q1 = max(share.q[0], kv * g) - kv * g, min(share.q[1], (kv + 1) * g) - kv * g
        out += [(base + q0 * hd, base + q1 * hd), (base + g * hd, base + (g + 2) * hd)]
    return out


def merge(ranges: list[tuple[int, int]]) -> Ranges:
    """Adjacent ranges joined: ``[(0, 4), (4, 8)] -> ((0, 8),)``."""
    out: list[tuple[int, int]] = []
    for start, stop in ranges:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        elif stop > start:
            out.append((start, stop))
    return tuple(out)


def width(ranges: Ranges) -> int:
    return sum(stop - start for start, stop in ranges)
