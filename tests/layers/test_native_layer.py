"""Decode steps with runs of blocks as one native call (``splice_kernels.decode_layers``), against the same blocks'
own ops."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers as T

import splice
from splice import native
from splice.cli_options import QUANT_SCHEMES
from splice.kernel_choice import int16_activations
from splice.layers import native_layer
from splice.layers.native_layer import LINEARS, layer_gemv, unfit_reason

from ..arch.tiny_models import COMMON, build_family, build_tiny, padded_batch, randomised_vectors, tiny_config

pytestmark = pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")

STEPS = 4


def engine_of(family: str, scheme: str = "bf16", **kwargs):
    options = {"dtype": torch.bfloat16, **(QUANT_SCHEMES[scheme] if scheme != "bf16" else {})}
    return splice.init_inference(build_family(family), replace_with_kernel_inject=True, max_out_tokens=64, **options,
                                 **kwargs)


def decode(engine, native_layers: bool, per_row_slots: bool = False, batch: int = 2):
    """A left-padded batch's prompt (``batch`` rows), then STEPS greedy decode steps with the blocks' native calls on
    or off: each step's logits, and the KV cache after them."""
    runtime = engine.runtime
    chosen = [block.native_layer for block in runtime.blocks]
    for block in runtime.blocks:
        block.native_layer = block.native_layer and native_layers
    ids, mask = padded_batch(batch=batch, length=9)
    try:
        with torch.inference_mode():
            cache = runtime.new_cache(batch)
            cache.start(mask)
            length = ids.shape[1]
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = [runtime(ids, positions, cache.slot_ids[:length], cache, length)]
            position = positions[:, -1:]
            for step in range(STEPS):
                slot = cache.slot_ids[length + step: length + step + 1]
                kv_len = length + step + 1
                if per_row_slots:  # the second row writes STEPS slots further on
                    slot = torch.stack([slot, slot + STEPS])
                    kv_len += STEPS
                    cache.valid[torch.arange(batch), slot[:, 0]] = True
                else:
                    cache.mark(slot)
                position = position + 1
                token = logits[-1].argmax(-1, keepdim=True)
                logits.append(runtime.decode_step(token, position, slot, cache, kv_len))
        return torch.stack(logits).float(), cache.keys.clone(), cache.values.clone()
    finally:
        for block, was in zip(runtime.blocks, chosen):
            block.native_layer = was


#: a run of blocks' native call: its lists each step (a compiled step's), or its registered arguments (an eager one's)
LAYER_CALLS = ("splice_kernels::decode_layers", "splice_kernels::decode_registered")


def layer_calls(engine, native_layers: bool, batch: int = 2) -> int:
    with torch.profiler.profile() as profile:
        decode(engine, native_layers, batch=batch)
    return sum(event.name in LAYER_CALLS for event in profile.events())


def assert_same_steps(engine, per_row_slots: bool = False, batch: int = 2) -> None:
    """The native calls' logits and cache against the blocks' own ops (the same kernels and roundings; a norm's sum
    may round its last bit otherwise, so within a few bf16 steps rather than bit for bit)."""
    logits, keys, values = decode(engine, True, per_row_slots, batch)
    expected, expected_keys, expected_values = decode(engine, False, per_row_slots, batch)
    scale = expected.abs().max().item()
    assert (logits - expected).abs().max().item() <= 0.02 * scale
    assert (logits.argmax(-1) == expected.argmax(-1)).all()
    for got, want in ((keys, expected_keys), (values, expected_values)):
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02 * want.abs().max().item())


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "mistral", "qwen3", "granite", "gemma", "gemma3_text",
                                    "stablelm", "starcoder2", "gpt_neox", "phi", "gptj", "falcon", "gpt2", "opt",
                                    "gpt_bigcode", "gpt_neo"])
def test_families_blocks_step_as_their_own_ops_do(family):
    """Llama; qkv biases and a sliding window (qwen2); rotary on half of each head (phi3); a window (mistral);
    per-head q and k norms before rotary (qwen3); each branch's output scaled before its residual add (granite);
    LayerNorms with biases and a gated SiLU MLP (stablelm), a plain tanh-GELU MLP with biases (starcoder2); parallel
    blocks: two LayerNorms and an erf GELU (gpt_neox), one LayerNorm and the tanh GELU (phi, gptj), no biases
    (falcon); learned positions, no rotary: GPT-2 (Conv1D linears), OPT (ReLU), GPT-BigCode (one KV head), GPT-Neo
    (local attention layers, unscaled scores); RMSNorms with float32 weights (Gemma's 1 + w) and a gated tanh GELU
    (gemma), with norms on the branch outputs and a qk-norm scaled in float32, local and global rotary tables (Gemma
    3)."""
    engine = engine_of(family)
    assert all(block.native_layer for block in engine.runtime.blocks)
    assert_same_steps(engine)
    assert layer_calls(engine, True) == STEPS and layer_calls(engine, False) == 0  # every block in one call a step


@pytest.mark.parametrize("family, activation", [("gpt_neox", "gelu"), ("phi", "gelu_new"), ("stablelm", "silu"),
                                                ("stablelm", "gelu_pytorch_tanh"), ("starcoder2", "relu")])
def test_wide_layer_norms_and_activations_step_as_their_own_ops_do(family, activation):
    """Rows of 512 features and MLPs 2044 wide (not a multiple of 8: each row's last activations take the tail
    path), so LayerNorm's sums and each activation's float approximation meet many values: the erf GELU and two
    LayerNorms (gpt_neox), the tanh GELU (phi), gated SiLU and a gated tanh GELU with LayerNorms (stablelm), ReLU
    (starcoder2's MLP with another activation)."""
    config = tiny_config(family, hidden_size=512, intermediate_size=2044)
    setattr(config, "hidden_act" if hasattr(config, "hidden_act") else "activation_function", activation)
    model = randomised_vectors(build_tiny(config), seed=1)
    engine = splice.init_inference(model, replace_with_kernel_inject=True, dtype=torch.bfloat16, max_out_tokens=64)
    assert all(block.native_layer for block in engine.runtime.blocks)
    assert engine.runtime.blocks[0].shape.activation == activation
    assert_same_steps(engine)


@pytest.mark.parametrize("family, scheme, batch", [
    ("llama", "bf16", 1), ("llama", "bf16", 2), ("llama", "int8", 1), ("llama", "int4-sym", 2), ("gpt_neox", "bf16", 2),
    ("phi", "int8", 1), ("gemma3_text", "bf16", 2)])
