"""Which rows each rank owns: balanced splits, head groups (uneven, replicated KV), grains, fused layouts."""
from __future__ import annotations

import pytest

from splice.tp.split import Heads, balanced, grained, head_share, layout_ranges, row_order, unit_span


def test_balanced_puts_larger_parts_first():
    assert balanced(6, 4) == [2, 2, 1, 1]
    assert balanced(4, 3) == [2, 1, 1]
    assert balanced(8, 2) == [4, 4]


def test_uneven_kv_heads_carry_their_query_heads():
    heads = Heads(n_q=12, n_kv=6, head_dim=8)
    shares = [head_share(heads, 4, r) for r in range(4)]
    assert [s.kv for s in shares] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert [s.q for s in shares] == [(0, 4), (4, 8), (8, 10), (10, 12)]


def test_more_ranks_than_kv_heads_replicates_kv():
    shares = [head_share(Heads(8, 2, 8), 4, r) for r in range(4)]
    assert [s.kv for s in shares] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q for s in shares] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    uneven = [head_share(Heads(4, 2, 8), 3, r) for r in range(3)]  # kv 0 on ranks 0,1; kv 1 on rank 2
    assert [(s.q, s.kv) for s in uneven] == [((0, 1), (0, 1)), ((1, 2), (0, 1)), ((2, 4), (1, 2))]


def test_more_ranks_than_heads_is_refused():
    with pytest.raises(ValueError, match=r"tp_size=5 is larger than the model's 4 attention heads; allowed: 1..4"):
        head_share(Heads(4, 4, 8), 5, 0)
    with pytest.raises(ValueError, match="6 query heads cannot be grouped over 4"):
        head_share(Heads(6, 4, 8), 2, 0)


def test_grain_and_its_fallback():
    assert [unit_span(320, 4, r, 64) for r in range(4)] == [(0, 128), (128, 192), (192, 256), (256, 320)]
    assert [unit_span(128, 3, r, 64) for r in range(3)] == [(0, 43), (43, 86), (86, 128)]  # 2 grains < 3 ranks
    with pytest.raises(ValueError, match="a width of 2 cannot be split over tensor_parallel.tp_size=3"):
        unit_span(2, 3, 0, 1)


def test_fused_layouts():
    mha, gqa = Heads(4, 4, 2), Heads(4, 2, 2)
    assert layout_ranges("qkv", 24, 2, 1, mha) == ((4, 8), (12, 16), (20, 24))  # [q | k | v]
    assert layout_ranges("heads", 24, 2, 1, mha) == ((12, 24),)  # per head [q, k, v]
    assert layout_ranges("kv_groups", 16, 2, 1, gqa) == ((8, 16),)  # per KV group [q, q, k, v]
    assert layout_ranges("kv_groups", 16, 4, 1, gqa) == ((2, 8),)  # half a group: its q head + k, v (joined)
    assert layout_ranges("kv_groups", 16, 4, 0, gqa) == ((0, 2), (4, 8))
    assert layout_ranges("halves", 16, 2, 1, grain=1) == ((4, 8), (12, 16))  # [gate | up]
    assert layout_ranges("kv", 4, 4, 3, gqa) == ((2, 4),)


def test_vocabulary_rows_go_in_whole_grains_the_rest_on_the_last_rank():
    assert grained(1000, 2, 64) == [512, 488]  # 15 grains: 8 and 7, the last 40 rows on the last rank
    assert grained(1024, 3, 64) == [384, 320, 320]
    assert grained(100, 2, 64) == [50, 50]  # fewer grains than ranks: single rows


def test_layouts_with_the_same_row_order_split_alike():
    one_per_group = Heads(2, 2, 8)
    assert row_order("heads", one_per_group) == row_order("kv_groups", one_per_group) == ("q0", "k0", "v0", "q1",
                                                                                           "k1", "v1")
    assert row_order("qkv", one_per_group) == ("q0", "q1", "k0", "k1", "v0", "v1")
    assert row_order("kv_groups", Heads(4, 2, 8)) == ("q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1")
