"""Per-forward latencies as DeepSpeed's ``profile_model_time`` / ``model_times`` record them.

DeepSpeed times every forward of the wrapped model with a pre- and a post-forward hook: CUDA events when asked
(``use_cuda_events=True``), else the wall clock with the device synchronised on both ends; one entry in milliseconds
per forward, so a ``generate`` of N new tokens gives N entries (the prefill, then one per decode step: Hugging Face's
loop calls the model once per new token). :class:`ForwardTimer` does the same for the hooks on the model and for
splice's native decode loop, which calls its runtime instead of the model's forward and measures each call with
:meth:`ForwardTimer.measure`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.profiler import record_function


class ForwardTimer:
    """The latency of each forward of ``module`` (through hooks on it) or of each block run under :meth:`measure`.

    ``use_cuda_events`` times a model on a GPU with CUDA events (read when :meth:`take` is called, so no step waits
    for the device); on the CPU, or with ``use_cuda_events=False``, the wall clock times it, the device synchronised
    before and after.
    """

    def __init__(self, module: nn.Module, use_cuda_events: bool = True):
        self.module = module
        self.use_cuda_events = use_cuda_events
        self.pending: list[Any] = []  # milliseconds, or (start, end) CUDA events not read yet
        self._start: Any = None
        self._hooks_on = True
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)

    def _before_forward(self, _module, _args) -> None:
        if self._hooks_on:
            self.start()

    def _after_forward(self, _module, _args, _output) -> None:
        if self._hooks_on:
            self.stop()

    def start(self) -> None:
        if self._events():
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._synchronize()
            self._start = time.perf_counter()

    def stop(self) -> None:
        if isinstance(self._start, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self._start, end))
        else:
            self._synchronize()
            self.pending.append((time.perf_counter() - self._start) * 1e3)

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Time the block as one forward."""
        self.start()
        yield
        self.stop()

    @contextmanager
    def measure_as_one(self) -> Iterator[None]:
        """Time the block as one forward, however many times the model's forward runs inside it (a CUDA graph's
        warm-up and capture, then its replay)."""
        self._hooks_on = False
        try:
            with self.measure():
                yield
        finally:
            self._hooks_on = True

    def take(self) -> list[float]:
        """The latencies (ms) recorded since the last call, oldest first; clears them."""
        if any(isinstance(entry, tuple) for entry in self.pending):
            torch.cuda.synchronize()
        times = [entry[0].elapsed_time(entry[1]) if isinstance(entry, tuple) else entry for entry in self.pending]
        self.pending = []
        return times

    def _events(self) -> bool:
        return self.use_cuda_events and _on_cuda(self.module)

    def _synchronize(self) -> None:
        if _on_cuda(self.module):
            torch.cuda.synchronize()


def _on_cuda(module: nn.Module) -> bool:
    param = next(module.parameters(), None)
    return param is not None and param.device.type == "cuda"


# ---- where one decode step's time goes (``splice bench --profile``) --------------------------------------------------
#: the stages of a decode step, in the order they are reported
STAGES = ("blocks", "qkv", "attention", "o", "gate_up", "down", "experts", "norms", "rotary", "lm_head", "sampling",
          "other")
#: a fused block's submodules and the stage each one's time counts to (``moe``: a mixture of experts' own MLP module,
#: its router included)
BLOCK_MODULES = {"qkv": "qkv", "o": "o", "gate_up": "gate_up", "down": "down", "moe": "experts", "attn_norm": "norms",
                 "mlp_norm": "norms", "qk_norm": "norms", "attn_out_norm": "norms", "mlp_out_norm": "norms"}
#: the fused block's methods timed as stages: ``project``'s own time (its norm and QKV GEMV are timed apart) is the
#: rotary embedding and the head split
BLOCK_METHODS = {"attend": "attention", "project": "rotary"}
#: the runtime's methods timed as stages: ``native_blocks`` runs whole blocks in one native call
#: (``layers.native_layer``), whose parts cannot be timed apart
RUNTIME_METHODS = {"native_blocks": "blocks"}
#: the torch.profiler range each forward of a profiled compiled step runs in
FORWARD_RANGE = "splice.forward"
#: operators of a compiled step that are GEMVs (the custom ops inductor calls as they are)
GEMV_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "splice::packed_linear", "mkldnn::_linear_pointwise",
            "splice_kernels::")
