"""The HTTP layer in process (Starlette's TestClient) over a scripted scheduler double: request parsing, OpenAI's
response and chunk shapes, stop strings, streaming, error bodies, metrics. ``test_server.py`` runs the real server."""
from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from splice.serve import app
from tests.serve.doubles import ScriptedScheduler

HELLO = [38699, 905, 30, 1428, 85, 1209]  # " Hello world. Bye now"
JAPANESE = [17097, 241, 115, 40993, 4636, 246, 237]  # " 日本 ✓": characters split across tokens
EOS = 2
ENGINE = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=EOS), config=SimpleNamespace(name_or_path="m"))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from splice.models import resolve_checkpoint

    return AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m-instruct")[0], local_files_only=True)


def client_for(tokenizer, scheduler: ScriptedScheduler) -> TestClient:
    return TestClient(app(ENGINE, tokenizer, model_name="smol", scheduler=scheduler), raise_server_exceptions=False)


def events(response) -> list:
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_completion_text_usage_and_sampling_values(tokenizer):
    scheduler = ScriptedScheduler(HELLO)
    with client_for(tokenizer, scheduler) as client:
        body = client.post("/v1/completions", json={"model": "smol", "prompt": "Hi there", "max_tokens": 4,
                                                    "temperature": 0, "presence_penalty": 0.5}).json()
        assert body["object"] == "text_completion" and body["model"] == "smol" and body["id"].startswith("cmpl-")
        assert body["choices"] == [{"index": 0, "text": " Hello world. By", "logprobs": None,
                                    "finish_reason": "length"}]
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
        prompt, params = scheduler.submitted[0]
        assert prompt == tokenizer("Hi there").input_ids
        assert (params.max_new_tokens, params.temperature, params.presence_penalty, params.stop_token_ids) == \
            (4, 0.0, 0.5, (EOS,))
        client.post("/v1/completions", json={"prompt": [5, 6, 7], "ignore_eos": True})  # OpenAI's defaults
        _, params = scheduler.submitted[1]
        assert (params.max_new_tokens, params.temperature, params.top_p, params.stop_token_ids) == (61, 1.0, 1.0, ())


def test_eos_ends_with_stop_and_no_text(tokenizer):
    with client_for(tokenizer, ScriptedScheduler([7042, 30, EOS, 905])) as client:
        choice = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8}).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" Paris.", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cut_exactly_and_never_streamed(tokenizer, stream):
    scheduler = ScriptedScheduler(HELLO)
    with client_for(tokenizer, scheduler) as client:
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "stop": ["world.", "zz"],
                                                        "stream": stream})
    if stream:
        chunks = events(response)
        texts = [c["choices"][0]["text"] for c in chunks]
        assert "".join(texts) == " Hello " and not any("w" in text for text in texts)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        assert response.json()["choices"][0]["text"] == " Hello "
        assert response.json()["choices"][0]["finish_reason"] == "stop"


def test_held_back_text_is_released_when_no_stop_string_completes(tokenizer):
    with client_for(tokenizer, ScriptedScheduler(HELLO)) as client:
        chunks = events(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "stream": True,
                                                             "stop": "Bye now!"}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == " Hello world. Bye now"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_characters_are_never_split(tokenizer):
    with client_for(tokenizer, ScriptedScheduler(JAPANESE)) as client:
        chunks = events(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 7, "stream": True}))
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == " 日本 ✓" and not any("\ufffd" in text for text in texts)


def test_chat_stream_role_first_usage_last_and_n_choices(tokenizer):
    scheduler = ScriptedScheduler(HELLO)
    with client_for(tokenizer, scheduler) as client:
        chunks = events(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True, "n": 2, "seed": 5,
            "stream_options": {"include_usage": True}}))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == " Hello world"
        assert mine[-1]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert [params.seed for _, params in scheduler.submitted] == [5, 6]  # each choice its own reproducible stream
    prompt = scheduler.submitted[0][0]
    assert prompt == list(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=True)["input_ids"])