def test_the_head_in_the_last_call_gives_the_same_logits(family, scheme, batch):
    """The final norm (RMSNorm; with a float32 weight: gemma3_text; LayerNorm with its bias: gpt_neox, phi) and the
    lm_head's GEMV (phi's with a bias) joining the step's last native call: the same arithmetic as the head's own
    modules (its norm rounds as the blocks' norms do, its GEMV is the lm_head's), so the same bits where the norm is an
    RMSNorm, and within a bf16 step of them where it is a LayerNorm (its sums in another order)."""
    engine = engine_of(family, scheme)
    runtime = engine.runtime
    head = runtime.head_call(batch)
    assert head is not None and head.kind == layer_gemv(runtime.lm_head).kind
    kinds = {"llama": native_layer.NORM_RMS, "gemma3_text": native_layer.NORM_RMS_FLOAT}
    assert head.norm_kind == kinds.get(family, native_layer.NORM_LAYER)
    joined = decode(engine, True, batch=batch)
    runtime.head_in_call = False
    try:
        apart = decode(engine, True, batch=batch)
    finally:
        runtime.head_in_call = True
    if head.norm_kind != native_layer.NORM_LAYER:
        assert all(torch.equal(a, b) for a, b in zip(joined, apart))
    else:
        torch.testing.assert_close(joined[0], apart[0], rtol=0.02, atol=0.02 * apart[0].abs().max().item())
        assert (joined[0].argmax(-1) == apart[0].argmax(-1)).all()


def test_the_head_joins_only_a_run_that_ends_the_step():
    engine = engine_of("llama")
    runtime = engine.runtime
    masks = {None: None}
    *_, last = native_layer.step_plan(runtime.blocks, 1, masks, head=runtime.head_call(1))
    assert last.head is not None and last.head.norm is runtime.norm.weight
    runtime.blocks[-1].native_layer = False  # the last block on its own ops: the head runs after it, apart
    plan = native_layer.step_plan(runtime.blocks, 1, masks, head=runtime.head_call(1))
    assert plan[-1] is runtime.blocks[-1] and plan[0].head is None
    runtime.blocks[-1].native_layer = True
    runtime.head_in_call = False
    assert runtime.head_call(1) is None
    runtime.head_in_call = True
    runtime.dims = dataclasses.replace(runtime.dims, final_softcap=30.0)
    assert runtime.head_call(1) is None  # a soft-cap after the lm_head: the head's own ops


def test_a_block_on_its_own_ops_splits_the_run():
    """A block in the middle that runs its own ops: the blocks before it and after it make a call each."""
    config = tiny_config("llama", num_hidden_layers=3)
    engine = splice.init_inference(randomised_vectors(build_tiny(config), seed=0), replace_with_kernel_inject=True,
                                   max_out_tokens=64, dtype=torch.bfloat16)
    blocks = engine.runtime.blocks
    assert len(blocks) == 3 and all(block.native_layer for block in blocks)
    expected = decode(engine, False)
    blocks[1].native_layer = False
    assert layer_calls(engine, True) == 2 * STEPS
    got = decode(engine, True)
    scale = expected[0].abs().max().item()
    assert (got[0] - expected[0]).abs().max().item() <= 0.02 * scale
    assert (got[0].argmax(-1) == expected[0].argmax(-1)).all()


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "qwen3", "granite", "gemma", "gemma3_text", "stablelm",
                                    "starcoder2", "gpt_neox", "phi", "gptj", "falcon", "gpt2", "opt", "gpt_bigcode",
                                    "gpt_neo"])