#: operators of a compiled step that attend (splice's decode-step kernel, SDPA), counted to attention
ATTENTION_OPS = ("splice_kernels::decode_attention", "aten::_scaled_dot_product")
#: the operator that computes whole blocks (``layers.native_layer``), counted to blocks
LAYER_OP = "splice_kernels::decode_layers"
#: words in the name of one of inductor's fused kernels -> the stage it is counted to, first match wins
FUSED_KERNEL_WORDS = (("softmax", "attention"), ("rsqrt", "norms"))


HEAD_NOTE = ("lm_head: in blocks (the final norm and the lm_head's GEMV join the last native call of a step; the "
             "eager profile runs them apart)")
BLOCKS_NOTE = ("blocks: whole blocks in native calls, a run of blocks in one (their norms, GEMVs, attention and the "
               "rest cannot be told apart; SPLICE_NATIVE_LAYER=0 runs them as separate ops)")
NATIVE_STEPS_NOTE = ("eager: the decode step is compiled, but a step whose blocks all run in one native call runs "
                     "eagerly (runtime.compile_native_steps = True sends it through the graph)")


@dataclass
class StepProfile:
    """Milliseconds per decode step in each stage (averaged over ``steps`` decode steps; the prefill is left out),
    the whole step, and for a compiled step what inductor fused together (``notes``)."""

    step: str  # "eager" or "compiled"
    steps: int
    step_ms: float
    stages: dict[str, float]
    notes: list[str] = field(default_factory=list)


class _StageClock:
    """Exclusive wall-clock time per stage: a stage nested in another (the QKV GEMV inside ``project``) counts to
    itself only."""

    def __init__(self, synchronize):
        self.totals = dict.fromkeys(STAGES, 0.0)
        self.stack: list[list] = []  # [stage, start, time spent in nested stages]
        self.synchronize = synchronize

    def enter(self, stage: str) -> None:
        self.synchronize()
        self.stack.append([stage, time.perf_counter(), 0.0])

    def leave(self) -> None:
        self.synchronize()
        stage, start, nested = self.stack.pop()
        spent = time.perf_counter() - start
        self.totals[stage] += (spent - nested) * 1e3
        if self.stack:
            self.stack[-1][2] += spent


class _StepBoundaries:
    """The ``timer`` a native ``generate`` is handed: notes where each forward (prefill, decode steps) starts and
    ends, and the stage totals at both ends, so each step's stages are told apart from the prefill's."""

    def __init__(self, clock: _StageClock | None, synchronize, range_name: str | None = None):
        self.clock = clock
        self.synchronize = synchronize
        self.range_name = range_name  # also mark each forward as a torch.profiler range of this name
        self.forwards: list[tuple[float, float, dict[str, float]]] = []  # (start, end, stage ms within)

    @contextmanager
    def measure(self) -> Iterator[None]:
        self.synchronize()
        before = dict(self.clock.totals) if self.clock else {}
        start = time.perf_counter()
        with record_function(self.range_name) if self.range_name else nullcontext():
            yield
            self.synchronize()
        end = time.perf_counter()
        within = {k: v - before[k] for k, v in self.clock.totals.items()} if self.clock else {}
        self.forwards.append((start, end, within))

    def decode_steps(self) -> list[tuple[float, float, dict[str, float]]]:
        return self.forwards[1:]

    def gaps_ms(self) -> list[float]:
        """The time between one forward's end and the next one's start: the logits processors, sampling and the
        loop's bookkeeping for the token the earlier forward gave."""
        return [(nxt[0] - prev[1]) * 1e3 for prev, nxt in zip(self.forwards, self.forwards[1:])]


