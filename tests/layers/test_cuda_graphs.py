"""CUDA graph replay (``enable_cuda_graph=True``). The CUDA cases are skipped without a device;
``benchmarks/device_check.sh`` runs them on a lent GPU. The helpers that decide what a graph can give back run
everywhere, and so do the cases over :func:`emulated_graphs`: torch.cuda's graph API played on the CPU, where a
capture records the operators its body runs and a replay runs those operators again, not the Python code around them,
as a CUDA graph does."""
from __future__ import annotations

import collections
import contextlib
import copy
import gc
import logging
import threading
import time
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.modeling_outputs import CausalLMOutputWithPast

import splice
import splice.plan
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
def test_replayer_runs_eagerly_what_it_cannot_capture(caplog):
    """A host read fails the capture: the call runs eagerly, says why, and leaves the caller on its own stream (the
    failed capture's stream stays current in torch.cuda.graph)."""

    def synchronizes(x):
        return x * float(x.sum())  # a host read: not capturable

    replayer = GraphReplayer(synchronizes, "sync")
    x = torch.ones(4, device="cuda")
    stream = torch.cuda.current_stream()
    with caplog.at_level(logging.INFO, logger="splice"):
        torch.testing.assert_close(replayer(x), x * 4)
        torch.testing.assert_close(replayer(x), x * 4)
    assert not replayer.graphs and "runs eagerly" in caplog.text and "capture failed" in caplog.text
    assert torch.cuda.current_stream() == stream
    assert torch.randn(4, device="cuda").shape == (4,)  # the device's generator left the failed capture's phase


@needs_cuda
def test_signatures_past_max_graphs_run_eagerly_and_say_so(caplog):
    weight = torch.randn(8, 8, device="cuda")
    replayer = GraphReplayer(lambda x: x @ weight, "matmul", max_graphs=1)
    small, large = torch.randn(2, 8, device="cuda"), torch.randn(3, 8, device="cuda")
    with caplog.at_level(logging.INFO, logger="splice"):
        replayer(small)
        torch.testing.assert_close(replayer(large), large @ weight)
    assert len(replayer.graphs) == 1 and "(3, 8) float32 runs eagerly" in caplog.text
    torch.testing.assert_close(replayer(small), small @ weight)


@needs_cuda
def test_static_inputs_take_calls_in_and_out_of_inference_mode():
    weight = torch.randn(8, 8, device="cuda")
    replayer = GraphReplayer(lambda x: x @ weight, "matmul")
    x = torch.randn(2, 8, device="cuda")
    with torch.inference_mode():
        replayer(torch.randn(2, 8, device="cuda"))  # captured on an inference tensor
    torch.testing.assert_close(replayer(x), x @ weight)


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
        expected_flipped = model(ids.flip(1), use_cache=False).logits
    engine = splice.init_inference(model, enable_cuda_graph=True)
    engine.profile_model_time()
    first = engine(ids, use_cache=False).logits
    second = engine(ids.flip(1), use_cache=False).logits
    assert len(engine._forward_graphs.graphs) == 1  # captured by the first call, replayed by the second
    torch.testing.assert_close(second, expected_flipped, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-4)  # not overwritten by the second replay
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


def test_copy_out_keeps_a_named_tuple():
    Pair = collections.namedtuple("Pair", "logits hidden")
    logits = torch.ones(1, 2)
    out = copy_out(Pair(logits, None))
    assert isinstance(out, Pair) and out.hidden is None and out.logits.data_ptr() != logits.data_ptr()


# ---- torch.cuda's graph API played on the CPU ----------------------------------------------------------------------
#: operators that read a device tensor on the host (a synchronisation): a CUDA capture fails on them
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.equal.default,
              torch.ops.aten.is_nonzero.default, torch.ops.aten.masked_select.default}