def test_logprobs_shapes(tokenizer):
    with client_for(tokenizer, ScriptedScheduler(HELLO)) as client:
        completion = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 2}).json()
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 2, "logprobs": True, "top_logprobs": 1}).json()
        ids = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 0,
                                                   "return_tokens_as_token_ids": True}).json()
    logprobs = completion["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" Hello", " world"] and logprobs["token_logprobs"] == [-0.5, -0.5]
    assert logprobs["text_offset"] == [0, 6] and len(logprobs["top_logprobs"][0]) == 2
    content = chat["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == " Hello" and content[0]["bytes"] == list(b" Hello")
    assert [len(item["top_logprobs"]) for item in content] == [1, 1]
    assert ids["choices"][0]["logprobs"]["tokens"] == ["token_id:38699", "token_id:905"]


def test_partial_character_token_bytes(tokenizer):
    with client_for(tokenizer, ScriptedScheduler(JAPANESE)) as client:
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 3, "logprobs": True}).json()
    raw = b"".join(bytes(item["bytes"]) for item in chat["choices"][0]["logprobs"]["content"])
    assert raw.decode("utf-8") == " 日"


BAD_REQUESTS = [
    (b"{not json", "not valid JSON"),
    (b'["a"]', "the request body is a JSON array; allowed: a JSON object"),
    (b"null", "the request body is a JSON null; allowed: a JSON object"),
    (b"3", "the request body is a JSON number"),
    ({"prompt": ""}, "prompt=''"),
    ({"prompt": []}, "prompt=[]"),
    ({"prompt": [1, 49152]}, "49152"),
    ({"prompt": "x", "max_tokens": 100}, "max_tokens <= 63"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens=0"),
    ({"prompt": "x", "temperature": 2.5}, "temperature=2.5"),
    ({"prompt": "x", "temperature": "hot"}, "temperature='hot'"),
    ({"prompt": "x", "top_p": 0}, "top_p=0"),
    ({"prompt": "x", "n": 0}, "n=0"),
    ({"prompt": "x", "logprobs": 6}, "logprobs=6"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty=-3"),
    ({"prompt": "x", "seed": 2**64}, "seed="),
    ({"prompt": "x", "best_of": 3}, "best_of=3"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"prompt": "x", "top_k": 5}, "top_k"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("body, named", BAD_REQUESTS)
def test_bad_completion_requests_are_400_naming_the_value(tokenizer, body, named):
    with client_for(tokenizer, ScriptedScheduler(HELLO)) as client:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = client.post("/v1/completions", **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, named", [
    ({"messages": []}, "messages=[]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "'robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/x"}}]}]},
     "'image_url'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 6}, "disagree"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "json_object"),
    ({"messages": [{"role": "user"}]}, "messages[0].content is required in a user message"),
    ({"messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": None}]},
     "messages[1].content is required in a user message"),
    ({"messages": [{"role": "system"}, {"role": "user", "content": "x"}]},
     "messages[0].content is required in a system message"),
])
def test_bad_chat_requests_are_400_naming_the_value(tokenizer, body, named):
    with client_for(tokenizer, ScriptedScheduler(HELLO)) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and named in response.json()["error"]["message"], response.text


def test_a_message_without_content_names_its_param(tokenizer):
    with client_for(tokenizer, ScriptedScheduler(HELLO)) as client:
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages.0.content", error
    assert error["code"] == "missing_required_parameter" and "allowed: a string or a list of" in error["message"]


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}),
])
def test_an_unknown_model_is_404_as_openai_answers_it(tokenizer, route, body):
    scheduler = ScriptedScheduler(HELLO)
    with client_for(tokenizer, scheduler) as client:
        response = client.post(route, json=body)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert "'gpt-4'" in error["message"] and "allowed: 'smol'" in error["message"] and scheduler.submitted == []