def test_decode_steps_agree_with_the_hf_reference(family):
    """The native calls' decode steps, teacher-forced one token at a time, against the unmodified bf16 HF model's
    logits at the same positions: within 5 % of the logit std and the argmax above 90 % the same (bf16 rounding
    differs, so not exact), as the injected prompt path is held to."""
    reference = build_family(family, dtype=torch.bfloat16)
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, dtype=torch.bfloat16,
                                   max_out_tokens=64)
    runtime = engine.runtime
    ids = padded_batch(batch=1, length=40)[0]
    prompt = 8
    with torch.inference_mode():
        expected = reference(ids).logits[0, prompt:].float()
        cache = runtime.new_cache(1)
        cache.start(torch.ones_like(ids[:, :prompt]))
        positions = torch.arange(ids.shape[1])[None]
        runtime(ids[:, :prompt], positions[:, :prompt], cache.slot_ids[:prompt], cache, prompt, dense=True)
        with torch.profiler.profile() as profile:
            got = []
            for t in range(prompt, ids.shape[1]):
                slot = cache.slot_ids[t:t + 1]
                cache.mark(slot)
                got.append(runtime.decode_step(ids[:, t:t + 1], positions[:, t:t + 1], slot, cache, t + 1)[0])
        got = torch.stack(got).float()
    assert sum(event.name in LAYER_CALLS for event in profile.events()) == ids.shape[1] - prompt
    assert ((expected - got).abs().max() / expected.std()).item() < 0.05
    assert (expected.argmax(-1) == got.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("scheme", ["int8", "int8-g64", "w8a8", "int4", "int4-sym"])
def test_quantized_blocks_step_as_their_own_ops_do(scheme):
    engine = engine_of("llama", scheme)
    assert all(block.native_layer for block in engine.runtime.blocks)
    if scheme == "int8-g64":  # grouped int8: its own GEMV kind
        kinds = {layer_gemv(getattr(block, name)).kind for block in engine.runtime.blocks for name in LINEARS}
        assert kinds == {native_layer.GEMV_INT8_GROUPED}
    assert_same_steps(engine)


def test_grouped_int8_on_int16_activations_steps_as_its_own_ops_do():
    """At the avx2 level without AVX-VNNI grouped int8 takes int16 activations: its own GEMV kind in the step."""
    with native.use_isa("avx2"), native.use_avx_vnni(False):
        engine = engine_of("llama", "int8-g64")
        kinds = {layer_gemv(getattr(block, name)).kind for block in engine.runtime.blocks for name in LINEARS}
        assert kinds == {native_layer.GEMV_INT8_GROUPED16}
        assert_same_steps(engine)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_float_product_gemvs_step_as_their_own_ops_do(monkeypatch, scheme):
    """With SPLICE_NATIVE_DOT=0 the quantized linears multiply in floats (int8_gemv, int4_gemv)."""
    monkeypatch.setenv("SPLICE_NATIVE_DOT", "0")
    engine = engine_of("llama", scheme)
    kinds = {layer_gemv(getattr(block, name)).kind for block in engine.runtime.blocks for name in LINEARS}
    assert kinds == {native_layer.GEMV_INT8 if scheme == "int8" else native_layer.GEMV_INT4}
    assert_same_steps(engine)


def test_rows_at_their_own_slots_step_as_their_own_ops_do():
    """Slots per row ([batch, 1], the serving scheduler's continuous batch), a different one in each row."""
    assert_same_steps(engine_of("llama", "int4-sym"), per_row_slots=True)


@pytest.mark.parametrize("quant", ["bf16", "int8"])
def test_sixteen_rows_step_as_their_own_ops_do(quant, monkeypatch):
    """A batch of 16 rows in native calls (the avx512 level's bf16 and int8 limits where oneDNN has no AMX tiles; set
    here, so every machine runs them)."""
    engine = engine_of("llama", quant)
    for kind in ("bf16", "int8", "int8_dot"):
        monkeypatch.setitem(native.MAX_ROWS, kind, 16)
    assert layer_calls(engine, True, batch=16) > 0
    assert_same_steps(engine, batch=16)


def test_rows_past_a_gemvs_limit_take_the_blocks_own_ops(monkeypatch):
    """A step with more rows than one of the block's GEMVs takes runs the block's own ops, with the same outputs."""
    engine = engine_of("llama")
    monkeypatch.setitem(native.MAX_ROWS, "bf16", 1)  # the batch of decode() has 2 rows
    assert layer_calls(engine, True) == 0
    got, expected = decode(engine, True), decode(engine, False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_calls_read_the_weights_a_layer_holds_now():
    """Loading a state dict repacks int4 weights into new tensors: the native calls compute with those."""
    engine, other = engine_of("llama", "int4-sym"), splice.init_inference(
        build_family("llama", seed=1), replace_with_kernel_inject=True, max_out_tokens=64, dtype=torch.bfloat16,
        **QUANT_SCHEMES["int4-sym"])
    packed = engine.runtime.blocks[0].qkv.packed
    engine.module.load_state_dict(other.module.state_dict())
    assert engine.runtime.blocks[0].qkv.packed is not packed
    expected = decode(other, True)[0]
    assert torch.equal(decode(engine, True)[0], expected)


@pytest.mark.parametrize("family, scheme, threads, per_row_slots", [
    ("llama", "bf16", 2, False), ("llama", "int8", 2, False), ("llama", "w8a8", 2, True), ("llama", "int4", 2, False),
    ("llama", "int4-sym", 3, True), ("qwen2", "bf16", 3, False), ("llama", "int4-sym", 1, False),
])
def test_one_parallel_region_a_call_gives_the_same_bits(family, scheme, threads, per_row_slots):
    """The layers of a call in one parallel region (every thread's share of each kernel, barriers between them)
    against a region a kernel: the same logits and cache, bit for bit; with more threads than this CPU runs at once
    (3) too."""
    engine = engine_of(family, scheme)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with native.use_layer_region(True):
            got = decode(engine, True, per_row_slots)
        with native.use_layer_region(False):
            expected = decode(engine, True, per_row_slots)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_eager_steps_gather_the_calls_once_a_prompt(monkeypatch):
    """The first decode step after a prompt gathers its blocks' calls; the later ones reuse them, and the next prompt
    gathers them again."""
    engine = engine_of("llama", "int4-sym")
    gathered = []
    layer_call = native_layer.layer_call
    monkeypatch.setattr(native_layer, "layer_call", lambda block, *args: gathered.append(block) or
                        layer_call(block, *args))
    expected = decode(engine, True)
    layers = len(engine.runtime.blocks)
    assert len(gathered) == layers  # STEPS steps, one gathering
    assert all(torch.equal(a, b) for a, b in zip(decode(engine, True), expected))
    assert len(gathered) == 2 * layers


def test_a_one_token_prompt_gathers_the_calls_again():
    """A prompt of one token is a prompt too: weights loaded after the last decode step are the ones that compute."""
    engine, other = engine_of("llama", "int4-sym"), splice.init_inference(
        build_family("llama", seed=1), replace_with_kernel_inject=True, max_out_tokens=64, dtype=torch.bfloat16,
        **QUANT_SCHEMES["int4-sym"])
    prompt = torch.tensor([[7]])
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.inference_mode():
        engine.generate(prompt, **options)  # keeps its plan (the old weights)
        engine.module.load_state_dict(other.module.state_dict())  # int4 repacked into new tensors
        assert torch.equal(engine.generate(prompt, **options), other.generate(prompt, **options))


@pytest.mark.parametrize("int4_head", [False, True], ids=["int8-head", "int4-head"])
def test_a_compiled_step_matches_the_eager_native_calls(fresh_compiles, int4_head):
    """The compiled step traces the same native calls, the head in the last one (an int8 head by default; quantized
    with the scheme, int4 tiles, whose logits' width the op's shape function reads from their dtype)."""
    quant = {**QUANT_SCHEMES["int4-sym"]["quant"], "quantize_lm_head": True if int4_head else None}
    engine = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, max_out_tokens=64,
                                   dtype=torch.bfloat16, quant=quant)
    int8_head = native_layer.GEMV_INT8_DOT16 if int16_activations() else native_layer.GEMV_INT8_DOT
    assert engine.runtime.head_call(2).kind == (native_layer.GEMV_INT4_DOT if int4_head else int8_head)
    eager = decode(engine, True)
    engine.runtime.compile_decode()
    engine.runtime.compile_native_steps = True  # steps in one native call would otherwise skip the graph
    compiled = decode(engine, True)
    assert engine.runtime.graphs_compiled
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0.02 * eager[0].abs().max().item())
    assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[2], eager[2])


def test_a_compiled_engine_runs_steps_in_one_native_call_eagerly(fresh_compiles):
    """The graph would hold the same native call; steps that are not one call (more rows than the kernels take in
    one) take the graph."""
    engine = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, max_out_tokens=64,
                                   dtype=torch.bfloat16, **QUANT_SCHEMES["int4-sym"])
    eager = decode(engine, True)
    runtime = engine.runtime
    runtime.compile_decode()
    assert runtime.step_runs_natively(2)
    assert torch.equal(decode(engine, True)[1], eager[1]) and not runtime.graphs_compiled
    too_many = max(native.MAX_ROWS.values()) + 1
    assert not runtime.step_runs_natively(too_many)
    runtime.compile_native_steps = True
    assert not runtime.step_runs_natively(2)


@pytest.mark.parametrize("family, reason", [
    ("gemma2", "it has soft-capped scores"),
    ("bloom", "it has alibi_slopes"),
    ("cohere", "it rotates q and k in float32"),
    ("mixtral", "its MLP is the model's own MixtralSparseMoeBlock (a mixture of experts)"),
    ("olmo", "it clamps q, k and v (clip_qkv)"),
    ("olmo2", "it rotates q and k in float32"),
])
def test_blocks_it_does_not_fit_keep_their_own_ops_and_the_report_says_why(family, reason):
    engine = engine_of(family)
    assert not any(block.native_layer for block in engine.runtime.blocks)
    assert reason in unfit_reason(engine.runtime.blocks[0])
    assert reason in engine.step_report("kernels").summary()


