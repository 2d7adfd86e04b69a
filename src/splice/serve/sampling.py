"""Per-request token choice for the serving scheduler: OpenAI's presence/frequency penalties, greedy or sampled
(transformers' temperature and top-p warpers, as ``splice.generation`` uses them) with the request's own random
generator, and the log-probabilities of the raw logits."""
from __future__ import annotations

import numbers
import random
from dataclasses import dataclass

import torch
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from ..generation import apply_processors, check_real, pick

#: the most alternatives ``logprobs`` may ask for (OpenAI's limit)
MAX_TOP_LOGPROBS = 20
#: the seeds a ``torch.Generator`` takes
SEED_RANGE = (-(2 ** 63), 2 ** 64)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (each value checked on construction, naming the bad one).

    ``temperature`` 0 is greedy (the argmax); ``seed`` seeds the request's own generator, so its draws do not depend
    on what runs beside it (its logits may, in rounding: docs/serving.md, "Reproducibility"); ``stop_token_ids`` end
    it with finish reason "stop" (the token is emitted: the HTTP app leaves its text out); the penalties follow OpenAI
    (``logit -= frequency * count + presence * (count > 0)`` over the generated tokens); ``logprobs`` k asks for the
    chosen token's log-probability and the k most likely alternatives.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self):
        check_integer("max_new_tokens", self.max_new_tokens, 1, None, "an integer >= 1")
        check_real("temperature", self.temperature, lambda v: v >= 0, "a number >= 0 (0 decodes greedily)")
        check_real("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            check_real(name, getattr(self, name), lambda v: -2 <= v <= 2, "a number in [-2, 2]")
        if self.seed is not None:
            check_integer("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1, "an integer in [-2**63, 2**64) or None")
        if self.logprobs is not None:
            check_integer("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS,
                          f"None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (tuple, list)):
            raise TypeError(f"stop_token_ids={stops!r}; allowed: a tuple of token ids")
        for token in stops:
            check_integer("stop_token_ids", token, 0, None, "a tuple of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(token) for token in stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def check_integer(name: str, value, low: int, high: int | None, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}); allowed: {allowed}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}={value!r}; allowed: {allowed}")


@dataclass(frozen=True)
class Choice:
    """The token a request picked, with its log-probability and the top alternatives when asked."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


class TokenPicker:
    """Picks one request's tokens from the raw fp32 logits of its row, keeping what the penalties need."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.counts: torch.Tensor | None = None  # how often each token was generated (with penalties only)
        self.generator: torch.Generator | None = None
        warpers = LogitsProcessorList()
        if not params.greedy:
            if params.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(float(params.temperature)))
            if params.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=float(params.top_p), min_tokens_to_keep=1))
        self.warpers = warpers

    def pick(self, logits: torch.Tensor) -> Choice:
        """The next token for raw fp32 ``logits [vocab]``."""
        scores = self.penalise(logits)
        if self.params.greedy:
            token = int(pick(scores, do_sample=False))
        else:
            token = self.sample(scores)
        if self.counts is not None:
            self.counts[token] += 1
        return self.with_logprobs(logits, token)

    def penalise(self, logits: torch.Tensor) -> torch.Tensor:
        """OpenAI's presence and frequency penalties over the tokens generated so far."""
        params = self.params
        if not params.penalised:
            return logits
        if self.counts is None:
            self.counts = torch.zeros_like(logits)
        return logits - (params.frequency_penalty * self.counts + params.presence_penalty * (self.counts > 0))

    def sample(self, scores: torch.Tensor) -> int:
        """A token drawn from the warped scores with this request's generator (seeded from ``seed``, else fresh)."""
        if self.generator is None:
            seed = self.params.seed if self.params.seed is not None else random.SystemRandom().randrange(2 ** 63)
            self.generator = torch.Generator(device=scores.device).manual_seed(seed)
        warped = apply_processors(self.warpers, None, scores[None].clone())
        probs = torch.softmax(warped, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=self.generator))

    def with_logprobs(self, logits: torch.Tensor, token: int) -> Choice:
        k = self.params.logprobs
        if k is None:
            return Choice(token)
        logprobs = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logprobs, k) if k else None
        alternatives = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist()))
        return Choice(token, float(logprobs[token]), alternatives)
