"""4 real processes: uneven GQA (6 KV heads over 4 ranks -> 2,2,1,1), KV heads replicated when tp > KV heads, MLP
widths in grains (5 x 64 over 4 -> 2,1,1,1 grains), the shared config untouched; then world 4 = 2 replicas of tp 2."""
from __future__ import annotations

import pytest

from tests.tp import workers
from tests.tp.launch import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_uneven_heads_replicated_kv_and_data_parallel_replicas():
    results = run_ranks(workers.heads_then_replicas, 4, timeout=200)
    kv6 = [r["heads"]["kv6"] for r in results]
    assert [r["q_rows"] for r in kv6] == [4, 4, 2, 2]
    assert [r["kv_rows"] for r in kv6] == [2, 2, 1, 1]
    assert [r["mlp"] for r in kv6] == [128, 64, 64, 64]
    kv2 = [r["heads"]["kv2"] for r in results]
    assert [(r["q_rows"], r["kv_rows"], r["groups"]) for r in kv2] == [(2, 1, 2)] * 4
    for r in kv6 + kv2:
        assert r["max_diff"] < 1e-4 and r["tokens_equal"], r
    assert {tuple(r["config_heads"]) for r in kv6} == {(12, 6)}  # per-rank counts live on the modules only
    assert {tuple(r["config_heads"]) for r in kv2} == {(8, 2)}
    replicas = [r["replicas"] for r in results]
    assert [(r["tp_rank"], r["replica"], r["replicas"]) for r in replicas] == [(0, 0, 2), (1, 0, 2), (0, 1, 2),
                                                                               (1, 1, 2)]
    for r in replicas:
        assert r["max_diff"] < 1e-4 and r["tokens_equal"], r
