"""InferenceEngine against the unmodified Hugging Face model."""
from __future__ import annotations

import copy

import pytest
import torch

import splice
from splice.engine import InferenceEngine

from .conftest import build_tiny, tiny_llama_config


@pytest.fixture
def pair():
    """A reference HF model and an identical copy handed to init_inference."""
    reference = build_tiny(tiny_llama_config())
    return reference, copy.deepcopy(reference)


PROMPTS = torch.tensor([[5, 17, 33, 9, 71, 4], [8, 3, 99, 12, 40, 6]])


def test_init_inference_returns_engine_module(pair):
    _, model = pair
    engine = splice.init_inference(model)
    assert isinstance(engine, InferenceEngine) and isinstance(engine, torch.nn.Module)
    assert engine.module is model and not engine.module.training
    assert [report.step for report in engine.reports] == ["dtype", "load", "shard", "fuse", "quantize", "kernels",
                                                          "place", "compile"]


def test_deepspeed_engine_attributes(pair):
    """What code written for DeepSpeed's engine reads from it."""
    _, model = pair
    engine = splice.init_inference(model, tensor_parallel={"tp_size": 1})
    assert engine._config is engine.inference_config
    assert engine.mp_world_size == 1 and engine.mp_group is None and engine.mpu is None
    assert engine.injection_dict is None


def test_forward_matches_reference_logits(pair):
    reference, model = pair
    engine = splice.init_inference(model)
    with torch.no_grad():
        expected = reference(PROMPTS).logits
    assert torch.equal(engine(PROMPTS).logits, expected)


def test_greedy_generate_matches_hf_token_for_token(pair):
    reference, model = pair
    engine = splice.init_inference(model, max_out_tokens=64)
    expected = reference.generate(PROMPTS, max_new_tokens=24, do_sample=False)
    assert torch.equal(engine.generate(PROMPTS, max_new_tokens=24, do_sample=False), expected)


def test_beam_search_matches_hf(pair):
    reference, model = pair
    engine = splice.init_inference(model)
    kwargs = dict(max_new_tokens=12, num_beams=3, do_sample=False, early_stopping=True)
    expected = reference.generate(PROMPTS[:1], **kwargs)
    assert torch.equal(engine.generate(PROMPTS[:1], **kwargs), expected)


@pytest.mark.parametrize("inject", [False, True])
def test_outputs_are_ordinary_tensors_the_caller_may_change(pair, inject):
    """As the model's own outputs (no_grad, not inference_mode): code such as ``logits /= temperature`` works."""
    reference, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=inject, max_out_tokens=32)
    with torch.no_grad():
        expected = reference(PROMPTS).logits
    logits = engine(PROMPTS).logits
    logits /= 2.0
    torch.testing.assert_close(logits, expected / 2.0)
    for options in (dict(), dict(return_dict_in_generate=True, output_scores=True)):
        output = engine.generate(PROMPTS, max_new_tokens=3, do_sample=False, **options)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        assert not sequences.is_inference()
        sequences[:, -1] = 0
        if options:
            assert not any(score.is_inference() for score in output.scores)


def test_only_plain_arguments_key_a_cuda_graph():
    """A call with a stateful argument (a Cache, which every run changes) never goes through a graph's warm-up."""
    from transformers import DynamicCache

    from splice.engine import _capturable

    ids = PROMPTS
    assert _capturable((ids,), dict(attention_mask=ids, use_cache=False, output_hidden_states=True))
    assert not _capturable((ids,), dict(past_key_values=DynamicCache()))
    assert not _capturable((ids,), dict(cache=DynamicCache()))  # the argument's name from transformers 5.25
    assert not _capturable(((ids, ids),), {})


def test_too_long_request_raises_before_any_forward(pair):
    _, model = pair
    engine = splice.init_inference(model, max_out_tokens=16)
    engine.profile_model_time()
    with pytest.raises(ValueError, match="max_out_tokens=16"):
        engine.generate(PROMPTS, max_new_tokens=11)
    with pytest.raises(ValueError, match="max_out_tokens=16"):
        engine.generate(PROMPTS, max_length=17)
    assert engine.model_times() == []
    engine.generate(PROMPTS, max_new_tokens=10)  # exactly 16: allowed


