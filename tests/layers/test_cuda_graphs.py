"""CUDA graph replay (``enable_cuda_graph=True``). The CUDA cases are skipped without a device;
``benchmarks/device_check.sh`` runs them on a lent GPU. The helpers that decide what a graph can give back run
everywhere."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

import splice
from splice.layers import cuda_graphs
from splice.layers.cuda_graphs import GraphReplayer, copy_out, signature, type_not_tensor

from ..arch.tiny_models import build_family, padded_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def test_signature_tells_shapes_dtypes_and_values_apart():
    a, b = torch.zeros(2, 3), torch.zeros(2, 4)
    assert signature((a, 1)) == signature((torch.ones(2, 3), 1))
    assert signature((a, 1)) != signature((b, 1))
    assert signature((a, 1)) != signature((a.long(), 1))
    assert signature((a, 1)) != signature((a, 2))


def test_only_outputs_made_of_tensors_can_come_back_from_a_graph():
    logits = torch.ones(1, 2)
    assert type_not_tensor(CausalLMOutputWithPast(logits=logits)) is None
    assert type_not_tensor((logits, [logits, None], {"x": 1.0})) is None
    assert type_not_tensor(CausalLMOutputWithPast(logits=logits, past_key_values=object())) == "object"


def test_copy_out_clones_every_tensor_and_keeps_the_output_class():
    logits = torch.ones(1, 2)
    out = copy_out(CausalLMOutputWithPast(logits=logits, hidden_states=(logits,)))
    assert isinstance(out, CausalLMOutputWithPast)
    assert torch.equal(out.logits, logits) and out.logits.data_ptr() != logits.data_ptr()
    assert out.hidden_states[0].data_ptr() != logits.data_ptr()


@needs_cuda
def test_replayer_replays_new_inputs_and_never_overwrites_a_returned_output(caplog):
    weight = torch.randn(8, 8, device="cuda")
    replayer = GraphReplayer(lambda x: x @ weight, "matmul")
    first_in, second_in = torch.randn(2, 8, device="cuda"), torch.randn(2, 8, device="cuda")
    with caplog.at_level(logging.INFO, logger="splice"):
        first = replayer(first_in)
        second = replayer(second_in)
    assert len(replayer.graphs) == 1 and "captured a CUDA graph of matmul" in caplog.text
    torch.testing.assert_close(first, first_in @ weight)
    torch.testing.assert_close(second, second_in @ weight)  # the replay, on the second call's inputs
    assert not torch.equal(first, second)
    replayer(torch.randn(3, 8, device="cuda"))  # another shape: another graph
    assert len(replayer.graphs) == 2


@needs_cuda
def test_replayer_runs_eagerly_what_it_cannot_capture(caplog, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 1)

    def synchronizes(x):
        return x * float(x.sum())  # a host read: not capturable

    replayer = GraphReplayer(synchronizes, "sync")
    x = torch.ones(4, device="cuda")
    with caplog.at_level(logging.INFO, logger="splice"):
        torch.testing.assert_close(replayer(x), x * 4)
        torch.testing.assert_close(replayer(x), x * 4)
    assert not replayer.graphs and "runs eagerly" in caplog.text


@needs_cuda
def test_generate_replays_the_decode_step_token_exact():
    model = build_family("llama").cuda()
    ids, mask = (t.cuda() for t in padded_batch(vocab=model.config.vocab_size))
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    engine = splice.init_inference(model, replace_with_kernel_inject=True, enable_cuda_graph=True,
                                   max_out_tokens=64)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    again = engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert engine.runtime.graphs is not None and engine.runtime.graphs.graphs


@needs_cuda
def test_engine_calls_replay_per_signature_and_are_timed_once_each():
    model = build_family("llama").cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), device="cuda")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    engine = splice.init_inference(model, enable_cuda_graph=True)
    engine.profile_model_time()
    first = engine(ids, use_cache=False).logits
    second = engine(ids.flip(1), use_cache=False).logits
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-4)
    assert not torch.equal(first, second)  # the second replay did not overwrite the first call's logits
    assert len(engine.model_times()) == 2


@pytest.mark.parametrize("tp, on_host, refused", [(2, False, "tp_size=2"), (1, True, "keep_module_on_host")])
def test_cuda_graphs_with_tensor_parallelism_or_host_weights_are_refused(tp, on_host, refused):
    from splice.config import InferenceConfig
    from splice.plan import check_graphs

    config = InferenceConfig(enable_cuda_graph=True, keep_module_on_host=on_host)
    with pytest.raises(ValueError, match=refused):
        check_graphs(config, torch.device("cuda"), tp)


@needs_cuda
def test_engine_call_with_a_cache_runs_eagerly_and_changes_the_cache_once():
    """A ``past_key_values`` cache is changed by every run: no warm-up or capture may run the call again."""
    model = build_family("llama").cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), device="cuda")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits[:, 5:]
    engine = splice.init_inference(model, enable_cuda_graph=True)
    first = engine(ids[:, :5], use_cache=True)
    second = engine(ids[:, 5:], past_key_values=first.past_key_values, use_cache=True)
    assert second.past_key_values.get_seq_length() == 9
    torch.testing.assert_close(second.logits, expected, rtol=1e-4, atol=1e-4)
