"""Hugging Face ``generate`` under tensor parallelism, through ``engine.generate``: beam search and the other options
splice's native loop does not implement, on plain AutoTP models (HF generate directly) and on kernel-injected ones
(the native loop hands the request to HF generate on the fused model). Every rank gets the single-process HF tokens,
the same beam scores bit for bit, and — seeded differently before ``init_inference`` — the same beam-sampled tokens.

The cases run inside the shared tp=2 and tp=3 runs of ``tests.tp.suite`` (tp=3: uneven query heads, replicated KV).
"""
from __future__ import annotations

import pytest

from tests.tp import suite, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def check(results: list[dict], families: tuple, options: tuple) -> None:
    assert all(sorted(r) == sorted(f"{f}/{m}" for f in families for m in ("autotp", "inject")) for r in results)
    for key, first in results[0].items():
        for rank, per_rank in enumerate(results):
            r = per_rank[key]
            assert sorted(r["equal"]) == sorted(options) and all(r["equal"].values()), (rank, key, r["equal"])
            # the kernel-injected model stayed injected, and HF generate (not the native loop) served every request
            assert r["injected"] == key.endswith("inject") and not r["native_loop_ran"], (rank, key)
            assert r["embedding"] == "VocabParallelEmbedding", (rank, key)  # Gemma's scaled embedding included
            # the beams stay in step: identical scores and identical sampled beams on every rank
            assert r["beam_scores"] == first["beam_scores"] and r["beam_sampled"] == first["beam_sampled"], (rank, key)


def test_beam_search_and_other_hf_only_options_tp2():
    check([r["hf_generate"] for r in suite.tp2()], ("llama", "gemma"), tuple(workers.HF_ONLY_OPTIONS))


def test_beam_search_with_uneven_heads_tp3():
    check([r["hf_generate"] for r in suite.tp3()], ("llama",), ("beams",))
