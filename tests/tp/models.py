"""Tiny random-weight models of each family AutoTP must handle (hidden 64, 2 layers, vocab 128)."""
from __future__ import annotations

import torch

#: gemma: its embedding scales by sqrt(hidden) in its own forward (transformers 5) and its lm_head is tied to it
FAMILIES = ("llama", "qwen2", "gpt2", "gpt_neox", "bloom", "falcon", "opt", "phi3", "gemma")


def tiny_config(family: str, **overrides):
    import transformers as T

    common = dict(vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    values = {
        "llama": lambda: T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                       **common),
        "qwen2": lambda: T.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                       **common),
        "gpt2": lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common),
        "gpt_neox": lambda: T.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=256, **common),
        "bloom": lambda: T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **common),
        "falcon": lambda: T.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **common),
        "phi3": lambda: T.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     **common),
        "gemma": lambda: T.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=256, tie_word_embeddings=True, **common),
        "opt": lambda: T.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                                   word_embed_proj_dim=64, max_position_embeddings=256, **common),
    }[family]()
    for key, value in overrides.items():
        setattr(values, key, value)
    return values


def build(family: str, seed: int = 0, meta: bool = False, **overrides):
    """A tiny random model of ``family`` in eval mode (on the meta device with ``meta=True``)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config).eval()
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