def test_padded_int4_weights_keep_their_own_ops():
    """An int4 weight whose input is padded to the group (hidden 96, groups of 64) runs more than its GEMV."""
    model = build_tiny(tiny_config("llama", hidden_size=96))
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=64, dtype=torch.bfloat16,
                                   quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 64}})
    assert not any(block.native_layer for block in engine.runtime.blocks)
    assert "runs no native GEMV for decode rows" in engine.step_report("kernels").summary()


def test_int8_groups_padded_to_whole_blocks_step_as_their_own_ops_do():
    """DeepSpeed's q_groups=2 on a 176-wide MLP: the down projection's groups of 88 inputs zero-padded to 96 columns,
    x spread to match in the native call as in the layer (the other linears' groups of 32 as they are)."""
    config = T.LlamaConfig(**{**COMMON, "intermediate_size": 176})
    engine = splice.init_inference(build_tiny(config), replace_with_kernel_inject=True, max_out_tokens=64,
                                   dtype=torch.bfloat16,
                                   quant={"enabled": True, "weight": {"num_bits": 8, "q_groups": 2}})
    downs = [block.down for block in engine.runtime.blocks]
    assert all(down.native_grouped and down.group == 88 and down.kept_group == 96 for down in downs)
    assert all(block.native_layer for block in engine.runtime.blocks)
    assert {layer_gemv(down).group for down in downs} == {88}
    assert_same_steps(engine)
    runtime = engine.runtime
    cache = runtime.new_cache(1)
    first = native_layer.native_run(runtime.blocks[:1], [native_layer.layer_call(runtime.blocks[0], 1)])
    assert first.groups == [32, 32, 32, 88]
    x, rotary = torch.randn(1, 1, 64).to(torch.bfloat16), [runtime.rope().lookup(torch.tensor([[3]]))]
    with pytest.raises(RuntimeError, match="weight of 192 columns in 2 groups does not hold groups of 100 inputs"):
        native_layer.decode_layers(first._replace(groups=[32, 32, 32, 100]), x, cache.keys, cache.values,
                                   torch.tensor([3]), {None: None}, 4, rotary)


def test_int8_inputs_padded_to_whole_groups_keep_their_own_ops():
    """Grouped int8 on 64 inputs in groups of 48: x zero-padded to two whole groups (then each group to 64 columns)
    before the GEMV, which the native call does not do."""
    engine = engine_of("llama", quant={"enabled": True, "weight": {"num_bits": 8, "group_size": 48}})
    linears = [getattr(block, name) for block in engine.runtime.blocks for name in LINEARS]
    assert all(linear.native_grouped and linear.groups_padded for linear in linears)
    assert not any(block.native_layer for block in engine.runtime.blocks)
    assert "runs no native GEMV for decode rows" in engine.step_report("kernels").summary()


def test_float32_and_switched_off_models_keep_their_own_ops(monkeypatch):
    fp32 = splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, max_out_tokens=32)
    assert not any(block.native_layer for block in fp32.runtime.blocks)
    summary = fp32.step_report("kernels").summary()
    assert "blocks: each block's own ops (it takes bfloat16, not torch.float32)" in summary
    monkeypatch.setenv("SPLICE_NATIVE_LAYER", "0")
    off = engine_of("llama")
    assert not any(block.native_layer for block in off.runtime.blocks)
    assert "SPLICE_NATIVE_LAYER=0" in off.step_report("kernels").summary()


def test_the_op_names_bad_inputs():
    engine = engine_of("llama")
    runtime = engine.runtime
    cache = runtime.new_cache(1)
    x = torch.randn(1, 1, 64).to(torch.bfloat16)
    slots = torch.tensor([3])
    rotary = [runtime.rope().lookup(torch.tensor([[3]]))]
    masks = {None: None}
    calls = [native_layer.layer_call(block, 1) for block in runtime.blocks]
    assert len(calls) >= 2 and all(calls)
    (both,) = native_layer.step_plan(runtime.blocks, 1, masks)
    first = native_layer.native_run(runtime.blocks[:1], calls[:1])

    def run(run=both, x=x, slots=slots, kv_len=4, masks=masks, rotary=rotary):
        return native_layer.decode_layers(run, x, cache.keys, cache.values, slots, masks, kv_len, rotary)

    run()  # fits
    with pytest.raises(RuntimeError, match="x must be a contiguous bf16 CPU tensor"):
        run(x=x.float())
    with pytest.raises(RuntimeError, match="kv_len 65 outside 1 .. 64"):
        run(kv_len=65)
    with pytest.raises(RuntimeError, match="slot 64 outside the cache's 0 .. 63"):
        run(slots=torch.tensor([64]))
    with pytest.raises(RuntimeError, match="cos and sin come together"):
        run(rotary=[(rotary[0][0], None)])
    with pytest.raises(RuntimeError, match="GEMV kind 9; allowed: 0 .. 7"):
        run(first._replace(kinds=[0, 0, 9, 0]))
    with pytest.raises(RuntimeError, match="cache layer 7 outside 0 .. 1"):
        run(first._replace(layers=[7]))
    with pytest.raises(RuntimeError, match=r"2 layers take 24 tensors \(12 a layer\), got 23"):
        run(both._replace(tensors=both.tensors[:23]))
    shapes = r"layer 0: the qkv linear is \[128, 64\] \(outputs, inputs\); the layer needs \[96, 64\]"
    with pytest.raises(RuntimeError, match=shapes):
        run(first._replace(heads=[2, 2]))
    odd = torch.zeros(2, 1, 2, 64, 72, dtype=torch.bfloat16)  # head_dim 72
    with pytest.raises(RuntimeError, match="head_dim a multiple of 16 up to 256"):
        native_layer.decode_layers(both, x, odd, odd.clone(), slots, masks, 4, rotary)
    with pytest.raises(RuntimeError, match=r"the mask must be bool \[1 or 1, 1, 1, 4\]"):
        run(masks={None: torch.ones(1, 1, 1, 5, dtype=torch.bool)})
    # a bad later layer or linear is refused before any layer's cache is written (slot 5: the call above wrote slot 3)
    before = cache.keys.clone(), cache.values.clone()
    wrong_o = list(both.tensors)
    wrong_o[12 + 3] = wrong_o[12 + 3].float()  # the second layer's o weight, for a bf16 GEMV
    with pytest.raises(RuntimeError, match="decode_layers: layer 1: the o linear: w must be a contiguous bf16"):
        run(both._replace(tensors=wrong_o), slots=torch.tensor([5]))
    wrong_bias = list(both.tensors)
    wrong_bias[11] = torch.zeros(3, dtype=torch.bfloat16)  # the first layer's down bias, for 64 outputs
    bias = r"layer 0: the down linear: the bias must be a float tensor of 64 values, got \[3\]"
    with pytest.raises(RuntimeError, match=bias):
        run(both._replace(tensors=wrong_bias), slots=torch.tensor([5]))
    head = runtime.head_call(1)
    assert run(both._replace(head=head)).shape == (1, runtime.lm_head.out_features)  # the logits
    with pytest.raises(RuntimeError, match=r"the head: the lm_head takes 32 inputs; the layers' hidden size is 64"):
        run(both._replace(head=head._replace(tensors=[head.tensors[0][:, :32].contiguous(), None, None])),
            slots=torch.tensor([5]))
    with pytest.raises(RuntimeError, match=r"the final norm's weight must be contiguous bf16 \[64\]"):
        run(both._replace(head=head._replace(norm=head.norm.float())), slots=torch.tensor([5]))
    with pytest.raises(RuntimeError, match="the head: only a LayerNorm takes a bias"):
        run(both._replace(head=head._replace(norm_bias=torch.zeros(64, dtype=torch.bfloat16))), slots=torch.tensor([5]))
    with pytest.raises(RuntimeError, match=r"the head: norm kind 3; allowed: 0 \(RMSNorm\), 1 \(LayerNorm\) or 2"):
        run(both._replace(head=head._replace(norm_kind=3)), slots=torch.tensor([5]))
    with pytest.raises(RuntimeError, match=r"the final norm's weight must be contiguous float32 \[64\], got BFloat16"):
        run(both._replace(head=head._replace(norm_kind=native_layer.NORM_RMS_FLOAT)), slots=torch.tensor([5]))
    assert torch.equal(cache.keys, before[0]) and torch.equal(cache.values, before[1])


