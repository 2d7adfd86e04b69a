"""The tp=2 run shared by several test modules: started once per test session, on first use."""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from tests.tp import workers
from tests.tp.launch import run_ranks
from tests.arch.tiny_models import AUTOTP_FAMILIES as FAMILIES, MOE_FAMILIES, build

#: ALiBi given to each attention module as one plane per head of the whole model: folded into Falcon's mask, MPT's
#: position_bias (each rank must get its own heads' planes)
ALIBI_CASES = [("falcon:alibi", "autotp", {}), ("mpt", "autotp", {})]
#: mixtures of experts: AutoTP splits every expert's intermediate features and keeps the routers and one-output gates
MOE_CASES = [(family, "autotp", {}) for family in MOE_FAMILIES]
PARITY_CASES = [(family, mode, {}) for family in FAMILIES for mode in ("autotp", "policy")] + ALIBI_CASES
#: multi-head latent attention (DeepSeek-V3): low-rank downs kept whole, each projection split by heads at its width
LATENT_CASES = [("deepseek_v3", "autotp", {})]
PARITY_CASES += MOE_CASES + LATENT_CASES
#: at tp=3 also Falcon's new architecture (per-KV-group [q.., k, v] layout, 2 KV heads replicated over 3 ranks)
TP3_CASES = [*PARITY_CASES, ("falcon", "autotp", {"new_decoder_architecture": True, "num_kv_heads": 2})]
#: (family, config overrides); llama is saved in several files and loaded through its index JSON.
CHECKPOINT_MODELS = [("llama", {"tie_word_embeddings": True}), ("gpt2", {})]
SHARDED = {"llama": "model.safetensors.index.json"}
_ROOT = tempfile.TemporaryDirectory(prefix="splice-tp2-")


@functools.lru_cache(maxsize=1)
def tp2() -> list[dict]:
    """Per rank: {"distributed", "parity", "checkpoints", "bad"} results of ``workers.tp2_suite``."""
    root = Path(_ROOT.name)
    for family, overrides in CHECKPOINT_MODELS:
        size = "150KB" if family in SHARDED else "100GB"
        build(family, **overrides).save_pretrained(root / family / "hf", max_shard_size=size)
    return run_ranks(workers.tp2_suite, 2, PARITY_CASES, CHECKPOINT_MODELS, SHARDED, str(root), timeout=200)


def saved_files(family: str) -> list[str]:
    return sorted(p.name for p in (Path(_ROOT.name) / family / "tp").iterdir())


def hf_files(family: str) -> list[str]:
    return sorted(p.name for p in (Path(_ROOT.name) / family / "hf").glob("*.safetensors*"))


@functools.lru_cache(maxsize=1)
def tp3() -> list[dict]:
    """Per rank: {"parity", "fused"} results of ``workers.tp3_suite`` (uneven heads, replicated KV heads)."""
    return run_ranks(workers.tp3_suite, 3, TP3_CASES, timeout=220)
