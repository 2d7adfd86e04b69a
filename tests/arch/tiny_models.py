"""Tiny random-weight models of every family with an architecture record, built from transformers config classes.

Each config switches on the family's variant (sliding window, qkv bias, qk-norm, fused projections with partial
rotary, Gemma's norm offset and embedding scale), and norm weights and biases are randomised so none is trivial.
"""
from __future__ import annotations

import torch

from ..conftest import build_tiny

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def family_config(model_type: str):
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    configs = {
        "llama": lambda: LlamaConfig(**COMMON),
        "mistral": lambda: MistralConfig(**COMMON, sliding_window=6),
        "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1),
        "qwen3": lambda: Qwen3Config(**{**COMMON, "num_hidden_layers": 2}, head_dim=32),
        "phi3": lambda: Phi3Config(**COMMON, partial_rotary_factor=0.5),
        "gemma": lambda: GemmaConfig(**{**COMMON, "tie_word_embeddings": True}, head_dim=32),
    }
    return configs[model_type]()


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")


def build_family(model_type: str, seed: int = 0, dtype=torch.float32):
    """The tiny model of ``model_type`` with its norm weights and biases randomised (deterministic in ``seed``)."""
    model = build_tiny(family_config(model_type), seed=seed, dtype=dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator).to(param.dtype))
    return model


def padded_batch(batch: int = 3, length: int = 10, vocab: int = 128, seed: int = 0):
    """Left-padded ``input_ids`` and ``attention_mask``: row i has ``3 * i`` pads (pad id 0)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : 3 * row] = 0
    return ids.masked_fill(mask == 0, 0), mask


def assert_bf16_injection_close_to_hf(reference, engine) -> None:
    """A bf16 injected engine against its bf16 HF reference on a padded batch: logits within 5 % of the logit std
    and argmax agreement above 90 % on real tokens (bf16 rounding differs, so not exact)."""
    ids, mask = padded_batch()
    with torch.inference_mode():
        expected = reference(ids, attention_mask=mask).logits.float()
        got = engine(ids, attention_mask=mask).logits.float()
    real = mask.bool()
    assert ((expected - got).abs()[real].max() / expected.std()).item() < 0.05
    assert (expected.argmax(-1) == got.argmax(-1))[real].float().mean() > 0.9