def profile_decode(engine, prompt: torch.Tensor, new_tokens: int) -> StepProfile:
    """Where one decode step's time goes: a greedy native ``generate`` of ``new_tokens`` (>= 3) tokens on a
    kernel-injected ``engine``, its decode steps averaged. An eager step is timed stage by stage (hooks on the fused
    blocks' modules and methods, installed for this call only); a compiled step under ``torch.profiler`` (see
    :func:`_profile_compiled`)."""
    from .generation import generate as native_generate

    runtime = engine.runtime
    if runtime is None:
        raise ValueError("profile_decode needs a kernel-injected engine (replace_with_kernel_inject=True)")
    if new_tokens < 3:
        raise ValueError(f"new_tokens={new_tokens}; allowed: >= 3 (the prefill is left out, and steps are averaged)")
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   attention_mask=torch.ones_like(prompt))
    synchronize = (torch.cuda.synchronize if runtime.device.type == "cuda" else lambda: None)
    if runtime.compiled and not runtime.step_runs_natively(prompt.shape[0]):
        return _profile_compiled(engine, prompt, options, synchronize)
    clock = _StageClock(synchronize)
    boundaries = _StepBoundaries(clock, synchronize)
    with torch.inference_mode(), _stage_hooks(runtime, clock):
        native_generate(engine.module, runtime, prompt, timer=boundaries, **options)
    steps = boundaries.decode_steps()
    stages = {name: sum(step[2][name] for step in steps) / len(steps) for name in STAGES}
    step_ms = sum((end - start) * 1e3 for start, end, _ in steps) / len(steps)
    stages["sampling"] = _mean(boundaries.gaps_ms()[1:])
    stages["other"] = step_ms - sum(v for k, v in stages.items() if k not in ("sampling", "other"))
    notes = ["sampling: the time between forwards (logits processors, argmax, the loop's bookkeeping)",
             "other: the embedding, KV-cache writes, residual adds, the MLP's activation, Python between the stages"]
    if stages["blocks"]:
        notes.append(BLOCKS_NOTE)
    if runtime.compiled:
        notes.append(NATIVE_STEPS_NOTE)
    return StepProfile("eager", len(steps), step_ms + stages["sampling"], stages, notes)


@contextmanager
def _stage_hooks(runtime, clock: _StageClock) -> Iterator[None]:
    """Time the fused blocks' submodules and methods, the final norm and the lm_head, as stages, while inside (where
    they would join a step's last native call, they run as their own modules instead, to be timed)."""
    handles, wrapped = [], []
    head_in_call, runtime.head_in_call = runtime.head_in_call, False

    def hook(module: nn.Module, stage: str) -> None:
        handles.append(module.register_forward_pre_hook(lambda *_: clock.enter(stage)))
        handles.append(module.register_forward_hook(lambda *_: clock.leave()))

    for block in runtime.blocks:
        for name, stage in BLOCK_MODULES.items():
            if getattr(block, name, None) is not None:
                hook(getattr(block, name), stage)
        for name, stage in BLOCK_METHODS.items():
            setattr(block, name, _timed(getattr(block, name), stage, clock))
            wrapped.append((block, name))
    for name, stage in RUNTIME_METHODS.items():
        setattr(runtime, name, _timed(getattr(runtime, name), stage, clock))
        wrapped.append((runtime, name))
    if runtime.norm is not None:
        hook(runtime.norm, "norms")
    hook(runtime.lm_head, "lm_head")
    try:
        yield
    finally:
        runtime.head_in_call = head_in_call
        for handle in handles:
            handle.remove()
        for owner, name in wrapped:
            delattr(owner, name)  # the class's method again


def _timed(method, stage: str, clock: _StageClock):
    def timed(*args, **kwargs):
        clock.enter(stage)
        try:
            return method(*args, **kwargs)
        finally:
            clock.leave()
    return timed


