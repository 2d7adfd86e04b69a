"""InferenceEngine: the module ``init_inference`` returns."""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from contextlib import contextmanager, nullcontext
from functools import partial, update_wrapper
from types import MethodType
from typing import Any, Iterator

import torch
from torch import nn
from transformers.utils import ModelOutput

from .arch.paths import input_embeddings
from .config import InferenceConfig
from .distributed import SINGLE_PROCESS, ParallelContext
from .generation import check_request, check_token_ids, generate_arguments, request_input_ids
from .generation import generate as native_generate
from .layers.causal_lm import SpliceCausalLM
from .layers.cuda_graphs import GraphReplayer
from .profiling import ForwardTimer
from .steps import StepReport
from .steps.fuse import HiddenStatesHook

log = logging.getLogger("splice")


class _ModelMethod:
    """A method the engine has only where the model it wraps has the method of that name (as DeepSpeed's engine, which
    sets ``generate`` only then): ``hasattr(engine, "generate")`` answers as ``hasattr(model, "generate")``."""

    def __init__(self, function: Any):
        self.function = function
        update_wrapper(self, function)

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        if engine is None:
            return self
        module = engine.__dict__.get("_modules", {}).get("module")
        if module is not None and not hasattr(module, self.__name__):
            raise self.missing(module)
        return MethodType(self.function, engine)

    def missing(self, module: nn.Module) -> AttributeError:
        return AttributeError(f"{type(module).__name__} has no {self.__name__}(); only forward() is available")


