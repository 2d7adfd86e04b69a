"""splice's native generate loop for kernel-injected models: prefill, decode steps on a static KV cache, the logits
processors Hugging Face would apply (its own public classes, in its order; its two minimum-length ones as one cheaper
class with the same scores), sampling, stopping and streaming.

``generate(model, ...)`` takes Hugging Face's ``generate`` arguments and returns what it returns. A request the
native loop does not implement (beam search, constraints, custom processors, ...) runs Hugging Face's ``generate`` on
the same injected model; never a silently different result.
"""
from __future__ import annotations

import copy
import inspect
import logging
import math
import warnings
import numbers
import reprlib
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin
from transformers.utils import logging as hf_logging

from . import native
from .arch import learned_position_limit
from .layers.causal_lm import SpliceCausalLM
from .profiling import ForwardTimer

log = logging.getLogger("splice")
#: the logger Hugging Face's generate warns through (its right-padding warning, which its generate gives inline, is
#: repeated here word for word; the others come from transformers' own preparation steps, see hf_generate_checks)
hf_generate_log = hf_logging.get_logger("transformers.generation.utils")
RIGHT_PADDING_WARNING = ("A decoder-only architecture is being used, but right-padding was detected! For correct "
                         "generation results, please set `padding_side='left'` when initializing the tokenizer.")

#: generation options the native loop implements (any value)
NATIVE_OPTIONS = frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "eos_token_id", "pad_token_id", "return_dict_in_generate", "output_scores", "output_logits",
})
#: options that do not change the tokens produced (``use_cache`` does decide whether a returned dict carries a cache:
#: plan_request hands a request that names it to Hugging Face's generate, and says when a dict goes without one)
IGNORED_OPTIONS = frozenset({
    "bos_token_id", "decoder_start_token_id", "use_cache", "cache_config", "compile_config", "disable_compile",
    "_from_model_config", "transformers_version",
})
#: the ``cache_implementation`` values that give the tokens of the native loop's own static cache: the default dynamic
#: cache and Hugging Face's static one (the others quantize or offload the cache, or switch to continuous batching, and
#: run Hugging Face's generate; ``cache_config`` only configures those)
NATIVE_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
#: options whose result Hugging Face's generate would not give on the fused blocks either (they never form attention
#: weights); ``output_hidden_states`` runs Hugging Face's generate, the model recording each fused block's output
REFUSED_OPTIONS = ("output_attentions",)


@dataclass
class Request:
    """One resolved native generate request."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    eos: torch.Tensor | None
    pad: int | None
    processors: LogitsProcessorList
    do_sample: bool
    return_dict: bool
    output_scores: bool
    output_logits: bool
    warn_right_padding: bool = False  # Hugging Face's generate would warn that the batch is right-padded
    hf_checks: HFChecks | None = None  # what Hugging Face's generate checks (and warns about) before decoding
    without_cache: bool = False  # a returned dict where Hugging Face's would carry its KV cache (use_cache by default)


@dataclass
class HFChecks:
    """What Hugging Face's generate prepares its special tokens and lengths from, for :func:`hf_generate_checks`."""

    config: GenerationConfig  # the generation config as Hugging Face's generate merges it, before its preparations
    has_attention_mask: bool  # the call passed an attention mask
    default_max_length: bool  # no max_length in the call, its generation config or the model's
    default_min_length: bool  # no min_length there