class RecordedOps(TorchDispatchMode):
    """Records each operator a capture runs, with its arguments and results (the tensors themselves)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise RuntimeError(f"operation not permitted when stream is capturing ({func})")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


class EmulatedGraph:
    """A replay runs the recorded operators again on the captured tensors and writes each result into the tensor the
    capture made for it, as a CUDA graph's kernels write the same memory each replay. A result that shares an input's
    memory (a view, an in-place operator's) was written there already; one that does not gets the fresh values, also
    where the operator may alias (``to`` a new dtype copies)."""

    def __init__(self):
        self.ops = []

    def replay(self):
        with torch.inference_mode():  # a graph writes its memory whatever the tensors' flags
            for func, args, kwargs, out in self.ops:
                again = func(*args, **kwargs)
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)}
                for captured, fresh in zip(tree_flatten(out)[0], tree_flatten(again)[0]):
                    if isinstance(captured, torch.Tensor) and captured.untyped_storage().data_ptr() not in inputs:
                        captured.copy_(fresh)


class EmulatedStreams:
    """The current stream, as torch.cuda keeps it per thread."""

    def __init__(self):
        self.current = self.Stream()

    class Stream:
        def wait_stream(self, other):
            pass

    def set_stream(self, stream):
        self.current = stream

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        yield
        self.current = before


class EmulatedCapture:
    """``torch.cuda.graph`` as torch writes it: its stream current during the capture, restored on exit unless ending
    the capture raises (as it does after a failure inside it)."""

    capturing = False

    def __init__(self, graph, streams, pool=None):
        self.graph, self.streams, self.recorder = graph, streams, RecordedOps()

    def __enter__(self):
        self.before, self.streams.current = self.streams.current, EmulatedStreams.Stream()
        EmulatedCapture.capturing = True
        EmulatedGenerator.default.state.capturing = True
        self.recorder.__enter__()

    def __exit__(self, kind, error, traceback):
        self.recorder.__exit__(kind, error, traceback)
        EmulatedCapture.capturing = False
        if error is not None:  # torch raises before its generators leave their capture phase
            raise RuntimeError("operation failed due to a previous error during capture")
        EmulatedGenerator.default.state.capturing = False
        self.graph.ops = self.recorder.ops
        self.streams.current = self.before


class EmulatedGenerator:
    """A device's default generator as a capture sees it: a capture puts its state in the capture phase and a capture
    that ends normally takes it out; ``clone_state`` and ``graphsafe_set_state`` as torch.Generator's."""

    default: EmulatedGenerator

    class State:
        capturing = False

    def __init__(self, state=None):
        self.state = state or self.State()

    def clone_state(self):
        return EmulatedGenerator()

    def graphsafe_set_state(self, other):
        self.state = other.state


@pytest.fixture
def emulated_graphs(monkeypatch):
    """torch.cuda's graph API on the CPU, and CUDA graphs allowed there (``init_inference`` refuses them)."""
    streams = EmulatedStreams()
    for name, value in dict(Stream=EmulatedStreams.Stream, current_stream=lambda: streams.current,
                            stream=streams.stream, set_stream=streams.set_stream, synchronize=lambda: None,
                            graph_pool_handle=lambda: (0, 1), CUDAGraph=EmulatedGraph,
                            graph=lambda graph, pool=None: EmulatedCapture(graph, streams, pool),
                            is_current_stream_capturing=lambda: EmulatedCapture.capturing).items():
        monkeypatch.setattr(torch.cuda, name, value)
    EmulatedGenerator.default = EmulatedGenerator()
    monkeypatch.setattr(cuda_graphs, "default_generator", lambda: EmulatedGenerator.default)
    monkeypatch.setattr(splice.plan, "check_graphs", lambda *args: None)
    return streams


def test_emulated_generate_replays_the_decode_step_token_exact(emulated_graphs, caplog):
    """The decode step's graphs over the static KV cache: a replay gives HF's tokens, for a second request, another
    batch size (a new cache, new graphs) and the first one again."""
    reference = build_family("llama")
    ids, mask = padded_batch(vocab=reference.config.vocab_size)
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    expected_one = reference.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=12, do_sample=False)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, enable_cuda_graph=True,
                                   max_out_tokens=64, device="cpu")
    with caplog.at_level(logging.INFO, logger="splice"):
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False), expected)
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False), expected)
        one = engine.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=12, do_sample=False)
        again = engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(one, expected_one) and torch.equal(again, expected)
    assert caplog.text.count("captured a CUDA graph of the decode step") == 3 and "eagerly" not in caplog.text