def test_fields_accepted_but_not_honoured_are_logged_once_each(tokenizer, caplog):
    asks = {"store": True, "service_tier": "flex", "metadata": {"team": "a"}}
    asks_nothing = {"store": False, "service_tier": "auto", "metadata": {}, "user": "u"}
    with client_for(tokenizer, ScriptedScheduler(HELLO)) as client, caplog.at_level("WARNING", "splice.serve"):
        quiet = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **asks_nothing})
        assert quiet.status_code == 200 and caplog.records == [], caplog.text
        said = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **asks})
        again = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "max_tokens": 1, **asks})
    assert said.status_code == 200 and again.status_code == 200
    [record] = caplog.records  # each field once per server
    assert record.levelname == "WARNING" and "accepts but does not honour" in record.getMessage()
    assert 'store=true, metadata={"team": "a"}, service_tier="flex"' in record.getMessage(), record.getMessage()


def test_an_empty_model_name_is_refused():
    with pytest.raises(ValueError, match="model_name='' is a name no client could pass as model"):
        app(ENGINE, None, model_name="", scheduler=ScriptedScheduler(HELLO))


@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 100}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100},
     "max_completion_tokens"),
])
def test_a_too_long_request_names_the_field_the_client_sent(tokenizer, route, body, field):
    with client_for(tokenizer, ScriptedScheduler(HELLO)) as client:
        response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == "context_length_exceeded", error
    assert f"allowed: {field} <= " in error["message"], error


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": [5] * 64, "max_tokens": 1}),
    ("/v1/completions", {"prompt": [5] * 70}),
])
def test_a_prompt_that_leaves_no_room_is_named_whatever_max_tokens_says(tokenizer, route, body):
    """No max_tokens fits after a prompt of max_len tokens: the error names the prompt and its limit, never a
    max_tokens bound below 1."""
    with client_for(tokenizer, ScriptedScheduler(HELLO)) as client:
        response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded", error
    assert "allowed: at most 63 prompt tokens" in error["message"] and "<=" not in error["message"], error


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "x", "n": None, "stream": None, "echo": None, "ignore_eos": None, "suffix": None,
                         "best_of": None, "logprobs": None, "stop": None, "seed": None, "user": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": None}], "n": None,
                              "stream": None, "logprobs": None, "top_logprobs": None, "response_format": None,
                              "tools": None, "tool_choice": None, "functions": None, "function_call": None,
                              "max_completion_tokens": None, "stream_options": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "safety_identifier": "h-123",
                              "prompt_cache_key": "k", "user": "u"}),
])
def test_null_leaves_an_optional_field_at_its_default(tokenizer, route, body):
    """OpenAI's API takes null for an optional field as "not given"; clients that send every field rely on it. The
    chat identifiers (``safety_identifier``, ``prompt_cache_key``) are accepted and change nothing, as ``user``."""
    scheduler = ScriptedScheduler(HELLO)
    with client_for(tokenizer, scheduler) as client:
        response = client.post(route, json={**body, "max_tokens": 2})
        unknown = client.post(route, json={**body, "max_tokens": 2, "top_k": None})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 1 and choices[0]["logprobs"] is None and choices[0]["finish_reason"] == "length"
    assert len(scheduler.submitted) == 1 and scheduler.submitted[0][1].stop_token_ids == (EOS,)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "top_k", unknown.text


def test_a_chat_template_refusing_the_messages_is_400(tokenizer):
    strict = copy.deepcopy(tokenizer)  # the module's tokenizer keeps its own template
    strict.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must "
                            "start with user') }}{% endif %}{% for m in messages %}{{ m['role'] }}: "
                            "{{ m['content'] }}\n{% endfor %}")
    messages = [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "x"}]
    with client_for(strict, ScriptedScheduler(HELLO)) as client:
        refused = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        accepted = client.post("/v1/chat/completions", json={"messages": messages[1:], "max_tokens": 2})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "messages" and error["code"] == "invalid_messages", error
    assert error["type"] == "invalid_request_error" and "must start with user" in error["message"], error
    assert accepted.status_code == 200, accepted.text