def generate(model, runtime: SpliceCausalLM, *args: Any, timer: ForwardTimer | None = None, **kwargs: Any):
    """Hugging Face ``generate`` for a kernel-injected ``model`` and its decode ``runtime`` (``engine.runtime``):
    the native loop when it implements the request, else transformers' generate on the fused model. ``args`` and
    ``kwargs`` are ``model.generate``'s, positional ones in its order (``inputs``, ``generation_config``,
    ``logits_processor``, ...).

    ``timer`` (the engine's :class:`~splice.profiling.ForwardTimer` when profiling, or anything whose ``measure()``
    context manager times one forward) times the native loop's prefill and each decode step; transformers' generate
    calls the model's forward, which the engine's timer times through its hooks."""
    if not isinstance(runtime, SpliceCausalLM):
        raise TypeError(f"splice.generation.generate needs the decode runtime of a kernel-injected model "
                        f"(engine.runtime), got {type(runtime).__name__}")
    args, kwargs = generate_arguments(model, args, kwargs)
    if args:  # a generate whose positional arguments have no names to read them by
        plan: Request | str = "positional arguments"
    else:
        options = dict(kwargs)
        streamer = options.pop("streamer", None)
        plan = plan_request(model, options.pop("inputs", None), options.pop("generation_config", None), options)
    if isinstance(plan, Request) and right_padding_not_native(runtime, plan):
        plan = "a right-padded batch whose pads fill a sliding window"
    if isinstance(plan, str):
        log.info("splice generate: %s not in the native loop; transformers' generate runs on the fused model", plan)
        return model.generate(*args, **kwargs)
    hf_generate_checks(model, plan)
    if plan.without_cache:
        warnings.warn(NO_CACHE_IN_THE_OUTPUT, UserWarning, stacklevel=2)  # once per process, by Python's default filter
    with torch.inference_mode():
        return decode(runtime, plan, streamer, timer)


def right_padding_not_native(runtime: SpliceCausalLM, req: Request) -> bool:
    """Whether ``req`` has a right-padded row (its last column masked) that the native loop would not give Hugging
    Face's tokens for: a row whose pads fill a sliding window, where its last pad's query sees no real token (Hugging
    Face's attention gives it zeros, splice's mask its own slot). ALiBi's bias counts each row's real tokens, as
    Hugging Face's does, so a right-padded row's new tokens follow its last real token there too."""
    trailing_pads = (req.attention_mask.flip(-1).cumsum(-1) == 0).sum(-1)
    if not bool((trailing_pads > 0).any()):
        return False
    windows = [window for window in runtime.windows if window is not None]
    return bool(windows) and int(trailing_pads.max()) >= min(windows)


#: What a native return_dict_in_generate output lacks, said where Hugging Face's would have it (use_cache by default).
NO_CACHE_IN_THE_OUTPUT = (
    "splice's native generate returns no past_key_values in its output dict (its KV cache is no transformers Cache), "
    "where Hugging Face's generate would return its cache (use_cache defaults to True); allowed: use_cache=True to "
    "have transformers' generate run on the fused model and return one, or use_cache=False to say none is wanted")


def hf_generate_checks(model, req: Request) -> None:
    """The checks Hugging Face's generate makes before decoding, run by transformers itself on a copy of the request's
    generation config for their warnings, in its order: its special tokens (a batch without attention mask or pad id,
    a pad id that is an eos id, eos ids that are not positive integers), right padding, its lengths (``max_new_tokens``
    and ``max_length`` both set, ``min_new_tokens`` taking precedence over ``min_length``, the model-agnostic default
    ``max_length``, a minimum length past the maximum)."""
    checks, ids = req.hf_checks, req.input_ids
    if checks is None:
        return
    config = copy.deepcopy(checks.config)
    model._prepare_special_tokens(config, checks.has_attention_mask, device=ids.device, batch_size=ids.shape[0])
    if req.warn_right_padding:
        hf_generate_log.warning(RIGHT_PADDING_WARNING)
    config = model._prepare_generated_length(
        generation_config=config, has_default_max_length=checks.default_max_length,
        has_default_min_length=checks.default_min_length, model_input_name="input_ids",
        input_ids_length=ids.shape[1], inputs_tensor=ids)
    model._validate_generated_length(config, ids.shape[1], checks.default_max_length)