def test_out_of_range_token_ids_raise(pair):
    _, model = pair
    engine = splice.init_inference(model)
    with pytest.raises(ValueError, match="token id 128"):
        engine(torch.tensor([[1, 128]]))
    with pytest.raises(ValueError, match="token id -1"):
        engine.generate(torch.tensor([[1, -1]]), max_new_tokens=2)
    with pytest.raises(TypeError, match="integer"):
        engine(torch.tensor([[1.0, 2.0]]))


def test_model_times_one_entry_per_forward_and_clears(pair):
    _, model = pair
    engine = splice.init_inference(model)
    with pytest.raises(RuntimeError, match="profile_model_time"):
        engine.model_times()
    engine.profile_model_time()
    engine(PROMPTS)
    engine(PROMPTS)
    times = engine.model_times()
    assert len(times) == 2 and all(t > 0 for t in times)
    assert engine.model_times() == []
    engine.generate(PROMPTS[:1], max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert len(engine.model_times()) == 5  # one prefill + four decode forwards


def hf_forward_count(model, ids, **kwargs) -> int:
    """How many times Hugging Face's generate calls the model: what DeepSpeed's forward hooks time."""
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    with torch.inference_mode():
        model.generate(ids, **kwargs)
    handle.remove()
    return len(calls)


@pytest.mark.parametrize("compile_decode", [False, True])
def test_model_times_native_loop_counts_prefill_and_each_decode_step(pair, compile_decode, fresh_compiles):
    reference, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, compile_decode=compile_decode,
                                   max_out_tokens=32)
    engine.profile_model_time(use_cuda_events=False)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert hf_forward_count(reference, PROMPTS, **kwargs) == 6
    engine.generate(PROMPTS, **kwargs)
    times = engine.model_times()
    assert len(times) == 6 and all(t > 0 for t in times)  # the prefill, then five decode steps
    assert engine.model_times() == []
    engine(PROMPTS)  # a plain call is one forward
    assert len(engine.model_times()) == 1


def test_model_times_native_loop_stops_counting_with_the_rows(pair):
    """A request that ends early at eos gives as many entries as Hugging Face's loop makes forwards."""
    reference, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    engine.profile_model_time()
    first = int(reference.generate(PROMPTS[:1], max_new_tokens=3, do_sample=False)[0, -1])
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=first, pad_token_id=0)
    forwards = hf_forward_count(reference, PROMPTS[:1], **kwargs)
    assert forwards < 10
    engine.generate(PROMPTS[:1], **kwargs)
    assert len(engine.model_times()) == forwards


def test_model_times_hf_fallback_counts_its_forwards(pair):
    reference, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    engine.profile_model_time()
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, no_repeat_ngram_size=2)  # not native
    engine.generate(PROMPTS, **kwargs)
    assert len(engine.model_times()) == hf_forward_count(reference, PROMPTS, **kwargs) == 5


def test_profile_model_time_refuses_a_non_boolean(pair):
    engine = splice.init_inference(pair[1])
    with pytest.raises(TypeError, match="use_cuda_events='yes'"):
        engine.profile_model_time(use_cuda_events="yes")
    with pytest.raises(ValueError, match=r"use_cuda_events=2; allowed: True or False \(or 1 or 0\)"):
        engine.profile_model_time(use_cuda_events=2)
    with pytest.raises(TypeError, match=r"use_cuda_events=1\.0 \(float\)"):
        engine.profile_model_time(use_cuda_events=1.0)
    assert not engine.model_profile_enabled  # a refused call starts nothing