def check_generate_logits_of_each_step_are_hf_s(device: str) -> None:
    """Each decode step's logits come from its own replay: none is overwritten by a later one."""
    reference = build_family("llama").to(device)
    ids, mask = (t.to(device) for t in padded_batch(vocab=reference.config.vocab_size))
    options = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
                   return_dict_in_generate=True)
    expected = reference.generate(ids, **options).logits
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, enable_cuda_graph=True,
                                   max_out_tokens=64, device=device)
    got = engine.generate(ids, **options).logits
    assert len(got) == len(expected) == 8 and len(engine.runtime.graphs.graphs) == 1
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=f"step {step}")


def check_more_lengths_than_graphs_run_eagerly(device: str, caplog) -> None:
    """Attended lengths 16, 32 and 64 with room for two graphs: the third length's steps run eagerly and the log says
    so; another batch size gets graphs of its own; every request gives HF's tokens."""
    reference = build_family("llama").to(device)
    greedy = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)  # no row stops before the third length
    ids, mask = (t.to(device) for t in padded_batch(vocab=reference.config.vocab_size))
    expected = reference.generate(ids, attention_mask=mask, **greedy)
    expected_one = reference.generate(ids[:1], attention_mask=mask[:1], **greedy)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, enable_cuda_graph=True,
                                   max_out_tokens=64, device=device)
    engine.runtime.min_attended = 16
    engine.runtime.graphs.max_graphs = 2
    with caplog.at_level(logging.INFO, logger="splice"):
        got = engine.generate(ids, attention_mask=mask, **greedy)
        one = engine.generate(ids[:1], attention_mask=mask[:1], **greedy)
    assert torch.equal(got, expected) and torch.equal(one, expected_one)
    assert caplog.text.count("64 runs eagerly, not from a CUDA graph: 2 graphs are captured already") == 2
    assert len(engine.runtime.graphs.graphs) == 2


def test_emulated_generate_logits_of_each_step_are_hf_s(emulated_graphs):
    check_generate_logits_of_each_step_are_hf_s("cpu")


def test_emulated_more_lengths_than_graphs_run_eagerly(emulated_graphs, caplog):
    check_more_lengths_than_graphs_run_eagerly("cpu", caplog)


