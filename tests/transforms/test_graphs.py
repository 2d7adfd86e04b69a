"""The graphs step: ``compile_decode=True`` compiles splice's decode step; it must not change a single greedy token."""
from __future__ import annotations

import copy

import pytest
import torch

import splice
from splice.layers.packed_linear import PackedLinear, can_pack

from ..arch.tiny_models import build_family, padded_batch

GREEDY = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)


def test_compiled_decode_gives_hf_greedy_tokens_fp32():
    reference = build_family("llama")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                   max_out_tokens=64)
    runtime = engine.module.splice_runtime
    assert runtime._compiled_step is not None
    assert ("graphs", "decode step compiled with torch.compile (static shapes; compiles on the first decode step, "
                      "cached by torch's inductor cache)") in engine.report
    ids, mask = padded_batch(batch=3, length=12)
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(engine.generate(ids, attention_mask=mask, **GREEDY), expected)
    # a second request of the same batch size reuses the graph (same cache, same shapes) and stays exact
    with torch.inference_mode():
        expected = reference.generate(ids[:, 3:], attention_mask=mask[:, 3:], **GREEDY)
    assert torch.equal(engine.generate(ids[:, 3:], attention_mask=mask[:, 3:], **GREEDY), expected)


@pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 on this CPU")
def test_compiled_decode_runs_the_packed_bf16_weights():
    reference = build_family("llama", dtype=torch.bfloat16)
    eager = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64)
    compiled = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, compile_decode=True,
                                     max_out_tokens=64)
    assert any(isinstance(m, PackedLinear) for m in compiled.module.modules())  # the very weights eager runs
    ids, mask = padded_batch(batch=1, length=12)
    options = dict(GREEDY, return_dict_in_generate=True, output_logits=True)
    got, expected = (engine.generate(ids, attention_mask=mask, **options) for engine in (compiled, eager))
    # bf16: inductor keeps fused intermediates in fp32 where eager rounds each op, so compare the first decode step's
    # logits (step 0 is the eager prefill in both) and the tokens up to it, not 20 tokens of a random tiny model
    decode_error = (got.logits[1] - expected.logits[1]).abs().max() / expected.logits[1].std()
    assert decode_error < 0.05
    assert torch.equal(got.sequences[:, :14], expected.sequences[:, :14])


def test_compile_decode_needs_kernel_injection():
    with pytest.raises(ValueError, match="compile_decode=True .* replace_with_kernel_inject=True"):
        splice.init_inference(build_family("llama"), compile_decode=True)


def test_compile_decode_and_cuda_graph_are_exclusive():
    with pytest.raises(ValueError, match="compile_decode=True and enable_cuda_graph=True"):
        splice.init_inference(build_family("llama"), replace_with_kernel_inject=True, compile_decode=True,
                              enable_cuda_graph=True)