@pytest.mark.parametrize("given, taken", [(1, True), (0, False), (True, True), (False, False)])
def test_profile_model_time_takes_one_and_zero_as_booleans(pair, given, taken):
    """DeepSpeed's ``profile_model_time(use_cuda_events=True)`` reads the value as a truth value."""
    engine = splice.init_inference(pair[1])
    engine.profile_model_time(use_cuda_events=given)
    assert engine._timer.use_cuda_events is taken
    engine(PROMPTS)
    assert len(engine.model_times()) == 1


def test_model_times_before_profiling_is_an_assertion_error_as_in_deepspeed_and_a_runtime_error(pair):
    """DeepSpeed asserts ``model_profile_enabled`` there; splice's callers catch RuntimeError."""
    engine = splice.init_inference(pair[1])
    with pytest.raises(AssertionError, match="needs profile_model_time"):
        engine.model_times()
    with pytest.raises(RuntimeError, match="needs profile_model_time"):
        engine.model_times()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("use_cuda_events", [True, False])
def test_model_times_on_cuda(pair, use_cuda_events):
    _, model = pair
    engine = splice.init_inference(model.cuda(), replace_with_kernel_inject=True, max_out_tokens=32)
    engine.profile_model_time(use_cuda_events=use_cuda_events)
    engine.generate(PROMPTS.cuda(), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    times = engine.model_times()
    assert len(times) == 4 and all(t > 0 for t in times)


def test_real_model_says_paris(smollm2):
    model, tokenizer = smollm2
    engine = splice.init_inference(model)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    out = engine.generate(**inputs, max_new_tokens=4, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
    assert text.startswith(" Paris")


@pytest.mark.parametrize("inject", [False, True])
def test_train_mode_is_refused_eval_allowed(pair, inject):
    """The engine runs under no_grad and its fused paths have no dropout: a training mode would be half honoured."""
    _, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=inject, max_out_tokens=32)
    with pytest.raises(ValueError, match=r"engine.train\(True\).*allowed: engine.eval\(\)"):
        engine.train()
    assert not engine.training and not engine.module.training
    assert engine.eval() is engine and engine.train(False) is engine and not engine.module.training


def test_threads_sharing_an_injected_engine_each_get_hf_tokens(pair):
    """The native loop decodes into the runtime's one KV cache: two threads' requests must not interleave in it."""
    import sys
    import threading

    reference, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=64)
    prompts = [torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    kwargs = dict(max_new_tokens=40, do_sample=False)
    expected = [reference.generate(prompt, **kwargs) for prompt in prompts]
    wrong = []

    def run(index):
        for _ in range(4):
            if not torch.equal(engine.generate(prompts[index], **kwargs), expected[index]):
                wrong.append(index)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, as a busy server would
    try:
        threads = [threading.Thread(target=run, args=(index,)) for index in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []


def test_generate_inside_generate_of_the_same_injected_engine_raises(pair):
    _, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)

    class Nested:
        def put(self, value):
            engine.generate(PROMPTS, max_new_tokens=2, do_sample=False)

        def end(self):
            pass

    with pytest.raises(RuntimeError, match="inside a generate of the same"):
        engine.generate(PROMPTS[:1], max_new_tokens=3, do_sample=False, streamer=Nested())
    engine.generate(PROMPTS, max_new_tokens=2, do_sample=False)  # the lock was released


@pytest.mark.parametrize("options", [dict(), dict(dtype=torch.bfloat16)], ids=["fp32", "bf16"])
def test_save_pretrained_of_an_unfused_engine_reloads_its_outputs(pair, tmp_path, options):
    from transformers import AutoModelForCausalLM

    reference, model = pair
    engine = splice.init_inference(model, **options)
    engine.module.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        logits = reloaded(PROMPTS).logits
        expected = reference(PROMPTS).logits
    assert torch.equal(logits, engine(PROMPTS).logits)
    if not options:
        assert torch.equal(logits, expected)


@pytest.mark.parametrize("options, named", [
    (dict(replace_with_kernel_inject=True), "fused by kernel injection"),
    (dict(dtype=torch.int8), "quantized"),
    (dict(quant={"enabled": True, "weight": {"num_bits": 4}}, replace_with_kernel_inject=True), "fused.*quantized"),
], ids=["inject", "int8", "int4-inject"])
def test_save_pretrained_of_a_changed_model_refuses_before_writing(pair, tmp_path, options, named):
    """transformers' from_pretrained would load such a folder with the changed layers at random, without an error."""
    _, model = pair
    engine = splice.init_inference(model, max_out_tokens=32, **options)
    folder = tmp_path / "out"
    for save in (engine.module.save_pretrained, engine.save_pretrained):
        with pytest.raises(RuntimeError, match=f"{named}.*Allowed: save the model before init_inference"):
            save(folder)
    assert not folder.exists()
    copy.deepcopy(engine)(PROMPTS)  # the refusing save_pretrained is copied with the model


def test_forward_hooks_on_an_injected_model_run_in_generate_as_on_hf(pair):
    """A hook on the model (or on a layer the native loop does not call as a module) is run by every forward, as
    Hugging Face's generate runs it: here one that bans a token changes the tokens as it does on the HF model."""
    reference, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    banned = int(reference.generate(PROMPTS, **kwargs)[0, -3])

    def ban(module, args, output):
        output.logits[..., banned] = -1e9

    calls = []
    handles = [reference.register_forward_hook(ban), engine.module.register_forward_hook(ban),
               engine.module.model.layers[0].register_forward_hook(lambda *_: calls.append(1))]
    expected = reference.generate(PROMPTS, **kwargs)
    assert banned not in expected[:, PROMPTS.shape[1]:]
    assert torch.equal(engine.generate(PROMPTS, **kwargs), expected)
    assert len(calls) == 6  # one per forward
    for handle in handles:
        handle.remove()
    assert torch.equal(engine.generate(PROMPTS, **kwargs), reference.generate(PROMPTS, **kwargs))


@pytest.mark.parametrize("inject", [False, True])
def test_destroy_frees_the_cache_and_graphs_and_the_engine_still_generates_hf_tokens(pair, inject):
    """DeepSpeed's engine.destroy(): what the engine allocated goes, and the next request allocates it again."""
    reference, model = pair
    expected = reference.generate(PROMPTS, max_new_tokens=6, do_sample=False)
    engine = splice.init_inference(model, replace_with_kernel_inject=inject, max_out_tokens=32)
    assert torch.equal(engine.generate(PROMPTS, max_new_tokens=6, do_sample=False), expected)
    engine.destroy()
    if inject:
        assert engine.runtime._cache is None
    assert torch.equal(engine.generate(PROMPTS, max_new_tokens=6, do_sample=False), expected)


def test_compile_of_an_unfused_model_compiles_it_whole_with_deepspeed_s_arguments(pair):
    reference, model = pair
    engine = splice.init_inference(model)
    assert not engine.is_compiled
    engine.compile(backend="eager", compile_kwargs={"fullgraph": False})
    assert engine.is_compiled and model._compiled_call_impl is not None
    with torch.no_grad():
        torch.testing.assert_close(engine(PROMPTS).logits, reference(PROMPTS).logits, rtol=1e-5, atol=1e-5)
    engine.compile(backend="inductor")  # compiled already: nothing changes
    assert model._compiled_call_impl is not None


def test_compile_of_an_injected_model_compiles_its_decode_step(pair):
    _, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    with pytest.raises(ValueError, match="backend='eager'.*allowed: backend='inductor'"):
        engine.compile(backend="eager")
    with pytest.raises(ValueError, match="dynamic.*allowed keys: mode, options"):
        engine.compile(compile_kwargs={"dynamic": True})
    assert not engine.is_compiled and not engine.runtime.compiled
    engine.compile()
    assert engine.is_compiled and engine.runtime.compiled


def test_compile_decode_at_init_counts_as_compiled(pair):
    _, model = pair
    engine = splice.init_inference(model, replace_with_kernel_inject=True, compile_decode=True, max_out_tokens=32)
    assert engine.is_compiled


def test_deepspeed_s_profiling_flag_says_whether_profiling_is_on(pair):
    """DeepSpeed-MII reads ``model_profile_enabled`` before asking for ``model_times()``."""
    _, model = pair
    engine = splice.init_inference(model)
    assert engine.model_profile_enabled is False
    engine.profile_model_time()
    assert engine.model_profile_enabled is True
    engine(PROMPTS)
    assert len(engine.model_times()) == 1


def test_max_out_tokens_limits_a_model_left_to_its_own_generate_only_when_given(pair):
    """Without kernel injection the model's own cache grows (DeepSpeed checks nothing there): the default
    max_out_tokens limits nothing, a max_out_tokens the config names limits the request."""
    reference, model = pair
    long_prompt = torch.randint(3, 128, (1, 1030))
    engine = splice.init_inference(model)
    expected = reference.generate(long_prompt, max_new_tokens=2, do_sample=False)
    assert torch.equal(engine.generate(long_prompt, max_new_tokens=2, do_sample=False), expected)
    limited = splice.init_inference(copy.deepcopy(reference), max_out_tokens=1031)
    with pytest.raises(ValueError, match=r"1030 \+ 2 new tokens = 1032 exceeds max_out_tokens=1031"):
        limited.generate(long_prompt, max_new_tokens=2, do_sample=False)


def test_floating_first_inputs_are_the_model_s_own_not_token_ids():
    """Whisper's forward takes its audio features first and Wav2Vec2's its samples (a model without a token
    embedding): the engine passes them on as DeepSpeed's does, where it had checked them as token ids."""
    from transformers import (Wav2Vec2Config, Wav2Vec2ForCTC, WhisperConfig,
                              WhisperForConditionalGeneration)

    torch.manual_seed(0)
    whisper = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)).eval()
    wav2vec = Wav2Vec2ForCTC(Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4)).eval()
    features, decoder_ids, samples = torch.randn(1, 8, 32), torch.tensor([[1, 5]]), torch.randn(1, 400)
    with torch.no_grad():
        expected = (whisper(features, decoder_input_ids=decoder_ids).logits, wav2vec(samples).logits)
    whisper_engine = splice.init_inference(copy.deepcopy(whisper))
    wav2vec_engine = splice.init_inference(copy.deepcopy(wav2vec))
    assert torch.equal(whisper_engine(features, decoder_input_ids=decoder_ids).logits, expected[0])
    assert torch.equal(wav2vec_engine(samples).logits, expected[1])
    assert wav2vec_engine.vocab_size is None
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        whisper_engine(input_ids=features)  # named as token ids, a floating tensor is still refused


def test_attention_weights_under_tensor_parallelism_are_refused(pair):
    """Each rank forms its own heads' attention weights only: asked for by keyword, in the model's config or in a
    generation config, they raise before any work (the engine's context stands in for a rank of two here, the check
    runs before any collective)."""
    from transformers import GenerationConfig

    from splice.distributed import ParallelContext

    _, model = pair
    model.set_attn_implementation("eager")  # the attention that forms its weights
    engine = splice.init_inference(model, max_out_tokens=64)
    assert engine(PROMPTS, output_attentions=True).attentions[0].shape[1] == 4  # one process: every head
    engine.parallel = ParallelContext(rank=0, world_size=2)
    pattern = r"output_attentions=True under tensor parallelism \(tp_size=2\).*allowed: output_attentions=False"
    with pytest.raises(ValueError, match=pattern):
        engine(PROMPTS, output_attentions=True)
    with pytest.raises(ValueError, match=pattern):
        engine.generate(PROMPTS, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    with pytest.raises(ValueError, match=pattern):
        engine.generate(PROMPTS, GenerationConfig(max_new_tokens=2, output_attentions=True))
    model.config.output_attentions = True
    with pytest.raises(ValueError, match=pattern):
        engine(PROMPTS)
