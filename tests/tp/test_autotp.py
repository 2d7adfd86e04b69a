"""splice.tp.autotp: the tracing forward leaves the user's model and random stream as they were."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from splice.tp.autotp import trace_model


def tiny_llama_in_training() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, attention_dropout=0.5)
    model = LlamaForCausalLM(config)
    model.train()
    model.model.layers[1].eval()  # a mixed state must come back as it was
    return model


def test_trace_keeps_training_flags_and_the_random_stream():
    model = tiny_llama_in_training()
    flags = {name: module.training for name, module in model.named_modules()}
    state = torch.random.get_rng_state()
    trace = trace_model(model)
    assert torch.equal(torch.random.get_rng_state(), state)  # dropout did not draw from it
    assert {name: module.training for name, module in model.named_modules()} == flags
    assert trace.blocks  # it traced the blocks all the same


def test_trace_finds_the_same_blocks_in_training_and_eval_mode():
    model = tiny_llama_in_training()
    in_training = trace_model(model)
    model.eval()
    assert trace_model(model).blocks == in_training.blocks
