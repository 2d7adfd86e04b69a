"""splice's native causal-LM path over the injected model: embedding -> fused blocks -> final norm -> lm_head.

It holds the model's own modules (registered in the model, so moving the model moves them) and reads their tensors at
call time; it owns only derived tables (rotary) and the KV cache it is asked to build.
"""
from __future__ import annotations

import inspect
import math
import types
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

from .. import native
from ..arch.record import ModelDims
from . import native_layer
from .cuda_graphs import GraphReplayer
from .kv_cache import StaticKVCache
from .rotary import RopeTable, build_table

#: the compiled decode step attends over at least this many slots (see ``SpliceCausalLM.attended_length``)
MIN_ATTENDED = 256
#: greedy steps one native call takes at most (:class:`GreedySteps`): Python handles a signal (Ctrl-C) only between
#: calls, so a long generate without a streamer still stops within a few steps' time
GREEDY_STEPS_A_CALL = 16


def inductor_options(device: torch.device, cpp_wrapper: bool = True) -> dict:
    """Inductor's options for a decode step's graph, read when it compiles. On CPU the graph's wrapper is C++
    (``cpp_wrapper``, unless the caller says no): a step calls a hundred or so kernels and custom ops, each costing
    less from C++ than from the Python wrapper (compiling takes longer, once per graph). A graph compiled for
    ``torch.profiler``'s kernel names (``cpp.enable_kernel_profile``) keeps the Python wrapper, whose operator calls
    the profiler sees."""
    profiled = torch._inductor.config.cpp.enable_kernel_profile
    return {"cpp_wrapper": cpp_wrapper and torch.device(device).type == "cpu" and not profiled}


def attended_length(kv_len: int, max_len: int, min_attended: int = MIN_ATTENDED) -> int:
    """The slots the compiled step attends over for ``kv_len`` filled ones: the next power of two from
    ``min_attended`` on, at most the cache's ``max_len``. A step then reads at most twice the keys and values in use,
    and a cache of ``max_len`` slots has at most ``log2(max_len / min_attended) + 1`` lengths to compile."""
    return min(max_len, max(min_attended, 1 << (kv_len - 1).bit_length()))


@dataclass
class Ends:
    """The model's modules around the blocks, each optional but the embedding and the lm_head: learned positions
    (looked up at ``position + position_offset``), a norm on the embeddings, OPT's projections in and out, the final
    norm."""

    embed: nn.Module
    lm_head: nn.Module
    norm: nn.Module | None = None
    position_embed: nn.Module | None = None
    position_offset: int = 0
    embed_norm: nn.Module | None = None
    project_in: nn.Module | None = None
    project_out: nn.Module | None = None


class GreedySteps:
    """Greedy decoding's steps through one registered native run that ends with the model's head, in native calls
    (``splice_kernels.decode_greedy``) that do what ``generate``'s loop does for each token: the rows' positions,
    the shared slot and the cache's marks one further, the step on each row's last token (masked as the loop masks
    it), the pick written after it (finished rows take ``pad``; a row picking an ``eos`` id finishes; below
    ``eos_banned_below`` columns no eos id is picked). Made by :meth:`SpliceCausalLM.greedy_steps`, its arguments
    gathered once: between steps a call's Python is slow to start, each step having streamed the weights through the
    caches."""

    def __init__(self, run: native_layer.NativeRun, embedding: torch.Tensor, embed_scale: float | None,
                 cache: StaticKVCache, cos: list, sin: list, eos: torch.Tensor | None, pad: int, eos_banned_below: int):
        self.run, self.cache = run, cache  # the run holds its registration
        self.before = (embedding, embed_scale, cache.keys, cache.values, run.registered.number)
        self.windows = [window or 0 for window in run.registered.windows]  # each of the run's masks'
        self.tables = (cos, sin)
        self.after = (eos, pad, eos_banned_below)

    def __call__(self, sequences: torch.Tensor, length: int, positions: torch.Tensor, slot: torch.Tensor,
                 unfinished: torch.Tensor, steps: int) -> tuple[torch.Tensor, int, int]:
        """Up to ``steps`` steps (at most :data:`GREEDY_STEPS_A_CALL`), the first on each row's token at column
        ``length - 1`` of ``sequences``, each masked as the loop's own step would be (``cache.mask``, none where every
        row sees every slot); fewer once every row has finished. The last step's tokens, the rows unfinished and the
        steps taken."""
        cache = self.cache
        tokens, running, taken, cache.filled = torch.ops.splice_kernels.decode_greedy(
            *self.before, slot, cache.valid, cache.filled, self.windows, positions, *self.tables, sequences, length,
            unfinished, *self.after, min(steps, GREEDY_STEPS_A_CALL))
        return tokens, running, taken


