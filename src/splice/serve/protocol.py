"""The OpenAI request bodies the server takes (pydantic models), their checks, and OpenAI's error body.

A request is parsed from the raw body in one place (:func:`parse_request`): malformed JSON, a wrong type, a value out
of range, an unknown field or a field splice accepts but cannot honour all become an :class:`APIError` (HTTP 400 with
``{"error": {"message", "type", "param", "code"}}``) whose message names the bad value and what is allowed.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

#: Largest ``n`` (choices per prompt): each choice is a request of its own in the scheduler's queue.
MAX_N = 16
#: Fields OpenAI's API has that splice accepts and ignores: none changes the output. Those in UNHONOURED_FIELDS
#: ask for something else, which splice does not do.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
#: The ignored fields that ask the server for something it does not do (keep the completion, tag it, give the
#: request a processing tier), with the values that ask nothing: any other value is logged as not honoured.
UNHONOURED_FIELDS = {"store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default")}
#: JSON's names of the types ``json.loads`` returns.
JSON_TYPES = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array"}


class APIError(Exception):
    """An error the server answers with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def shorten(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: a long prompt in an error message would bury the message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text)} characters)"


def json_text(value: Any, limit: int = 40) -> str:
    """``value`` as JSON, cut to ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


Temperature = Annotated[StrictFloat, Field(ge=0, le=2)]
TopP = Annotated[StrictFloat, Field(gt=0, le=1)]
Penalty = Annotated[StrictFloat, Field(ge=-2, le=2)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
StopString = Annotated[StrictStr, Field(min_length=1)]
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """The fields both endpoints share."""
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Annotated[StrictInt, Field(ge=-2**63, lt=2**63)] | None = None
    logit_bias: dict[str, Any] | None = None
    #: not OpenAI's: generate past the model's end-of-sequence tokens (as vLLM's ``ignore_eos``), for benchmarks
    ignore_eos: StrictBool = False
    #: not OpenAI's: logprobs name each token "token_id:ID" instead of its text (as vLLM's option of that name)
    return_tokens_as_token_ids: StrictBool = False
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unhonoured(self) -> dict[str, str]:
        """The fields in UNHONOURED_FIELDS this request sets to a value that asks for something, each with its
        value as JSON."""
        return {name: json_text(getattr(self, name)) for name, nothing in UNHONOURED_FIELDS.items()
                if getattr(self, name) not in nothing}

    def check_supported(self) -> None:
        """Fields splice accepts but cannot honour raise here, naming the field."""
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server; allowed: null or {}", "logit_bias",
                              "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")


class CompletionRequest(SamplingFields):
    prompt: (Annotated[StrictStr, Field(min_length=1)] | Annotated[list[Annotated[StrictStr, Field(min_length=1)]],
                                                                   Field(min_length=1)]
             | TokenIds | Annotated[list[TokenIds], Field(min_length=1)])
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of={self.best_of} is not supported (no server-side ranking of choices); "
                              f"allowed: null or equal to n ({self.n})", "best_of", "unsupported_parameter")
        if self.suffix:
            raise bad_request("suffix is not supported by this server (no insertion); allowed: null or \"\"",
                              "suffix", "unsupported_parameter")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs needs the prompt's logprobs, which this server does not compute; "
                              "allowed: echo or logprobs, not both", "echo", "unsupported_parameter")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    #: OpenAI's chat identifiers of the end user and of a prompt-cache bucket (the successors of ``user``): accepted
    #: and ignored as ``user`` is, for they change nothing about the output
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for index, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise bad_request(f"messages[{index}].content is required in a {message.role} message; allowed: a "
                                  f"string or a list of {{\"type\": \"text\", \"text\": ...}} parts",
                                  f"messages.{index}.content", "missing_required_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise bad_request(f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} "
                              "disagree; allowed: one of them", "max_completion_tokens")

    def chat(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (``developer`` is OpenAI's newer name for ``system``; a
        ``name`` goes to the template, which uses it or not)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                 **({"name": m.name} if m.name is not None else {})} for m in self.messages]


Request = TypeVar("Request", CompletionRequest, ChatCompletionRequest)


def parse_request(body: bytes, kind: type[Request]) -> Request:
    """The request ``kind`` from a raw JSON body; any problem is an :class:`APIError` (400) naming it."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON ({error}); allowed: a JSON object",
                          code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body is a JSON {JSON_TYPES.get(type(data), type(data).__name__)}; allowed: "
                          "a JSON object",
                          code="invalid_json")
    refuse_unsupported_features(data)
    data = {key: value for key, value in data.items() if value is not None or key not in nullable_fields(kind)}
    try:
        request = kind.model_validate(data)
    except ValidationError as error:
        raise validation_error(error) from None
    request.check_supported()
    return request