@pytest.mark.parametrize("inject", [False, True])
def test_emulated_engine_calls_replay_per_signature(emulated_graphs, caplog, inject):
    """engine(...): one graph per signature, each replay on its call's inputs, the earlier results kept; a call whose
    output holds a Cache runs eagerly and says so."""
    reference = build_family("llama")
    ids = torch.randint(0, reference.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected, flipped = (reference(x, use_cache=False).logits for x in (ids, ids.flip(1)))
    engine = splice.init_inference(copy.deepcopy(reference), enable_cuda_graph=True, replace_with_kernel_inject=inject,
                                   max_out_tokens=64, device="cpu")
    with caplog.at_level(logging.INFO, logger="splice"):
        first = engine(ids, use_cache=False).logits
        second = engine(ids.flip(1), use_cache=False).logits
        masked = engine(ids.flip(1), attention_mask=torch.ones_like(ids), use_cache=False).logits
        cached = engine(ids).logits
    assert len(engine._forward_graphs.graphs) == 2 and "holds a DynamicCache" in caplog.text
    for got, want in ((first, expected), (second, flipped), (masked, flipped), (cached, expected)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_emulated_static_inputs_take_calls_in_and_out_of_inference_mode(emulated_graphs):
    weight = torch.randn(8, 8)
    replayer = GraphReplayer(lambda x: x @ weight, "matmul")
    x = torch.randn(2, 8)
    with torch.inference_mode():
        replayer(torch.randn(2, 8))  # captured on an inference tensor
    torch.testing.assert_close(replayer(x), x @ weight)
    with torch.inference_mode():
        torch.testing.assert_close(replayer(-x), -x @ weight)


def test_emulated_failed_capture_runs_eagerly_on_the_caller_s_stream(emulated_graphs, caplog):
    replayer = GraphReplayer(lambda x: x * float(x.sum()), "sync")
    stream = torch.cuda.current_stream()
    with caplog.at_level(logging.INFO, logger="splice"):
        torch.testing.assert_close(replayer(torch.ones(4)), torch.full((4,), 4.0))
    assert torch.cuda.current_stream() is stream and not replayer.graphs
    assert "capture failed (operation not permitted when stream is capturing" in caplog.text
    assert not EmulatedGenerator.default.state.capturing  # random operators on the device work again


def test_emulated_clear_lets_go_of_what_eager_signatures_held(emulated_graphs):
    """A signature holds its arguments (the decode step's KV cache): clearing the graphs of an old cache frees it."""
    replayer = GraphReplayer(lambda x, cache: x * 2, "step", max_graphs=0)
    cache = torch.nn.Module()
    held = weakref.ref(cache)
    replayer(torch.ones(2), cache)
    replayer.clear()
    del cache
    gc.collect()
    assert held() is None


def test_emulated_replays_from_two_threads_get_their_own_inputs(emulated_graphs, monkeypatch):
    """Two threads share a graph's static inputs: a replay must not read the other thread's inputs."""
    replayer = GraphReplayer(lambda x: x * 2, "double")
    replayer(torch.zeros(4))  # captured
    replaying = threading.Event()
    replay = EmulatedGraph.replay

    def slow_replay(graph):
        replaying.set()
        time.sleep(0.2)  # the other thread's call comes in meanwhile
        replay(graph)

    monkeypatch.setattr(EmulatedGraph, "replay", slow_replay)
    results = {}
    first = threading.Thread(target=lambda: results.update(first=replayer(torch.ones(4))))
    first.start()
    replaying.wait()
    results["second"] = replayer(torch.full((4,), 5.0))
    first.join()
    assert torch.equal(results["first"], torch.full((4,), 2.0))
    assert torch.equal(results["second"], torch.full((4,), 10.0))


def test_emulated_graphs_go_with_the_engine(emulated_graphs):
    model = build_family("llama")
    ids, mask = padded_batch(vocab=model.config.vocab_size)
    engine = splice.init_inference(model, replace_with_kernel_inject=True, enable_cuda_graph=True, max_out_tokens=64,
                                   device="cpu")
    engine.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    engine(ids, use_cache=False)
    graphs = [*engine.runtime.graphs.graphs.values(), *engine._forward_graphs.graphs.values()]
    held = [weakref.ref(item.graph) for item in graphs] + [weakref.ref(engine.runtime.cache_for(ids.shape[0]))]
    assert len(graphs) == 2
    del engine, graphs
    gc.collect()
    assert all(ref() is None for ref in held)


def test_emulated_engine_call_after_a_cast_of_the_model_captures_again(emulated_graphs):
    """A graph reads the weights where they were at capture: once the model is cast (or moved) a call captures anew
    rather than replaying on the old weights."""
    reference = build_family("llama")
    ids = torch.randint(0, reference.config.vocab_size, (2, 9))
    engine = splice.init_inference(copy.deepcopy(reference), enable_cuda_graph=True, device="cpu")
    engine(ids, use_cache=False)
    engine.module.to(torch.float64)
    with torch.no_grad():
        expected = reference.to(torch.float64)(ids, use_cache=False).logits
    got = engine(ids, use_cache=False).logits
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_emulated_mixture_of_experts_generates_hf_s_tokens(emulated_graphs):
    """A mixture of experts' blocks (each layer's own router and experts) under graph replay: HF's tokens, whether
    a step's routing is captured or runs eagerly."""
    check_mixture_of_experts_tokens("cpu")


def check_mixture_of_experts_tokens(device: str) -> None:
    reference = build_family("mixtral").to(device)
    ids, mask = (t.to(device) for t in padded_batch(vocab=reference.config.vocab_size))
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, enable_cuda_graph=True,
                                   max_out_tokens=64, device=device)
    for _ in range(2):
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False), expected)