def generate_arguments(model, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of a ``model.generate`` call with each positional one moved to the keyword it binds to in that
    signature (Hugging Face's: ``inputs``, ``generation_config``, ``logits_processor``, ``stopping_criteria``, ...),
    so the checks and the native loop find a positional generation config where they find a keyword one. A generate
    that takes ``*args`` (a wrapper passing them on) or has no signature binds as Hugging Face's does; positional-only
    parameters stay positional. Raises the ``TypeError`` the call itself would for too many positional arguments or
    one given twice."""
    if not args:
        return args, dict(kwargs)
    try:
        signature = inspect.signature(model.generate)
    except (TypeError, ValueError):
        signature = None
    if signature is None or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
        signature = hf_generate_signature()
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as error:
        order = [p.name for p in signature.parameters.values()
                 if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        raise TypeError(f"{type(model).__name__}.generate: {error}; allowed: positional arguments in the order "
                        f"({', '.join(order)}), or keywords") from None
    positional: list = []
    keywords: dict = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.POSITIONAL_ONLY:
            positional.append(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            positional.extend(value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            keywords.update(value)
        else:
            keywords[name] = value
    return tuple(positional), keywords


def hf_generate_signature() -> inspect.Signature:
    """The signature of Hugging Face's ``generate`` as a bound method (without ``self``)."""
    signature = inspect.signature(GenerationMixin.generate)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def plan_request(model, inputs, generation_config, kwargs: dict) -> Request | str:
    """The resolved request, or a string naming what the native loop does not implement."""
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() < 2:  # no generate takes these; HF's fails obscurely
        check_generate_ids_shape(input_ids)
    if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.is_floating_point()):
        return "inputs other than a 2-D tensor of token ids"
    default_length = takes_hf_default_max_length(model, generation_config, kwargs)
    default_min_length = hf_default_option(model, generation_config, kwargs, "min_length")
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)  # exactly HF's merge
    refused = [name for name in REFUSED_OPTIONS if getattr(config, name, False)]
    if refused:
        raise ValueError(f"{', '.join(refused)}=True is not available on a kernel-injected model (the fused blocks "
                         "attend with SDPA and never form attention weights); allowed: False, or "
                         "replace_with_kernel_inject=False")
    if config.return_dict_in_generate and kwargs.get("use_cache") is True:
        # asked for by name: Hugging Face's output carries its KV cache (a transformers Cache); splice's static
        # cache is none, so Hugging Face's generate gives it
        return "use_cache=True with return_dict_in_generate=True (the output's cache)"
    attention_mask = model_kwargs.pop("attention_mask", None)
    model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None}
    if model_kwargs:
        return f"arguments {sorted(model_kwargs)}"
    other = non_native_options(config)
    if other:
        return f"options {other}"
    prompt_len = input_ids.shape[1]
    max_new = hf_total_length(model, config.max_new_tokens, config.max_length, default_length, prompt_len) - prompt_len
    if max_new <= 0:
        return f"max_new_tokens={max_new}"
    eos, pad = special_tokens(config, input_ids.device)
    warn = hf_warns_right_padding(input_ids, attention_mask, pad)
    checks = HFChecks(config, attention_mask is not None, default_length, default_min_length)
    if attention_mask is None:
        attention_mask = infer_attention_mask(input_ids, pad, eos)
    processors = logits_processors(config, attention_mask, prompt_len, eos)
    return Request(input_ids, attention_mask, max_new, eos, pad, processors, bool(config.do_sample),
                   bool(config.return_dict_in_generate), bool(config.output_scores), bool(config.output_logits),
                   warn, checks, bool(config.return_dict_in_generate) and config.use_cache is not False)


def takes_hf_default_max_length(model, generation_config, kwargs: dict) -> bool:
    """Whether Hugging Face's generate takes this call's ``max_length`` as its default, which then counts new tokens
    (the prompt is added to it): transformers 5 when neither the call, its generation config nor the model's sets
    one; transformers 4 when the call does not pass one."""
    if kwargs.get("max_length") is not None:
        return False
    if GenerationConfig().max_length is not None:  # transformers 4: every config carries the default max_length
        return True
    return hf_default_option(model, generation_config, kwargs, "max_length")


