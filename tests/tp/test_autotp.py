"""splice.tp.autotp: the tracing forward leaves the user's model and random stream as they were; a model without a
token embedding gets a plan without an input vocab rule."""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from splice.tp.autotp import autotp_plan, edge_rules, trace_model
from splice.tp.plan import Rule, verify


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


class NoTokenInputs(LlamaForCausalLM):
    """A Llama whose get_input_embeddings raises as transformers' Wav2Vec2 does for a model fed no token ids."""

    def get_input_embeddings(self):
        raise NotImplementedError


def test_edge_rules_read_a_raising_get_input_embeddings_as_no_embedding():
    class Speech(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.head = nn.Linear(8, 32)

        def get_input_embeddings(self):
            raise NotImplementedError

        def get_output_embeddings(self):
            return self.head

    model = Speech()
    linears = {"proj": model.proj, "head": model.head}
    assert edge_rules(model, linears, {}) == {"head": Rule("vocab"), "proj": Rule("replicate")}


def test_autotp_plan_for_a_model_without_token_embedding_has_no_input_vocab_rule():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    model = NoTokenInputs(config).eval()
    plan = autotp_plan(model)
    # transformers' get_output_embeddings also answers None when get_input_embeddings raises: both stay whole
    assert not [name for name, rule in plan.rules.items() if rule.style == "vocab"]
    assert plan.rules["lm_head"] == Rule("replicate")
    assert plan.rules["model.layers.*.self_attn.o_proj"].style == "row"
    assert verify(plan, model, 2)["model.layers.1.mlp.down_proj"].style == "row"  # runs as two ranks would hold it
