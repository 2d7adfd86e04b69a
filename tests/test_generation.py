"""splice's native generate loop against Hugging Face ``generate`` on the unmodified model with the same weights."""
from __future__ import annotations

import copy
import logging
import warnings
from contextlib import contextmanager

import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList,
                          TopKLogitsWarper)
from transformers.generation.utils import GenerateDecoderOnlyOutput

import splice
from splice import native
from splice.generation import (RIGHT_PADDING_WARNING, EosBannedBelowLength, Request, check_request, generate,
                               hf_generate_log, pick, plan_request)
from splice.layers.widened_linear import prompts_in_float32
from splice.steps.fuse import inject

from .arch.tiny_models import FAMILIES, build, build_family, padded_batch
from .snippet_models import byte_tokenizer, snippet_llama


def pair(model_type: str, max_out_tokens: int = 128):
    """The HF model, and a fused copy with its decode runtime: ``generate(*fused, ...)``."""
    reference = build_family(model_type)
    model = copy.deepcopy(reference)
    return reference, (model, inject(model, max_out_tokens))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_48_tokens_match_batch_1_and_padded_batch_3(model_type):
    reference, model = pair(model_type)
    ids, mask = padded_batch(batch=3, length=10)
    options = dict(max_new_tokens=48, do_sample=False, eos_token_id=None)  # random weights: no early stop
    with torch.inference_mode():
        for batch in ({"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": mask}):
            expected = reference.generate(**batch, **options)
            got = generate(*model, **batch, **options)
            assert got.shape == expected.shape == (batch["input_ids"].shape[0], 58)
            assert torch.equal(got, expected)


def test_int32_ids_give_hf_s_int64_sequences():
    reference, model = pair("llama")
    ids, mask = padded_batch()
    options = dict(max_new_tokens=6, eos_token_id=None)
    expected = reference.generate(ids.int(), attention_mask=mask, **options)
    got = generate(*model, ids.int(), attention_mask=mask, **options)
    assert got.dtype == expected.dtype == torch.int64 and torch.equal(got, expected)