@pytest.mark.parametrize("scheme", ("bf16", "int4-sym"))
def test_registered_runs_step_as_their_lists_do_and_are_released_with_their_plan(scheme):
    """A run's arguments kept by the library (``decode_registered``) give the bits the lists give (``decode_layers``),
    with and without the head; the library lets them go when the run's Registered goes."""
    import gc

    engine = engine_of("llama", scheme)
    runtime = engine.runtime
    x = torch.randn(2, 1, 64).to(torch.bfloat16)
    slots, masks = torch.tensor([3]), {None: torch.rand(2, 1, 1, 4) > 0.3}
    masks[None][..., 0] = True
    rotary = [runtime.rope().lookup(torch.tensor([[3], [3]]))]
    before = torch.ops.splice_kernels.registered_layer_stacks()
    for head in (None, runtime.head_call(2)):
        (run,) = native_layer.step_plan(runtime.blocks, 2, masks, head=head)
        (registered,) = native_layer.registered_plan([run])
        results = []
        for item in (run, registered, registered):  # the registered run's first step registers, the second reuses
            cache = runtime.new_cache(2)
            out = native_layer.decode_layers(item, x, cache.keys, cache.values, slots, masks, 4, rotary)
            results.append((out, cache.keys, cache.values))
        for got in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0], got))
        assert torch.ops.splice_kernels.registered_layer_stacks() == before + 1
        del registered, item
        gc.collect()
        assert torch.ops.splice_kernels.registered_layer_stacks() == before


def test_the_registered_ops_name_bad_inputs():
    engine = engine_of("llama")
    runtime = engine.runtime
    cache = runtime.new_cache(1)
    x, slots, masks = torch.randn(1, 1, 64).to(torch.bfloat16), torch.tensor([3]), {None: None}
    rotary = [runtime.rope().lookup(torch.tensor([[3]]))]
    (run,) = native_layer.registered_plan(native_layer.step_plan(runtime.blocks, 1, masks))
    native_layer.decode_layers(run, x, cache.keys, cache.values, slots, masks, 4, rotary)  # registers
    ops = torch.ops.splice_kernels
    number = run.registered.number
    with pytest.raises(RuntimeError, match="decode_registered: no layers registered as 123456"):
        ops.decode_registered(x, cache.keys, cache.values, 123456, slots, [None], 4, *rotary[0])
    with pytest.raises(RuntimeError, match="release_layers: no layers registered as 123456"):
        ops.release_layers(123456)
    with pytest.raises(RuntimeError, match=r"the layers take rows of 64 and heads of 16, got x \[1, 1, 32\]"):
        ops.decode_registered(x[..., :32].contiguous(), cache.keys, cache.values, number, slots, [None], 4,
                              [rotary[0][0]], [rotary[0][1]])
    with pytest.raises(RuntimeError, match=r"layer 0: mask 0 and rotary table 0 of 0 masks and 1 tables"):
        ops.decode_registered(x, cache.keys, cache.values, number, slots, [], 4, [rotary[0][0]], [rotary[0][1]])
    count = ops.registered_layer_stacks()
    wrong_norms = [None if norm is None else norm.float() for norm in run.norms]
    with pytest.raises(RuntimeError, match=r"layer 0: the norms' weights must be contiguous bf16"):
        ops.register_layers(run.layers, wrong_norms, run.eps, run.tensors, run.kinds, run.groups, run.heads,
                            run.scales, run.layouts, [], 0.0, 0, 0, 0, 64, 16, [0] * len(run.layers),
                            [0] * len(run.layers))
    with pytest.raises(RuntimeError, match="register_layers: head_dim 72; the layers take a head_dim a multiple of 16"):
        ops.register_layers(run.layers, run.norms, run.eps, run.tensors, run.kinds, run.groups, run.heads,
                            run.scales, run.layouts, [], 0.0, 0, 0, 0, 64, 72, [0] * len(run.layers),
                            [0] * len(run.layers))
    with pytest.raises(RuntimeError, match="layer 0: the attention and MLP norms' weights are needed"):
        ops.register_layers(run.layers, [None] * len(run.norms), run.eps, run.tensors, run.kinds, run.groups,
                            run.heads, run.scales, run.layouts, [], 0.0, 0, 0, 0, 64, 16, [0] * len(run.layers),
                            [0] * len(run.layers))
    wrong_qk = list(run.norms)
    wrong_qk[2] = torch.ones(3, 16, dtype=torch.bfloat16)  # 4 query and 2 KV heads need 6 rows
    with pytest.raises(RuntimeError, match=r"the qk-norm's weights must be contiguous bf16 or float32 \[6, 16\]"):
        ops.register_layers(run.layers, wrong_qk, run.eps, run.tensors, run.kinds, run.groups, run.heads,
                            run.scales, run.layouts, [], 0.0, 0, 0, 0, 64, 16, [0] * len(run.layers),
                            [0] * len(run.layers))
    register = (lambda norms=run.norms, layouts=run.layouts: ops.register_layers(
        run.layers, norms, run.eps, run.tensors, run.kinds, run.groups, run.heads, run.scales, layouts, [], 0.0, 0,
        0, 0, 64, 16, [0] * len(run.layers), [0] * len(run.layers)))
    layout = r"layer 0: the layout \(norm kind, activation, gated, parallel\) must be .* got \(0, 7, 1, 0\)"
    with pytest.raises(RuntimeError, match=layout):
        register(layouts=[0, 7, 1, 0] + run.layouts[4:])
    with pytest.raises(RuntimeError, match=r"2 layers take 8 layouts \(4 a layer\), got 4"):
        register(layouts=run.layouts[:4])
    with pytest.raises(RuntimeError, match=r"a gated MLP|the gate_up linear is \[256, 64\] .* needs \[128, 64\]"):
        register(layouts=[0, 0, 0, 0] + run.layouts[4:])  # a plain MLP's up has ffn outputs, not 2 ffn
    biased = list(run.norms)
    biased[3] = torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="layer 0: only LayerNorms take biases"):
        register(norms=biased)
    no_mlp_norm = list(run.norms)
    no_mlp_norm[1] = None
    with pytest.raises(RuntimeError, match="the attention and MLP norms' weights are needed"):
        register(norms=no_mlp_norm)  # only a parallel block's MLP may read the attention's norm
    assert ops.registered_layer_stacks() == count  # nothing kept from a refused call


