"""A scheduler double for the HTTP layer's unit tests: each request replays a script of token ids, repeated up to its
length limit and ending early at a stop id, through the real :class:`~splice.serve.scheduler.RequestHandle`, so the
app's parsing, text, streaming and error paths are tested without a model. ``fail_with``: requests (those with a seed
in ``fail_seeds``, when given) end with that error after their first token; ``endless``: the others send their first
token and then nothing until cancelled. The end-to-end tests (``test_server.py``) use the real scheduler."""
from __future__ import annotations

from splice.serve.scheduler import QueueFull, RequestHandle, SamplingParams, TokenEvent


class ScriptedScheduler:
    def __init__(self, script: list[int], *, max_len: int = 64, vocab_size: int = 49152, full: bool = False,
                 fail_with: str | None = None, fail_seeds: tuple[int, ...] | None = None, endless: bool = False,
                 max_batch: int = 8, max_queue: int = 64):
        self.script, self.max_len, self.vocab_size = script, max_len, vocab_size
        self.full, self.fail_with, self.fail_seeds, self.endless = full, fail_with, fail_seeds, endless
        self.max_batch, self.max_queue = max_batch, max_queue
        self.submitted: list[tuple[list[int], SamplingParams]] = []
        self.cancelled: list[RequestHandle] = []
        self.failed = None

    def submit(self, prompt_ids, params: SamplingParams) -> RequestHandle:
        if self.full:
            raise QueueFull("1 requests are waiting (max_queue=1)")
        if len(prompt_ids) + params.max_new_tokens > self.max_len:
            raise ValueError("too long")
        self.submitted.append((list(prompt_ids), params))
        handle = RequestHandle(tuple(prompt_ids), params, self.cancel)
        for event in self.events(params):
            handle.push(event)
        return handle

    def events(self, params: SamplingParams) -> list[TokenEvent]:
        if self.fail_with is not None and (self.fail_seeds is None or params.seed in self.fail_seeds):
            return [TokenEvent(self.script[0], None, None, None), TokenEvent(None, None, None, "error",
                                                                            self.fail_with)]
        if self.endless:
            return [TokenEvent(self.script[0], None, None, None)]
        events = []
        tokens = (self.script * params.max_new_tokens)[:params.max_new_tokens]  # the script repeats to the limit
        for count, token in enumerate(tokens, start=1):
            top = ((token, -0.5), (token + 1, -1.5))[:params.logprobs] if params.logprobs is not None else None
            logprob = -0.5 if params.logprobs is not None else None
            stop = token in params.stop_token_ids
            reason = "stop" if stop else "length" if count == params.max_new_tokens else None
            events.append(TokenEvent(token, logprob, top, reason))
            if stop:
                break
        return events

    def cancel(self, handle: RequestHandle) -> None:
        self.cancelled.append(handle)
        handle.push(TokenEvent(None, None, None, "cancelled"))

    def stats(self) -> dict:
        return {"queued": 0, "running": 0, "max_batch": self.max_batch, "max_queue": self.max_queue}