def test_sampling_matches_hf_with_the_same_seed():
    reference, model = pair("llama")
    ids, mask = padded_batch()
    options = dict(max_new_tokens=24, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3,
                   min_new_tokens=4, eos_token_id=[2, 5])
    torch.manual_seed(3)
    expected = reference.generate(ids, attention_mask=mask, **options)
    torch.manual_seed(3)
    assert torch.equal(generate(*model, ids, attention_mask=mask, **options), expected)


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    _, model = pair("llama")
    ids, mask = padded_batch()
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(generate(*model, ids, attention_mask=mask, max_new_tokens=16, do_sample=True))
    assert torch.equal(runs[0], runs[1])
    greedy = generate(*model, ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    top1 = generate(*model, ids, attention_mask=mask, max_new_tokens=16, do_sample=True, top_k=1)
    assert torch.equal(greedy, top1)


def test_eos_list_stops_rows_and_pads_finished_ones():
    reference, model = pair("llama")
    ids, mask = padded_batch()
    free = generate(*model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    stop_ids = [int(free[0, 12]), int(free[1, 14]), int(free[2, 15])]  # a token each row emits
    options = dict(max_new_tokens=12, eos_token_id=stop_ids, pad_token_id=0)
    expected = reference.generate(ids, attention_mask=mask, **options)
    got = generate(*model, ids, attention_mask=mask, **options)
    assert torch.equal(got, expected) and got.shape[1] <= 16 and (got == 0).any()


def test_generation_config_defaults_come_from_the_model():
    reference, model = pair("llama")
    ids, _ = padded_batch(batch=1)
    for m in (reference, model[0]):
        m.generation_config.max_new_tokens = 9
        m.generation_config.eos_token_id = None
    plan = plan_request(model[0], ids, None, {})
    assert plan.max_new_tokens == 9 and plan.eos is None
    assert torch.equal(generate(*model, ids), reference.generate(ids))
    config = GenerationConfig(max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    expected = reference.generate(ids, generation_config=config)
    assert torch.equal(generate(*model, ids, generation_config=config), expected)


def test_no_length_option_gives_hf_s_20_new_tokens_within_the_positions():
    """With no max_length or max_new_tokens in the call or either generation config, Hugging Face's generate makes 20
    new tokens (not 20 in all), at most up to the model's max_position_embeddings (256); the request check counts
    the same total against max_out_tokens."""
    reference, model = pair("llama", max_out_tokens=256)
    for m in (reference, model[0]):
        m.generation_config.eos_token_id = None
    ids, mask = padded_batch()
    long_prompt = torch.randint(3, 128, (1, 245), generator=torch.Generator().manual_seed(0))
    for batch, new in (({"input_ids": ids, "attention_mask": mask}, 20), ({"input_ids": long_prompt}, 11)):
        expected = reference.generate(**batch)
        assert expected.shape[1] == batch["input_ids"].shape[1] + new
        assert torch.equal(generate(*model, **batch), expected)
    with pytest.raises(ValueError, match="10 \\+ 20 new tokens = 30 exceeds max_out_tokens=29"):
        check_request(model[0], (ids,), {"attention_mask": mask}, 128, max_out_tokens=29)


def test_positional_arguments_bind_in_hf_order():
    """``generate(model, runtime, inputs, generation_config, logits_processor, ...)``, as Hugging Face's generate
    takes them: the third is the processor list (which transformers' generate then runs), not the streamer."""
    from transformers import LogitsProcessorList, SuppressTokensLogitsProcessor

    reference, model = pair("llama")
    ids, _ = padded_batch(batch=1)
    config = GenerationConfig(max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    free = reference.generate(ids, config)
    assert torch.equal(generate(*model, ids, config), free)
    processors = LogitsProcessorList([SuppressTokensLogitsProcessor(free[0, ids.shape[1]:].tolist())])
    expected = reference.generate(ids, config, processors)
    assert not torch.equal(expected, free)
    assert torch.equal(generate(*model, ids, config, processors), expected)


def test_return_dict_scores_and_logits():
    """Without a cache in the output (``use_cache=False``), the native loop gives Hugging Face's output dict."""
    reference, model = pair("qwen3")
    ids, mask = padded_batch()
    options = dict(max_new_tokens=5, return_dict_in_generate=True, output_scores=True, output_logits=True,
                   eos_token_id=None, use_cache=False)
    assert isinstance(plan_request(model[0], ids, None, {"attention_mask": mask, **options}), Request)
    expected = reference.generate(ids, attention_mask=mask, **options)
    got = generate(*model, ids, attention_mask=mask, **options)
    assert isinstance(got, GenerateDecoderOnlyOutput) and got.cache is None and expected.cache is None
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(got.logits) == 5
    for ours, theirs in zip(got.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_an_output_dict_carries_hf_s_cache_where_use_cache_true_is_asked_for():
    """use_cache=True with return_dict_in_generate=True asks for the output's KV cache, which splice's static cache is
    not: Hugging Face's generate runs on the fused model and returns its own."""
    reference, model = pair("llama")
    ids, mask = padded_batch()
    options = dict(max_new_tokens=5, return_dict_in_generate=True, eos_token_id=None, use_cache=True)
    expected = reference.generate(ids, attention_mask=mask, **options)
    got = generate(*model, ids, attention_mask=mask, **options)
    assert type(got.cache) is type(expected.cache) and expected.cache is not None
    assert got.cache.get_seq_length() == expected.cache.get_seq_length() == 14
    assert torch.equal(got.sequences, expected.sequences)
    assert isinstance(plan_request(model[0], ids, None, {"attention_mask": mask, **options}), str)


@pytest.mark.parametrize("use_cache", [None, "generation config", False])
def test_an_output_dict_without_use_cache_named_stays_native_and_says_it_has_no_cache(use_cache):
    """By default (or from the generation config) Hugging Face's dict would carry its cache: the native loop's dict
    carries none and says so; use_cache=False asks for none, and nothing is said."""
    reference, model = pair("llama")
    ids, mask = padded_batch()
    options = dict(max_new_tokens=5, return_dict_in_generate=True, eos_token_id=None)
    if use_cache == "generation config":
        for m in (reference, model[0]):
            m.generation_config.use_cache = True
    elif use_cache is False:
        options["use_cache"] = False
    assert isinstance(plan_request(model[0], ids, None, {"attention_mask": mask, **options}), Request)
    expected = reference.generate(ids, attention_mask=mask, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = generate(*model, ids, attention_mask=mask, **options)
    assert torch.equal(got.sequences, expected.sequences) and got.cache is None
    said = [w for w in caught if "returns no past_key_values" in str(w.message)]
    assert len(said) == (0 if use_cache is False else 1)


@contextmanager
def hf_generate_warnings():
    """The messages Hugging Face's generate logger (and splice's copy of its warnings) emits meanwhile."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    hf_generate_log.addHandler(handler)
    try:
        yield records
    finally:
        hf_generate_log.removeHandler(handler)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox", "opt"])
def test_a_right_padded_batch_gets_hf_s_tokens_and_warning_in_the_native_loop(model_type):
    """Right padding (the last column masked in some rows): Hugging Face's tokens, though not what the rows would give
    alone (its first token comes from the last pad's query), and its warning once; all in the native loop."""
    reference, model = pair(model_type)
    ids, mask = padded_batch(batch=3, length=10, side="right")
    options = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    with torch.inference_mode():
        with hf_generate_warnings() as expected_warnings:
            expected = reference.generate(ids, attention_mask=mask, **options)
        assert isinstance(plan_request(model[0], ids, None, {"attention_mask": mask, **options}), Request)
        model[0].generate = None  # the native loop must not hand the request to Hugging Face's generate
        try:
            with hf_generate_warnings() as warnings:
                got = generate(*model, ids, attention_mask=mask, **options)
        finally:
            del model[0].generate
    assert torch.equal(got, expected)
    assert warnings == expected_warnings == [RIGHT_PADDING_WARNING]


def test_a_batch_without_mask_whose_pad_is_eos_gets_hf_s_warning():
    """Without an attention mask, a pad id that is also an eos id cannot mark the pads: Hugging Face's generate warns
    (once per process) and so does the native loop, with the same tokens."""
    reference, model = pair("llama")
    ids, _ = padded_batch()  # left pads of id 0
    options = dict(max_new_tokens=4, pad_token_id=0, eos_token_id=[0, 5])
    seen = []
    for run in (lambda: reference.generate(ids, **options), lambda: generate(*model, ids, **options)):
        logging.Logger.warning_once.cache_clear()
        with hf_generate_warnings() as warnings:
            seen.append((run(), warnings))
    assert torch.equal(seen[0][0], seen[1][0])
    assert seen[0][1] == seen[1][1] and len(seen[0][1]) == 1 and "cannot be inferred" in seen[0][1][0]


@pytest.mark.parametrize("pads, native_loop", [(5, True), (6, False)])
def test_a_sliding_window_right_padded_batch_stays_native_unless_pads_fill_the_window(pads, native_loop):
    """Gemma 2's tiny model has a sliding window of 6: a row with 5 pads at its end keeps a real token in its last
    pad's window, so the native loop gives Hugging Face's tokens; with 6 pads that query sees no real token
    (Hugging Face's attention gives it zeros), and the batch runs Hugging Face's generate on the fused model."""
    reference, model = pair("gemma2")
    assert 6 in model[1].windows
    ids, mask = padded_batch(batch=2, length=10, side="right")
    mask[1], ids[1] = 1, ids[0].flip(0)
    mask[1, 10 - pads:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    options = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    hf_generate, calls = model[0].generate, []
    model[0].generate = lambda *args, **kwargs: calls.append(1) or hf_generate(*args, **kwargs)
    try:
        with torch.inference_mode():
            expected = reference.generate(ids, attention_mask=mask, **options)
            got = generate(*model, ids, attention_mask=mask, **options)
    finally:
        del model[0].generate
    assert torch.equal(got, expected)
    assert bool(calls) != native_loop


def test_streamer_sees_prompt_then_each_token():
    class Recorder:
        def __init__(self):
            self.values, self.ended = [], False

        def put(self, value):
            self.values.append(value.clone())

        def end(self):
            self.ended = True

    _, model = pair("llama")
    ids, _ = padded_batch(batch=1)
    recorder = Recorder()
    out = generate(*model, ids, max_new_tokens=6, eos_token_id=None, streamer=recorder)
    assert recorder.ended and torch.equal(recorder.values[0], ids)
    assert torch.equal(torch.cat([v.view(-1) for v in recorder.values[1:]]), out[0, ids.shape[1]:])


def test_beam_search_falls_back_to_hf_on_the_fused_model():
    reference, model = pair("mistral")
    ids, mask = padded_batch()
    options = dict(max_new_tokens=12, num_beams=3, eos_token_id=None)
    assert isinstance(plan_request(model[0], ids, None, {"attention_mask": mask, **options}), str)
    expected = reference.generate(ids, attention_mask=mask, **options)
    assert torch.equal(generate(*model, ids, attention_mask=mask, **options), expected)


def test_attention_weights_raise_and_hidden_states_come_from_hf_generate_on_the_fused_blocks():
    """The fused blocks never form attention weights: ``output_attentions`` raises. They record their outputs as the
    model's layers do, so ``output_hidden_states`` runs Hugging Face's generate on them: the reference's tokens and
    every step's hidden states."""
    reference, model = pair("llama")
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match="output_attentions=True"):
        generate(*model, ids[:1], max_new_tokens=2, return_dict_in_generate=True, output_attentions=True)
    options = dict(max_new_tokens=4, eos_token_id=None, return_dict_in_generate=True, output_hidden_states=True)
    expected = reference.generate(ids, attention_mask=mask, **options)
    got = generate(*model, ids, attention_mask=mask, **options)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.hidden_states) == len(expected.hidden_states) == 4
    for ours, theirs in zip(got.hidden_states, expected.hidden_states):
        assert len(ours) == len(theirs) == 3  # the embeddings and each of the 2 layers
        for have, want in zip(ours, theirs):
            assert ((have - want).abs().max() / want.std()).item() < 1e-4


def test_request_past_max_out_tokens_raises_before_work():
    _, model = pair("llama", max_out_tokens=16)
    ids, _ = padded_batch(batch=1)
    with pytest.raises(ValueError, match="max_out_tokens=16"):
        generate(*model, ids, max_new_tokens=7)


def test_engine_generate_uses_the_native_loop(tiny_llama):
    reference = copy.deepcopy(tiny_llama)
    engine = splice.init_inference(tiny_llama, replace_with_kernel_inject=True, max_out_tokens=64)
    ids, mask = padded_batch()
    calls = []
    engine.module.generate = lambda *a, **k: calls.append(1)  # the HF path must not be taken
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
    assert not calls
    assert torch.equal(got, reference.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None))


@pytest.mark.slow
def test_real_smollm2_greedy_matches(smollm2):
    reference, tokenizer = smollm2
    model = copy.deepcopy(reference)
    model = (model, inject(model, max_out_tokens=128))
    prompts = ["The capital of France is", "Once upon a time, there was a little", "Hi"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.inference_mode():
        for inputs in ({"input_ids": batch.input_ids[1:2]}, dict(batch)):
            expected = reference.generate(**inputs, max_new_tokens=48, do_sample=False)
            assert torch.equal(generate(*model, **inputs, max_new_tokens=48, do_sample=False), expected)
    text = tokenizer.decode(generate(*model, batch.input_ids[:1], attention_mask=batch.attention_mask[:1],
                                     max_new_tokens=3)[0, batch.input_ids.shape[1]:])
    assert text.startswith(" Paris")


def english_text() -> str:
    """A real English text installed on this machine (a licence the OS or Python ships); never stored in the repo."""
    import sysconfig
    from pathlib import Path

    candidates = [Path("/usr/share/common-licenses/Apache-2.0"), Path("/usr/share/common-licenses/GPL-3"),
                  Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt", Path("/usr/lib/python3/dist-packages/LICENSE")]
    for path in candidates:
        if path.is_file() and path.stat().st_size > 4000:
            return path.read_text(errors="ignore")
    pytest.skip("no English licence text found on this machine")


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    return float(torch.exp(loss))


@pytest.mark.slow
def test_bf16_fidelity_on_real_text(record_property):
    """bf16 splice (fused blocks, packed weights, native path) vs HF bf16: greedy agreement and perplexity."""
    from splice.generation import prefill_positions

    reference, tokenizer = splice.load("smollm2-135m-instruct", dtype="bf16")
    engine = splice.init_inference(splice.load("smollm2-135m-instruct", dtype="bf16")[0],
                                   replace_with_kernel_inject=True, max_out_tokens=640)
    runtime = engine.runtime
    ids = tokenizer(english_text(), return_tensors="pt").input_ids[:, :512]
    with torch.inference_mode():
        with prompts_in_float32(reference):  # HF's bf16 products and float32 sums, fast without bf16 arithmetic too
            expected = reference(ids).logits
        cache = runtime.cache_for(1)
        mask = torch.ones_like(ids)
        cache.start(mask)
        got = runtime.forward(ids, prefill_positions(mask), cache.slot_ids[: ids.shape[1]], cache, ids.shape[1],
                              last_only=False)
        agreement = (expected.argmax(-1) == got.argmax(-1)).float().mean().item()
        ppl_hf, ppl_splice = perplexity(expected, ids), perplexity(got, ids)
        prompts = tokenizer(["The capital of France is", "Once upon a time, there was a little",
                             "The license grants you the right to"], return_tensors="pt", padding=True,
                            padding_side="left")
        options = dict(max_new_tokens=48, min_new_tokens=48, do_sample=False)
        free_hf = reference.generate(**prompts, **options)[:, prompts.input_ids.shape[1]:]
        free_splice = engine.generate(**prompts, **options)[:, prompts.input_ids.shape[1]:]
    same = (free_hf == free_splice).int()
    first_divergence = [int(row.argmin()) if not row.all() else row.numel() for row in same]
    record_property("bf16_teacher_forced_agreement", agreement)
    record_property("bf16_perplexity", {"hf": ppl_hf, "splice": ppl_splice})
    record_property("bf16_greedy_first_divergence_of_48", first_divergence)
    print(f"\nbf16: argmax agreement {agreement:.4f} over {ids.shape[1]} tokens; perplexity HF {ppl_hf:.4f} "
          f"splice {ppl_splice:.4f}; free-running greedy agrees for {first_divergence} of 48 tokens")
    assert agreement >= 0.95
    assert abs(ppl_splice - ppl_hf) / ppl_hf < 0.005


@pytest.mark.parametrize("native_pick", (False, True), ids=("torch", "native"))
def test_greedy_pick_is_argmax_with_its_ties_and_nans(native_pick):
    """The greedy token is ``torch.argmax``'s: the first of equal highest scores, a NaN where a row has one, over a
    vocabulary-sized row and a small one; with splice's ``argmax_rows`` (float32 rows) as with torch's reduction."""
    if native_pick and not native.available():
        pytest.skip("splice's native kernels are not available here")
    torch.manual_seed(0)
    scores = torch.randn(5, 49152)
    scores[1, [7, 300, 40000]] = scores[1].max() + 1  # ties: the first wins
    scores[2, 12345] = float("nan")
    scores[3] = 0.0  # all equal
    scores[4, -1] = float("inf")
    for rows in (scores, scores[:, :17].contiguous(), scores.bfloat16()):
        assert torch.equal(pick(rows, do_sample=False, native_pick=native_pick), torch.argmax(rows, dim=-1))
    assert pick(scores, do_sample=False, native_pick=native_pick)[1].item() == 7


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_native_greedy_loop_picks_with_argmax_rows(monkeypatch):
    """On CPU with the native kernels the loop's greedy pick is ``argmax_rows`` (Hugging Face's tokens either way:
    the other tests here); sampling keeps torch."""
    reference, model = pair("llama")
    ids, mask = padded_batch()
    asked = []
    fits = native.argmax_fits
    monkeypatch.setattr(native, "argmax_fits", lambda scores: asked.append(scores.shape) or fits(scores))
    got = generate(*model, ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert len(asked) == 6 and torch.equal(got, expected)
    asked.clear()
    generate(*model, ids, attention_mask=mask, max_new_tokens=3, do_sample=True, eos_token_id=None)
    assert not asked


@pytest.mark.parametrize("eos_ids", ([2], [2, 5], [-1, 2, 300]))
def test_eos_ban_gives_hugging_faces_minimum_length_scores(eos_ids):
    """The scores of Hugging Face's MinLengthLogitsProcessor and MinNewTokensLengthLogitsProcessor, below, at and
    past the length, for one eos id and several; ids outside the vocabulary (of 50) ban nothing, as in theirs."""
    from transformers.generation import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor

    torch.manual_seed(0)
    eos = torch.tensor(eos_ids)
    prompt, minimum = 6, 4
    processors = ((MinLengthLogitsProcessor(prompt + minimum, eos_ids), EosBannedBelowLength(prompt + minimum, eos)),
                  (MinNewTokensLengthLogitsProcessor(prompt, minimum, eos_ids),
                   EosBannedBelowLength(prompt + minimum, eos)))
    banned = 0
    for length in range(prompt, prompt + minimum + 3):
        ids, scores = torch.randint(0, 50, (3, length)), torch.randn(3, 50)
        for theirs, ours in processors:
            expected, got = theirs(ids, scores.clone()), ours(ids, scores.clone())
            assert torch.equal(got, expected)
            banned += bool(torch.isinf(got[:, [i for i in eos_ids if 0 <= i < 50]]).all())
    assert banned == 2 * minimum  # every length below the minimum, for both


def test_eos_ids_as_a_tensor_stop_as_hf_s_without_a_copy_warning():
    reference, model = pair("llama")
    ids, mask = padded_batch()
    free = generate(*model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    options = dict(max_new_tokens=12, eos_token_id=torch.tensor([int(free[0, 12]), int(free[1, 14]), int(free[2, 15])]))
    expected = reference.generate(ids, attention_mask=mask, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # Hugging Face's generate warns nothing for a tensor of eos ids
        got = generate(*model, ids, attention_mask=mask, **options)
    assert torch.equal(got, expected) and got.shape[1] <= 16


def _stop_string_case(reference):
    """The byte tokenizer and a stop string from the middle of the reference's greedy continuation."""
    tokenizer = byte_tokenizer()
    prompt = tokenizer(["The capital of France is"], return_tensors="pt")
    free = reference.generate(**prompt, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(free[0, prompt.input_ids.shape[1]:])
    return prompt, dict(stop_strings=[text[len(text) // 2:len(text) // 2 + 3]], tokenizer=tokenizer)


#: Hugging Face generate options outside the native loop: (name, options, seed for sampling or None); each runs
#: transformers' generate on the fused model, which must give the reference's tokens (the same seed, the same samples)
FALLBACK_CASES = [
    ("num_return_sequences", dict(do_sample=True, num_return_sequences=2), 5),
    ("no_repeat_ngram_size", dict(no_repeat_ngram_size=2), None),
    ("bad_words_ids", dict(bad_words_ids=[[5], [9, 10]]), None),
    ("min_p", dict(do_sample=True, min_p=0.1), 3),
    ("typical_p", dict(do_sample=True, typical_p=0.8), 3),
    ("sequence_bias", dict(sequence_bias={(5,): 10.0, (9, 10): -5.0}), None),
    ("suppress_tokens", dict(suppress_tokens=[5, 6, 7]), None),
    ("begin_suppress_tokens", dict(begin_suppress_tokens=[5, 6]), None),
    ("forced_eos_token_id", dict(forced_eos_token_id=2, eos_token_id=2), None),
    ("renormalize_logits", dict(do_sample=True, top_k=10, renormalize_logits=True), 4),
    ("logits_processor", dict(do_sample=True, logits_processor=LogitsProcessorList([TopKLogitsWarper(5)])), 2),
    ("stopping_criteria", dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(14)])), None),
    ("prompt_lookup_num_tokens", dict(prompt_lookup_num_tokens=3), None),
]


@pytest.mark.parametrize("options, seed", [case[1:] for case in FALLBACK_CASES], ids=[c[0] for c in FALLBACK_CASES])
def test_options_outside_the_native_loop_give_hf_s_tokens_through_the_engine(options, seed):
    reference = build_family("llama")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    ids, mask = padded_batch()
    if "prompt_lookup_num_tokens" in options:  # one row (HF's candidate generator's limit), a repeated prompt
        ids, mask = ids[:1].repeat(1, 2), mask[:1].repeat(1, 2)
    options = dict(max_new_tokens=10, eos_token_id=None) | options
    outputs = []
    for model in (reference, engine):
        if seed is not None:
            torch.manual_seed(seed)
        outputs.append(model.generate(ids, attention_mask=mask, **options))
    assert isinstance(plan_request(engine.module, ids, None, {"attention_mask": mask, **options}), str)
    assert torch.equal(outputs[1], outputs[0])


def test_stop_strings_and_speculative_decoding_give_hf_s_tokens_through_the_engine():
    reference = snippet_llama()
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    prompt, stop = _stop_string_case(reference)
    expected = reference.generate(**prompt, max_new_tokens=20, do_sample=False, **stop)
    got = engine.generate(**prompt, max_new_tokens=20, do_sample=False, **stop)
    assert torch.equal(got, expected) and got.shape[1] < prompt.input_ids.shape[1] + 20
    assistant = snippet_llama(seed=1)
    options = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = reference.generate(**prompt, **options)
    assert torch.equal(engine.generate(**prompt, assistant_model=assistant, **options), expected)
    assert torch.equal(reference.generate(**prompt, assistant_model=engine.module, **options), expected)


def engine_pair(name: str = "llama", inject: bool = True, **overrides):
    """The tiny HF model ``name`` (config ``overrides``), and an engine on a copy of it."""
    reference = build(name, **overrides) if overrides else build_family(name)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=inject, max_out_tokens=64)
    return reference, engine


def outcome(generate_call):
    """What a generate call gives: its tokens (or output), or the type of the exception it raises."""
    try:
        torch.manual_seed(0)
        return generate_call()
    except Exception as error:  # noqa: BLE001 - the comparison is with whatever Hugging Face's generate raises
        return type(error)


def assert_same_outcome(got, expected) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, expected)
    else:
        assert got is expected


@contextmanager
def all_warnings():
    """Hugging Face's generate logger's messages and ``warnings.warn``'s, in one list each, meanwhile."""
    logging.Logger.warning_once.cache_clear()
    with hf_generate_warnings() as logged, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        yield logged, warned


def generate_with_warnings(model, ids, **options):
    """``model.generate(ids, **options)`` and its warnings (Hugging Face's logger's, then ``warnings.warn``'s)."""
    with all_warnings() as (logged, warned):
        out = model.generate(ids, **options)
    return out, logged + [str(w.message) for w in warned]


def test_min_new_tokens_takes_precedence_over_min_length_with_hf_s_warning():
    """With both, Hugging Face's generate bans eos until prompt + min_new_tokens only (it replaces min_length, and
    warns); the native loop gives its tokens, stopping at an eos before min_length."""
    reference, engine = engine_pair()
    ids = padded_batch(batch=1, length=9)[0]
    free = reference.generate(ids, max_new_tokens=6, eos_token_id=None)[0, 9:].tolist()
    stop = next(k for k in range(2, 6) if free[k] not in free[:k])  # a new token not emitted before it
    options = dict(max_new_tokens=20, eos_token_id=free[stop], min_length=15, min_new_tokens=2)
    assert isinstance(plan_request(engine.module, ids, None, dict(options)), Request)
    expected, expected_warnings = generate_with_warnings(reference, ids, **options)
    got, got_warnings = generate_with_warnings(engine, ids, **options)
    assert expected.shape[1] == 9 + stop + 1 < 15 and torch.equal(got, expected)
    assert got_warnings == expected_warnings
    assert any("`min_new_tokens` will take precedence" in message for message in got_warnings)


#: options set to 0 / 0.0, which are values, not "unset": each runs Hugging Face's generate on the fused model
ZERO_OPTIONS = [dict(forced_eos_token_id=0), dict(forced_bos_token_id=0), dict(guidance_scale=0.0),
                dict(max_time=0.0), dict(top_h=0.0, do_sample=True), dict(num_beams=0),
                dict(prompt_lookup_num_tokens=0), dict(prefill_chunk_size=0), dict(begin_suppress_tokens=0)]


@pytest.mark.parametrize("options", ZERO_OPTIONS, ids=[next(iter(o)) for o in ZERO_OPTIONS])
def test_options_set_to_zero_give_hf_s_outcome(options):
    """``0`` is not ``False``: forced_eos_token_id=0 (Pythia's eos) forces token 0 last, guidance_scale=0.0 guides,
    max_time=0.0 stops after one token, and values Hugging Face's generate refuses raise its error."""
    reference, engine = engine_pair()
    ids = padded_batch(batch=1)[0]
    options = dict(max_new_tokens=8, eos_token_id=None, **options)
    assert isinstance(plan_request(engine.module, ids, None, dict(options)), str)
    expected = outcome(lambda: reference.generate(ids, **options))
    assert_same_outcome(outcome(lambda: engine.generate(ids, **options)), expected)


@pytest.mark.parametrize("eos", [300, -1, [-1, 2]], ids=str)
def test_eos_ids_outside_the_vocabulary_ban_nothing_below_the_minimum_length(eos):
    """An eos id past the vocabulary (300 of 128) or negative (-1) has no column to ban, as in Hugging Face's
    processors: no index error, and -1 is not the last token's column. The last token is made the first pick."""
    reference = build_family("llama")
    ids = padded_batch(batch=1)[0]
    first = int(reference.generate(ids, max_new_tokens=1, eos_token_id=None)[0, -1])
    with torch.no_grad():
        reference.lm_head.weight[-1] = 4 * reference.lm_head.weight[first]
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    options = dict(max_new_tokens=8, min_new_tokens=3, eos_token_id=eos)
    assert isinstance(plan_request(engine.module, ids, None, dict(options)), Request)
    expected, expected_warnings = generate_with_warnings(reference, ids, **options)
    got, got_warnings = generate_with_warnings(engine, ids, **options)
    assert int(expected[0, ids.shape[1]]) == 127 and torch.equal(got, expected)
    assert got_warnings == expected_warnings


@pytest.mark.parametrize("cache_implementation, native_loop", [
    ("dynamic", True), ("static", True), ("quantized", False), ("offloaded", False), ("offloaded_static", False),
    ("sliding_window", False)])
def test_cache_implementation_runs_natively_only_where_it_cannot_change_tokens(cache_implementation, native_loop):
    """The dynamic and static caches give the native loop's tokens; a quantized or offloaded cache (or a deprecated
    name, which Hugging Face's generate warns about) runs its generate on the fused model: its tokens or its error."""
    reference, engine = engine_pair()
    ids, mask = padded_batch()
    options = dict(max_new_tokens=6, eos_token_id=None, cache_implementation=cache_implementation)
    plan = plan_request(engine.module, ids, None, {"attention_mask": mask, **options})
    assert isinstance(plan, Request) == native_loop
    expected = outcome(lambda: reference.generate(ids, attention_mask=mask, **options))
    assert_same_outcome(outcome(lambda: engine.generate(ids, attention_mask=mask, **options)), expected)


#: calls of the native loop where Hugging Face's generate warns: (name, prompt rows, options, words of its warning)
WARNING_CASES = [
    ("default max_length", 1, {}, "model-agnostic default `max_length`"),
    ("batch without mask or pad id", 2, dict(max_new_tokens=4), "pad token id were not set"),
    ("min_new_tokens past the maximum", 1, dict(max_new_tokens=4, min_new_tokens=6), "Unfeasible length constraints"),
    ("min_length past the maximum", 1, dict(max_new_tokens=4, min_length=30), "Unfeasible length constraints"),
    ("negative eos id", 1, dict(max_new_tokens=4, eos_token_id=[-1, 2]), "should consist of positive integers"),
    ("max_length and max_new_tokens", 1, dict(max_new_tokens=4, max_length=30), "`max_new_tokens` will take"),
]


@pytest.mark.parametrize("rows, options, words", [c[1:] for c in WARNING_CASES], ids=[c[0] for c in WARNING_CASES])
def test_the_native_loop_gives_hf_s_warnings(rows, options, words):
    """Hugging Face's generate's warnings, in its order, from transformers' own checks, with its tokens."""
    reference, engine = engine_pair()
    for model in (reference, engine.module):
        model.generation_config.pad_token_id = None  # unset unless the call sets it
    ids = padded_batch(batch=rows)[0][:, -6:]  # no pads
    assert isinstance(plan_request(engine.module, ids, None, dict(options)), Request)
    expected, expected_warnings = generate_with_warnings(reference, ids, **options)
    got, got_warnings = generate_with_warnings(engine, ids, **options)
    assert torch.equal(got, expected)
    assert got_warnings == expected_warnings and any(words in message for message in got_warnings)


@pytest.mark.parametrize("name, limit", [("gpt2", dict(n_positions=32)), ("opt", dict(max_position_embeddings=32))])
def test_a_request_past_the_learned_positions_raises_before_work_without_kernel_injection(name, limit):
    """32 learned positions: Hugging Face's generate feeds every token but the last, so it makes 30 + 3 tokens and
    fails on an index error at 30 + 4; the engine (without kernel injection, which refuses max_out_tokens=64 at
    init) gives its tokens up to 33 and raises a ValueError naming the lengths past that, before any forward."""
    reference, engine = engine_pair(name, inject=False, **limit)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    options = dict(eos_token_id=None, do_sample=False)
    assert torch.equal(engine.generate(ids, max_new_tokens=3, **options),
                       reference.generate(ids, max_new_tokens=3, **options))
    with pytest.raises(IndexError):
        reference.generate(ids, max_new_tokens=4, **options)
    forwards = []
    engine.module.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=r"30 \+ 10 new tokens = 40 .* 32 learned positions .* <= 33"):
        engine.generate(ids, max_new_tokens=10, **options)
    assert not forwards
    with pytest.raises(ValueError, match="learned positions"):
        splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)


def greedy_both_ways(engine, ids, monkeypatch, **options):
    """``engine.generate(ids, **options)`` with greedy decoding's native steps (``runtime.greedy_steps``), then with
    the loop's own steps (``runtime.greedy_steps`` offering none): the two outcomes, each call's streamed tokens (a
    streamer given) and the steps each native call took."""
    runtime = engine.runtime
    taken, streamed = [], {True: [], False: []}
    offer = runtime.greedy_steps

    def counted(*args):
        steps = offer(*args)
        if steps is None:
            return None

        def step(*step_args):
            out = steps(*step_args)
            if out is not None:
                taken.append(out[2])
            return out
        return step

    class Recorder:
        def __init__(self, into):
            self.into = into

        def put(self, value):
            self.into.append(value.clone())

        def end(self):
            pass

    outs, stream = {}, options.pop("stream", False)
    for fused in (True, False):
        with monkeypatch.context() as patch:
            patch.setattr(runtime, "greedy_steps", counted if fused else lambda *args: None)
            streamer = {"streamer": Recorder(streamed[fused])} if stream else {}
            with torch.inference_mode():
                outs[fused] = engine.generate(ids, **options, **streamer)
    return outs[True], outs[False], streamed, taken


GREEDY_CASES = [  # family, scheme, overrides, rows (or "padded": 3 left-padded rows)
    ("llama", "bf16", {}, 1),
    ("llama", "int4-sym", {}, 2),
    ("llama", "int4-sym", {}, "padded"),  # every step masked
    ("qwen3", "bf16", {}, 1),
    ("mistral", "bf16", {"sliding_window": 14}, 1),  # no mask up to 14 slots, then the window's
    ("mistral", "bf16", {"sliding_window": 14}, "padded"),
]


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("family, scheme, overrides, rows", GREEDY_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in GREEDY_CASES])
def test_greedy_steps_in_one_native_call_give_the_loop_s_tokens(family, scheme, overrides, rows, stream, monkeypatch):
    """bf16 steps that run in one native call take greedy decoding's steps with the loop's bookkeeping (positions,
    slot, cache marks, the masks, the pick, eos, the minimum length's eos ban) in native calls: one a token with a
    streamer, else several. The same kernels on the same inputs: the tokens (and streamed tokens) of the loop's own
    steps, which the tests above hold to Hugging Face's: without eos, with an eos id that ends a row early, and with
    that eos banned below a minimum length; left-padded rows and a sliding window past its size masked as the loop
    masks them."""
    from .layers.test_native_layer import engine_of

    engine = engine_of(family, scheme) if not overrides else splice.init_inference(
        build(family, **overrides), replace_with_kernel_inject=True, max_out_tokens=64, dtype=torch.bfloat16)
    if rows == "padded":
        ids, mask = padded_batch(batch=3, length=10)
        rows, padding = 3, {"attention_mask": mask}
    else:
        ids, padding = torch.randint(3, 100, (rows, 10), generator=torch.Generator().manual_seed(1)), {}
    options = dict(max_new_tokens=12, do_sample=False, stream=stream, **padding)
    got, expected, streamed, taken = greedy_both_ways(engine, ids, monkeypatch, eos_token_id=None, **options)
    assert torch.equal(got, expected) and got.shape == (rows, 22)
    new = 12 - 1  # the first new token comes from the prompt's logits
    assert taken == ([1] * new if stream else [new])
    assert all(torch.equal(a, b) for a, b in zip(streamed[True], streamed[False], strict=True))
    eos = int(got[0, 13])  # the fourth new token of the first row
    for minimum in ({}, {"min_new_tokens": 6}):
        got, expected, streamed, taken = greedy_both_ways(engine, ids, monkeypatch, eos_token_id=eos, pad_token_id=0,
                                                      **options, **minimum)
        assert torch.equal(got, expected) and taken
        assert all(torch.equal(a, b) for a, b in zip(streamed[True], streamed[False], strict=True))
        if not minimum and rows == 1:
            assert got.shape[1] <= 14  # the first row's eos ended it
        if minimum:
            assert not (got[:, 10:16] == eos).any()  # eos banned for the first 6 new tokens


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_greedy_steps_scale_the_embeddings_as_the_loop_does(monkeypatch):
    """A family that scales its embeddings (the runtime's ``embed_scale``, a value bf16 rounds): the native steps
    round the scaled rows as torch does, so the loop's tokens; a long request without a streamer takes its steps
    16 a call at most."""
    from .layers.test_native_layer import engine_of

    engine = engine_of("llama")
    engine.runtime.embed_scale = 3.3
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(2))
    got, expected, _, taken = greedy_both_ways(engine, ids, monkeypatch, max_new_tokens=16, do_sample=False,
                                               eos_token_id=None)
    assert torch.equal(got, expected) and taken == [15]
    got, expected, _, taken = greedy_both_ways(engine, ids, monkeypatch, max_new_tokens=41, do_sample=False,
                                               eos_token_id=None)
    assert torch.equal(got, expected) and taken == [16, 16, 8]  # at most GREEDY_STEPS_A_CALL a call
    engine.runtime.embed_scale = None
    plain, _, _, _ = greedy_both_ways(engine, ids, monkeypatch, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert not torch.equal(plain, got)  # the scale changed the tokens


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_greedy_steps_multiply_granites_embeddings_by_its_unrounded_float(monkeypatch):
    """Granite multiplies its embeddings by a float that torch does not round to bf16 first (3.3, not bf16's 3.296875):
    the native steps take it as it is, so the loop's tokens, which the family tests hold to Hugging Face's."""
    engine = splice.init_inference(build("granite", embedding_multiplier=3.3, logits_scaling=1.0),
                                   replace_with_kernel_inject=True, max_out_tokens=64, dtype=torch.bfloat16)
    assert engine.runtime.greedy_embed_scale() == 3.3
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(2))
    got, expected, _, taken = greedy_both_ways(engine, ids, monkeypatch, max_new_tokens=16, do_sample=False,
                                               eos_token_id=None)
    assert torch.equal(got, expected) and taken == [15]


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_greedy_steps_stay_in_the_loop_where_a_step_needs_what_they_do_not_do(monkeypatch):
    """Sampling and a timed forward (``profile_model_time``: every step timed) step through the loop; float32 runs no
    native steps to take."""
    from .layers.test_native_layer import engine_of

    engine = engine_of("llama")
    ids, _ = padded_batch(batch=2, length=10)
    taken = []
    offer = engine.runtime.greedy_steps
    monkeypatch.setattr(engine.runtime, "greedy_steps", lambda *args: taken.append(offer(*args)) or taken[-1])
    with torch.inference_mode():
        engine.generate(ids[:1], max_new_tokens=4, do_sample=True, eos_token_id=None)
        engine.profile_model_time()
        engine.generate(ids[:1], max_new_tokens=4, do_sample=False, eos_token_id=None)
        assert len(engine.model_times()) == 4
    assert not taken  # not even asked
    float_engine = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, max_out_tokens=64)
    with torch.inference_mode():
        float_engine.generate(ids[:1], max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert float_engine.runtime.greedy_steps(1, float_engine.runtime.cache_for(1), None, 0, 0) is None