def hf_default_option(model, generation_config, kwargs: dict, name: str) -> bool:
    """Whether neither the call, its generation config nor the model's sets ``name`` (Hugging Face's generate then
    takes it as a default: ``has_default_max_length``, ``has_default_min_length``)."""
    given = None if generation_config is None else getattr(generation_config, name, None)
    model_config = getattr(model, "generation_config", None)
    return kwargs.get(name) is None and given is None and getattr(model_config, name, None) is None


def hf_total_length(model, max_new_tokens, max_length, default_length: bool, prompt_len: int) -> int:
    """Prompt plus new tokens as Hugging Face's generate resolves them: ``max_new_tokens`` first; a default
    ``max_length`` (:func:`takes_hf_default_max_length`; in transformers 4 only its value 20) means that many new
    tokens, capped at the model's ``max_position_embeddings``; else ``max_length`` is the total."""
    if max_new_tokens is not None:
        return prompt_len + int(max_new_tokens)
    if max_length is None:  # transformers 5 fills an unset max_length in from its defaults (20)
        max_length = getattr(GenerationConfig, "_get_default_generation_params", lambda: {"max_length": 20})()[
            "max_length"]
    max_length = int(max_length)
    hf_default = GenerationConfig().max_length
    if default_length and (hf_default is None or hf_default == max_length):
        max_length += prompt_len
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int):
            max_length = min(max_length, limit)
    return max_length


def hf_warns_right_padding(input_ids: torch.Tensor, attention_mask, pad: int | None) -> bool:
    """Hugging Face's test for its right-padding warning: a batch of more than one row with a pad id, some row's
    last column masked in the given attention mask, or (without one) holding the pad id."""
    if pad is None or input_ids.shape[0] < 2:
        return False
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == input_ids.shape:
        return bool((attention_mask[:, -1] == 0).any())
    return bool((input_ids[:, -1] == pad).any())


def non_native_options(config: GenerationConfig) -> list[str]:
    """Options set to something other than their neutral default that the native loop does not implement. Unset is
    None or False only: 0 and 0.0 are values (``forced_eos_token_id=0`` is Pythia's eos; ``guidance_scale=0.0``
    guides; ``num_beams=0``, which Hugging Face's generate refuses)."""
    pristine = GenerationConfig().to_dict()
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()  # HF's fallbacks for unset options
    unknown = []
    for name, value in config.to_dict().items():
        if name in NATIVE_OPTIONS or name in IGNORED_OPTIONS or name in REFUSED_OPTIONS:
            continue
        if name == "cache_implementation" and value in NATIVE_CACHE_IMPLEMENTATIONS:
            continue
        if value is None or value is False or same_value(value, pristine.get(name)) or \
                same_value(value, defaults.get(name, object())):
            continue
        unknown.append(f"{name}={value!r}")
    return unknown


def same_value(value, default) -> bool:
    """Whether an option's ``value`` is its ``default``: equal, and a bool only where the default is one (``0`` is no
    ``False``, ``1`` no ``True``)."""
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    try:
        return bool(value == default)
    except (TypeError, ValueError, RuntimeError):  # a tensor or array value, which compares elementwise
        return False


def special_tokens(config: GenerationConfig, device) -> tuple[torch.Tensor | None, int | None]:
    """eos ids as a tensor and the pad id, defaulting pad to the first eos as Hugging Face does. eos ids given as a
    tensor are taken as they are (Hugging Face's generate moves them, without copy-constructing and its warning)."""
    eos_ids = config.eos_token_id
    eos = None if eos_ids is None else torch.as_tensor(eos_ids, dtype=torch.long, device=device).view(-1)
    pad = config.pad_token_id
    if pad is None and eos is not None:
        pad = int(eos[0])
    return eos, pad


def infer_attention_mask(input_ids: torch.Tensor, pad: int | None, eos: torch.Tensor | None) -> torch.Tensor:
    """Hugging Face's rule: pad tokens are masked when the pad id is present and is not an eos id."""
    if pad is None or (eos is not None and bool((eos == pad).any())) or not bool((input_ids == pad).any()):
        return torch.ones_like(input_ids)
    return input_ids.ne(pad).long()