def test_decode_greedy_names_what_it_cannot_take_before_writing():
    """Greedy decoding's native steps (``decode_greedy``) refuse a slot that is not the step's last, a token outside
    the embedding, columns past the sequences, rotary tables or windows the layers do not read or layers without the
    head, naming it, before they write anything."""
    engine = engine_of("llama")
    runtime = engine.runtime
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = runtime.cache_for(1)
        cache.start(torch.ones_like(ids))
        runtime(ids, torch.arange(6)[None], cache.slot_ids[:6], cache, 6, dense=True)  # fills slots 0 .. 5
        steps = runtime.greedy_steps(1, cache, None, 0, 0)
    run = steps.run
    assert run.registered.number is not None
    sequences = torch.zeros(1, 20, dtype=torch.long)
    sequences[:, :6], sequences[0, 6] = ids, 7  # the prompt and its first new token
    table = runtime.rope()
    state = dict(slot=torch.tensor([5]), valid=cache.valid, positions=torch.tensor([[5]]), sequences=sequences,
                 unfinished=torch.ones(1, dtype=torch.long))

    def step(stack=run.registered.number, kv_len=7, steps=1, tables=1, windows=(0,), **changes):
        given = {**state, **changes}
        return torch.ops.splice_kernels.decode_greedy(
            runtime.embed.weight, None, cache.keys, cache.values, stack, given["slot"], given["valid"], 6,
            list(windows), given["positions"], [table.cos] * tables, [table.sin] * tables, given["sequences"], kv_len,
            given["unfinished"], None, 0, 0, steps)

    before = {name: tensor.clone() for name, tensor in state.items()}
    keys = cache.keys.clone()
    out_of_vocab = sequences.clone()
    out_of_vocab[0, 6] = 10_000
    headless = native_layer.registered_plan(native_layer.step_plan(runtime.blocks, 1, {None: None}))[0]
    headless_number = headless.registered.registered(headless, 64, 16)
    refused = [
        (dict(windows=(0, 4)), r"the layers read 1 masks: one window each \(0 for none\), got \[0, 4\]"),
        (dict(slot=torch.tensor([3])), r"slot 3 \+ 1 is not the step's last of 7 slots"),
        (dict(sequences=out_of_vocab), "token 10000 outside the embedding's 0 .. 127"),
        (dict(steps=14), r"sequences must .* inside, got \[1, 20\] with kv_len 7 and 14 steps"),
        (dict(tables=2), "the layers read 1 rotary tables"),
        (dict(stack=headless_number), "the registered layers must end with the model's head"),
        (dict(stack=123456), "no layers registered as 123456"),
    ]
    for changes, message in refused:
        with pytest.raises(RuntimeError, match="decode_greedy: " + message):
            step(**changes)
        assert all(torch.equal(state[name], before[name]) for name in state) and torch.equal(cache.keys, keys)
    tokens, running, taken, filled = step(steps=3)
    assert taken == 3 and running == 1 and int(state["slot"]) == 8 and int(state["positions"]) == 8 and filled == 9
    assert cache.valid[0, :9].all() and not cache.valid[0, 9:].any() and (sequences[0, 7:10] > 0).any()
    assert torch.equal(tokens, sequences[:, 9])