def test_full_queue_is_429_with_retry_after_and_unknown_routes_404(tokenizer):
    with client_for(tokenizer, ScriptedScheduler(HELLO, full=True)) as client:
        busy = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        missing = client.get("/v1/engines")
        wrong_method = client.get("/v1/completions")
        metrics = client.get("/metrics").text
    assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
    assert busy.json()["error"]["code"] == "queue_full"
    assert missing.status_code == 404 and "/v1/engines" in missing.json()["error"]["message"]
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert 'splice_requests_total{endpoint="/v1/completions",status="429"} 1.0' in metrics
    assert 'splice_requests_total{endpoint="other",status="404"} 1.0' in metrics


def test_a_failed_request_is_500_without_traceback(tokenizer):
    with client_for(tokenizer, ScriptedScheduler(HELLO, fail_with="the batched step failed: boom")) as client:
        plain = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        streamed = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    assert plain.status_code == 500 and "boom" in plain.json()["error"]["message"]
    assert "Traceback" not in plain.text
    assert events(streamed)[-1]["error"]["code"] == "generation_failed"


def test_unexpected_errors_are_500_in_the_error_shape(tokenizer):
    scheduler = ScriptedScheduler(HELLO)
    scheduler.submit = lambda *args: (_ for _ in ()).throw(KeyError("internal detail"))
    with client_for(tokenizer, scheduler) as client:
        response = client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    assert "internal detail" not in response.text and "Traceback" not in response.text


def test_models_health_and_echo(tokenizer):
    with client_for(tokenizer, ScriptedScheduler(HELLO)) as client:
        models = client.get("/v1/models").json()
        health = client.get("/health")
        echo = client.post("/v1/completions", json={"prompt": ["A", "B"], "max_tokens": 1, "echo": True}).json()
    assert models["data"][0]["id"] == "smol" and models["data"][0]["max_model_len"] == 64
    assert health.status_code == 200
    assert [(c["index"], c["text"]) for c in echo["choices"]] == [(0, "A Hello"), (1, "B Hello")]


def test_a_failed_or_closed_scheduler_is_503(tokenizer):
    scheduler = ScriptedScheduler(HELLO)
    scheduler.submit = lambda *args: (_ for _ in ()).throw(RuntimeError("the scheduler takes no more requests"))
    with client_for(tokenizer, scheduler) as client:
        closed = client.post("/v1/completions", json={"prompt": "x"})
        scheduler.failed = RuntimeError("rank 1 lost")
        health = client.get("/health")
    assert closed.status_code == 503 and closed.headers["Retry-After"] == "1"
    assert health.status_code == 503 and "rank 1 lost" in health.json()["error"]["message"]