def logits_processors(config: GenerationConfig, attention_mask: torch.Tensor, prompt_len: int,
                      eos: torch.Tensor | None) -> LogitsProcessorList:
    """The processors Hugging Face builds for the native options, in its order."""
    processors = LogitsProcessorList()
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        padding = (attention_mask != 0).int().argmax(dim=1)
        penalty = float(config.repetition_penalty)
        processors.append(RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=padding))
    if eos is not None and config.min_new_tokens is not None:
        # Hugging Face's generate then replaces min_length by prompt + min_new_tokens (the same ban)
        if config.min_new_tokens > 0:
            processors.append(EosBannedBelowLength(prompt_len + config.min_new_tokens, eos))
    elif eos is not None and config.min_length is not None and config.min_length > 0:
        processors.append(EosBannedBelowLength(config.min_length, eos))
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    return processors


def apply_processors(processors: LogitsProcessorList, input_ids: torch.Tensor | None,
                     scores: torch.Tensor) -> torch.Tensor:
    """``processors(input_ids, scores)`` for processors that take those two arguments alone (all the loop builds):
    the same calls in the same order, without the signature lookup the list makes per processor and step."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores


class EosBannedBelowLength(LogitsProcessor):
    """Hugging Face's ``MinLengthLogitsProcessor`` (``length`` = ``min_length``) and
    ``MinNewTokensLengthLogitsProcessor`` (``length`` = prompt + ``min_new_tokens``): the same scores, every eos id's
    -inf while the sequences are shorter than ``length``. Theirs build a vocabulary-sized mask on every step, even
    after ``length``; this sets the eos columns, and only until then. As theirs (``isin`` over the vocabulary), an eos
    id outside ``[0, vocabulary)`` bans nothing: not a negative index's column from the end, and no index error."""

    def __init__(self, length: int, eos: torch.Tensor):
        self.length, self.eos = length, eos

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] >= self.length:
            return scores
        eos = self.eos.to(scores.device)
        return scores.index_fill(-1, eos[(eos >= 0) & (eos < scores.shape[-1])], -math.inf)


def check_request_length(prompt_length: int, total: int, max_out_tokens: int) -> None:
    """Raise before any work if the prompt plus the tokens to generate exceed ``max_out_tokens``."""
    if total > max_out_tokens:
        raise ValueError(
            f"prompt length {prompt_length} + {total - prompt_length} new tokens = {total} exceeds "
            f"max_out_tokens={max_out_tokens}; allowed: prompt length + max_new_tokens <= {max_out_tokens} "
            "(raise max_out_tokens in the config, or shorten the request)"
        )


# ---- the per-request check ------------------------------------------------------------------------------------------
#: generation option -> (whether a value is allowed, what is allowed); None always is (the option is off)
VALUE_RULES = {
    "temperature": (lambda v: v >= 0, "a number >= 0 (0 or do_sample=False decodes greedily)"),
    "top_k": (lambda v: v >= 0 and float(v).is_integer(), "an integer >= 0 (0 turns top-k off)"),
    "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1] (1 turns top-p off)"),
    "min_p": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "typical_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "repetition_penalty": (lambda v: v > 0, "a number > 0 (1 turns it off)"),
    "max_new_tokens": (lambda v: v >= 1 and float(v).is_integer(), "an integer >= 1"),
    "max_length": (lambda v: v >= 1 and float(v).is_integer(), "an integer >= 1"),
    "min_new_tokens": (lambda v: v >= 0 and float(v).is_integer(), "an integer >= 0"),
    "min_length": (lambda v: v >= 0 and float(v).is_integer(), "an integer >= 0"),
}