class InferenceEngine(nn.Module):
    """Wraps the model the pipeline built: ``forward``, ``generate`` and per-forward profiling.

    Everywhere else the engine stands in for the model it wraps (``engine.module``), as DeepSpeed's engine does, so
    code written for a Hugging Face model takes it unchanged (``pipe.model = init_inference(pipe.model, ...)``): an
    attribute the engine does not have itself is read from the model (``config``, ``generation_config``, ``device``,
    ``dtype``, ``can_generate``, ``main_input_name``, ...), and assigning one the model has sets it on the model.

    ``reports`` holds what each pipeline step did, one dataclass per step (``report`` gives them as
    ``(step, sentence)`` pairs); ``parallel`` is the tensor-parallel context the model was sharded for; ``runtime`` is
    the native decode runtime of a fused (kernel-injected) model, None otherwise; ``inference_config`` is the resolved
    :class:`~splice.config.InferenceConfig` (``config`` is the model's own).
    """

    def __init__(self, module: nn.Module, config: InferenceConfig, reports: list[StepReport] | None = None,
                 parallel: ParallelContext = SINGLE_PROCESS, runtime: SpliceCausalLM | None = None):
        super().__init__()
        self.inference_config = config  # the engine's own attributes first: from here on, the model's are delegated
        self.reports = list(reports or [])
        self.parallel = parallel
        self.runtime = runtime
        self._timer: ForwardTimer | None = None
        self._forward_graphs = GraphReplayer(self._call_module, "engine(...)") if config.enable_cuda_graph else None
        self._graphs_weights: tuple | None = None  # where the weights the forward graphs read were (_weights_place)
        self._is_compiled = False  # compile() ran
        self.module = module
        super().train(False)  # the engine, as its model, in eval mode (nn.Module starts in training mode)
        if hasattr(type(module), "save_pretrained"):
            # the model's own save_pretrained would write fused or quantized weights that transformers' from_pretrained
            # loads as missing (initialised at random) without an error: it refuses those, and saves the others
            module.save_pretrained = partial(_save_pretrained, module, parallel.world_size)

    # --- standing in for the wrapped model ----------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """The engine's own parameters, buffers and submodules (``module``), else the wrapped model's attribute."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or _is_dunder(name):
                raise
            method = getattr(type(self), name, None)
            if isinstance(method, _ModelMethod):  # the model lacks it too (Python calls here when __get__ refuses)
                raise method.missing(module) from None
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"neither {type(self).__name__} nor the model it wraps "
                                 f"({type(module).__name__}) has an attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        """An attribute the wrapped model has (and the engine does not) is set on the model, so that what its own
        ``generate`` and ``forward`` read is what the caller set (``engine.generation_config = ...``)."""
        if self._delegates(name):
            setattr(self.__dict__["_modules"]["module"], name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._delegates(name):
            delattr(self.__dict__["_modules"]["module"], name)
        else:
            super().__delattr__(name)

    def _delegates(self, name: str) -> bool:
        """Whether ``name`` is the wrapped model's, not the engine's own."""
        modules = self.__dict__.get("_modules")
        module = modules.get("module") if modules is not None else None
        if module is None or _is_dunder(name) or name in self.__dict__ or hasattr(type(self), name):
            return False
        if name in modules or name in self.__dict__["_parameters"] or name in self.__dict__["_buffers"]:
            return False
        return hasattr(module, name)

    # --- DeepSpeed's engine attributes, read by code written for it ---------------------------------------------
    @property
    def _config(self) -> InferenceConfig:
        """DeepSpeed's name for the resolved config (``inference_config``)."""
        return self.inference_config

    @property
    def mp_world_size(self) -> int:
        """The number of ranks the model is sharded across (the tensor-parallel group's size)."""
        return self.parallel.world_size

    @property
    def mp_group(self) -> Any:
        """The tensor-parallel process group (the default group's object where the group is the whole world, as the
        group DeepSpeed makes of every rank would be); None for one process."""
        if self.parallel.group is None and self.parallel.enabled:
            return torch.distributed.group.WORLD
        return self.parallel.group

    @property
    def mpu(self) -> Any:
        return self.inference_config.tensor_parallel.mpu

    @property
    def injection_dict(self) -> dict | None:
        return self.inference_config.injection_policy

    @property
    def report(self) -> list[tuple[str, str]]:
        """What each step did, as ``(step, sentence)`` pairs."""
        return [(report.step, report.summary()) for report in self.reports]

    def step_report(self, step: str) -> StepReport:
        """The report of the step named ``step`` ("dtype", "load", "shard", "fuse", "quantize", "kernels", "place",
        "compile")."""
        for report in self.reports:
            if report.step == step:
                return report
        raise KeyError(f"no step {step!r}; steps: {', '.join(r.step for r in self.reports)}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward; with ``enable_cuda_graph``, replayed from a CUDA graph of this call's signature."""
        self._checked_input_ids(args, kwargs)
        self._check_outputs(kwargs)
        # no_grad, not inference_mode: what comes back is an ordinary tensor, which the caller may change in place
        # (``logits /= temperature``), as the model's own output under no_grad
        with torch.no_grad():
            if self._forward_graphs is None or not _capturable(args, kwargs):
                return self.module(*args, **kwargs)
            place = _weights_place(self.module)
            if place != self._graphs_weights:  # moved or cast (engine.to, module.half): the graphs read the old ones
                self._forward_graphs.clear()
                self._graphs_weights = place
            with self._timer.measure_as_one() if self._timer is not None else nullcontext():
                return self._forward_graphs(len(args), tuple(kwargs), *args, *kwargs.values())

    def _call_module(self, positional: int, names: tuple[str, ...], *values: Any) -> Any:
        """``module(*args, **kwargs)`` from the flat form a graph replayer keys its signatures by."""
        return self.module(*values[:positional], **dict(zip(names, values[positional:])))

    def train(self, mode: bool = True) -> InferenceEngine:
        """``train(False)`` (``eval()``) only: the engine runs its model for inference (under no_grad, its fused blocks
        and native decode loop without dropout), so a training mode would be honoured by some of its paths only."""
        if mode is True:
            raise ValueError("engine.train(True): an InferenceEngine runs its model for inference only (no gradients; "
                             "fused blocks and the native decode loop have no dropout); allowed: engine.eval() or "
                             "engine.train(False); train the model before init_inference")
        return super().train(mode)

    @_ModelMethod
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Hugging Face ``generate`` with every option it has, positional arguments in its order (``inputs``,
        ``generation_config``, ``logits_processor``, ...), after checking the request
        (:func:`splice.generation.check_request`: ids, padding, sampling values, length within ``max_out_tokens``).
        Only where the model has ``generate``: else reading ``engine.generate`` raises AttributeError."""
        # positional arguments by name, so the checks and the native loop read each where the model's generate does
        args, kwargs = generate_arguments(self.module, args, kwargs)
        check_request(self.module, args, kwargs, self.vocab_size, self._request_limit())
        if self.parallel.enabled:
            self._check_outputs(kwargs, generating=True)  # a rank's share of the heads' weights
        self.parallel.sync_rng()  # under TP every rank must sample the same tokens, even if reseeded since init
        with torch.no_grad():  # as Hugging Face's generate: its output is an ordinary tensor
            if self.runtime is None:
                return self.module.generate(*args, **kwargs)
            if self._hooks_native_loop_skips():
                log.info("splice generate: forward hooks on modules the native loop does not call; transformers' "
                         "generate runs on the fused model")
                return self.module.generate(*args, **kwargs)
            with _runtime_lock(self.runtime):  # one native loop at a time: they share the runtime's KV cache
                output = native_generate(self.module, self.runtime, *args, timer=self._timer, **kwargs)  # or HF's
        return ordinary_tensors(output)

    def _request_limit(self) -> int | None:
        """The most tokens (prompt + new) a ``generate`` request may reach: ``max_out_tokens`` where it sizes the
        native loop's KV cache, or where the config names it; None for a model left to its own generate (whose cache
        grows, as under DeepSpeed, which checks nothing there) and for an encoder-decoder, whose prompt is the
        encoder's input and not part of the generated sequence."""
        if getattr(getattr(self.module, "config", None), "is_encoder_decoder", False):
            return None
        config = self.inference_config
        if self.runtime is not None or "max_out_tokens" in config.model_fields_set:
            return config.max_out_tokens
        return None

    def _hooks_native_loop_skips(self) -> bool:
        """Whether a forward hook (not splice's or transformers' own) is on a module the native loop does not call as
        a module (the model, its containers, the fused blocks), or on every module: Hugging Face's generate, which
        calls each of them once a forward, runs them."""
        if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
            return True
        runtime = self.runtime
        ends = [getattr(runtime.ends, field.name) for field in dataclasses.fields(runtime.ends)]
        called = {id(module) for end in ends if isinstance(end, nn.Module) for module in end.modules()}
        called |= {id(module) for block in runtime.blocks for module in block.modules() if module is not block}
        return any(not self._splice_hook(hook) for module in self.module.modules() if id(module) not in called
                   for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()))

    def _splice_hook(self, hook: Any) -> bool:
        """The profiling timer's hooks, and transformers' hidden-state recorders (inactive unless asked for)."""
        return (self._timer is not None and getattr(hook, "__self__", None) is self._timer) or \
            isinstance(hook, HiddenStatesHook) or getattr(hook, "__qualname__", "").endswith("output_capturing_hook")

    def _check_outputs(self, kwargs: dict, generating: bool = False) -> None:
        """Attention weights are never formed by the fused blocks (SDPA), and under tensor parallelism each rank forms
        its own heads' only: asking for them raises rather than returning none or a rank's share (hidden states are
        recorded as the model records them)."""
        if not self._asks_attentions(kwargs, generating):
            return
        if self.fused:
            raise ValueError("output_attentions=True needs the attention weights, which splice's fused blocks do not "
                             "form (they attend with SDPA); allowed: output_attentions=False, or "
                             "replace_with_kernel_inject=False for a model whose attention weights are wanted")
        if self.parallel.enabled:
            raise ValueError(f"output_attentions=True under tensor parallelism (tp_size={self.parallel.world_size}): "
                             "each rank computes the attention weights of its own heads only; allowed: "
                             "output_attentions=False, or tp_size=1 for a model whose attention weights are wanted")

    def _asks_attentions(self, kwargs: dict, generating: bool) -> bool:
        """Whether a call asks for attention weights: by keyword, else (``generate``) in the generation config it
        passes or the model's, else in the model's config."""
        if kwargs.get("output_attentions") is not None:
            return bool(kwargs["output_attentions"])
        configs = (kwargs.get("generation_config"), getattr(self.module, "generation_config", None)) \
            if generating else ()
        configs += (getattr(self.module, "config", None),)
        return any(bool(getattr(config, "output_attentions", False)) for config in configs if config is not None)

    @property
    def fused(self) -> bool:
        """Whether kernel injection replaced the model's layers by splice's fused blocks."""
        return any(report.step == "fuse" and getattr(report, "family", None) for report in self.reports)

    def _checked_input_ids(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The token ids of a call, checked; None for a model without an input embedding that was not given
        ``input_ids`` (its first argument is whatever its forward takes)."""
        input_ids = request_input_ids(self.module, args, kwargs)
        if input_ids is None or (self.vocab_size is None and "input_ids" not in kwargs):
            return None
        check_token_ids(input_ids, self.vocab_size)
        return input_ids

    @property
    def vocab_size(self) -> int | None:
        """The input embedding's number of tokens; None for a model without one (transformers' models without token
        inputs, such as Wav2Vec2, raise ``NotImplementedError`` from ``get_input_embeddings``)."""
        return getattr(input_embeddings(self.module), "num_embeddings", None)

    # --- DeepSpeed's engine methods -----------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Free what the engine allocated to run the model (DeepSpeed's ``destroy`` frees its kernels' workspace): the
        decode runtime's KV cache and the CUDA graphs of decode steps and ``engine(...)`` calls. The engine stays
        usable: the next request allocates its cache, and captures its graphs, again."""
        if self.runtime is not None:
            with _runtime_lock(self.runtime):  # not while a generate decodes into the cache
                self.runtime.release()
        if self._forward_graphs is not None:
            self._forward_graphs.clear()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # what the cache and graphs held goes back to the device, not only to torch

    def compile(self, backend: Any = "inductor", compile_kwargs: dict | None = None) -> None:
        """DeepSpeed's ``compile``. A kernel-injected model compiles its decode step (``compile_decode=True``, on
        inductor; ``compile_kwargs`` may give torch.compile's ``mode`` and ``options``); any other model is compiled
        whole, ``torch.compile(module, backend=backend, **compile_kwargs)``, as DeepSpeed does. Once compiled, a second
        call does nothing."""
        if self.is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        if self.runtime is None:
            self.module.compile(backend=backend, **kwargs)
        else:
            check_decode_compile(backend, kwargs)
            self.runtime.compile_decode(cpp_wrapper=self.parallel.world_size == 1, **kwargs)
            if self.runtime.graphs is not None:
                self.runtime.capture_graphs()  # the graphs replay the compiled step from here on
        if self._forward_graphs is not None:
            self._forward_graphs.clear()
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` ran, or ``compile_decode=True`` compiled the decode step at init."""
        return self._is_compiled or (self.runtime is not None and self.runtime.compiled)

    # --- profiling, as DeepSpeed's engine offers it ---------------------------------------------------------------
    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Start recording the latency of every forward of the model, as DeepSpeed does: each ``engine(...)`` call,
        and in ``generate`` the prefill and every decode step (native loop, compiled step or Hugging Face's generate),
        so N new tokens give N entries.

        ``use_cuda_events``: a model on a GPU is timed with CUDA events; otherwise (and on the CPU) with the wall
        clock, the device synchronised before and after. Calling it again changes only this choice. ``1`` and ``0``
        are taken as True and False (DeepSpeed reads the value as a truth value).
        """
        use_cuda_events = _flag(use_cuda_events)
        if self._timer is None:
            self._timer = ForwardTimer(self.module, use_cuda_events)
        self._timer.use_cuda_events = use_cuda_events

    @property
    def model_profile_enabled(self) -> bool:
        """Whether :meth:`profile_model_time` has been called (DeepSpeed's flag, which serving code such as
        DeepSpeed-MII reads before asking for ``model_times()``)."""
        return self._timer is not None

    def model_times(self) -> list[float]:
        """The per-forward latencies in milliseconds since the last call, oldest first; clears them."""
        if self._timer is None:
            raise ProfilingNotEnabled("model_times() needs profile_model_time() to be called first")
        return self._timer.take()


class ProfilingNotEnabled(RuntimeError, AssertionError):
    """``model_times()`` before ``profile_model_time()``. A RuntimeError for splice's callers, and an AssertionError
    too because DeepSpeed's engine asserts there, so code written for DeepSpeed that catches that still catches it."""


def _flag(use_cuda_events: Any) -> bool:
    """``profile_model_time``'s ``use_cuda_events`` as a bool: True, False, or the ints 1 and 0 (bool is an int)."""
    if isinstance(use_cuda_events, int) and use_cuda_events in (0, 1):
        return bool(use_cuda_events)
    if isinstance(use_cuda_events, int):
        raise ValueError(f"use_cuda_events={use_cuda_events!r}; allowed: True or False (or 1 or 0)")
    raise TypeError(f"use_cuda_events={use_cuda_events!r} ({type(use_cuda_events).__name__}); allowed: True or False "
                    "(or 1 or 0)")


#: what compile_kwargs a kernel-injected model's decode step takes (its shapes are static, its graph whole)
DECODE_COMPILE_KWARGS = ("mode", "options")


def check_decode_compile(backend: Any, kwargs: dict) -> None:
    """engine.compile's arguments for a kernel-injected model: inductor, and only what the decode step can take."""
    if backend != "inductor":
        raise ValueError(f"engine.compile(backend={backend!r}): a kernel-injected model compiles its decode step with "
                         "inductor (its native kernels are inductor custom ops); allowed: backend='inductor'")
    unknown = sorted(set(kwargs) - set(DECODE_COMPILE_KWARGS))
    if unknown:
        raise ValueError(f"engine.compile(compile_kwargs={kwargs!r}): {', '.join(unknown)} cannot apply to the "
                         "kernel-injected decode step (compiled with static shapes, one whole graph per batch size "
                         f"and attended length); allowed keys: {', '.join(DECODE_COMPILE_KWARGS)}")


def _weights_place(module: nn.Module) -> tuple | None:
    """Where the model's first weight is (storage, device, dtype): a move or cast of the model replaces it."""
    weight = next(module.parameters(), None)
    return None if weight is None else (weight.data_ptr(), weight.device, weight.dtype)


_RUNTIME_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decode runtime -> [lock, owner thread]


@contextmanager
def _runtime_lock(runtime: SpliceCausalLM) -> Iterator[None]:
    """Holds ``runtime``'s lock: the native loop writes the runtime's one static KV cache, so two threads' requests
    run one after the other. A request made from inside another on the same thread (a streamer calling generate)
    would overwrite the cache the outer one is decoding into: it raises."""
    state = _RUNTIME_LOCKS.setdefault(runtime, [threading.Lock(), None])
    if state[1] == threading.get_ident():
        raise RuntimeError("engine.generate called from inside a generate of the same kernel-injected engine (a "
                           "streamer or logits processor): both would decode into the one KV cache; allowed: one "
                           "request at a time per engine and thread (another engine, or another thread, waits)")
    with state[0]:
        state[1] = threading.get_ident()
        try:
            yield
        finally:
            state[1] = None


def _save_pretrained(module: nn.Module, world_size: int, *args: Any, **kwargs: Any) -> Any:
    """The model's own ``save_pretrained``, for a model whose weights are still Hugging Face's layout; else raises
    before writing anything."""
    from .layers.block import has_fused_blocks
    from .quant.layers import QuantizedLinear

    changes = []
    if has_fused_blocks(module):
        changes.append("its layers were fused by kernel injection (replace_with_kernel_inject=True)")
    if any(isinstance(sub, QuantizedLinear) for sub in module.modules()):
        changes.append("its linears are quantized (splice.quant.save_quantized saves them, load_quantized loads "
                       "them into a model built the same way)")
    if world_size > 1:
        changes.append(f"it holds one of {world_size} tensor-parallel shards (save_mp_checkpoint_path saves them)")
    if changes:
        raise RuntimeError(f"save_pretrained on a model init_inference changed: {'; '.join(changes)}. transformers' "
                           f"from_pretrained would load such a folder with those layers at random. Allowed: save the "
                           f"model before init_inference, or an engine built without those options")
    return type(module).save_pretrained(module, *args, **kwargs)


def ordinary_tensors(value: Any) -> Any:
    """``value`` with each inference tensor in it (the native loop runs under ``inference_mode``) cloned into an
    ordinary one, which the caller may change in place as Hugging Face's output; other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(ordinary_tensors(item) for item in value)
    if isinstance(value, ModelOutput):
        for key, item in value.items():
            value[key] = ordinary_tensors(item)
    return value


def _capturable(args: tuple, kwargs: dict) -> bool:
    """Whether a call's arguments can key a CUDA graph: tensors and plain values only. An object such as a
    ``Cache`` (``past_key_values``) is changed by every run, so the warm-up runs before a capture would change it
    too: such a call runs eagerly."""
    return all(isinstance(value, torch.Tensor) or _plain(value) for value in (*args, *kwargs.values()))


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(map(_plain, value))
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device))


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")