class SpliceCausalLM:
    """``forward(tokens, positions, slots, cache, kv_len)`` returns the logits of the last position (or all).

    The embedding and the lm_head are called as modules: under tensor parallelism they are vocab-parallel (the
    embedding sums its rows over the group, the lm_head all-gathers), so every rank gets the full logits."""

    def __init__(self, config: Any, dims: ModelDims, ends: Ends, blocks: nn.ModuleList, embed_scale: bool,
                 max_len: int):
        self.config = config  # read only (rope types that need transformers' own init functions)
        self.dims = dims
        self.embed, self.blocks, self.norm, self.lm_head = ends.embed, blocks, ends.norm, ends.lm_head
        self.ends = ends
        # the family scales its embeddings: here, unless the embedding module does it itself (Gemma in transformers 5)
        scales_itself = getattr(ends.embed, "embed_scale", None) is not None
        self.embed_scale = math.sqrt(dims.hidden) if embed_scale and not scales_itself else None
        self.max_len = max_len
        self.windows = sorted({block.window for block in blocks}, key=lambda w: -1 if w is None else w)
        self.ropes = (dims.layer_ropes or (dims.rope,)) if dims.positions == "rotary" else ()
        self._rope: dict[int, RopeTable] = {}
        self._compiled_step = None
        self._cpp_wrapper = True  # compile_decode's choice
        self._compiled_keys: set[tuple] = set()  # (batch, attended length, dtype, device, slot dims, cache id) seen
        self._direct_steps: dict[tuple, Any] = {}  # key and grad modes -> its graph's compiled code, or False
        # the compiled step's smallest attended length: below it, reading the empty slots costs less than a compile
        self.min_attended = MIN_ATTENDED
        self._cache: StaticKVCache | None = None
        self._step_plans: dict[tuple, list] = {}  # (rows, boolean masks, row limits, head) -> an eager step's plan
        # the final norm and lm_head join a decode step's last native call (head_call); off, they run as their own
        # modules (the eager step profiler times them so)
        self.head_in_call = True
        self.graphs: GraphReplayer | None = None  # the decode step's CUDA graphs (capture_graphs)
        # a compiled engine's decode steps that run in one native call end to end run eagerly (step_runs_natively);
        # True sends them through the compiled graph too
        self.compile_native_steps = False

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def rope(self, index: int = 0) -> RopeTable:
        """Rotary table ``index`` for ``max_len`` positions on the model's device, in its dtype (float32 where the
        family keeps them so: ``dims.rotary_tables_float``), built once."""
        dtype = torch.float32 if self.dims.rotary_tables_float else self.dtype
        table = self._rope.get(index)
        if table is None or table.cos.device != self.device or table.cos.dtype != dtype:
            table = build_table(self.ropes[index], self.config, self.dims.head_dim, self.max_len, dtype, self.device)
            self._rope[index] = table
        return table

    def new_cache(self, batch: int) -> StaticKVCache:
        block = self.blocks[0].shape
        return StaticKVCache(len(self.blocks), batch, block.n_kv_heads, self.max_len, block.head_dim, self.dtype,
                             self.device)

    def cache_for(self, batch: int) -> StaticKVCache:
        """The KV cache for ``batch`` rows, kept between requests of the same batch size (a compiled step keeps its
        graph); its stale contents are never attended to, as ``start`` marks every slot empty."""
        cache = self._cache
        if cache is None or cache.batch != batch or cache.keys.device != self.device or cache.keys.dtype != self.dtype:
            self.release()  # the old buffers, and the graphs that write into them, before allocating the new ones
            cache = self._cache = self.new_cache(batch)
        return cache

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: StaticKVCache,
                kv_len: int, last_only: bool = True, dense: bool = False,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens, positions [batch, seq]`` at cache ``slots [seq]`` (or per row ``[batch, seq]``); attends to the
        first ``kv_len`` slots. The logits ``[batch, vocab]`` of the last position (``last_only``) or of position
        ``last[i]`` of row ``i`` (``last [batch]``: right-padded rows), else ``[batch, seq, vocab]``.

        ``dense``: a prompt without padding filling slots ``0 .. kv_len-1``, so full-attention layers need no mask
        (SDPA's causal kernel); a right-padded row's real tokens attend to nothing after them either.
        """
        if tokens.shape[1] != 1 or dense:
            self._step_plans.clear()  # a prompt: the next decode step gathers its blocks' native calls again
        x = self.embed_inputs(tokens, positions)
        rotary = [self.rope(index).lookup(positions) for index in range(len(self.ropes))]
        # an eager decode step that sees every slot needs no mask in native calls (a block's own ops take None for a
        # prompt's causal mask: theirs is made when one runs)
        eager_step = tokens.shape[1] == 1 and not torch.compiler.is_compiling()
        masks = {window: None if (dense and window is None) or (eager_step and cache.sees_all(slots, kv_len, window))
                 else cache.mask(slots, kv_len, window) for window in self.windows}
        for item in self.step_plan(x, masks, last_only and last is None):
            if isinstance(item, native_layer.NativeRun):
                x = self.native_blocks(item, x, cache, slots, masks, kv_len, rotary)
                if item.head is not None:  # the last run, ending the step with the final norm and lm_head
                    return x
                continue
            cos, sin = rotary[item.layout.rope_index] if rotary else (None, None)
            if masks[item.window] is None and not dense:
                masks[item.window] = cache.mask(slots, kv_len, item.window)
            x = item.step(x, cos, sin, cache, slots, masks[item.window], kv_len)
        if last is not None:
            return self.head(x[torch.arange(x.shape[0], device=x.device), last])
        if last_only:
            x = x[:, -1:]
        logits = self.head(x)
        return logits[:, -1] if last_only else logits

    __call__ = forward

    def step_plan(self, x: torch.Tensor, masks: dict, last_logits: bool = False) -> list:
        """The blocks in the order a step on ``x`` runs them, runs of them in native calls (``native_layer.step_plan``),
        the last run with the model's head where the step returns the last position's logits (``last_logits``) and
        :meth:`head_call` allows. An eager step keeps its plan until the next prompt (one a batch size): gathering the
        calls reads a few hundred module attributes, and after a step has streamed its weights through the caches each
        read misses them; its runs' arguments are kept by the native library (``native_layer.Registered``), so a step
        hands over only what changes. A prompt drops the plans (and with them what the library kept), so linears or
        weights replaced between ``generate`` calls are the ones that compute. A compiled step's trace gathers its
        own."""
        if not native_layer.step_takes_calls(x):
            return list(self.blocks)
        rows = x.shape[0]
        if torch.compiler.is_compiling():
            return native_layer.step_plan(self.blocks, rows, masks, head=self.head_call(rows) if last_logits else None)
        key = (rows, tuple(native_layer.mask_takes_calls(mask) for mask in masks.values()),
               tuple(native.MAX_ROWS.values()), last_logits and self.head_in_call)  # MAX_ROWS: the active level's
        plan = self._step_plans.get(key)
        if plan is None:
            head = self.head_call(rows, native_layer.held) if last_logits else None
            plan = native_layer.step_plan(self.blocks, rows, masks, native_layer.held, head)
            plan = self._step_plans[key] = native_layer.registered_plan(plan)
        return plan

    def head_call(self, rows: int, read=getattr) -> native_layer.HeadCall | None:
        """The head's part of a step's last native call (``native_layer.head_call``): where ``head_in_call`` is on
        and the head is the final norm and the lm_head alone (no projection out, no logit soft-cap or scale)."""
        dims = self.dims
        if not self.head_in_call or self.ends.project_out is not None or dims.final_softcap is not None or \
                dims.logits_divisor is not None or dims.logits_multiplier is not None:
            return None
        return native_layer.head_call(self.norm, self.lm_head, rows, read)

    def native_blocks(self, run: native_layer.NativeRun, x: torch.Tensor, cache: StaticKVCache, slots: torch.Tensor,
                      masks: dict, kv_len: int, rotary: list) -> torch.Tensor:
        """A run of blocks' decode step in one native call (``native_layer.decode_layers``)."""
        return native_layer.decode_layers(run, x, cache.keys, cache.values, slots, masks, kv_len, rotary)

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, cache: StaticKVCache,
                    kv_len: int) -> torch.Tensor:
        """One new token per row (``tokens, positions [batch, 1]`` at ``slot [1]``, or per row ``[batch, 1]``): the
        only step worth compiling.

        The eager step attends over the ``kv_len`` filled slots; the compiled one over :meth:`attended_length` slots
        (the mask hides the empty ones), so its shapes change only at a bucket boundary: one graph per bucket and
        batch size, each compiled when first reached."""
        if self.graphs is not None:
            return self.graphs(tokens, positions, slot, cache, self.attended_length(kv_len), keep_alive=(cache,))
        if self._compiled_step is None or self.step_runs_natively(tokens.shape[0]):
            return self.forward(tokens, positions, slot, cache, kv_len)
        attended = self.attended_length(kv_len)
        # per-row slots ([batch, 1]) and each cache object get graphs of their own: the unsafe guard skip below must
        # never hand one a graph traced for the other
        key = (tokens.shape[0], attended, self.dtype, self.device, slot.dim(), id(cache))
        modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tokens.is_inference())
        direct = self._direct_steps.get((key, modes))  # None: not looked up yet; False: looked up, none found
        if direct:
            return direct(self, tokens, positions, slot, cache, attended)
        if key not in self._compiled_keys or not hasattr(torch.compiler, "set_stance"):
            with self._compiling():
                logits = self._compiled_step(tokens, positions, slot, cache, attended)
            self._compiled_keys.add(key)
            return logits
        # a graph for this batch, length, dtype and device exists: check only the guards that tell graphs apart
        # (evaluating every guard on every parameter costs ~1 ms a step on SmolLM2-135M, 2 cores). Inputs no graph
        # fits (say, tensors made outside inference mode) are refused before anything runs; they then take the full
        # check.
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                logits = self._compiled_step(tokens, positions, slot, cache, attended)
        except RuntimeError as error:
            if "Recompilation triggered" not in str(error):
                raise
            with self._compiling():
                return self._compiled_step(tokens, positions, slot, cache, attended)
        if direct is None:
            self._direct_steps[key, modes] = self.direct_step(tokens, positions, slot, cache, attended) or False
        return logits

    def step_runs_natively(self, rows: int) -> bool:
        """Whether an eager decode step of ``rows`` rows runs every block in one native call (the head in it too where
        :meth:`head_call` allows): its plan, the one :meth:`forward` then takes (kept until the next prompt), a single
        run. A compiled engine runs such steps eagerly (unless ``compile_native_steps``): the graph would hold the same
        call, with next to nothing around it to fuse, and its own inputs and guards to pay for at every step."""
        return self.native_step_run(rows) is not None

    def native_step_run(self, rows: int) -> native_layer.NativeRun | None:
        """The one native run an eager decode step of ``rows`` rows is, end to end (:meth:`step_runs_natively`), or
        None."""
        if self.compile_native_steps:
            return None
        x = torch.empty((rows, 1, 0), dtype=self.dtype, device=self.device)  # what step_plan reads of x
        plan = self.step_plan(x, {window: None for window in self.windows}, last_logits=True)  # masks: None or bool
        return plan[0] if len(plan) == 1 and isinstance(plan[0], native_layer.NativeRun) else None

    def greedy_steps(self, rows: int, cache: StaticKVCache, eos: torch.Tensor | None, pad: int,
                     eos_banned_below: int) -> "GreedySteps | None":
        """Greedy decoding's next steps of ``rows`` rows in native calls that do the loop's bookkeeping too
        (:class:`GreedySteps`; ``eos``, ``pad`` and ``eos_banned_below`` as it takes them), or None where they cannot
        run so: the eager step must be one native run ending with the head (:meth:`step_runs_natively`) and the
        embedding a plain lookup in a contiguous bf16 CPU table (no module that scales it, no learned positions, norm
        or projection after it, no hooks on it; at most one scale, Gemma's or Granite's), and no layer without positions
        in a rotary model (Cohere 2's full-attention layers). Registers the run with the native library."""
        run = self.native_step_run(rows) if self.graphs is None else None
        if run is None or run.head is None or run.registered is None or (self.ropes and None in run.ropes):
            return None
        embed, ends = self.embed, self.ends
        weight = getattr(embed, "weight", None)
        if type(embed) is not nn.Embedding or embed.max_norm is not None or embed._forward_hooks or \
                embed._forward_pre_hooks or ends.position_embed is not None or ends.embed_norm is not None or \
                ends.project_in is not None or weight.dtype != torch.bfloat16 or not weight.is_contiguous() or \
                weight.device.type != "cpu" or None not in (self.embed_scale, self.dims.embed_multiplier):
            return None
        run.registered.registered(run, self.dims.hidden, cache.keys.shape[-1])
        tables = [self.rope(index) for index in run.registered.ropes] if self.ropes else []
        return GreedySteps(run, weight, self.greedy_embed_scale(), cache, [table.cos for table in tables],
                           [table.sin for table in tables], eos, pad, eos_banned_below)

    def greedy_embed_scale(self) -> float | None:
        """The float the greedy steps multiply each embedding row by, as :meth:`embed_inputs` scales it: Gemma's
        ``sqrt(hidden)`` rounded to bf16 first, Granite's multiplier as it is; None for neither."""
        if self.embed_scale is not None:
            return float(torch.tensor(self.embed_scale, dtype=torch.float32).to(torch.bfloat16))
        return self.dims.embed_multiplier

    def direct_step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, cache: StaticKVCache,
                    attended: int):
        """The compiled code of the graph whose guards these inputs pass in full, as a function of ``forward``'s
        arguments: later steps of the same key and grad modes call it with no guard check at all (the check that
        remains costs a few hundred microseconds a step: a tenth of SmolLM2-135M's int4 step on 2 cores). None where
        dynamo's cache cannot be read (its internals differ in this torch), no graph passes, or the graph's code does
        not take ``forward``'s arguments."""
        forward = type(self).forward
        call = inspect.signature(forward).bind(self, tokens, positions, slot, cache, attended)
        call.apply_defaults()
        frame = dict(call.arguments)  # forward's locals as the step enters it, which its guards read
        try:
            entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(forward)
            entry = next((e for e in entries if e.guard_manager.check(frame)), None)
        except (AttributeError, KeyError, RuntimeError, TypeError):
            return None
        code = getattr(entry, "code", None)
        arguments = forward.__code__.co_argcount
        if not isinstance(code, types.CodeType) or code.co_argcount != arguments or \
                code.co_varnames[:arguments] != forward.__code__.co_varnames[:arguments]:
            return None  # no graph passes, or its code does not take forward's arguments as forward does
        return types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__)

    def _compiling(self):
        """The settings a call that may compile a graph runs under: :func:`inductor_options`, and dynamo's limit on
        graphs per function raised so a new (batch, length) key gets its graph rather than silently falling back to
        eager: batch sizes times lengths may pass the default limit, and graphs
        of other runtimes of the same function (other engines in the process) may count towards it. Each runtime's
        graphs stay bounded by its keys."""
        graphs = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(type(self).forward))
        stack = ExitStack()
        stack.enter_context(torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit,
                                                                           graphs + 1)))
        stack.enter_context(torch._inductor.config.patch(inductor_options(self.device, self._cpp_wrapper)))
        return stack

    def attended_length(self, kv_len: int) -> int:
        """:func:`attended_length` for this runtime's cache and ``min_attended``."""
        return attended_length(kv_len, self.max_len, self.min_attended)

    @property
    def compiled(self) -> bool:
        """Whether the decode step is compiled (:meth:`compile_decode`); a step that is one native call end to end runs
        eagerly even so (:meth:`step_runs_natively`)."""
        return self._compiled_step is not None

    @property
    def graphs_compiled(self) -> int:
        """How many decode-step graphs have been compiled (one a batch size and attended length a step reached)."""
        return len(self._compiled_keys)

    def static_shapes(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` rows runs a graph of its batch size and attended length (compiled, or
        replayed from CUDA graphs): a caller stepping varying batches pads them to a few sizes. Not where the step
        runs eagerly, as one native call (:meth:`step_runs_natively`)."""
        return self.graphs is not None or (self.compiled and not self.step_runs_natively(rows))

    def release(self) -> None:
        """Free the KV cache and the decode step's CUDA graphs (``engine.destroy()``); the next request allocates a
        cache again and captures its graphs again when first reached. The compiled code stays."""
        self._cache = None
        if self.graphs is not None:
            self.graphs.clear()
        self._direct_steps.clear()  # keyed by the cache's id, which a new cache may reuse
        self._step_plans.clear()

    def compile_decode(self, cpp_wrapper: bool = True, **options) -> None:
        """Compile the decode step with ``torch.compile`` (opt-in: compiling takes tens of seconds on a small CPU).
        ``cpp_wrapper``: the graphs' wrapper in C++ on CPU (:func:`inductor_options`); tensor parallelism turns it off,
        since inductor's C++ wrapper cannot call the functional collectives dynamo traces the all-reduces into.

        oneDNN-packed linears run inside the graph as the ``splice::packed_linear`` custom op (``layers.compiled``)."""
        for index in range(len(self.ropes)):
            self.rope(index)
        self._compiled_step = torch.compile(self.forward, dynamic=False, **options)
        self._cpp_wrapper = cpp_wrapper
        self._compiled_keys = set()
        self._direct_steps = {}

    def capture_graphs(self) -> None:
        """Replay decode steps from CUDA graphs (``enable_cuda_graph``): one per batch size and attended length, each
        captured when first reached, over the static KV cache (the graph writes its keys and values in place and
        reads which slots are filled from the cache's mask buffers). The step captured is the compiled one when
        :meth:`compile_decode` ran first, else the eager one."""
        for index in range(len(self.ropes)):
            self.rope(index)  # the tables the graphs read, built before any capture
        step = self._compiled_step if self._compiled_step is not None else self.forward
        self.graphs = GraphReplayer(step, "the decode step")

    def embed_inputs(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings (through the embedding module itself: a vocab-parallel one looks up its rows and sums over
        the group), scaled, projected in, plus learned positions, normed, as the family does."""
        ends = self.ends
        x = self.embed(tokens)
        if self.embed_scale is not None:
            x.mul_(torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype))
        if self.dims.embed_multiplier is not None:  # a float, as Granite multiplies (not rounded to x's dtype first)
            x = x * self.dims.embed_multiplier
        if ends.project_in is not None:
            x = ends.project_in(x)
        if ends.position_embed is not None:
            x = x + F.embedding(positions + ends.position_offset, ends.position_embed.weight)
        if ends.embed_norm is not None:
            x = ends.embed_norm(x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, projection out, lm_head, the logits' divisor (Granite) or multiplier (Cohere) and the final logit
        soft-cap (Gemma 2), as the family does."""
        if self.norm is not None:
            x = self.norm(x)
        if self.ends.project_out is not None:
            x = self.ends.project_out(x)
        logits = self.lm_head(x)
        if self.dims.logits_divisor is not None:
            logits = logits / self.dims.logits_divisor
        if self.dims.logits_multiplier is not None:
            logits = logits * self.dims.logits_multiplier
        cap = self.dims.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
