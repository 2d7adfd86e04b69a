"""One record per architecture family. Adding a family = adding a record here + a parity test."""
from __future__ import annotations

from .record import ArchRecord

LLAMA = ArchRecord(model_type="llama")

MISTRAL = ArchRecord(model_type="mistral", sliding_window=True)

QWEN2 = ArchRecord(model_type="qwen2", sliding_window=True)  # q/k/v biases come from the checkpoint

QWEN3 = ArchRecord(model_type="qwen3", sliding_window=True, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")

PHI3 = ArchRecord(model_type="phi3", qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj", sliding_window=True)

GEMMA = ArchRecord(model_type="gemma", norm_offset=1.0, embed_scale=True)

RECORDS: tuple[ArchRecord, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA)
