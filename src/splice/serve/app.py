"""The OpenAI-compatible HTTP app over a :class:`~splice.serve.scheduler.Scheduler`.

``app(engine, tokenizer)`` returns a FastAPI (ASGI) app: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Every generation request becomes one scheduler request per
choice (``n`` and a list of prompts multiply them); its tokens come back as events, which :class:`ChoiceRun` turns
into text (incremental detokenization, stop strings, logprobs) for a JSON response or a server-sent-event stream.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import RequestCounter, ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields, bad_request, error_body
from .protocol import parse_request, shorten
from .scheduler import QueueFull, SamplingParams, Scheduler
from .text import IncrementalDecoder, StopStrings, TokenLogprob, TokenText, chat_logprobs, completion_logprobs

log = logging.getLogger("splice.serve")
#: Seconds a client told "queue full" (429) is asked to wait before retrying.
RETRY_AFTER_S = 1
#: The status a plain request whose client went away ends with (nginx's "client closed request"), so that
#: ``splice_requests_total`` does not count it as a server error; the client never receives it.
CLIENT_CLOSED = 499


def app(engine, tokenizer, *, model_name: str | None = None, max_batch: int = 8, max_queue: int = 64,
        max_prefills: int = 1, prefill_batch: int = 1, scheduler: Scheduler | None = None) -> FastAPI:
    """The ASGI app serving ``engine`` (from ``init_inference`` with kernel injection) and ``tokenizer``.

    ``model_name``: the name clients give as ``model`` (default: the model's ``name_or_path``). Without
    ``scheduler`` the app builds one (``max_batch`` rows stepped together, ``max_queue`` requests waiting beyond them,
    ``max_prefills`` prompts admitted per iteration, ``prefill_batch`` of them prefilled in one forward: see
    :class:`~splice.serve.scheduler.Scheduler`), starts it when the app starts and drains it when the app shuts down
    (running and queued requests finish). A ``scheduler`` passed in is the caller's to start and shut down; these
    parameters are then its own.
    """
    if model_name is not None and not model_name.strip():
        raise ValueError(f"model_name={model_name!r} is a name no client could pass as model; allowed: a non-empty "
                         "name, or None for the model's own")
    owned = scheduler is None
    if owned:
        scheduler = Scheduler(engine, max_batch=max_batch, max_queue=max_queue, max_prefills=max_prefills,
                              prefill_batch=prefill_batch)  # refuses an engine it cannot step
    service = Service(scheduler, tokenizer, model_name or default_model_name(engine), stop_token_ids(engine,
                                                                                                     tokenizer))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if owned:
            scheduler.start()
        watcher = asyncio.create_task(watch_for_failure(scheduler))
        try:
            yield
        finally:
            watcher.cancel()
            if owned:
                await asyncio.to_thread(scheduler.shutdown, drain=True)

    api = FastAPI(title="splice", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    api.state.service = service
    add_error_handlers(api)
    add_routes(api, service)
    api.add_middleware(RequestCounter, metrics=service.metrics)
    return api


def default_model_name(engine) -> str:
    config = getattr(engine, "config", None)
    return str(getattr(config, "name_or_path", "") or "splice")


def stop_token_ids(engine, tokenizer) -> tuple[int, ...]:
    """The end-of-sequence ids of the model's generation config and of the tokenizer: generation stops at any."""
    ids: list[int] = []
    generation_config = getattr(engine, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for token_id in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


async def watch_for_failure(scheduler: Scheduler, period_s: float = 0.5) -> None:
    """Logs once the scheduler failed (a rank of a tensor-parallel server died); ``/health`` then answers 503 and the
    command line ends the server."""
    while getattr(scheduler, "failed", None) is None:
        await asyncio.sleep(period_s)
    log.error("splice serve: the scheduler failed: %s", scheduler.failed)


# --- what the endpoints share ---------------------------------------------------------------------------------------
class Service:
    def __init__(self, scheduler: Scheduler, tokenizer, model_name: str, stop_ids: tuple[int, ...]):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.stop_ids = stop_ids
        self.token_text = TokenText(tokenizer)
        self.created = int(time.time())
        self.metrics = ServerMetrics(scheduler.stats)
        self.unhonoured_said: set[str] = set()

    def check_model(self, name: str | None) -> None:
        """A name that is not the served model's is a 404, as OpenAI answers a model that does not exist."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model {shorten(name)} does not exist; allowed: {self.model_name!r}",
                           param="model", code="model_not_found")

    def warn_unhonoured(self, body: SamplingFields) -> None:
        """Logs the fields a request sets that ask for what the server does not do (store the completion, a service
        tier): accepted, as OpenAI's clients send them, but not honoured. Each field is logged once per server, so
        a client sending it with every request does not flood the log."""
        fields = {name: value for name, value in body.unhonoured().items() if name not in self.unhonoured_said}
        if fields:
            self.unhonoured_said.update(fields)
            log.warning("splice serve: a request sets %s, which this server accepts but does not honour (nothing is "
                        "stored, every request runs alike); said once per field",
                        ", ".join(f"{name}={value}" for name, value in fields.items()))

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt).input_ids)
            if not ids:
                raise bad_request(f"{param}={shorten(prompt)} has no tokens; allowed: a non-empty prompt", param)
            return ids
        vocab = self.scheduler.vocab_size
        bad = next((token for token in prompt if not 0 <= token < vocab), None)
        if bad is not None:
            raise bad_request(f"{param} has token id {bad}; allowed: ids in [0, {vocab})", param)
        return list(prompt)

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(f"the model {self.model_name!r} has no chat template; allowed: /v1/completions",
                              "messages", "no_chat_template")
        try:
            encoded = self.tokenizer.apply_chat_template(body.chat(), add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)
        except (TemplateError, ValueError) as error:
            # the template's own check of the conversation (raise_exception: role order, an unsupported system role)
            raise bad_request(f"the model's chat template refuses these messages: {error}; allowed: messages in the "
                              "roles and order the model's chat template accepts", "messages",
                              "invalid_messages") from None
        return list(encoded["input_ids"])

    def sampling_params(self, body: SamplingFields, prompt_len: int, max_tokens: int | None, param: str,
                        logprobs: int | None, seed: int | None, max_tokens_param: str = "max_tokens") -> SamplingParams:
        """``max_tokens_param``: the field the client gave ``max_tokens`` in, named when it is too large."""
        limit = self.scheduler.max_len
        if prompt_len >= limit:  # no max_tokens would fit: the prompt is what is too long
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the {param} has "
                                f"{prompt_len}, which leaves no room for a completion; allowed: at most "
                                f"{limit - 1} prompt tokens", param=param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; you requested "
                                f"{prompt_len + max_tokens} ({prompt_len} in the {param}, {max_tokens} for the "
                                f"completion); allowed: {max_tokens_param} <= {limit - prompt_len}",
                           param=max_tokens_param, code="context_length_exceeded")
        temperature = 1.0 if body.temperature is None else body.temperature
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p, seed=seed,
                                  stop_token_ids=() if body.ignore_eos else self.stop_ids,
                                  presence_penalty=body.presence_penalty or 0.0,
                                  frequency_penalty=body.frequency_penalty or 0.0, logprobs=logprobs)
        except (ValueError, TypeError) as error:
            raise bad_request(str(error)) from None

    def submit(self, jobs: Sequence[Job]) -> list[Any]:
        """Every job to the scheduler, or none: a full queue (429) or a refused prompt (400) cancels those already
        queued."""
        handles = []
        try:
            for job in jobs:
                handles.append(self.scheduler.submit(job.prompt_ids, job.params))
        except BaseException as error:
            for handle in handles:
                handle.cancel()
            raise submit_error(error) from None
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in distinct_prompts(jobs)))
        return handles


def submit_error(error: BaseException) -> BaseException:
    if isinstance(error, QueueFull):
        return APIError(429, f"The server is busy: {error}; retry after {RETRY_AFTER_S} s", type="rate_limit_error",
                        code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, ValueError):
        return bad_request(str(error))
    if isinstance(error, RuntimeError):
        return APIError(503, f"The server is not accepting requests: {error}", type="server_error",
                        code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
    return error


@dataclass
class Job:
    """One choice to generate: its prompt (shared by the choices of one prompt) and sampling parameters."""
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""


def distinct_prompts(jobs: Sequence[Job]) -> list[list[int]]:
    """Each prompt once, however many choices it has (the choices of one prompt share its list)."""
    return list({id(job.prompt_ids): job.prompt_ids for job in jobs}.values())


def jobs_for(service: Service, body: SamplingFields, prompts: list[list[int]], max_tokens: int | None, param: str,
             logprobs: int | None, echo: Sequence[str] = (), max_tokens_param: str = "max_tokens") -> list[Job]:
    """``n`` jobs per prompt, indexed as OpenAI indexes choices (prompt-major); a seed gives each choice its own
    reproducible stream (seed + index). ``max_tokens_param`` is the field ``max_tokens`` came from."""
    check_choices(service, len(prompts), body.n)
    jobs = []
    for number, ids in enumerate(prompts):
        for copy in range(body.n):
            index = number * body.n + copy
            seed = None if body.seed is None else body.seed + index
            params = service.sampling_params(body, len(ids), max_tokens, param, logprobs, seed, max_tokens_param)
            jobs.append(Job(index, ids, params, echo[number] if echo else ""))
    return jobs


def check_choices(service: Service, prompts: int, n: int) -> None:
    """A request whose choices outnumber the scheduler's rows and queue places together could never be queued whole
    (each choice is a request of its own in the scheduler, all submitted at once): a 400, not a 429 to retry."""
    stats = service.scheduler.stats()
    most = stats["max_batch"] + stats["max_queue"]
    limits = f"max_batch {stats['max_batch']} + max_queue {stats['max_queue']}"
    if prompts > most:
        raise bad_request(f"prompt has {prompts} prompts; allowed: at most {most} ({limits}: each prompt's choices are "
                          "requests of their own in the server's batch and queue)", "prompt")
    if prompts * n > most:
        count = f"{prompts} prompts x n={n}" if prompts > 1 else f"n={n}"
        raise bad_request(f"{count} is {prompts * n} choices; allowed: at most {most} choices per request ({limits}: "
                          f"each choice is a request of its own in the server's batch and queue), n <= "
                          f"{most // prompts} here", "n")


# --- one choice: scheduler events to text ---------------------------------------------------------------------------
class GenerationFailed(Exception):
    """A choice ended with the scheduler's "error" or "cancelled" event."""


@dataclass
class Piece:
    """Text a choice can emit now, the logprob entries of the tokens behind it, and its finish reason at the end."""
    text: str
    entries: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceRun:
    """The events of one scheduler request as :class:`Piece` s, timing its tokens into the metrics."""

    def __init__(self, job: Job, handle, service: Service, body: SamplingFields, arrived: float):
        self.job, self.handle, self.service = job, handle, service
        self.tokens_as_ids = body.return_tokens_as_token_ids
        self.decoder = IncrementalDecoder(service.tokenizer, job.prompt_ids)
        self.stops = StopStrings(body.stop_strings())
        self.arrived = arrived
        self.first_token_s: float | None = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._entries: list[TokenLogprob] = []  # logprob entries not handed out yet

    async def pieces(self) -> AsyncIterator[Piece]:
        last = None  # when the previous token arrived
        async for event in self.handle:
            reason = event.finish_reason
            if reason in ("cancelled", "error"):
                self._finish(reason)
                raise GenerationFailed(event.error or f"the request was {reason}")
            delta = ""
            if event.token_id is not None:
                last = self._count_token(last)
                # an end-of-sequence token ends the text as a stop string does: it is not part of it
                ends = reason == "stop" and event.token_id in self.job.params.stop_token_ids
                delta = self._take_token(event, text=not ends)
            if reason is not None:
                delta += self.decoder.flush()
            text = self.stops.feed(delta)
            if self.stops.stopped:
                reason = "stop"
                self.handle.cancel()  # its row is free at the next step
            elif reason is not None:
                text += self.stops.flush()
            if reason is not None:
                self._finish(reason)
            if text or reason is not None:
                yield self._piece(text, reason)
            if reason is not None:
                return

    def _count_token(self, last: float | None) -> float:
        """Time to first token or the gap since the previous one, into the metrics; the arrival time."""
        now, metrics = time.perf_counter(), self.service.metrics
        if last is None:
            self.first_token_s = now - self.arrived
            metrics.ttft.observe(self.first_token_s)
        else:
            metrics.itl.observe(now - last)
        self.completion_tokens += 1
        metrics.generated_tokens.inc()
        return now

    def _take_token(self, event, text: bool = True) -> str:
        """The token's new text ("" without ``text``), its logprob entry kept when asked for."""
        if self.job.params.logprobs is not None:
            self._entries.append(self.service.token_text.entry(event.token_id, event.logprob,
                                                               event.top_logprobs or (), self.tokens_as_ids,
                                                               self.decoder.offset))
        return self.decoder.push(event.token_id) if text else ""

    def _finish(self, reason: str) -> None:
        """Counts the choice once, by its finish reason (the first one it got: a choice cancelled here may still
        receive the final event the scheduler sent before it saw the cancellation)."""
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self.service.metrics.finished.labels(reason).inc()
        if reason in ("stop", "length"):
            self.service.metrics.duration.observe(time.perf_counter() - self.arrived)

    def _piece(self, text: str, reason: str | None) -> Piece:
        """A piece with the entries of the tokens that start within the text handed out so far; the last piece
        also takes those at the end of the text (an end-of-sequence token), unless a stop string cut the text."""
        if reason is not None and not self.stops.stopped:
            handed = len(self._entries)
        else:  # offsets never decrease: the entries to hand out are the first ones
            handed = sum(entry.offset < self.stops.emitted for entry in self._entries)
        entries, self._entries = self._entries[:handed], self._entries[handed:]
        return Piece(text, entries, reason)

    def cancel_if_running(self) -> None:
        """Cancels the choice unless it finished; it counts as "cancelled"."""
        if self.finish_reason is None:
            self._finish("cancelled")
            self.handle.cancel()


async def collect(run: ChoiceRun) -> tuple[str, list[TokenLogprob]]:
    text, entries = [], []
    async for piece in run.pieces():
        text.append(piece.text)
        entries += piece.entries
    return "".join(text), entries


# --- responses ------------------------------------------------------------------------------------------------------
def usage(jobs: Sequence[Job], runs: Sequence[ChoiceRun]) -> dict[str, int]:
    prompt = sum(len(ids) for ids in distinct_prompts(jobs))
    completion = sum(run.completion_tokens for run in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class Call:
    """One HTTP generation request: its kind (``completions`` or ``chat``), id and the runs of its choices."""
    kind: str
    body: SamplingFields
    jobs: list[Job]
    runs: list[ChoiceRun]
    id: str
    created: int
    model: str

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def header(self, object_name: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": object_name or self.object, "created": self.created, "model": self.model}

    def logprobs(self, run: ChoiceRun, entries: list[TokenLogprob]) -> dict | None:
        """The logprobs of ``entries`` (a whole choice's or a chunk's: their offsets are the same in both)."""
        if run.job.params.logprobs is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries, run.service.token_text)
        return completion_logprobs(entries, len(run.job.echo))

    def log(self, started: float, outcome: str = "") -> None:
        ttfts = [f"{run.first_token_s:.3f}" for run in self.runs if run.first_token_s is not None]
        log.info("%s %s prompt_tokens=%d completion_tokens=%d finish=%s ttft_s=%s total_s=%.3f%s", self.id,
                 self.kind, usage(self.jobs, self.runs)["prompt_tokens"], sum(r.completion_tokens for r in self.runs),
                 ",".join(str(run.finish_reason) for run in self.runs), ",".join(ttfts) or "-",
                 time.perf_counter() - started, f" {outcome}" if outcome else "")


async def respond(call: Call, request: Request, started: float) -> dict[str, Any]:
    """The whole response once every choice finished; a client that goes away cancels its choices."""
    watcher = asyncio.create_task(cancel_on_disconnect(request, call.runs))
    outcome = ""
    try:
        results = await asyncio.gather(*(collect(run) for run in call.runs))
    except GenerationFailed as error:
        if watcher.done():  # the client went away: nobody reads this answer, and no server error happened
            outcome = "disconnected"
            raise APIError(CLIENT_CLOSED, "the client closed the connection before the response",
                           code="client_closed_request") from None
        outcome = f"failed: {error}"
        raise APIError(500, f"generation failed: {error}", type="server_error", code="generation_failed") from None
    finally:
        watcher.cancel()
        for run in call.runs:
            run.cancel_if_running()
        call.log(started, outcome)
    choices = []
    for run, (text, entries) in zip(call.runs, results):
        choice: dict[str, Any] = {"index": run.job.index}
        if call.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = run.job.echo + text
        choice["logprobs"] = call.logprobs(run, entries)
        choice["finish_reason"] = run.finish_reason
        choices.append(choice)
    return {**call.header(), "choices": choices, "usage": usage(call.jobs, call.runs)}


async def cancel_on_disconnect(request: Request, runs: Sequence[ChoiceRun]) -> None:
    """Waits for the client to disconnect (the body was read, so the next message is the disconnect), then cancels
    the choices still running."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for run in runs:
        run.cancel_if_running()


async def stream(call: Call, started: float) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``. The choices run side by side; a
    client that disconnects cancels this generator, which cancels them."""
    include_usage = bool(call.body.stream_options and call.body.stream_options.include_usage)
    outcome = "disconnected"
    try:
        for run in call.runs:
            if call.kind == "chat":
                yield sse(chunk(call, run, {"delta": {"role": "assistant", "content": ""}}))
            elif run.job.echo:
                yield sse(chunk(call, run, {"text": run.job.echo}))
        async for run, piece in side_by_side(call.runs):
            if isinstance(piece, GenerationFailed):
                yield sse(error_body(f"generation failed: {piece}", "server_error", None, "generation_failed"))
                outcome = f"failed: {piece}"
                break
            for data in piece_chunks(call, run, piece):
                yield sse(data)
        else:
            if include_usage:
                yield sse({**call.header(call.chunk_object), "choices": [], "usage": usage(call.jobs, call.runs)})
            outcome = ""
        yield "data: [DONE]\n\n"
    finally:
        for run in call.runs:
            run.cancel_if_running()
        call.log(started, outcome)


async def side_by_side(runs: Sequence[ChoiceRun]) -> AsyncIterator[tuple[ChoiceRun, Piece | GenerationFailed]]:
    """The pieces of all ``runs`` as they come, each with its run; a failed run gives its error as its last item."""
    pieces: asyncio.Queue = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for piece in run.pieces():
                await pieces.put((run, piece))
        except GenerationFailed as error:
            await pieces.put((run, error))
        await pieces.put((run, None))

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        running = len(tasks)
        while running:
            run, piece = await pieces.get()
            if piece is None:
                running -= 1
            else:
                yield run, piece
    finally:
        for task in tasks:
            task.cancel()


def piece_chunks(call: Call, run: ChoiceRun, piece: Piece) -> list[dict[str, Any]]:
    """The chunks of one piece: its text (and logprobs), then a chunk with the finish reason when it is the last."""
    chat = call.kind == "chat"
    chunks = []
    if piece.text or piece.entries:
        content = {"delta": {"content": piece.text}} if chat else {"text": piece.text}
        chunks.append(chunk(call, run, content, logprobs=call.logprobs(run, piece.entries)))
    if piece.finish_reason is not None:
        chunks.append(chunk(call, run, {"delta": {}} if chat else {"text": ""}, finish_reason=piece.finish_reason))
    return chunks


class EventStream(StreamingResponse):
    """The event stream of ``runs``; however the response ends (a client gone before the first chunk included), the
    runs still going are cancelled, freeing their rows."""

    def __init__(self, events: AsyncIterator[str], runs: Sequence[ChoiceRun]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.runs = runs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for run in self.runs:
                run.cancel_if_running()


def chunk(call: Call, run: ChoiceRun, content: dict, logprobs: dict | None = None,
          finish_reason: str | None = None) -> dict[str, Any]:
    return {**call.header(call.chunk_object), "choices": [{"index": run.job.index, **content, "logprobs": logprobs,
                                               "finish_reason": finish_reason}]}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


# --- routes ---------------------------------------------------------------------------------------------------------
def add_routes(api: FastAPI, service: Service) -> None:
    @api.post("/v1/completions")
    async def completions(request: Request):
        started = time.perf_counter()
        body = parse_request(await request.body(), CompletionRequest)
        service.check_model(body.model)
        service.warn_unhonoured(body)
        prompts = body.prompts()
        ids = [service.prompt_ids(prompt, "prompt") for prompt in prompts]
        echo = [prompt if isinstance(prompt, str) else service.tokenizer.decode(prompt) for prompt in prompts]
        jobs = jobs_for(service, body, ids, body.max_tokens, "prompt", body.logprobs, echo if body.echo else ())
        return await generate(service, request, "completions", f"cmpl-{uuid.uuid4().hex}", body, jobs, started)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        started = time.perf_counter()
        body = parse_request(await request.body(), ChatCompletionRequest)
        service.check_model(body.model)
        service.warn_unhonoured(body)
        ids = service.chat_ids(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        # the field the client sent (both, when they agree: OpenAI's current name)
        limit_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        jobs = jobs_for(service, body, [ids], getattr(body, limit_field), "messages", logprobs,
                        max_tokens_param=limit_field)
        return await generate(service, request, "chat", f"chatcmpl-{uuid.uuid4().hex}", body, jobs, started)

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(service)]}

    @api.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != service.model_name:
            raise APIError(404, f"The model {shorten(name)} does not exist; allowed: {service.model_name!r}",
                           param="model", code="model_not_found")
        return model_card(service)

    @api.get("/health")
    async def health():
        failed = getattr(service.scheduler, "failed", None)
        if failed is not None:
            return JSONResponse(error_body(f"the scheduler failed: {failed}", "server_error", None, "failed"), 503)
        return {"status": "ok", **service.scheduler.stats()}

    @api.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type=service.metrics.content_type)


def model_card(service: Service) -> dict[str, Any]:
    return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "splice",
            "max_model_len": service.scheduler.max_len}


async def generate(service: Service, request: Request, kind: str, call_id: str, body: SamplingFields,
                   jobs: list[Job], started: float):
    handles = service.submit(jobs)
    runs = [ChoiceRun(job, handle, service, body, started) for job, handle in zip(jobs, handles)]
    call = Call(kind, body, jobs, runs, call_id, int(time.time()), service.model_name)
    if body.stream:
        return EventStream(stream(call, started), call.runs)
    return await respond(call, request, started)


# --- errors ---------------------------------------------------------------------------------------------------------
def add_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(APIError)
    async def api_error(_: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @api.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError):
        return JSONResponse(error_body(f"invalid request: {shorten(error.errors(), 300)}"), status_code=400)

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        if error.status_code == 404:
            message = f"Unknown route {request.method} {shorten(request.url.path)}"
            code = "not_found"
        else:
            message, code = str(error.detail), None
        if error.status_code == 405:
            message = f"{request.method} is not allowed on {shorten(request.url.path)}"
            code = "method_not_allowed"
        return JSONResponse(error_body(message, "invalid_request_error", None, code), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @api.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        log.exception("splice serve: %s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error ({type(error).__name__})", "server_error", None,
                                       "internal_error"), status_code=500)