# ---- on a CUDA device ------------------------------------------------------------------------------------------------
@needs_cuda
def test_mixture_of_experts_generates_hf_s_tokens_with_cuda_graphs():
    check_mixture_of_experts_tokens("cuda")


@needs_cuda
def test_generate_logits_of_each_step_are_hf_s_on_cuda():
    check_generate_logits_of_each_step_are_hf_s("cuda")


@needs_cuda
def test_generate_over_more_lengths_than_graphs_runs_the_rest_eagerly_on_cuda(caplog):
    check_more_lengths_than_graphs_run_eagerly("cuda", caplog)


@needs_cuda
def test_engine_calls_from_two_threads_get_their_own_results():
    reference = build_family("llama").cuda()
    inputs = [torch.randint(0, reference.config.vocab_size, (2, 9), device="cuda") for _ in range(2)]
    with torch.no_grad():
        expected = [reference(ids, use_cache=False).logits for ids in inputs]
    engine = splice.init_inference(copy.deepcopy(reference), enable_cuda_graph=True)
    engine(inputs[0], use_cache=False)  # captured
    errors = []

    def run(index):
        for _ in range(20):
            got = engine(inputs[index], use_cache=False).logits
            if not torch.allclose(got, expected[index], rtol=1e-4, atol=1e-4):
                errors.append(index)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(engine._forward_graphs.graphs) == 1


@needs_cuda
def test_graphs_and_cache_go_with_the_engine():
    model = build_family("llama").cuda()
    ids, mask = (t.cuda() for t in padded_batch(vocab=model.config.vocab_size))
    engine = splice.init_inference(model, replace_with_kernel_inject=True, enable_cuda_graph=True, max_out_tokens=64)
    engine.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    engine(ids, use_cache=False)
    torch.cuda.synchronize()
    graphs = [*engine.runtime.graphs.graphs.values(), *engine._forward_graphs.graphs.values()]
    held = [weakref.ref(item.graph) for item in graphs] + [weakref.ref(engine.runtime.cache_for(ids.shape[0]))]
    assert len(graphs) == 2
    with_graphs = torch.cuda.memory_allocated()
    del engine, graphs
    gc.collect()
    assert all(ref() is None for ref in held)
    assert torch.cuda.memory_allocated() < with_graphs  # the KV cache and the graphs' outputs went back


def test_clear_lets_the_memory_pool_go_with_the_graphs():
    """A pool goes back to the allocator with its last graph: clearing must not keep its handle for the next
    capture (on CUDA that capture fails an allocator check and the step runs eagerly)."""
    replayer = GraphReplayer(lambda x: x * 2, "double")
    replayer.pool = (0, 1)
    replayer.clear()
    assert replayer.pool is None


@needs_cuda
def test_a_new_batch_size_captures_again_after_the_last_one_s_graphs_went(caplog):
    """Another batch size takes a new KV cache, and the old one's graphs (and their pool) go: the new batch size's
    step is captured again, not run eagerly, and gives HF's tokens."""
    reference = build_family("llama").cuda()
    ids, mask = (t.cuda() for t in padded_batch(vocab=reference.config.vocab_size))
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, enable_cuda_graph=True,
                                   max_out_tokens=64)
    greedy = dict(max_new_tokens=8, do_sample=False)
    with caplog.at_level(logging.INFO, logger="splice"):
        engine.generate(ids[:1], attention_mask=mask[:1], **greedy)
        got = engine.generate(ids, attention_mask=mask, **greedy)
    assert torch.equal(got, reference.generate(ids, attention_mask=mask, **greedy))
    assert caplog.text.count("captured a CUDA graph of the decode step") == 2 and "eagerly" not in caplog.text
    assert len(engine.runtime.graphs.graphs) == 1
