"""Continuous batching over a kernel-injected engine: one thread owns the engine and steps every running request
together; requests join between decode steps (their prompt is prefilled on a free row of the cache, then they step
with the others) and leave the step they finish, freeing their row at once.

Each request keeps its own position and length (``splice.serve.batch``); the batched decode step is the runtime's
own fused (and, when the engine was compiled, compiled) step, so a greedy request gives the tokens
``engine.generate`` gives it alone, but for near-ties: a matrix multiplication's rounding can depend on how many rows
it has (docs/serving.md, "Reproducibility"). Under tensor parallelism rank 0 runs the :class:`Scheduler` and
broadcasts each iteration's :class:`~splice.serve.batch.StepPlan` before running it; every other rank runs
:func:`follow`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import torch

from ..distributed import SINGLE_PROCESS, timeout_s
from ..layers.causal_lm import SpliceCausalLM
from .batch import BatchRunner, Move, StepPlan
from .sampling import Choice, SamplingParams, TokenPicker, check_integer

__all__ = ["QueueFull", "RequestHandle", "SamplingParams", "Scheduler", "TokenEvent", "follow"]

log = logging.getLogger("splice.serve")


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (``token_id``), or a final event without one (``finish_reason`` "cancelled" / "error").

    ``logprob`` / ``top_logprobs``: log-softmax of the raw logits, when the request asked for them.
    """

    token_id: int | None
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None
    finish_reason: str | None
    error: str | None = None


class QueueFull(Exception):
    """``submit`` while ``max_queue`` requests are already waiting for a row."""


class RequestHandle:
    """A submitted request: iterate it (blocking, or ``async for``) for its :class:`TokenEvent` s; iteration ends
    after the one event with ``finish_reason`` set. Leaving an iteration before that cancels the request (a client
    that went away frees its row)."""

    def __init__(self, prompt: tuple[int, ...], params: SamplingParams, on_cancel):
        self.id = uuid.uuid4().hex
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.params = params
        self._on_cancel = on_cancel
        self._events: deque[TokenEvent] = deque()
        self._ready = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self.cancel_requested = False
        self.finished = False
        self.overtaken = 0  # later requests the scheduler admitted while this one waited

    def cancel(self) -> None:
        """Ask for the request to end: a queued one ends now, a running one at the next step boundary; either way
        with a final "cancelled" event (nothing happens once it has finished)."""
        if not self.cancel_requested and not self.finished:
            self.cancel_requested = True
            self._on_cancel(self)

    def push(self, event: TokenEvent) -> None:
        """Hand ``event`` to the consumer (any thread); anything after the final event is dropped."""
        with self._ready:
            if self.finished:
                return
            self.finished = event.finish_reason is not None
            self._events.append(event)
            self._ready.notify_all()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, future = waiter
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # the consumer's loop has closed: nobody is waiting any more
                pass

    def __iter__(self) -> Iterator[TokenEvent]:
        done = False
        try:
            while not done:
                with self._ready:
                    self._ready.wait_for(lambda: self._events)
                    event = self._events.popleft()
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:
                self.cancel()

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        done = False
        try:
            while not done:
                with self._ready:
                    event = self._events.popleft() if self._events else None
                    if event is None:
                        future = loop.create_future()
                        self._waiter = (loop, future)
                if event is None:
                    await future
                    continue
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:
                self.cancel()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(eq=False)