# --- more choices than the scheduler can hold -------------------------------------------------------------------------
@pytest.mark.parametrize("route, body, param, named", [
    ("/v1/completions", {"prompt": [[5, 6]] * 3, "n": 2}, "n", "3 prompts x n=2 is 6 choices; allowed: at most 4"),
    ("/v1/completions", {"prompt": [[5, 6]] * 5}, "prompt", "prompt has 5 prompts; allowed: at most 4"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 5}, "n",
     "n=5 is 5 choices; allowed: at most 4"),
])
def test_more_choices_than_rows_and_queue_places_are_400_naming_the_limit(tokenizer, route, body, param, named):
    """Each choice is a request of its own in the scheduler: a request with more than max_batch + max_queue of them
    could never be queued whole, so it is refused as bad input (not a 429 to retry) before anything is queued."""
    scheduler = ScriptedScheduler(HELLO, max_batch=2, max_queue=2)
    with client_for(tokenizer, scheduler) as client:
        response = client.post(route, json={**body, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and named in error["message"], error
    assert "max_batch 2 + max_queue 2" in error["message"] and scheduler.submitted == []


def test_an_idle_server_takes_as_many_choices_as_it_has_rows_and_queue_places(tokenizer):
    """The real scheduler (2 rows, 2 queue places, a tiny fp32 Llama): 4 choices are served at once, 6 are a 400."""
    import torch

    import splice
    from tests.arch.tiny_models import build_family

    engine = splice.init_inference(build_family("llama"), dtype=torch.float32, replace_with_kernel_inject=True,
                                   max_out_tokens=32)
    with TestClient(app(engine, tokenizer, model_name="smol", max_batch=2, max_queue=2),
                    raise_server_exceptions=False) as client:
        body = {"prompt": [[5, 6], [7, 8]], "n": 2, "max_tokens": 2, "temperature": 0}
        served = client.post("/v1/completions", json=body)
        refused = client.post("/v1/completions", json={**body, "prompt": [[5, 6], [7, 8], [9, 10]]})
    assert served.status_code == 200, served.text
    assert [choice["index"] for choice in served.json()["choices"]] == [0, 1, 2, 3]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n", refused.text


# --- text_offset ------------------------------------------------------------------------------------------------------
def completion_logprobs_both_ways(tokenizer, script, body) -> tuple[dict, list[dict]]:
    """The choice of a plain completion and the choices of the streamed chunks of the same request."""
    with client_for(tokenizer, ScriptedScheduler(script)) as client:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]
        chunks = events(client.post("/v1/completions", json={**body, "stream": True}))
    return whole, [chunk["choices"][0] for chunk in chunks]


def streamed_logprobs(choices: list[dict]) -> tuple[str, list[str], list[int]]:
    text, tokens, offsets = "", [], []
    for choice in choices:
        text += choice["text"]
        if choice["logprobs"]:
            tokens += choice["logprobs"]["tokens"]
            offsets += choice["logprobs"]["text_offset"]
    return text, tokens, offsets


@pytest.mark.parametrize("stop, text, offsets", [
    (None, " 日本 ✓", [0, 1, 1, 2, 3, 4, 4]),
    ("本", " 日", [0, 1, 1]),  # the token of 本 starts where the text ends: its entry is cut with it
])
def test_text_offset_is_each_tokens_character_offset_streamed_or_not(tokenizer, stop, text, offsets):
    """OpenAI's text_offset: where each token starts in the returned text. A token holding part of a multi-byte
    character starts where that character starts (the first, holding the space as well, at the space); the streamed
    offsets are the same, absolute in the choice's text."""
    body = {"prompt": "x", "max_tokens": 7, "logprobs": 1, **({"stop": stop} if stop else {})}
    whole, chunks = completion_logprobs_both_ways(tokenizer, JAPANESE, body)
    assert whole["text"] == text and whole["logprobs"]["text_offset"] == offsets
    assert streamed_logprobs(chunks) == (text, whole["logprobs"]["tokens"], offsets)
    assert offsets == sorted(offsets) and all(0 <= offset < len(text) for offset in offsets)


def test_streamed_logprobs_go_out_with_their_text_and_a_stop_string_cuts_them(tokenizer):
    """With stop "aab" the text "a", "a", "a" is held back in part; the entries of tokens whose text is held back
    wait for it, so the stream never sends an entry the stop string then cuts ("a" + "ab" ends the text at "a")."""
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    body = {"prompt": "x", "max_tokens": 4, "logprobs": 0, "stop": "aab"}
    whole, chunks = completion_logprobs_both_ways(tokenizer, [a, a, a, b], body)
    assert (whole["text"], whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"]) == ("a", ["a"], [0])
    assert streamed_logprobs(chunks) == ("a", ["a"], [0])


# --- end-of-sequence tokens -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_an_end_of_sequence_token_that_is_a_regular_token_is_not_in_the_text(tokenizer, stream):
    """generation_config.eos_token_id [2, 30] (30 is "."): the "." ends the choice (finish_reason "stop") and, as a
    stop string would, is left out of the text; it counts as a completion token and has its logprob entry, at the
    end of the text."""
    engine = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[EOS, 30]),
                             config=SimpleNamespace(name_or_path="m"))
    with TestClient(app(engine, tokenizer, model_name="smol", scheduler=ScriptedScheduler(HELLO)),
                    raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "logprobs": 0,
                                                        "stream": stream, **({"stream_options": {
                                                            "include_usage": True}} if stream else {})})
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 6, "stream": stream})
    if stream:
        chunks = events(response)
        text, tokens, offsets = streamed_logprobs([c["choices"][0] for c in chunks if c["choices"]])
        finish, usage = chunks[-2]["choices"][0]["finish_reason"], chunks[-1]["usage"]
        chat_chunks = [c["choices"][0] for c in events(chat)]
        chat_text = "".join(c["delta"].get("content", "") for c in chat_chunks)
    else:
        choice, usage = response.json()["choices"][0], response.json()["usage"]
        text, finish = choice["text"], choice["finish_reason"]
        tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
        chat_text = chat.json()["choices"][0]["message"]["content"]
    assert (text, finish, usage["completion_tokens"]) == (" Hello world", "stop", 3)
    assert (tokens, offsets) == ([" Hello", " world", "."], [0, 6, 12])
    assert chat_text == " Hello world"