@pytest.mark.parametrize("family", ("llama", "qwen2"))
def test_a_step_that_sees_every_slot_gives_the_masked_steps_logits(family):
    """An unpadded decode step runs its native calls without a mask; a block on its own ops still gets one. The
    logits are the masked step's."""
    engine = engine_of(family)
    runtime = engine.runtime
    ids = torch.randint(3, 100, (1, 10), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(10)[None]

    @torch.inference_mode()
    def steps(unmasked: bool) -> list[torch.Tensor]:
        cache = runtime.new_cache(1)
        cache.start(torch.ones_like(ids[:, :8]))
        runtime(ids[:, :8], positions[:, :8], cache.slot_ids[:8], cache, 8, dense=True)
        logits = []
        for t in (8, 9):
            slot = cache.slot_ids[t:t + 1]
            cache.mark(slot)
            if not unmasked:
                cache.filled = 0  # not known: the mask is made
            assert cache.sees_all(slot, t + 1) == unmasked
            logits.append(runtime.decode_step(ids[:, t:t + 1], positions[:, t:t + 1], slot, cache, t + 1))
        return logits

    masked = steps(False)
    assert all(torch.equal(a, b) for a, b in zip(masked, steps(True)))
    runtime.blocks[0].native_layer = False  # the first block on its own ops: its mask is made for it
    assert all(torch.equal(a, b) for a, b in zip(masked, steps(True)))


# ---- a mixture of experts' routed experts in one native call (experts_decode) -------------------------------------
def routed(engine, rows: int, none_here: bool = False, one_expert: bool = False):
    """The first block's experts module, ``rows`` normed hidden states and their routing (with ``none_here`` one pick
    of the last row an index past the last expert, as expert parallelism marks "none here"; with ``one_expert`` every
    row's first pick expert 1 and its others none here: fewer experts than threads)."""
    moe = engine.runtime.blocks[0].moe
    x = (torch.randn(rows, moe.experts.hidden_dim, generator=torch.Generator().manual_seed(rows)) * 0.5).bfloat16()
    _, weights, index = moe.gate(x)
    if none_here:
        index[-1, 0] = len(moe.experts.down_proj)
    if one_expert:
        index[:, 0], index[:, 1:] = 1, len(moe.experts.down_proj)
    return moe.experts, x, index, weights


def python_experts(experts, x, index, weights):
    """The experts module's forward with the native call ruled out (each expert's linears as modules)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_layer, "experts_call", lambda module, rows, index: None)
        return experts(x, index, weights)


@pytest.mark.parametrize("scheme", ["bf16", "int8", "int4", "int4-sym", "int8-g64"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])  # float32 and bf16 routing weights
@pytest.mark.parametrize("rows, none_here, one_expert", [(1, False, False), (3, False, False), (4, True, False),
                                                         (3, False, True)])
def test_routed_experts_in_one_native_call_equal_their_modules_bit_for_bit(scheme, family, rows, none_here,
                                                                           one_expert):
    """Each thread whole experts (as many as threads, or more), or (one expert) the threads sharing its GEMVs."""
    experts, x, index, weights = routed(engine_of(family, scheme), rows, none_here, one_expert)
    call = native_layer.experts_call(experts, x, index)
    assert call is not None and call.chosen == sorted({e for e in index.flatten().tolist() if e < call.experts})
    with torch.inference_mode():
        assert torch.equal(experts(x, index, weights), python_experts(experts, x, index, weights))


def test_routed_experts_at_the_avx2_level_equal_their_modules_bit_for_bit():
    with native.use_isa("avx2"), native.use_avx_vnni(False):
        for scheme in ("bf16", "int8", "int4-sym"):
            experts, x, index, weights = routed(engine_of("mixtral", scheme), 2)
            with torch.inference_mode():
                assert torch.equal(experts(x, index, weights), python_experts(experts, x, index, weights)), scheme


def test_experts_the_native_call_cannot_compute_run_their_own_forward():
    """Float32 rows, more rows than a GEMV takes, or a gate other than transformers' default SiLU gate: the module's
    own per-expert forward."""
    experts, x, index, weights = routed(engine_of("mixtral"), 2)
    assert native_layer.experts_call(experts, x.float(), index) is None
    rows = native.MAX_ROWS["bf16"] + 1
    too_many = torch.zeros(rows, x.shape[1], dtype=torch.bfloat16)
    assert native_layer.experts_call(experts, too_many, torch.zeros(rows, 2, dtype=torch.long)) is None
    experts.act_fn = torch.nn.GELU()
    assert native_layer.experts_call(experts, x, index) is None


def test_the_native_experts_call_names_bad_input():
    experts, x, index, weights = routed(engine_of("mixtral", "int8"), 2)
    index = torch.tensor([[0, 1], [2, 4]])  # expert 4 of 4: none here
    call = native_layer.experts_call(experts, x, index)
    assert (call.chosen, call.experts) == ([0, 1, 2], 4)
    decode = torch.ops.splice_kernels.experts_decode
    with pytest.raises(RuntimeError, match=r"row 1 picks expert 3; allowed: the chosen \[0, 1, 2\], or 4 and past"):
        decode(x, torch.tensor([[0, 1], [2, 3]]), weights, *call)
    with pytest.raises(RuntimeError, match="weights must be float32 or bf16 of index's shape"):
        decode(x, index, weights[:, :1], *call)
    with pytest.raises(RuntimeError, match="two linears a chosen expert"):
        decode(x, index, weights, call.chosen, call.experts, call.tensors, call.kinds[:-1], call.groups)
    with pytest.raises(RuntimeError, match=r"chosen must list experts of 0 \.\. 3 in ascending order"):
        decode(x, index, weights, [1, 0, 2], *call[1:])
    with pytest.raises(RuntimeError, match=r"expert 0's linears are \[.*\]; rows of 32 need"):
        decode(x[:, :32].contiguous(), index, weights, *call)


def test_a_rotation_in_float32_keeps_its_blocks_own_ops():
    """The native call rotates bf16 q and k in bf16, rounding each op: a block that rotates in float32 (OLMo's and
    Cohere's rounding) keeps its own ops."""
    block = engine_of("qwen3").runtime.blocks[0]
    assert unfit_reason(block) is None
    block.layout = dataclasses.replace(block.layout, rotary_float=True)
    assert unfit_reason(block) == "it rotates q and k in float32, rounding once (rotary_float)"


def test_a_layer_without_positions_in_a_rotary_model_steps_unrotated():
    """A layer that takes no positions in a rotary model (Cohere 2's full-attention layers) steps in the call with no
    table (its q and k left as they are), as its own ops step with the table they ignore; the greedy steps, whose
    tables serve every layer, leave such a model to the step path."""
    rotary = engine_of("llama").runtime
    assert rotary.greedy_steps(1, rotary.new_cache(1), None, 0, 0) is not None
    engine = engine_of("llama")
    runtime = engine.runtime
    block = runtime.blocks[0]
    block.layout = dataclasses.replace(block.layout, rotary=False)
    assert unfit_reason(block) is None
    (run,) = native_layer.step_plan(runtime.blocks, 1, {None: None})
    assert run.ropes == [None, 0]
    assert runtime.greedy_steps(1, runtime.new_cache(1), None, 0, 0) is None
    assert_same_steps(engine)


def test_attention_sinks_attend_on_the_attention_kernel_but_keep_the_layer_calls_off():
    """GPT-OSS's sinks join each query's softmax: its decode steps attend on splice's attention kernel, which takes
    them (as its own ops give within bf16's rounding), and a block with sinks stays out of the layer calls, which do
    not (the kernels step says why)."""
    from splice.layers.native_layer import attention_unfit_reason

    engine = engine_of("gpt_oss")
    block = engine.runtime.blocks[0]
    assert block.native_attention and not block.native_attention_half and not block.native_layer
    reason = "its attention has sinks (a learned logit per head in the softmax)"
    assert attention_unfit_reason(block) == reason and reason in engine.step_report("kernels").summary()
    q = torch.randn(2, 4, 1, 16).bfloat16()
    k, v = torch.randn(2, 2, 9, 16).bfloat16(), torch.randn(2, 2, 9, 16).bfloat16()
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., :4] = False
    assert block.takes_native_attention(q, k, mask, None)
    got = block.attend(q, k, v, mask, causal=False)
    block.native_attention = False
    expected = block.attend(q, k, v, mask, causal=False)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0.02, atol=0.02)