class Running:
    """A request holding a row: its handle, token picker and the tokens generated so far."""

    handle: RequestHandle
    picker: TokenPicker
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the cache
    done: bool = False

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is in the cache, the rest waits for a later iteration."""
        return 0 < self.prefilled < self.handle.prompt_tokens and not self.done

    @property
    def next_slot(self) -> int:
        """The slot (= position) the last generated token is fed at."""
        return self.handle.prompt_tokens + len(self.generated) - 1


def check_prefill_batch(prefill_batch: int, max_prefills: int) -> None:
    """Raise unless ``prefill_batch <= max_prefills``: the group comes from the prompts admitted in one iteration.
    Raising max_prefills along with it would change how much prefill work runs between the running requests' tokens,
    which the caller did not ask for."""
    if prefill_batch > max_prefills:
        raise ValueError(f"prefill_batch={prefill_batch} (--prefill-batch) exceeds max_prefills={max_prefills} "
                         "(--max-prefills): only the prompts admitted in one iteration are prefilled together; "
                         f"allowed: prefill_batch <= max_prefills (e.g. max_prefills={prefill_batch} too)")


class Scheduler:
    """Serves requests on ``engine`` (an ``InferenceEngine`` with kernel injection) with continuous batching: at most
    ``max_batch`` running together, at most ``max_queue`` waiting for a row (beyond those the free rows take). See the
    module docstring.

    Admission order: while prompts wait and rows are free, each iteration prefills waiting prompts first and then
    runs the decode step, at most ``max_prefills`` prompts and ``prefill_chunk`` prompt tokens per iteration (a longer
    prompt is prefilled in chunks), so the running requests get a token at least once per that much prefill work (on
    a CPU one prefill of a hundred tokens costs several decode steps). One prompt per iteration is the default: a
    burst's later prompts wait one decode step more each, but requests admitted in the same iteration step in
    lockstep, so with equal output lengths they finish in the same step and their clients' next requests arrive as a
    burst again; admitted one per iteration, they finish one per step and the next requests arrive spread out, each
    reaching its first token after about one prefill. Among the waiting prompts the shortest goes first (it reaches
    its first token soonest and holds the others up least); one that ``max_overtaken`` later requests have overtaken
    goes before any other, so no request waits forever. Aging counts admissions rather than seconds, so the order is
    a function of the arrivals alone and bounds a long prompt's extra wait to ``max_overtaken`` other prefills.

    Up to ``prefill_batch`` prompts admitted in one iteration (at most ``max_prefills``) are prefilled in one forward,
    each on its own row: that costs less than one forward each, most for a quantized model, which de-quantises its
    weights once per prefill forward, but none of them gets its first token before all of them are done, and they
    then step in lockstep. It trades first-token latency for prefill throughput, so it is off (1) by default."""

    def __init__(self, engine, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 512,
                 max_prefills: int = 1, max_overtaken: int = 8, prefill_batch: int = 1):
        runtime = native_runtime(engine)
        check_integer("max_batch", max_batch, 1, None, "an integer >= 1")
        check_integer("max_queue", max_queue, 0, None, "an integer >= 0")
        check_integer("prefill_chunk", prefill_chunk, 1, None, "an integer >= 1")
        check_integer("max_overtaken", max_overtaken, 0, None, "an integer >= 0")
        check_integer("prefill_batch", prefill_batch, 1, None, "an integer >= 1")
        check_integer("max_prefills", max_prefills, 1, None, "an integer >= 1")
        check_prefill_batch(prefill_batch, max_prefills)
        self.parallel = getattr(engine, "parallel", SINGLE_PROCESS)
        if self.parallel.rank != 0:
            raise ValueError(f"Scheduler runs on rank 0 of the tensor-parallel group; rank {self.parallel.rank} "
                             "calls splice.serve.scheduler.follow(engine)")
        self.engine, self.runtime = engine, runtime
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.max_overtaken, self.prefill_batch, self.max_prefills = max_overtaken, prefill_batch, max_prefills
        self.runner = BatchRunner(runtime, max_batch)
        cache = self.runner.cache
        log.info("splice serve: KV cache of %d rows x %d slots (max_out_tokens), %.0f MiB", max_batch, cache.max_len,
                 2 * cache.keys.numel() * cache.keys.element_size() / 2 ** 20)
        self.failed: BaseException | None = None  # the error that stopped the scheduler (a rank lost), else None
        self._lock = threading.Condition()
        self._queue: deque[RequestHandle] = deque()
        self._running: list[Running] = []
        self._accepting = True
        self._thread: threading.Thread | None = None

    @property
    def max_len(self) -> int:
        """The longest prompt + new tokens a request may have (the engine's ``max_out_tokens``)."""
        return self.runtime.max_len

    @property
    def vocab_size(self) -> int:
        return vocab_size(self.engine, self.runtime)

    def start(self) -> None:
        """Start the thread that owns the engine."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the scheduler was already started")
            self._thread = threading.Thread(target=self._serve, name="splice-scheduler", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids, params: SamplingParams) -> RequestHandle:
        """Queue a request; ``ValueError`` / ``TypeError`` naming a bad value before anything is queued,
        :class:`QueueFull` when ``max_queue`` requests wait, ``RuntimeError`` once shutdown began."""
        prompt = self.checked_prompt(prompt_ids, params)
        handle = RequestHandle(prompt, params, self._cancel)
        with self._lock:
            if not self._accepting:
                reason = f"it failed: {self.failed}" if self.failed is not None else "it is shutting down"
                raise RuntimeError(f"the scheduler takes no more requests: {reason}")
            free_rows = self.max_batch - self._busy_rows()
            if len(self._queue) >= self.max_queue + free_rows:  # the first ones take the free rows: not waiting
                raise QueueFull(f"{self.max_queue} requests are waiting for a row (max_queue={self.max_queue})")
            self._queue.append(handle)
            self._lock.notify_all()
        return handle

    def checked_prompt(self, prompt_ids, params: SamplingParams) -> tuple[int, ...]:
        """The prompt as a tuple of ids, after checking it and its length with ``params`` against the engine."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params={params!r}; allowed: a SamplingParams")
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
            raise TypeError(f"prompt_ids={prompt_ids!r}; allowed: a list of token ids")
        vocab = self.vocab_size
        for token in prompt_ids:
            check_integer("prompt token id", token, 0, vocab - 1, f"an integer in [0, {vocab})")
        for token in params.stop_token_ids:
            check_integer("stop_token_ids", token, 0, vocab - 1, f"token ids in [0, {vocab})")
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty; allowed: at least one token")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_len:
            raise ValueError(f"prompt length {len(prompt_ids)} + max_new_tokens {params.max_new_tokens} = {total} "
                             f"exceeds max_out_tokens={self.max_len}; allowed: at most {self.max_len}")
        return tuple(int(token) for token in prompt_ids)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; ``drain`` finishes the running and queued requests, otherwise they are cancelled. Joins the
        engine's thread (at most ``timeout`` seconds)."""
        with self._lock:
            self._accepting = False
            if not drain or self._thread is None:
                for handle in list(self._queue) + [row.handle for row in self._running]:
                    handle.cancel_requested = True
                self._end_queued("cancelled")
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def stats(self) -> dict:
        with self._lock:
            return {"queued": len(self._queue), "running": self._busy_rows(), "max_batch": self.max_batch,
                    "max_queue": self.max_queue}

    def _busy_rows(self) -> int:
        """Rows held by unfinished requests (a finished one's row is free once its final event is out)."""
        return sum(not row.done for row in self._running)

    # ---- the engine's thread ----------------------------------------------------------------------------------------
    def _cancel(self, handle: RequestHandle) -> None:
        """A queued request ends at once; a running one at the next step boundary (the thread sees the flag)."""
        with self._lock:
            if handle in self._queue:
                self._queue.remove(handle)
                handle.push(final("cancelled"))

    def _end_queued(self, reason: str, error: str | None = None) -> None:
        while self._queue:
            self._queue.popleft().push(final(reason, error))

    def _serve(self) -> None:
        try:
            with torch.inference_mode():
                while self._iterate():
                    pass
                self._broadcast(StepPlan(stop=True))
        except BaseException as error:  # noqa: BLE001 - a lost rank or a broken group: nothing can run any more
            self._fail(error)

    def _iterate(self) -> bool:
        """One step boundary and step: release finished rows, take the next prompt chunks (queued requests admitted
        into free rows), run the plan, pick tokens. False when shut down with nothing left to do."""
        moves = self._release()
        stepping = [row for row in self._running if row.generated]  # rows 0 .. n-1: each has a token to feed
        chunks = self._prefill_chunks()
        if not (moves or chunks or stepping):
            return self._wait()
        plan = StepPlan(moves=tuple(moves), step_tokens=tuple(row.generated[-1] for row in stepping),
                        step_slots=tuple(row.next_slot for row in stepping),
                        prefills=tuple((index, start, chunk) for index, _, start, chunk in chunks),
                        prefill_batch=self.prefill_batch,
                        max_batch=self.max_batch)
        self._broadcast(plan)
        try:
            self.runner.run(plan, on_step=lambda logits: self._stepped(stepping, logits),
                            on_prefill=lambda index, logits, error: self._prefilled(chunks[index], logits, error))
        except Exception as error:
            if self.parallel.enabled:
                raise  # the ranks may now disagree: fatal
            log.exception("splice serve: the batched step failed; its %d requests end with an error", len(stepping))
            for row in self._running:
                if not row.done:
                    self._finish(row, final("error", f"the batched step failed: {error!r}"))
            return True
        return True

    def _stepped(self, stepping: list[Running], logits: torch.Tensor) -> None:
        """The decode step's tokens go out at once."""
        for i, row in enumerate(stepping):
            self._emit(row, lambda i=i, row=row: row.picker.pick(logits[i]))

    def _prefilled(self, chunk: tuple[int, Running, int, tuple[int, ...]], logits: torch.Tensor | None,
                   error: Exception | None) -> None:
        """A prompt chunk is in the cache: a prompt now whole sends its first token at once, before the iteration's
        next forward runs."""
        _, row, start, tokens = chunk
        if error is not None and self.parallel.enabled:
            raise error  # the other ranks stop at it too
        if error is not None:
            self._finish(row, final("error", f"the prefill failed: {error!r}"))
            return
        row.prefilled = start + len(tokens)
        if row.prefilled == row.handle.prompt_tokens:
            self._emit(row, lambda: row.picker.pick(logits))

    def _release(self) -> list[Move]:
        """Free the rows of finished and cancelled requests, moving the last running row into each freed one so the
        running rows stay ``0 .. n-1`` (a partly prefilled prompt stays last); the moves to apply to the cache."""
        running = self._running
        for row in running:
            if row.handle.cancel_requested and not row.done:
                self._finish(row, final("cancelled"))
        moves = []
        with self._lock:
            partial = running.pop() if running and running[-1].prefilling else None
            partial_row = len(running)
            for index in reversed(range(len(running))):
                if not running[index].done:
                    continue
                last = running.pop()
                if index < len(running):
                    running[index] = last
                    moves.append(Move(len(running), index, last.next_slot))
            if partial is not None:
                if partial_row != len(running):
                    moves.append(Move(partial_row, len(running), partial.prefilled))
                running.append(partial)
        return moves

    def _prefill_chunks(self) -> list[tuple[int, Running, int, tuple[int, ...]]]:
        """This iteration's prompt work, ``(row, request, first slot, tokens)``, at most ``prefill_chunk`` tokens:
        the next chunk of a partly prefilled prompt, then queued requests in admission order (:meth:`_next_waiting`)
        into free rows while their first chunk fits. Chunks start at multiples of ``prefill_chunk`` whatever runs
        beside them, and a prompt within one chunk is prefilled whole, as ``generate`` does."""
        budget, chunks, running = self.prefill_chunk, [], self._running
        if running and running[-1].prefilling:
            row = running[-1]
            chunk = row.handle.prompt[row.prefilled: row.prefilled + self.prefill_chunk]
            chunks.append((len(running) - 1, row, row.prefilled, chunk))
            budget -= len(chunk)
        with self._lock:
            admitted = 0
            while self._queue and len(running) < self.max_batch and admitted < self.max_prefills:
                handle = self._next_waiting()
                chunk = handle.prompt[: self.prefill_chunk]
                if len(chunk) > budget:
                    break  # nothing overtakes the request that is next: it goes first in the next iteration
                self._admit(handle)
                admitted += 1
                row = Running(handle, TokenPicker(handle.params))
                running.append(row)
                chunks.append((len(running) - 1, row, 0, chunk))
                budget -= len(chunk)
        return chunks

    def _next_waiting(self) -> RequestHandle:
        """The waiting request to admit next: the oldest that ``max_overtaken`` later ones have overtaken, else the
        one with the shortest prompt (the oldest of equals)."""
        aged = next((handle for handle in self._queue if handle.overtaken >= self.max_overtaken), None)
        return aged if aged is not None else min(self._queue, key=lambda handle: handle.prompt_tokens)

    def _admit(self, handle: RequestHandle) -> None:
        """Take ``handle`` off the queue; each older request still waiting has been overtaken once more."""
        for older in self._queue:
            if older is handle:
                break
            older.overtaken += 1
        self._queue.remove(handle)

    def _wait(self) -> bool:
        """Nothing runs: wait for a request or shutdown (under tensor parallelism, tell the other ranks so within
        the collective timeout). False when shut down."""
        with self._lock:
            if not self._accepting and not self._queue:
                return False
            heartbeat = timeout_s() / 4 if self.parallel.enabled else None
            woken = self._lock.wait_for(lambda: self._queue or not self._accepting, heartbeat)
        if not woken:
            self._broadcast(StepPlan())
        return True

    def _emit(self, row: Running, pick) -> None:
        """Pick ``row``'s next token and send it, with the finish reason when it ends the request; an error here
        ends only this request."""
        try:
            choice: Choice = pick()
        except Exception as error:  # noqa: BLE001 - reported to the request, the others keep running
            log.exception("splice serve: request %s failed while picking its token", row.handle.id)
            self._finish(row, final("error", f"picking the next token failed: {error!r}"))
            return
        row.generated.append(choice.token)
        params = row.handle.params
        reason = None
        if choice.token in params.stop_token_ids:
            reason = "stop"
        elif len(row.generated) >= params.max_new_tokens:
            reason = "length"
        event = TokenEvent(choice.token, choice.logprob, choice.top_logprobs, reason)
        if reason is None:
            row.handle.push(event)
        else:
            self._finish(row, event)

    def _finish(self, row: Running, event: TokenEvent) -> None:
        row.done = True
        row.handle.push(event)
        log.debug("splice serve: request %s %s (%d prompt + %d generated tokens)", row.handle.id, event.finish_reason,
                 row.handle.prompt_tokens, len(row.generated))

    def _broadcast(self, plan: StepPlan) -> None:
        if self.parallel.enabled:
            self.parallel.broadcast_object(plan)

    def _fail(self, error: BaseException) -> None:
        """The engine can serve no more (under tensor parallelism: a rank died or the group broke): every request
        ends with an error, and :attr:`failed` tells the app to exit non-zero."""
        log.error("splice serve: the scheduler stopped: %r", error)
        with self._lock:
            self.failed = error
            self._accepting = False
            message = f"the server failed: {error!r}"
            for row in self._running:
                row.done = True
                row.handle.push(final("error", message))
            self._end_queued("error", message)