# --- metrics ----------------------------------------------------------------------------------------------------------
def test_failed_and_cancelled_choices_are_counted_and_model_routes_share_a_label(tokenizer):
    """n=2: choice 0 fails, so choice 1 (still running) is cancelled; each counts once by its finish reason. A stop
    string that ends a choice counts as "stop" (the cancellation it sends is not counted again)."""
    scheduler = ScriptedScheduler(HELLO, fail_with="boom", fail_seeds=(10,), endless=True)
    with client_for(tokenizer, scheduler) as client:
        failed = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "n": 2, "seed": 10})
        stopped = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stop": "Hel"})
        card = client.get("/v1/models/smol")
        missing = client.get("/v1/models/other")
        metrics = client.get("/metrics").text
    assert failed.status_code == 500 and stopped.json()["choices"][0]["finish_reason"] == "stop"
    assert len(scheduler.cancelled) == 2  # choice 1 of the first request, and the stopped one
    finished = sorted(line for line in metrics.splitlines() if line.startswith("splice_request_finished_total"))
    assert finished == ['splice_request_finished_total{reason="cancelled"} 1.0',
                        'splice_request_finished_total{reason="error"} 1.0',
                        'splice_request_finished_total{reason="stop"} 1.0']
    assert card.status_code == 200 and missing.status_code == 404
    assert 'splice_requests_total{endpoint="/v1/models",status="200"} 1.0' in metrics
    assert 'splice_requests_total{endpoint="/v1/models",status="404"} 1.0' in metrics


def test_a_client_that_leaves_a_plain_request_is_499_not_a_server_error(tokenizer):
    """The disconnect cancels the request; the metrics count it as the client's doing (499), not as a 500."""
    scheduler = ScriptedScheduler(HELLO, endless=True)
    api = app(ENGINE, tokenizer, model_name="smol", scheduler=scheduler)
    body = json.dumps({"prompt": "x", "max_tokens": 4}).encode()
    sent = []

    async def run() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]

        async def receive():
            return messages.pop(0) if messages else await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b"",
                 "http_version": "1.1", "scheme": "http", "server": ("test", 80), "client": ("test", 1),
                 "root_path": "", "raw_path": b"/v1/completions", "app": api}
        await asyncio.wait_for(api(scope, receive, send), 10)

    asyncio.run(run())
    assert sent[0]["status"] == 499 and len(scheduler.cancelled) == 1
    metrics = api.state.service.metrics.render().decode()
    assert 'splice_requests_total{endpoint="/v1/completions",status="499"} 1.0' in metrics
    assert 'status="500"' not in metrics
    assert 'splice_request_finished_total{reason="cancelled"} 1.0' in metrics