def _profile_compiled(engine, prompt: torch.Tensor, options: dict, synchronize) -> StepProfile:
    """A compiled step under ``torch.profiler``: inductor calls the GEMVs as separate operators, in the order the
    blocks run them (QKV, o, gate+up, down per layer, then the lm_head), so they are attributed by position; the
    rest is splice's attention kernel (or SDPA) and inductor's fused kernels, named after the operators they fuse when
    the step was compiled with ``torch._inductor.config.cpp.enable_kernel_profile`` (without splice's attention
    kernel, attention fused with the rotary embedding, the mask and the KV-cache write; norms fused with the residual
    adds and the activation), else one unnamed remainder."""
    from torch.profiler import ProfilerActivity, profile

    from .generation import generate as native_generate

    runtime = engine.runtime
    boundaries = _StepBoundaries(None, synchronize, FORWARD_RANGE)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        native_generate(engine.module, runtime, prompt, timer=boundaries, **options)
    steps = boundaries.decode_steps()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    ranges = [e.time_range for e in events if e.name == FORWARD_RANGE][1:]  # the prefill left out
    layers = len(runtime.blocks)
    native_blocks = sum(block.native_layer for block in runtime.blocks)
    head_in_call = runtime.blocks[-1].native_layer and runtime.head_call(prompt.shape[0]) is not None
    stages = dict.fromkeys(STAGES, 0.0)
    unmatched = 0
    kernel_names = False
    for step in ranges:
        inside = [e for e in events if e.name != FORWARD_RANGE and step.start <= e.time_range.start
                  and e.time_range.end <= step.end]
        gemvs = [e for e in inside if e.name.startswith(GEMV_OPS) and not e.name.startswith((*ATTENTION_OPS, LAYER_OP))
                 and not _under(e, GEMV_OPS)]
        # the blocks the kernels step chose run in the native calls where a step has them; the others run their
        # four projections' GEMVs; then the lm_head, unless it joined the last native call
        native = native_blocks if any(e.name == LAYER_OP for e in inside) else 0
        order = ["qkv", "o", "gate_up", "down"] * (layers - native) + ([] if native and head_in_call else ["lm_head"])
        if len(gemvs) == len(order):
            for stage, event in zip(order, gemvs):
                stages[stage] += event.time_range.elapsed_us() * 1e-3
        else:
            unmatched += 1
        for event in inside:
            if event.name == LAYER_OP:
                stages["blocks"] += event.time_range.elapsed_us() * 1e-3
            elif event.name.startswith(ATTENTION_OPS) and not _under(event, ATTENTION_OPS):
                stages["attention"] += event.time_range.elapsed_us() * 1e-3
            elif "cpp_fused" in event.name or "triton_" in event.name:
                kernel_names = True
                stage = next((s for word, s in FUSED_KERNEL_WORDS if word in event.name), None)
                if stage is not None:
                    stages[stage] += event.time_range.elapsed_us() * 1e-3
    stages = {k: v / len(steps) for k, v in stages.items()}
    step_ms = sum((end - start) * 1e3 for start, end, _ in steps) / len(steps)
    stages["sampling"] = _mean(boundaries.gaps_ms()[1:])
    stages["other"] = step_ms - sum(v for k, v in stages.items() if k not in ("sampling", "other"))
    notes = ["compiled: inductor fuses the rotary embedding and the KV-cache write with the work around them (into "
             "its attention kernel where splice's does not run), and the residual adds into the norms; they cannot "
             "be told apart (rotary 0 here)",
             "times include torch.profiler's cost per operator"]
    if stages["blocks"]:
        notes.append(BLOCKS_NOTE)
    if native_blocks and head_in_call:
        notes.append(HEAD_NOTE)
    if not kernel_names:
        notes.append("inductor's kernels were not named (compile with torch._inductor.config.cpp."
                     "enable_kernel_profile=True): attention and norms are in 'other'")
    if unmatched:
        notes.append(f"{unmatched} step(s) did not call one GEMV per projection; their GEMVs are in 'other'")
    return StepProfile("compiled", len(steps), step_ms + stages["sampling"], stages, notes)


def _under(event, names: tuple[str, ...]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(names):
            return True
        parent = parent.cpu_parent
    return False


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
