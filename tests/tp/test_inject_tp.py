"""Kernel injection under tensor parallelism on real processes (gloo): ``init_inference(model,
tensor_parallel={"tp_size": N}, replace_with_kernel_inject=True)`` on every family with a fused-block record, at tp=2
and tp=3 (4 query heads over 3 ranks: 1, 1, 2 per rank, the 2 KV heads replicated), against the single-process
unmodified Hugging Face model.

The cases run inside the shared tp=2 and tp=3 runs of ``tests.tp.suite`` (process start-up dominates on 2 cores).
"""
from __future__ import annotations

import pytest

from tests.arch.tiny_models import FAMILIES
from tests.tp import suite, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: per-rank (query heads, KV heads) of the tiny models (4 query / 2 KV heads everywhere)
SHAPES = {2: [(2, 1), (2, 1)], 3: [(1, 1), (1, 1), (2, 1)]}


def check_fused(results: list[dict], tp: int) -> None:
    for rank, per_family in enumerate(results):
        assert sorted(per_family) == sorted(FAMILIES), rank
        for family, r in per_family.items():
            where = (tp, rank, family, r)
            # logits within 1e-4 (scaled by the logit std), through HF's forward and through splice's native path
            assert r["hf_forward"] < 1e-4 and r["native"] < 1e-4, where
            # greedy tokens of engine.generate (the native loop, left-padded batch of 3) equal HF's single process
            assert r["tokens_equal"] and r["native_loop"], where
            assert tuple(r["shape"]) == SHAPES[tp][rank], where
            assert tuple(r["config_heads"]) == (4, 2), where  # per-rank counts live in the blocks only
            # exactly two all-reduces per block (after o and after down); the vocab-parallel embedding adds one
            assert r["all_reduce"] - r["embed_all_reduce"] == 2 * r["layers"], where
            assert r["modules"][2:] == ["RowParallelLinear", "RowParallelLinear"], where
            # vocab-parallel embedding and lm_head in every family, Gemma's (which scales by sqrt(hidden) in its own
            # forward, and is tied to its lm_head) included: one all-reduce in the embedding, one all-gather in the head
            assert r["modules"][:2] == ["VocabParallelEmbedding", "VocabParallelLinear"], where
            assert (r["embed_all_reduce"], r["all_gather"]) == (1, 1), where
            assert r["tied"] == (family == "gemma"), where  # the tiny Gemma ties its lm_head; the others do not


def test_every_fused_family_matches_single_process_tp2():
    check_fused([r["fused"] for r in suite.tp2()], 2)


def test_every_fused_family_matches_single_process_tp3():
    check_fused([r["fused"] for r in suite.tp3()], 3)


def check_other_families(results: list[dict], tp: int, variants: tuple) -> None:
    """The other families' variants: parity, greedy tokens, each rank's heads as the split gives them, two
    all-reduces a block."""
    from splice.tp.split import Heads, head_share

    for rank, per_family in enumerate(results):
        assert sorted(per_family) == sorted(variants), rank
        for family, r in per_family.items():
            where = (tp, rank, family, r)
            assert r["hf_forward"] < 1e-4 and r["native"] < 1e-4, where
            assert r["tokens_equal"] and r["native_loop"], where
            n_q, n_kv = r["config_heads"]
            share = head_share(Heads(n_q, n_kv, 16), tp, rank)
            assert tuple(r["shape"]) == (share.n_q, share.n_kv), where
            assert r["all_reduce"] - r["embed_all_reduce"] == 2 * r["layers"], where
            assert r["modules"] == ["VocabParallelEmbedding", "VocabParallelLinear", "RowParallelLinear",
                                    "RowParallelLinear"], where


def test_other_families_match_single_process_tp2():
    check_other_families([r["fused_families"] for r in suite.tp2()], 2, workers.TP_VARIANTS)


def test_multi_query_and_alibi_match_single_process_tp3():
    check_other_families([r["fused_families"] for r in suite.tp3()], 3, workers.TP3_VARIANTS)


def test_compiled_decode_step_runs_under_tensor_parallelism():
    """compile_decode=True at tp=2: each rank's compiled step (collectives traced in, no graph breaks) gives HF's
    single-process greedy tokens."""
    for rank, result in enumerate(r["fused_extra"]["compiled"] for r in suite.tp2()):
        assert result == {"tokens_equal": True, "compiled": True, "graph_breaks": 0}, (rank, result)


def test_native_loop_samples_the_same_tokens_on_every_rank():
    """Ranks seeded differently before init_inference: the tensor_parallel step gives all rank 0's RNG state, and
    the native loop draws in step."""
    first, second = (r["fused_extra"]["sampled"] for r in suite.tp2())
    assert first == second and len(first) == len(workers.PROMPT[0]) + 8


def test_wrapped_16_bit_linears_keep_the_collectives():
    """bf16 on CPU: only the plain linears inside the row/vocab-parallel wrappers are wrapped (native GEMV, or packed
    for oneDNN without native kernels)."""
    import torch

    from splice.layers.native_linear import can_use_native
    from splice.layers.packed_linear import can_pack

    for r in (r["fused_extra"] for r in suite.tp2()):
        assert r["o"] == "RowParallelLinear" and r["head"] == "VocabParallelLinear", r
        if can_use_native(torch.bfloat16, "cpu"):
            assert r["o_inner"] == r["qkv"] == r["head_inner"] == "NativeLinear", r
        elif can_pack(torch.bfloat16, "cpu"):
            assert r["o_inner"] == r["qkv"] == r["head_inner"] == "PackedLinear", r
        assert r["all_reduce"] == 5 and r["bf16_error"] < 0.05, r  # 2 layers x 2 + the embedding


def test_meta_model_from_a_checkpoint_then_fused():
    """Each rank loads only its slices (tensor_parallel step), then kernel injection runs on them."""
    for r in (r["fused_extra"]["checkpoint"] for r in suite.tp2()):
        assert r["injected"] and r["tied"] and not r["meta_left"], r
        assert r["max_diff"] < 1e-4 and r["tokens_equal"], r
