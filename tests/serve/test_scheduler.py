"""The continuous-batching scheduler: greedy requests give what the unmodified Hugging Face model's ``generate`` gives
each alone (fp32, tie-free references) while rows join and leave mid-run; sampling, penalties, logprobs and stop
tokens as specified; cancel, queue limit, shutdown and faults end requests as they should and leave the others
running."""
from __future__ import annotations

import asyncio
import copy
import threading

import pytest
import torch

import splice
from splice.serve import scheduler as scheduler_module
from splice.serve.batch import prefill_groups
from splice.serve.sampling import TokenPicker
from splice.serve.scheduler import QueueFull, SamplingParams, Scheduler, TokenEvent
from tests.arch.tiny_models import build_family

GREEDY = dict(temperature=0)


def tiny_engine(family: str = "llama", max_out_tokens: int = 64, seed: int = 0):
    return splice.init_inference(build_family(family, seed=seed), dtype=torch.float32, replace_with_kernel_inject=True,
                                 max_out_tokens=max_out_tokens)


def tiny_engine_and_hf(family: str = "llama", max_out_tokens: int = 64, seed: int = 0):
    """A kernel-injected fp32 engine and an unmodified copy of the Hugging Face model it was built from."""
    model = build_family(family, seed=seed)
    hf = copy.deepcopy(model)  # init_inference replaces the model's blocks in place
    engine = splice.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True,
                                   max_out_tokens=max_out_tokens)
    return engine, hf


def reference(hf_model, prompt: list[int], new_tokens: int, stop: tuple[int, ...] = ()) -> tuple[list[int], float]:
    """The unmodified Hugging Face model's ``generate`` alone (greedy, fp32): the new tokens, and the smallest gap
    between the two best logits on the way (a tie-free run has a gap well above rounding)."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=new_tokens, do_sample=False, eos_token_id=list(stop) or None,
                                pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    gaps = [float(top[0, 0] - top[0, 1]) for top in (logits.topk(2).values for logits in out.logits)]
    return out.sequences[0, len(prompt):].tolist(), min(gaps)


def run_all(scheduler: Scheduler, requests: list[tuple[list[int], SamplingParams]]) -> list[list[TokenEvent]]:
    """Submit every request at once, then collect each one's events."""
    handles = [scheduler.submit(prompt, params) for prompt, params in requests]
    return [list(handle) for handle in handles]


def tokens(events: list[TokenEvent]) -> list[int]:
    return [event.token_id for event in events if event.token_id is not None]


def serve(engine, requests, max_batch: int, **options) -> list[list[TokenEvent]]:
    scheduler = Scheduler(engine, max_batch=max_batch, **options)
    scheduler.start()
    try:
        return run_all(scheduler, requests)
    finally:
        scheduler.shutdown()


def record_plans(scheduler: Scheduler) -> list:
    """The plans ``scheduler`` runs, in order."""
    plans = []
    run = scheduler.runner.run
    scheduler.runner.run = lambda plan, **callbacks: plans.append(plan) or run(plan, **callbacks)
    return plans


def assert_one_final_event(events: list[TokenEvent], reason: str) -> None:
    assert [event.finish_reason for event in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].finish_reason == reason, events[-1]


# ---- greedy identity -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2):
    """A kernel-injected fp32 SmolLM2, 16 real-text prompts of 5..50 tokens with 4..10 new tokens each, and what the
    unmodified Hugging Face model (fp32) gives each alone."""
    from tests.test_generation import english_text

    model, tokenizer = smollm2
    engine = splice.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                   max_out_tokens=128)
    ids = tokenizer(english_text()[:8000]).input_ids
    prompts = [ids[37 * i: 37 * i + 5 + 3 * i] for i in range(16)]
    new = [4 + 2 * (i % 4) for i in range(16)]
    eos = (tokenizer.eos_token_id,)
    references = [reference(model, prompt, n, eos) for prompt, n in zip(prompts, new)]
    assert min(gap for _, gap in references) > 1e-4  # tie-free: rounding cannot decide a token
    return engine, prompts, new, eos, [tokens for tokens, _ in references], model


