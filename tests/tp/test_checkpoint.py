"""Per-rank loading from a meta model + HF safetensors folder (only this rank's slices), save_mp_checkpoint_path and
reloading the saved shards: identical logits; tied embeddings stay tied; GPT-2's transposed Conv1D weights; a
checkpoint in several files loaded through its index JSON."""
from __future__ import annotations

import pytest

from tests.tp import suite

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_meta_model_loads_its_slices_and_saved_shards_reload():
    for per_model in (r["checkpoints"] for r in suite.tp2()):
        assert set(per_model) == {family for family, _ in suite.CHECKPOINT_MODELS}
        for family, r in per_model.items():
            assert r["first"]["max_diff"] < 1e-4 and r["first"]["tokens_equal"], (family, r)
            assert r["reloaded"]["tokens_equal"] and r["bitwise_same"], (family, r)
            assert r["tied"] and not r["meta_left"], (family, r)
            assert r["loaded"].endswith(suite.SHARDED.get(family, "hf")), (family, r)
    assert len(suite.hf_files("llama")) > 2  # several files + the index: loaded through the index JSON
    assert suite.saved_files("llama") == ["splice_tp.json", "tp2-rank0.safetensors", "tp2-rank1.safetensors"]


def test_shards_reload_at_the_grain_they_were_cut_with():
    for rank, r in enumerate(suite.tp2()):
        assert r["grain"]["mlp_columns"] == (64, 32)[rank], r  # grain 32 splits 96 columns unevenly; 64 would not
        assert r["grain"]["vocab_rows"] == ((96, 64)[rank],) * 2, r  # the vocabulary too, saved and reloaded
        assert r["grain"]["saved"]["tokens_equal"] and r["grain"]["reloaded"]["tokens_equal"], r
        assert r["grain"]["reloaded"]["max_diff"] < 1e-4, r
        assert "cut with tensor_parallel.tp_grain_size=32, but tp_grain_size=64" in r["grain"]["other_grain"], r


def test_experts_split_by_rank_are_saved_and_reload():
    """Mixtral and Qwen2-MoE sharded in memory (each expert's 128 or 64 features split in two), saved with
    save_mp_checkpoint_path and reloaded into meta models, and meta models filled from the Hugging Face checkpoint's
    per-expert tensors (stacked by transformers' conversion, each rank copying its slice): the same tokens and
    logits as the whole model; sharded
    then quantized, the same as the whole model quantized (the experts keep their all-reduce, also after a native
    call for their bf16 decode rows)."""
    for r in (r["experts"] for r in suite.tp2()):
        for family, whole in (("mixtral", 128), ("qwen2_moe", 64)):
            case = r[family]
            assert case["first"]["tokens_equal"] and case["first"]["max_diff"] < 1e-4, (family, case)
            assert case["reloaded"]["tokens_equal"] and case["reloaded"]["max_diff"] < 1e-4, (family, case)
            assert case["from_hf"]["tokens_equal"] and case["from_hf"]["max_diff"] < 1e-4, (family, case)
            assert case["hf_features"] == whole // 2, (family, case)
            assert case["features"] == (whole // 2, whole // 2) and not case["meta_left"], (family, case)
            assert case["quantized"]["tokens_equal"] and case["quantized"]["max_diff"] < 1e-4, (family, case)
            assert case["quantized_hooks"] == 1, (family, case)
            # bf16 decode rows through the rank's experts in one native call, then the all-reduce: the whole
            # module's result but for each rank's sum rounded to bf16 apart
            assert case["native_bf16"] is None or case["native_bf16"] < 0.02, (family, case)
