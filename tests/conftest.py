"""Shared fixtures: tiny random-weight models built from transformers config classes, and the real default model."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    values = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def build_tiny(config, seed: int = 0, dtype=torch.float32):
    """A random-weight causal LM from a transformers config, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@pytest.fixture
def tiny_llama():
    return build_tiny(tiny_llama_config())


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32) and its tokenizer, from splice's converted cache."""
    from splice.models import load

    return load("smollm2-135m-instruct")