@pytest.mark.slow
@pytest.mark.parametrize("max_batch", [4, 8])
def test_smollm2_greedy_equals_hf_alone_while_rows_join_and_leave(smol, max_batch):
    engine, prompts, new, eos, expected, _ = smol
    params = [SamplingParams(n, stop_token_ids=eos, **GREEDY) for n in new]
    results = serve(engine, list(zip(prompts, params)), max_batch)
    for events, want, n in zip(results, expected, new):
        assert tokens(events) == want
        assert_one_final_event(events, "length" if len(want) == n and want[-1] not in eos else "stop")


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "mixtral", "qwen2_moe", "gpt_oss", "cohere2"])
def test_tiny_family_greedy_equals_hf_alone(family):
    """A non-Llama family record (learned positions / partial rotary, parallel residual; a mixture of experts, its
    rows routed together; attention sinks; layers without positions), 12 requests through 3 rows; the references are
    tie-free so rounding cannot decide a token."""
    engine, hf = tiny_engine_and_hf(family)
    prompts = [torch.randint(3, 128, (3 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(12)]
    new = [4 + (i % 4) * 3 for i in range(12)]
    expected = [reference(hf, prompt, n) for prompt, n in zip(prompts, new)]
    assert min(gap for _, gap in expected) > 1e-4
    results = serve(engine, [(p, SamplingParams(n, **GREEDY)) for p, n in zip(prompts, new)], max_batch=3)
    assert [tokens(events) for events in results] == [want for want, _ in expected]


def test_long_prompts_are_prefilled_in_chunks_while_the_others_step():
    """``prefill_chunk`` 6: prompts of up to 31 tokens go in chunks of 6 at slots 0, 6, 12, ..., between decode steps
    of the running requests; greedy tokens still equal HF's alone (tie-free references)."""
    engine, hf = tiny_engine_and_hf()
    prompts = [torch.randint(3, 128, (3 + 4 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(8)]
    expected = [reference(hf, prompt, 8) for prompt in prompts]
    assert min(gap for _, gap in expected) > 1e-4
    scheduler = Scheduler(engine, max_batch=3, prefill_chunk=6)
    plans = record_plans(scheduler)
    scheduler.start()
    results = run_all(scheduler, [(p, SamplingParams(8, **GREEDY)) for p in prompts])
    scheduler.shutdown()
    assert [tokens(events) for events in results] == [want for want, _ in expected]
    assert all(sum(len(chunk) for _, _, chunk in plan.prefills) <= 6 for plan in plans)
    assert all(start % 6 == 0 for plan in plans for _, start, _ in plan.prefills)
    assert any(plan.step_tokens and any(start > 0 for _, start, _ in plan.prefills) for plan in plans)


def test_prompts_prefilled_together_give_what_hf_gives_each_alone():
    """Ten prompts of 2..29 tokens queued at once, 4 admitted per iteration, up to 3 prefilled in one right-padded
    forward (4 rows): greedy tokens equal HF's alone (tie-free references)."""
    engine, hf = tiny_engine_and_hf()
    prompts = [torch.randint(3, 128, (2 + 3 * i,), generator=torch.Generator().manual_seed(50 + i)).tolist()
               for i in range(10)]
    expected = [reference(hf, prompt, 6) for prompt in prompts]
    assert min(gap for _, gap in expected) > 1e-4
    scheduler = Scheduler(engine, max_batch=4, max_prefills=4, prefill_batch=3)
    plans = record_plans(scheduler)
    handles = [scheduler.submit(prompt, SamplingParams(6, **GREEDY)) for prompt in prompts]
    scheduler.start()
    results = [list(handle) for handle in handles]
    scheduler.shutdown()
    assert [tokens(events) for events in results] == [want for want, _ in expected]
    assert max(len(group) for plan in plans for group in prefill_groups(plan.prefills, plan.prefill_batch)) == 3


# ---- admission order ------------------------------------------------------------------------------------------------
def first_token_order(scheduler: Scheduler, requests: list[tuple[list[int], SamplingParams]]) -> list[int]:
    """Queue ``requests`` before the scheduler starts, run them all; the request indices in the order their first
    tokens were sent."""
    handles = [scheduler.submit(prompt, params) for prompt, params in requests]
    index = {handle: i for i, handle in enumerate(handles)}
    order = []
    push = scheduler_module.RequestHandle.push

    def recording(handle, event):
        if event.token_id is not None and handle in index and not handle.finished and index[handle] not in order:
            order.append(index[handle])
        push(handle, event)

    scheduler_module.RequestHandle.push = recording
    try:
        scheduler.start()
        for handle in handles:
            assert_one_final_event(list(handle), "length")
    finally:
        scheduler_module.RequestHandle.push = push
        scheduler.shutdown()
    return order


@pytest.mark.parametrize("max_prefills, first_plan", [(1, [3]), (2, [3, 37])])
def test_a_short_prompt_queued_behind_a_long_one_gets_its_first_token_first(max_prefills, first_plan):
    """One prompt per iteration (the default): the short one in the first; two per iteration: both in the first,
    the short one first, and its token goes out before the long prompt's prefill runs."""
    engine = tiny_engine()
    long, short = list(range(3, 40)), [5, 6, 7]
    scheduler = Scheduler(engine, max_batch=2, prefill_chunk=64, max_prefills=max_prefills)
    plans = record_plans(scheduler)
    assert first_token_order(scheduler, [(long, SamplingParams(3, **GREEDY)), (short, SamplingParams(3, **GREEDY))]
                             ) == [1, 0]
    assert [len(chunk) for _, _, chunk in plans[0].prefills] == first_plan
    assert all(len(plan.prefills) <= max_prefills for plan in plans)


@pytest.mark.parametrize("max_overtaken, expected", [(2, [1, 2, 0, 3, 4, 5]), (100, [1, 2, 3, 4, 5, 0])])
def test_an_old_request_is_not_starved_by_a_stream_of_short_ones(max_overtaken, expected):
    """One row, a long prompt queued before five short ones: the short ones overtake it until ``max_overtaken``
    of them have, then it goes next."""
    engine = tiny_engine()
    requests = [(list(range(3, 13)), SamplingParams(2, **GREEDY))] + \
        [([20 + i, 7], SamplingParams(2, **GREEDY)) for i in range(5)]
    scheduler = Scheduler(engine, max_batch=1, max_overtaken=max_overtaken)
    assert first_token_order(scheduler, requests) == expected


def test_decode_steps_go_on_under_a_continuous_stream_of_arrivals():
    """A running request keeps getting a token every iteration while short prompts keep arriving: at most
    ``prefill_chunk`` prompt tokens go between two of its steps, and its tokens equal HF's alone."""
    engine, hf = tiny_engine_and_hf()
    prompt = [5, 9, 33, 7]
    expected, gap = reference(hf, prompt, 40)
    assert gap > 1e-4
    scheduler = Scheduler(engine, max_batch=8, prefill_chunk=8, max_prefills=8)
    plans = record_plans(scheduler)
    scheduler.start()
    running = scheduler.submit(prompt, SamplingParams(40, **GREEDY))
    events = iter(running)
    got = [next(events).token_id]
    arrivals = []
    for i in range(12):  # three short prompts per token: more prompt work than one iteration's budget takes
        arrivals += [scheduler.submit([10 + i, 11, 12, 13], SamplingParams(2, **GREEDY)) for _ in range(3)]
        got.append(next(events).token_id)
    got += tokens(list(events))
    for handle in arrivals:
        assert_one_final_event(list(handle), "length")
    scheduler.shutdown()
    assert got == expected
    admitted = [plan for plan in plans if plan.prefills]
    assert len(admitted) > 4 and all(sum(len(chunk) for _, _, chunk in plan.prefills) <= 8 for plan in plans)
    assert all(plan.step_tokens for plan in admitted[1:])  # from the running request's first token on, a step each


@pytest.mark.slow
def test_compiled_step_greedy_equals_hf_alone(fresh_compiles):
    engine, hf = tiny_engine_and_hf("llama", max_out_tokens=32)
    engine.runtime.compile_decode()
    prompts = [[5, 9, 33, 7], [40, 2, 11, 90, 17, 3, 8], [12, 13], [77, 6, 5, 4, 3]]
    new = [6, 3, 8, 5]
    expected = [reference(hf, prompt, n) for prompt, n in zip(prompts, new)]
    assert min(gap for _, gap in expected) > 1e-4
    results = serve(engine, [(p, SamplingParams(n, **GREEDY)) for p, n in zip(prompts, new)], max_batch=2)
    assert [tokens(events) for events in results] == [want for want, _ in expected]
    batches = {key[0] for key in engine.runtime._compiled_keys}
    assert batches <= {1, 2}  # padded to the batch buckets


# ---- sampling, penalties, logprobs, stop -----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_seed_gives_a_request_its_own_random_stream_alone_and_beside_others(smol):
    """The draws depend on the request's seed only; its logits beside others differ from alone in rounding at most
    (docs/serving.md, "Reproducibility"), which changes a draw only at a near-tie these fixed seeds do not hit."""
    engine, prompts, _, _, _, _ = smol
    seeded = SamplingParams(12, temperature=0.9, top_p=0.95, seed=1234)
    alone = serve(engine, [(prompts[3], seeded)], max_batch=4)[0]
    others = [(prompts[i], SamplingParams(12, temperature=1.0, seed=i)) for i in (0, 5, 9)]
    beside = serve(engine, [others[0], (prompts[3], seeded), *others[1:]], max_batch=4)[1]
    assert tokens(alone) == tokens(beside) and len(tokens(alone)) == 12
    hot = [(prompts[3], SamplingParams(12, temperature=1.5, seed=seed)) for seed in (1, 2)]
    first, second = serve(engine, hot, max_batch=4)
    assert tokens(first) != tokens(second)  # the seed is honoured


@pytest.mark.slow
def test_penalties_and_logprobs_follow_the_reference_logits(smol):
    """Each picked token is the argmax of ``logits - frequency * count - presence * (count > 0)`` over the tokens
    generated so far, the logits recomputed by the unmodified Hugging Face model (fp32); logprobs are log_softmax of
    the raw logits."""
    engine, _, _, _, _, hf = smol
    prompt = hf.config.bos_token_id, *[28, 30, 28, 30, 28, 30, 28, 30, 28, 30]
    prompt = [token for token in prompt if token is not None]
    plain = tokens(serve(engine, [(prompt, SamplingParams(10, **GREEDY))], 1)[0])
    params = SamplingParams(10, presence_penalty=0.5, frequency_penalty=2.0, logprobs=3, **GREEDY)
    events = serve(engine, [(prompt, params)], 1)[0]
    picked = tokens(events)
    assert picked != plain
    counts = torch.zeros(hf.config.vocab_size)
    for i, event in enumerate(events):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + picked[:i]])).logits[0, -1].float()
        penalised = logits - 2.0 * counts - 0.5 * (counts > 0)
        best = penalised.topk(2).values
        assert best[0] - best[1] > 1e-4  # tie-free: rounding cannot decide the token
        assert event.token_id == int(penalised.argmax())
        logprobs = torch.log_softmax(logits, -1)
        assert event.logprob == pytest.approx(float(logprobs[event.token_id]), abs=1e-4)
        top = logprobs.topk(3)
        assert [token for token, _ in event.top_logprobs] == top.indices.tolist()
        assert [value for _, value in event.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        counts[event.token_id] += 1


def test_penalties_lower_the_scores_of_generated_tokens_as_openai_specifies():
    picker = TokenPicker(SamplingParams(4, presence_penalty=0.5, frequency_penalty=1.5, **GREEDY))
    logits = torch.tensor([0.0, 3.0, 2.9, 1.0])
    assert [picker.pick(logits).token for _ in range(3)] == [1, 2, 1]  # 3 - 2 < 2.9; 3 - 2 > 2.9 - 2; ...
    assert picker.counts.tolist() == [0, 2, 1, 0]
    assert torch.allclose(picker.penalise(logits), logits - 1.5 * picker.counts - 0.5 * (picker.counts > 0))


def test_stop_token_ends_the_request_and_is_emitted():
    engine = tiny_engine()
    prompt = [5, 9, 33, 7, 40]
    free = tokens(serve(engine, [(prompt, SamplingParams(12, **GREEDY))], 2)[0])
    stop = free[4]
    events = serve(engine, [(prompt, SamplingParams(12, stop_token_ids=(stop, 127), **GREEDY))], 2)[0]
    assert tokens(events) == free[: free.index(stop) + 1]
    assert_one_final_event(events, "stop")
    assert_one_final_event(serve(engine, [(prompt, SamplingParams(3, **GREEDY))], 2)[0], "length")


# ---- cancel, queue, shutdown, faults, bad input ---------------------------------------------------------------------
def test_cancel_frees_the_row_for_a_queued_request():
    engine = tiny_engine()
    scheduler = Scheduler(engine, max_batch=1, max_queue=4)
    scheduler.start()
    long = scheduler.submit([5, 6, 7], SamplingParams(60, **GREEDY))
    waiting = scheduler.submit([8, 9, 10, 11], SamplingParams(4, **GREEDY))  # longer: it cannot go first
    events = iter(long)
    first = next(events)
    assert first.token_id is not None and scheduler.stats()["queued"] == 1
    long.cancel()
    rest = list(events)
    assert_one_final_event([first, *rest], "cancelled")
    assert rest[-1].token_id is None and len(rest) < 59
    assert_one_final_event(list(waiting), "length")
    scheduler.shutdown()
    assert scheduler.stats() == {"queued": 0, "running": 0, "max_batch": 1, "max_queue": 4}


def test_max_queue_0_refuses_while_every_row_is_busy_and_takes_a_request_once_one_finishes():
    scheduler = Scheduler(tiny_engine(), max_batch=1, max_queue=0)
    scheduler.start()
    busy = scheduler.submit([5, 6, 7], SamplingParams(60, **GREEDY))
    events = iter(busy)
    next(events)
    with pytest.raises(QueueFull, match="max_queue=0"):
        scheduler.submit([8, 9], SamplingParams(3, **GREEDY))
    busy.cancel()
    assert list(events)[-1].finish_reason == "cancelled"
    assert_one_final_event(list(scheduler.submit([8, 9], SamplingParams(3, **GREEDY))), "length")
    scheduler.shutdown()


def test_queue_full_and_shutdown_without_drain_cancels_the_queued():
    scheduler = Scheduler(tiny_engine(), max_batch=1, max_queue=2)  # not started: requests stay queued
    queued = [scheduler.submit([5, 6], SamplingParams(4, **GREEDY)) for _ in range(3)]  # one takes the free row
    with pytest.raises(QueueFull, match="max_queue=2"):
        scheduler.submit([5, 6], SamplingParams(4, **GREEDY))
    scheduler.shutdown(drain=False)
    for handle in queued:
        events = list(handle)
        assert len(events) == 1 and events[0] == TokenEvent(None, None, None, "cancelled")
    with pytest.raises(RuntimeError, match="shutting down"):
        scheduler.submit([5, 6], SamplingParams(4, **GREEDY))


@pytest.mark.parametrize("drain", [True, False])
def test_shutdown_drains_or_cancels_running_and_queued(drain):
    scheduler = Scheduler(tiny_engine(), max_batch=2, max_queue=8)
    handles = [scheduler.submit([5 + i, 6, 7], SamplingParams(60, **GREEDY)) for i in range(5)]
    scheduler.start()
    scheduler.shutdown(drain=drain, timeout=60)
    assert not scheduler._thread.is_alive()
    for handle in handles:
        events = list(handle)
        if drain:
            assert len(tokens(events)) == 60
            assert_one_final_event(events, "length")
        else:
            assert_one_final_event(events, "cancelled")


def test_one_requests_error_leaves_the_others_running(monkeypatch):
    engine, hf = tiny_engine_and_hf()
    prompts = [[5, 9, 33], [7, 40, 2, 11], [12, 13, 14, 15, 16]]
    expected = [reference(hf, prompt, 8)[0] for prompt in prompts]
    pick = TokenPicker.pick

    def failing(self, logits):
        if self.params.seed == 666:
            raise RuntimeError("injected fault")
        return pick(self, logits)

    monkeypatch.setattr(TokenPicker, "pick", failing)
    requests = [(prompts[0], SamplingParams(8, **GREEDY)), (prompts[1], SamplingParams(8, seed=666, **GREEDY)),
                (prompts[2], SamplingParams(8, **GREEDY))]
    results = serve(engine, requests, max_batch=3)
    assert tokens(results[0]) == expected[0] and tokens(results[2]) == expected[2]
    assert_one_final_event(results[1], "error")
    assert "injected fault" in results[1][-1].error


def test_a_failed_batched_step_ends_its_requests_and_the_scheduler_serves_on(monkeypatch):
    engine, hf = tiny_engine_and_hf()
    scheduler = Scheduler(engine, max_batch=2)
    failures = []

    def failing_step(tokens, slots):
        failures.append(len(tokens))
        raise RuntimeError("step fault")

    monkeypatch.setattr(scheduler.runner, "step", failing_step)
    scheduler.start()
    broken = run_all(scheduler, [([5, 6, 7], SamplingParams(5, **GREEDY)), ([8, 9], SamplingParams(5, **GREEDY))])
    for events in broken:
        assert_one_final_event(events, "error")
        assert "step fault" in events[-1].error
    monkeypatch.undo()
    later = run_all(scheduler, [([5, 6, 7], SamplingParams(5, **GREEDY))])[0]
    scheduler.shutdown()
    assert tokens(later) == reference(hf, [5, 6, 7], 5)[0] and failures and scheduler.failed is None


@pytest.mark.parametrize("prompt, params, message", [
    ([5, 128], SamplingParams(4), "prompt token id=128"),
    ([5, -1], SamplingParams(4), "prompt token id=-1"),
    ([], SamplingParams(4), "prompt_ids is empty"),
    ("hello", SamplingParams(4), "prompt_ids='hello'"),
    ([5, 6], SamplingParams(63), "prompt length 2 + max_new_tokens 63 = 65 exceeds max_out_tokens=64"),
    ([5, 6], SamplingParams(4, stop_token_ids=(200,)), "stop_token_ids=200"),
    ([5, 6], {"max_new_tokens": 4}, "params="),
])
def test_bad_submit_raises_naming_the_value_before_queueing(prompt, params, message):
    scheduler = Scheduler(tiny_engine(), max_batch=1)
    with pytest.raises((ValueError, TypeError), match=message.replace("+", r"\+")):
        scheduler.submit(prompt, params)
    assert scheduler.stats()["queued"] == 0


@pytest.mark.parametrize("field, value, message", [
    ("max_new_tokens", 0, "max_new_tokens=0"), ("temperature", -0.5, "temperature=-0.5"),
    ("top_p", 0.0, "top_p=0.0"), ("presence_penalty", 2.5, "presence_penalty=2.5"),
    ("frequency_penalty", float("nan"), "frequency_penalty=nan"), ("logprobs", 21, "logprobs=21"),
    ("seed", 1.5, "seed=1.5"), ("max_new_tokens", True, "max_new_tokens=True"),
])
def test_bad_sampling_params_raise_naming_the_value(field, value, message):
    options = {"max_new_tokens": 4, field: value}
    with pytest.raises((ValueError, TypeError), match=message):
        SamplingParams(**options)


def test_engine_without_native_runtime_and_bad_sizes_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="engine.runtime is None"):
        Scheduler(splice.init_inference(tiny_llama, replace_with_kernel_inject=False))
    with pytest.raises(ValueError, match="max_batch=0"):
        Scheduler(tiny_engine(), max_batch=0)
    with pytest.raises(ValueError, match="max_overtaken=-1"):
        Scheduler(tiny_engine(), max_overtaken=-1)
    with pytest.raises(ValueError, match="prefill_batch=0"):
        Scheduler(tiny_engine(), prefill_batch=0)
    with pytest.raises(ValueError, match="max_prefills=0"):
        Scheduler(tiny_engine(), max_prefills=0)
    with pytest.raises(ValueError, match=r"prefill_batch=4 \(--prefill-batch\) exceeds max_prefills=1 "
                                         r"\(--max-prefills\).*allowed: prefill_batch <= max_prefills"):
        Scheduler(tiny_engine(), max_batch=3, prefill_batch=4)
    with pytest.raises(ValueError, match="this is rank 0 of 1"):
        scheduler_module.follow(tiny_engine())


def test_handles_iterate_on_an_asyncio_loop_and_from_threads():
    engine, hf = tiny_engine_and_hf()
    scheduler = Scheduler(engine, max_batch=2)
    scheduler.start()
    prompts = [[5, 9, 33], [7, 40, 2, 11], [12, 13]]
    expected = [reference(hf, prompt, 6)[0] for prompt in prompts]

    async def collect(handle):
        return [event async for event in handle]

    async def main():
        handles = [scheduler.submit(prompt, SamplingParams(6, **GREEDY)) for prompt in prompts]
        return await asyncio.gather(*(collect(handle) for handle in handles))

    async_results = asyncio.run(main())
    thread_results = [None] * 3

    def consume(i):
        thread_results[i] = list(scheduler.submit(prompts[i], SamplingParams(6, **GREEDY)))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    scheduler.shutdown()
    assert [tokens(events) for events in async_results] == expected
    assert [tokens(events) for events in thread_results] == expected


def test_leaving_an_async_iteration_early_cancels_the_request():
    scheduler = Scheduler(tiny_engine(), max_batch=1)
    scheduler.start()

    async def first_then_leave():
        handle = scheduler.submit([5, 6, 7], SamplingParams(60, **GREEDY))
        async for event in handle:
            break
        return handle, event

    handle, first = asyncio.run(first_then_leave())
    assert first.token_id is not None and handle.cancel_requested
    follow_up = list(scheduler.submit([8, 9], SamplingParams(3, **GREEDY)))  # the row was freed
    scheduler.shutdown()
    assert_one_final_event(follow_up, "length")