def nullable_fields(kind: type[Request]) -> set[str]:
    """The fields a null leaves at their default: OpenAI's API takes null for each optional field (``"n": null``,
    ``"stream": null``, ``"tools": null``) as "not given", and clients that send every field rely on that. An unknown
    field stays refused, null or not."""
    optional = {name for name, info in kind.model_fields.items() if not info.is_required()}
    return optional | set(UNSUPPORTED_FEATURES)


#: Features of OpenAI's API that change what the model is asked to do and that splice does not implement.
UNSUPPORTED_FEATURES = ("tools", "tool_choice", "functions", "function_call", "audio", "modalities", "prediction",
                        "web_search_options", "reasoning_effort", "verbosity")


def refuse_unsupported_features(data: dict) -> None:
    for name in UNSUPPORTED_FEATURES:
        if data.get(name) is not None:
            raise bad_request(f"{name} is not supported by this server; allowed: leave it out", name,
                              "unsupported_parameter")


def validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, as OpenAI's 400 body: the field's path, the value given, what is allowed."""
    problems = error.errors(include_url=False)
    first = min(problems, key=lambda p: (PRIORITY.get(p["type"], 2), len(p["loc"])))
    path = [str(part) for part in first["loc"] if not _is_union_branch(part)]
    param = ".".join(path) or None
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unrecognized_argument")
    if first["type"] == "missing":
        return bad_request(f"{param} is required", param, "missing_required_parameter")
    names = [part for part in path if not part.isdigit()]
    allowed = ALLOWED.get(names[-1] if names else "", first["msg"])
    return bad_request(f"{param}={shorten(first.get('input'))} is not allowed; allowed: {allowed}", param)


#: Which of pydantic's errors to report first: a wrong message role or part type says more than the fields that go
#: with it, and an unknown field more than a type error in a union's other branches.
PRIORITY = {"literal_error": 0, "extra_forbidden": 1}


def _is_union_branch(part: Any) -> bool:
    """pydantic names the union member it tried (``str``, ``list[int]``, ...) in an error's location."""
    return isinstance(part, str) and (part.startswith(("list[", "constrained-", "function-")) or part in
                                      ("str", "int", "float", "bool", "TextPart", "ChatMessage", "StreamOptions"))


ALLOWED = {
    "model": "a string, the served model's name",
    "prompt": "a non-empty string, a list of non-empty strings, a list of token ids or a list of such lists",
    "messages": "a non-empty list of {role, content} messages",
    "role": "system, developer, user or assistant",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "type": "\"text\"",
    "text": "a string",
    "name": "a string",
    "max_tokens": "an integer >= 1",
    "max_completion_tokens": "an integer >= 1",
    "temperature": "a number in [0, 2] (0: greedy)",
    "top_p": "a number in (0, 1]",
    "n": f"an integer in [1, {MAX_N}]",
    "stream": "true or false",
    "include_usage": "true or false",
    "stop": "a non-empty string or a list of at most 4 non-empty strings",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "seed": "an integer in [-2**63, 2**63)",
    "logprobs": "an integer in [0, 5] for completions, true or false for chat completions",
    "top_logprobs": "an integer in [0, 20]",
    "echo": "true or false",
    "best_of": "null or equal to n",
    "suffix": "null or a string",
    "logit_bias": "null or {}",
    "ignore_eos": "true or false",
    "return_tokens_as_token_ids": "true or false",
    "response_format": "{\"type\": \"text\"}",
}