def request_input_ids(model, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The token ids of a ``forward`` / ``generate`` call, wherever Hugging Face accepts them. For a model whose main
    input is not token ids (``main_input_name``: Whisper's ``input_features``, Wav2Vec2's ``input_values``, a vision
    model's ``pixel_values``) a floating tensor in the first place or as ``inputs`` is that input; named
    ``input_ids``, or given to a text model, it is a mistake that :func:`check_token_ids` names."""
    if "input_ids" in kwargs:
        candidate = kwargs["input_ids"]
    else:
        candidate = kwargs.get("inputs", args[0] if args else None)
        takes_ids = getattr(model, "main_input_name", "input_ids") == "input_ids"
        if isinstance(candidate, torch.Tensor) and candidate.is_floating_point() and not takes_ids:
            return None
    return candidate if isinstance(candidate, torch.Tensor) else None


def check_request(model, args: tuple, kwargs: dict, vocab_size: int | None, max_out_tokens: int | None) -> None:
    """Raise ``ValueError`` / ``TypeError`` naming the bad value and what is allowed, before any work: the token ids
    (integers in range, at least one per row), the attention mask (no row of padding only), the sampling and length
    options (from the keyword arguments, else the generation config), and the total length against
    ``max_out_tokens`` (None: no limit). Positional arguments count as they bind in ``model.generate``'s signature
    (the second is the generation config).

    An empty prompt is a request without tokens: ``input_ids=None`` starts from the model's ``bos_token_id`` as
    Hugging Face does (its text-generation pipeline passes an empty text that way); a tensor of length 0 raises.
    """
    args, kwargs = generate_arguments(model, args, kwargs)
    config = kwargs.get("generation_config")
    if config is None:
        config = getattr(model, "generation_config", None)
    elif not isinstance(config, GenerationConfig):
        raise TypeError(f"generation_config={reprlib.repr(config)} ({type(config).__name__}); allowed: a transformers "
                        "GenerationConfig or None (generate's second positional argument is the generation config)")
    options = {name: kwargs[name] if kwargs.get(name) is not None else getattr(config, name, None)
               for name in (*VALUE_RULES, "do_sample", "pad_token_id", "eos_token_id")}
    check_generation_values(options)
    input_ids = request_input_ids(model, args, kwargs)
    if input_ids is None:
        return
    check_generate_ids_shape(input_ids)
    check_token_ids(input_ids, vocab_size)
    check_padding_rows(input_ids, kwargs.get("attention_mask"), options["pad_token_id"], options["eos_token_id"])
    prompt_length = input_ids.shape[-1]
    total = requested_total(model, prompt_length, kwargs, kwargs.get("generation_config"))
    if max_out_tokens is not None:
        check_request_length(prompt_length, total, max_out_tokens)
    check_learned_positions(model, prompt_length, total)


def check_learned_positions(model, prompt_length: int, total: int) -> None:
    """Raise before any work if generating ``total`` tokens would embed a position past the model's learned table:
    every token but the last is fed to the model, so ``total`` may be one more than the positions, as in Hugging
    Face's generate, which fails on an index error past that."""
    limit = learned_position_limit(model)
    if limit is None or total <= limit + 1:
        return
    raise ValueError(
        f"prompt length {prompt_length} + {total - prompt_length} new tokens = {total} would feed the model position "
        f"{total - 2}, past the {limit} learned positions (0 to {limit - 1}) of this {model.config.model_type} model; "
        f"allowed: prompt length + max_new_tokens <= {limit + 1} (every token but the last is fed back)")


def check_generation_values(options: dict) -> None:
    """Each set sampling or length option is a finite real number its rule allows."""
    for name, (allowed, description) in VALUE_RULES.items():
        if options.get(name) is not None:
            check_real(name, options[name], allowed, description)
    if options.get("do_sample") and options.get("temperature") == 0:
        raise ValueError("temperature=0 with do_sample=True; allowed: temperature > 0 to sample, or "
                         "do_sample=False (greedy decoding, which temperature 0 means)")


def check_real(name: str, value, allowed, description: str) -> None:
    """Raise ``TypeError`` unless ``value`` is a real number (not a bool), ``ValueError`` unless it is finite and
    ``allowed(value)``; both name the value and say what is allowed (``description``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}); allowed: {description}")
    if not math.isfinite(value) or not allowed(value):
        raise ValueError(f"{name}={value!r}; allowed: {description}")


def check_generate_ids_shape(input_ids: torch.Tensor) -> None:
    """Raise unless ``input_ids`` has generate's shape ``[batch, length]`` (Hugging Face's generate takes no
    ``[length]`` ids: it indexes their second dimension)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; allowed for generate: [batch, length], "
                         "e.g. ids[None] for a single prompt of shape [length]")


