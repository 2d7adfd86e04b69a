"""Kernel injection under tensor parallelism on real processes (gloo): ``init_inference(model,
tensor_parallel={"tp_size": N}, replace_with_kernel_inject=True)`` on every family with a fused-block record
(mixtures of experts: AutoTP's plan, their experts split by features), at tp=2 and tp=3 (4 query heads over 3
ranks: 1, 1, 2 per rank, the 2 KV heads replicated), against the single-process unmodified Hugging Face model.

The cases run inside the shared tp=2 and tp=3 runs of ``tests.tp.suite`` (process start-up dominates on 2 cores).
"""
from __future__ import annotations

import pytest

from tests.arch.tiny_models import FAMILIES, build_family
from tests.tp import suite, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def check_fused(results: list[dict], tp: int, families: tuple = FAMILIES) -> None:
    from splice.arch import lookup, model_dims
    from splice.layers.experts import is_experts
    from splice.tp.plan import experts_layout
    from splice.tp.split import Heads, head_share

    for rank, per_family in enumerate(results):
        assert sorted(per_family) == sorted(families), rank
        for family, r in per_family.items():
            where = (tp, rank, family, r)
            # logits within 1e-4 (scaled by the logit std), through HF's forward and through splice's native path
            assert r["hf_forward"] < 1e-4 and r["native"] < 1e-4, where
            # greedy tokens of engine.generate (the native loop, left-padded batch of 3) equal HF's single process
            assert r["tokens_equal"] and r["native_loop"], where
            # each rank's heads as the split gives them (4 query / 2 KV heads over 3 ranks: 1, 1, 2 query heads, the
            # KV heads replicated); the config keeps the model's counts (per-rank counts live in the blocks only)
            config = build_family(family).config
            dims = model_dims(lookup(config), config)
            assert tuple(r["config_heads"]) == (dims.n_heads, dims.n_kv_heads), where
            share = head_share(Heads(dims.n_heads, dims.n_kv_heads, dims.head_dim), tp, rank)
            assert tuple(r["shape"]) == (share.n_q, share.n_kv), where
            # exactly two all-reduces per block (after o and after down, or a mixture of experts' experts module),
            # a shared expert's down projection one more; experts a split would change (GPT-OSS's biased ones) stay
            # whole on every rank, with none after them; the vocab-parallel embedding adds one
            whole_experts = any(is_experts(m) and experts_layout(m) is None for m in build_family(family).modules())
            per_block = 1 if whole_experts else 3 if r["shared_expert"] else 2
            assert r["all_reduce"] - r["embed_all_reduce"] == per_block * r["layers"], where
            mlp = "NoneType" if lookup(config).moe else "RowParallelLinear"  # the layer's own module stays as it is
            assert r["modules"][2:] == ["RowParallelLinear", mlp], where
            # vocab-parallel embedding and lm_head in every family, Gemma's (which scales by sqrt(hidden) in its own
            # forward, and is tied to its lm_head) included: one all-reduce in the embedding, one all-gather in the
            # head; a tied head (the tiny Gemma's, GPT-2's, ...) still shares the embedding's rows
            assert r["modules"][:2] == ["VocabParallelEmbedding", "VocabParallelLinear"], where
            assert (r["embed_all_reduce"], r["all_gather"]) == (1, 1), where
            assert r["tied"] == config.tie_word_embeddings, where


def test_every_fused_family_matches_single_process_tp2():
    check_fused([r["fused"] for r in suite.tp2()], 2)


def test_every_fused_family_matches_single_process_tp3():
    check_fused([r["fused"] for r in suite.tp3()], 3)


def test_other_families_match_single_process_tp2():
    """Per-head and multi-query fused q/k/v (the shared K/V head replicated), Conv1D, post-norm with OPT's
    projections, ALiBi, soft-capping, Gemma 3's language model inside its multimodal model."""
    check_fused([r["fused_families"] for r in suite.tp2()], 2, workers.TP_VARIANTS)


def test_multi_query_grouped_and_alibi_match_single_process_tp3():
    """Uneven heads: the shared K/V head replicated on every rank, a KV group's query heads split over two ranks;
    each rank's ALiBi slopes follow its heads."""
    check_fused([r["fused_families"] for r in suite.tp3()], 3, workers.TP3_VARIANTS)


def test_encoders_match_single_process_tp2():
    """BERT, RoBERTa and DistilBERT with a task head at tp=2, kernel-injected (the record's plan: fused bidirectional
    blocks, 2 of 4 heads a rank, o/down row-parallel: two all-reduces a block, embeddings and heads replicated; no
    decode runtime) and through AutoTP, against the single-process model; int8 weights on the fused shards agree."""
    for rank, results in enumerate(r["encoders"] for r in suite.tp2()):
        for name, _ in workers.TP_ENCODERS:
            where = (rank, name)
            fused, autotp, int8 = (results[(name, mode)] for mode in ("inject", "autotp", "inject_int8"))
            assert fused["error"] < 1e-4 and autotp["error"] < 1e-4, (where, fused, autotp)
            assert fused["shape"] == [(2, 2)] * 2 and fused["all_reduce"] == 2 * fused["blocks"], (where, fused)
            assert fused["row_parallel"] == ["RowParallelLinear"] * 4 and not fused["runtime"], (where, fused)
            assert autotp["blocks"] == 0, (where, autotp)
            assert int8["relative"] < 0.05 and int8["row_parallel"] == ["RowParallelLinear"] * 4, (where, int8)


def test_encoders_split_uneven_heads_at_tp3():
    """4 heads over 3 ranks (2, 1, 1): each rank's fused bidirectional blocks take its share, the output matches the
    single-process model."""
    ranks = [r["encoders"] for r in suite.tp3()]
    for name, _ in workers.TP_ENCODERS:
        fused = [results[(name, "inject")] for results in ranks]
        assert all(f["error"] < 1e-4 and f["all_reduce"] == 2 * f["blocks"] for f in fused), (name, fused)
        assert [f["shape"] for f in fused] == [[(h, h)] * 2 for h in (2, 1, 1)], (name, fused)


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