def test_a_qk_norm_rounding_otherwise_than_its_weight_says_keeps_its_blocks_own_ops():
    """A qk-norm with an offset scales in float32 and rounds once, one without rounds before its bf16 weight: the
    native call takes the rounding from the weight's dtype (float32: Gemma 3's), so an offset on a bf16 weight keeps
    the block's own ops."""
    block = engine_of("qwen3").runtime.blocks[0]
    assert unfit_reason(block) is None
    block.qk_norm.offset = 1.0
    assert unfit_reason(block) == "its qk-norm's weight is not float32 with an offset (Gemma 3's) or bf16 without one"


def test_granites_logits_divisor_keeps_the_head_out_of_the_native_calls():
    """Granite's blocks step natively (their residual multiplier in the call) and its embedding multiplier (a float
    torch does not round first, unlike Gemma's normalizer) goes into the greedy steps' call, but a logits divisor keeps
    the head out of the native call, and so the greedy steps in the loop; Llama's engine takes both. The tokens stay
    the bf16 reference's."""
    def engine_and_reference(name, **overrides):
        reference = randomised_vectors(build_tiny(tiny_config(name, **overrides), dtype=torch.bfloat16), 0)
        engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
        return engine, reference

    def offers(engine):
        runtime = engine.runtime
        return (runtime.head_call(1) is not None,
                runtime.greedy_steps(1, runtime.cache_for(1), None, 0, 0) is not None)

    assert offers(engine_and_reference("llama")[0]) == (True, True)
    cases = (({"logits_scaling": 1.0}, (True, True)), ({"embedding_multiplier": 1.0}, (False, False)))
    for overrides, expected in cases:
        engine, reference = engine_and_reference("granite", **overrides)
        assert all(block.native_layer for block in engine.runtime.blocks)
        assert offers(engine) == expected
        ids, mask = padded_batch()
        with torch.inference_mode():
            want = reference.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)[:, ids.shape[1]:]
            got = engine.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)[:, ids.shape[1]:]
        assert (want == got).float().mean() > 0.9


def test_a_qk_norm_over_each_whole_projection_keeps_its_blocks_own_ops():
    """OLMoE's q and k norms span every head (the native call normalises each head alone): its attention half stays
    on the block's own ops, and so do its experts."""
    from splice.layers.native_layer import attention_unfit_reason

    model = randomised_vectors(build_tiny(tiny_config("olmoe", clip_qkv=None)), 0)
    engine = splice.init_inference(model, replace_with_kernel_inject=True, dtype=torch.bfloat16, max_out_tokens=64)
    block = engine.runtime.blocks[0]
    assert attention_unfit_reason(block) == "its qk-norm spans each whole projection, not one head"
    assert not block.native_attention_half and not block.native_layer
    block.layout = dataclasses.replace(block.layout, clip_qkv=0.3)
    assert attention_unfit_reason(block) == "it clamps q, k and v (clip_qkv)"


# ---- a block whose MLP runs elsewhere: its attention half in one native call (decode_attention_half) ---------------
def decode_with_attention_half(engine, on: bool, per_row_slots: bool = False):
    """``decode``'s steps with the blocks' attention halves in native calls or on their own ops."""
    blocks = engine.runtime.blocks
    chosen = [block.native_attention_half for block in blocks]
    for block in blocks:
        block.native_attention_half = block.native_attention_half and on
    try:
        with torch.profiler.profile() as profile:
            out = decode(engine, False, per_row_slots)
    finally:
        for block, was in zip(blocks, chosen):
            block.native_attention_half = was
    calls = sum(event.name == "splice_kernels::decode_attention_half" for event in profile.events())
    return out, calls


@pytest.mark.parametrize("family, scheme, per_row_slots", [
    ("mixtral", "bf16", False), ("mixtral", "int4-sym", False), ("qwen2_moe", "bf16", False),  # qkv biases
    ("qwen2_moe", "int4-sym", False), ("qwen3_moe", "bf16", False), ("qwen3_moe", "int4-sym", False),  # qk-norm
    ("mixtral", "bf16", True),  # each row at its own slot, as splice serve's rows
    ("granitemoe", "bf16", False),  # the attention's output scaled before its residual add
])
def test_a_mixture_of_experts_attention_half_steps_as_its_own_ops_do(family, scheme, per_row_slots):
    engine = engine_of(family, scheme)
    blocks = engine.runtime.blocks
    assert all(block.native_attention_half and not block.native_layer for block in blocks)
    assert "(a mixture of experts); its attention in one" in engine.step_report("kernels").summary()
    (logits, keys, values), calls = decode_with_attention_half(engine, True, per_row_slots)
    (expected, expected_keys, expected_values), none = decode_with_attention_half(engine, False, per_row_slots)
    assert calls == STEPS * len(blocks) and none == 0
    assert (logits - expected).abs().max().item() <= 0.02 * expected.abs().max().item()
    assert (logits.argmax(-1) == expected.argmax(-1)).all()
    for got, want in ((keys, expected_keys), (values, expected_values)):
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02 * want.abs().max().item())


def test_the_attention_half_op_names_bad_inputs():
    engine = engine_of("mixtral")
    runtime, block = engine.runtime, engine.runtime.blocks[0]
    cache = runtime.new_cache(1)
    x = torch.randn(1, 1, 64).to(torch.bfloat16)
    cos, sin = runtime.rope().lookup(torch.tensor([[3]]))
    call = native_layer.attention_call(block, 1)

    def run(call=call, x=x, layer=0):
        return native_layer.decode_attention_half(call._replace(layer=layer), x, cache.keys, cache.values,
                                                  torch.tensor([3]), None, 4, cos, sin)

    out, normed = run()
    assert out.shape == normed.shape == x.shape
    with pytest.raises(RuntimeError, match="decode_attention_half: cache layer 5 outside 0 .. 1"):
        run(layer=5)
    with pytest.raises(RuntimeError, match=r"decode_attention_half: 1 layers take 6 tensors \(6 a layer\), got 5"):
        run(call._replace(tensors=call.tensors[:5]))
    with pytest.raises(RuntimeError, match=r"layer 0: the qkv linear is \[128, 64\] \(outputs, inputs\); the layer "
                                           r"needs \[96, 64\]"):
        run(call._replace(heads=[2, 2]))
    with pytest.raises(RuntimeError, match="x must be a contiguous bf16 CPU tensor"):
        run(x=x.float())