def check_token_ids(input_ids: torch.Tensor, vocab_size: int | None) -> None:
    """Raise if ``input_ids`` is not a non-empty integer tensor of ids within ``[0, vocab_size)``, of shape
    ``[batch, length]`` or (a forward, which some models take it for) ``[length]``."""
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    if input_ids.dim() not in (1, 2):
        raise ValueError(f"input_ids must have shape [batch, length] or [length], got {tuple(input_ids.shape)}")
    if input_ids.shape[-1] == 0 or input_ids.numel() == 0:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: an empty prompt; allowed: at least one "
                         "token per row (generate also takes input_ids=None, starting from the model's bos_token_id)")
    if vocab_size is None:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids contains token id {bad}; allowed: 0 <= id < vocab_size={vocab_size}")


def check_padding_rows(input_ids: torch.Tensor, attention_mask, pad: int | None, eos) -> None:
    """No row may be padding only: it has nothing to attend to, and would generate from garbage."""
    if attention_mask is None:
        eos_ids = [] if eos is None else torch.as_tensor(eos).view(-1).tolist()
        if pad is None or pad in eos_ids:
            return
        attention_mask = input_ids.ne(pad)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask has shape {shape}; allowed: a tensor the shape of input_ids, "
                         f"{tuple(input_ids.shape)}")
    empty = (attention_mask.reshape(-1, input_ids.shape[-1]) == 0).all(dim=-1).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"row(s) {empty} of the batch are padding only (attention_mask all 0); allowed: at least "
                         "one real token per row")


def requested_total(model, prompt_length: int, kwargs: dict, generation_config) -> int:
    """Prompt plus new tokens, as Hugging Face's generate resolves them from the keyword arguments, the given
    generation config and the model's, in that order (:func:`hf_total_length`)."""
    configs = [c for c in (generation_config, getattr(model, "generation_config", None)) if c is not None]

    def value(name):
        if kwargs.get(name) is not None:
            return kwargs[name]
        return next((getattr(c, name) for c in configs if getattr(c, name, None) is not None), None)

    total = hf_total_length(model, value("max_new_tokens"), value("max_length"),
                            takes_hf_default_max_length(model, generation_config, kwargs), prompt_length)
    return max(prompt_length, total)


