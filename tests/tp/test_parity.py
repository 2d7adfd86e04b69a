"""AutoTP and injection_policy on real processes (gloo): logits within 1e-4 of the single-process model, greedy
tokens identical, for every family at tp=2 and tp=3 (uneven heads: 4 over 3; KV heads replicated when tp > kv)."""
from __future__ import annotations

import pytest

from tests.tp import suite, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def check_parity(results: list[dict], cases: list) -> None:
    """Every case on every rank: logits within 1e-4, same greedy tokens, the plan's source, about 1/tp of the bytes
    (tiny models keep relatively large replicated norms and position tables, hence the loose bound)."""
    for rank, per_case in enumerate(results):
        assert len(per_case) == len(cases)
        for family, mode, overrides in cases:
            r = per_case[f"{family}/{mode}{overrides or ''}"]
            assert r["max_diff"] < 1e-4 and r["tokens_equal"], (rank, family, mode, r)
            assert r["plan"] == mode and r["param_ratio"] < 0.75, (rank, family, mode, r)


def test_every_family_matches_single_process_tp2():
    check_parity([r["parity"] for r in suite.tp2()], suite.PARITY_CASES)


def test_every_family_matches_single_process_tp3():
    check_parity([r["parity"] for r in suite.tp3()], suite.TP3_CASES)


def test_ranks_sample_the_same_tokens():
    first, second = (r["sampled"] for r in suite.tp2())
    assert first == second and len(first) == len(workers.PROMPT[0]) + 8


def test_shard_first_then_quantize_keeps_the_all_reduce():
    for r in (r["quantized"] for r in suite.tp2()):
        assert r["wrapper_kept"] and r["inner"] != "Linear" and r["quantized"] == 15, r
        assert r["max_diff"] < 1e-4 and r["tokens_equal"], r


def test_gptq_under_tensor_parallelism_needs_the_same_ids_on_every_rank():
    for r in (r["gptq"] for r in suite.tp2()):
        assert "calibration_ids differ between the ranks (1 of 2" in r["error"] and r["unchanged"], r
        assert r["max_diff"] < 0.1, r  # int4 of a tiny random model: close to the fp32 reference, not equal


def test_the_whole_pipeline_with_a_parallel_context():
    for r in (r["pipeline"] for r in suite.tp2()):
        assert r["max_diff"] < 1e-4 and r["tokens_equal"], r
        assert "shard" in r["steps"] and "place" in r["steps"], r


def test_ranks_reseeded_after_init_still_sample_the_same_tokens():
    first, second = (r["reseeded"] for r in suite.tp2())
    assert first["tokens"] == second["tokens"]
    assert first["group_size"] == second["group_size"] == 2  # engine.mp_group: the tensor-parallel group, not None


def test_attention_sinks_are_cut_to_each_rank_heads():
    """GPT-OSS at tp=2: each rank adds its own heads' sink logits; the same logits and tokens as one process."""
    for r in (r["sinks"] for r in suite.tp2()):
        assert r["max_diff"] < 1e-4 and r["tokens_equal"] and r["sinks"] == (2,), r
        assert r["from_hf"]["max_diff"] < 1e-4 and r["from_hf"]["tokens_equal"], r  # a meta model from its checkpoint
