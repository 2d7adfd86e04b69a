"""``splice.profiling``: DeepSpeed's per-forward timer (also tested through the engine in test_engine.py) and the
stage-by-stage profile of a decode step that ``splice bench --profile`` prints."""
from __future__ import annotations

import pytest
import torch

import splice
from splice import native
from splice.profiling import STAGES, ForwardTimer, profile_decode

from .arch.tiny_models import build_family

PROMPT = torch.tensor([[5, 17, 33, 9, 71, 4, 8, 3]])


def test_forward_timer_times_hooked_forwards_and_measured_blocks():
    module = torch.nn.Linear(4, 4)
    timer = ForwardTimer(module, use_cuda_events=True)  # a CPU module: the wall clock
    module(torch.ones(1, 4))
    with timer.measure():
        torch.ones(64, 64) @ torch.ones(64, 64)
    times = timer.take()
    assert len(times) == 2 and all(t > 0 for t in times)
    assert timer.take() == []


def test_eager_step_profile_covers_every_stage_and_leaves_no_hooks():
    engine = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, max_out_tokens=32)
    hooks_before = installed_hooks(engine.module)
    profile = profile_decode(engine, PROMPT, new_tokens=5)
    assert profile.step == "eager" and profile.steps == 4
    assert set(profile.stages) == set(STAGES)
    # float32: no block runs in a native call; a dense model has no experts
    timed = [s for s in STAGES if s not in ("other", "blocks", "experts")]
    assert all(profile.stages[s] > 0 for s in timed), profile.stages
    assert profile.stages["blocks"] == 0
    assert sum(profile.stages.values()) == pytest.approx(profile.step_ms)
    # nothing stays installed: the blocks run their own methods, no module keeps a hook
    for block in engine.runtime.blocks:
        assert not {"attend", "project", "native_step"} & set(vars(block))
    assert installed_hooks(engine.module) == hooks_before


def test_a_mixture_of_experts_layers_own_mlp_is_the_experts_stage():
    engine = splice.init_inference(build_family("mixtral"), replace_with_kernel_inject=True, max_out_tokens=32)
    profile = profile_decode(engine, PROMPT, new_tokens=5)
    assert profile.stages["experts"] > 0 and profile.stages["gate_up"] == profile.stages["down"] == 0
    assert profile.stages["qkv"] > 0 and sum(profile.stages.values()) == pytest.approx(profile.step_ms)


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
@pytest.mark.parametrize("compiled", [False, True])
def test_blocks_in_one_native_call_are_one_stage(compiled, fresh_compiles):
    engine = splice.init_inference(build_family("llama"), dtype=torch.bfloat16, replace_with_kernel_inject=True,
                                   compile_decode=compiled, max_out_tokens=32)
    engine.runtime.compile_native_steps = compiled  # compiled: the graph, which the step would otherwise skip
    profile = profile_decode(engine, PROMPT, new_tokens=5)
    assert profile.step == ("compiled" if compiled else "eager")
    # the final norm and lm_head join the last native call; the eager profile runs them apart to time them
    assert profile.stages["blocks"] > 0 and (profile.stages["lm_head"] == 0) == compiled
    assert all(profile.stages[s] == 0 for s in ("qkv", "attention", "o", "gate_up", "down")), profile.stages
    assert any(note.startswith("blocks: whole blocks in native calls") for note in profile.notes)
    assert any(note.startswith("lm_head: in blocks") for note in profile.notes) == compiled
    assert sum(profile.stages.values()) == pytest.approx(profile.step_ms)
    assert engine.runtime.head_in_call  # as before the profile


@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_a_compiled_engine_whose_steps_run_natively_is_profiled_as_the_eager_step_it_runs(fresh_compiles):
    engine = splice.init_inference(build_family("llama"), dtype=torch.bfloat16, replace_with_kernel_inject=True,
                                   compile_decode=True, max_out_tokens=32)
    profile = profile_decode(engine, PROMPT, new_tokens=5)
    assert profile.step == "eager" and profile.stages["blocks"] > 0 and profile.stages["lm_head"] > 0
    assert any(note.startswith("eager: the decode step is compiled") for note in profile.notes)
    assert not engine.runtime.graphs_compiled  # no graph was made
    assert engine.runtime.head_in_call and not engine.runtime.compile_native_steps  # as before the profile


def installed_hooks(model) -> dict[str, tuple]:
    """Each module's forward hooks and pre-hooks (the fused blocks carry transformers' hidden-state hooks)."""
    return {name: (tuple(m._forward_hooks.values()), tuple(m._forward_pre_hooks.values()))
            for name, m in model.named_modules()}


def test_compiled_step_profile_attributes_the_gemvs(fresh_compiles):
    import torch._inductor.config

    engine = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=32)
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        profile = profile_decode(engine, PROMPT, new_tokens=5)
    assert profile.step == "compiled" and profile.steps == 4
    for stage in ("qkv", "attention", "o", "gate_up", "down", "norms", "lm_head", "sampling"):
        assert profile.stages[stage] > 0, (stage, profile.stages)
    assert profile.stages["rotary"] == 0 and any("cannot be told apart" in note for note in profile.notes)
    assert sum(profile.stages.values()) == pytest.approx(profile.step_ms)


def test_profile_decode_refuses_what_it_cannot_profile():
    engine = splice.init_inference(build_family("llama"), max_out_tokens=32)
    with pytest.raises(ValueError, match="kernel-injected"):
        profile_decode(engine, PROMPT, new_tokens=5)
    injected = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, max_out_tokens=32)
    with pytest.raises(ValueError, match="new_tokens=2"):
        profile_decode(injected, PROMPT, new_tokens=2)