def decode(runtime: SpliceCausalLM, req: Request, streamer=None, timer: ForwardTimer | None = None):
    """Prefill the prompt, then one decode step per new token until every row stops or the length is reached; each
    of these forwards timed by ``timer`` when given."""
    measure = timer.measure if timer is not None else nullcontext
    ids, mask = req.input_ids, req.attention_mask
    batch, prompt_len = ids.shape
    total = prompt_len + req.max_new_tokens
    check_request_length(prompt_len, total, runtime.max_len)
    # Hugging Face's generate concatenates int64 tokens to the prompt, which promotes narrower ids (int32) to int64
    sequences = torch.full((batch, total), req.pad if req.pad is not None else 0, device=ids.device,
                           dtype=torch.promote_types(ids.dtype, torch.long))
    sequences[:, :prompt_len] = ids
    unfinished = torch.ones(batch, dtype=torch.long, device=ids.device)
    scores, raw_logits = [], []
    if streamer is not None:
        streamer.put(ids.cpu())
    cache = runtime.cache_for(batch)
    positions = prefill_positions(mask)
    cache.start(mask)
    dense = bool(mask.all())  # no padding: the causal kernel needs no mask
    with measure():
        # a right-padded row's first token comes from its last pad's query, as in Hugging Face's generate
        logits = runtime.forward(ids, positions, cache.slot_ids[:prompt_len], cache, prompt_len, dense=dense)
    # Hugging Face's positions: each new token's is the last column's plus one (a right-padded row's last column is
    # a pad at position 0, so its new tokens take positions 1, 2, ...); the new tokens follow the pad columns, which
    # stay masked
    position, slot = positions[:, -1:].clone(), cache.slot_ids[prompt_len - 1:prompt_len].clone()
    length = prompt_len
    native_pick = not req.do_sample and native.available_on(runtime.device)
    # greedy, no processor, no scores kept: the pick reads the logits as they are (the indices of their float32
    # copies, which it does not need to make)
    pick_from_logits = native_pick and not req.processors and not (req.output_scores or req.output_logits)
    # greedy, no scores kept, no processor but the minimum lengths' eos ban, no forward timed: the loop's steps may run
    # in native calls that do the loop's bookkeeping too (runtime.greedy_steps), several a call without a streamer
    bans = [p.length for p in req.processors if isinstance(p, EosBannedBelowLength)]
    fused = runtime.greedy_steps(batch, cache, req.eos, req.pad if req.eos is not None else 0, max(bans, default=0)) \
        if native_pick and timer is None and sequences.device.type == "cpu" and len(bans) == len(req.processors) \
        and not (req.output_scores or req.output_logits) else None
    while True:
        running = None  # the rows not finished, where the pick counted them
        if pick_from_logits and native.argmax_fits(logits) and sequences.device.type == "cpu":
            # the pick, eos and the sequences' column in one call (what the torch steps below do)
            tokens, running = torch.ops.splice_kernels.greedy_next(
                logits, sequences, length, unfinished, req.eos, req.pad if req.eos is not None else 0)
            next_logits = next_scores = None
        else:
            next_logits = logits.to(dtype=torch.float32, copy=True)
            next_scores = apply_processors(req.processors, sequences[:, :length], next_logits)
            tokens = pick(next_scores, req.do_sample, native_pick)
            if req.eos is not None:  # a finished row takes pad; a row stops at any eos id
                tokens = tokens.masked_fill(unfinished == 0, req.pad)
                unfinished.masked_fill_(torch.isin(tokens, req.eos), 0)
            sequences[:, length] = tokens
        length += 1
        if req.output_scores:
            scores.append(next_scores)
        if req.output_logits:
            raw_logits.append(next_logits)
        if streamer is not None:
            streamer.put(tokens.cpu())
        if length == total or not (running if running is not None else bool(unfinished.any())):
            break
        if fused is not None:  # the remaining steps in native calls, until every row has finished
            running = None
            while length < total and running != 0:
                tokens, running, taken = fused(sequences, length, position, slot, unfinished,
                                               1 if streamer is not None else total - length)
                length += taken
                if streamer is not None:
                    streamer.put(tokens.cpu())
            break
        position.add_(1)
        slot.add_(1)
        cache.mark(slot)
        with measure():
            logits = runtime.decode_step(tokens[:, None], position, slot, cache, length)
    if streamer is not None:
        streamer.end()
    return result(sequences[:, :length].contiguous(), req, scores, raw_logits)


def prefill_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of a padded prompt, as Hugging Face computes them: each real token's count of real tokens before
    it; pads get 0."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def pick(scores: torch.Tensor, do_sample: bool, native_pick: bool = False) -> torch.Tensor:
    """The next token of each row: sampled, or the highest score's (the first of equal ones, as ``torch.argmax``;
    ``max``'s indices are the same tokens, and on CPU its reduction is the cheaper one over a vocabulary). With
    ``native_pick``, float32 CPU scores go to splice's ``argmax_rows`` (the same indices, NaN included, without torch's
    element-by-element reduction)."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    if native_pick and native.argmax_fits(scores):
        return torch.ops.splice_kernels.argmax_rows(scores)
    return scores.max(dim=-1).indices


def result(sequences: torch.Tensor, req: Request, scores: list, raw_logits: list):
    if not req.return_dict:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=tuple(scores) if req.output_scores else None,
                                     logits=tuple(raw_logits) if req.output_logits else None)