def final(reason: str, error: str | None = None) -> TokenEvent:
    """A final event without a token."""
    return TokenEvent(None, None, None, reason, error)


def native_runtime(engine) -> SpliceCausalLM:
    runtime = getattr(engine, "runtime", None)
    if not isinstance(runtime, SpliceCausalLM):
        raise ValueError(f"the scheduler needs an engine with splice's native runtime (init_inference(..., "
                         f"replace_with_kernel_inject=True) on a supported family); engine.runtime is {runtime!r}")
    return runtime


def vocab_size(engine, runtime: SpliceCausalLM) -> int:
    """The token ids a prompt may hold: the model's vocabulary (the whole one, also under tensor parallelism)."""
    size = getattr(runtime.config, "vocab_size", None)
    return int(size) if size else int(engine.vocab_size)


def follow(engine) -> None:
    """On a rank other than 0 of a tensor-parallel engine: replay rank 0's scheduler plans (the same model ops, the
    same collectives) until rank 0 shuts down. Raises when the group breaks (rank 0 lost)."""
    runtime = native_runtime(engine)
    parallel = getattr(engine, "parallel", SINGLE_PROCESS)
    if not parallel.enabled or parallel.rank == 0:
        raise ValueError(f"follow(engine) runs on ranks other than 0 of a tensor-parallel engine; this is rank "
                         f"{parallel.rank} of {parallel.world_size}")
    runner = None
    with torch.inference_mode():
        while True:
            plan: StepPlan = parallel.broadcast_object(None)
            if plan.stop:
                return
            if plan.idle:
                continue
            if runner is None:
                runner = BatchRunner(runtime, plan.max_batch)
            logits = runner.run(plan)
            failed = [error for error in logits.prefill_errors if error is not None]
            if failed:
                raise failed[0]
