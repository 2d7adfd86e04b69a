"""A mixture of experts' experts module as one linear per expert and matrix (``splice.layers.experts``), where a
compiled decode step meets it."""
from __future__ import annotations

import copy

import pytest
import torch

import splice
from splice.cli_options import QUANT_SCHEMES

from ..arch.tiny_models import build_family, padded_batch


@pytest.mark.parametrize("scheme", ["bf16", "int4-sym"])
def test_a_compiled_step_routes_each_token_as_the_eager_one_does(scheme, fresh_compiles):
    """Which experts run is read from each step's routing (a graph traced through it would keep the experts of the
    step it was traced on): the compiled engine's tokens and logits are the eager engine's, bit for bit."""
    options = {"dtype": torch.bfloat16, **({} if scheme == "bf16" else QUANT_SCHEMES[scheme])}
    reference = build_family("mixtral", dtype=torch.bfloat16)
    engines = [splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=True, max_out_tokens=64,
                                     compile_decode=compiled, **options) for compiled in (False, True)]
    ids, mask = padded_batch(batch=2, length=9)
    options = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, output_logits=True,
                   return_dict_in_generate=True, use_cache=False)
    with torch.inference_mode():
        eager, compiled = (engine.generate(ids, **options) for engine in engines)
    assert engines[1].runtime._compiled_keys  # the step ran compiled
    assert torch.equal(eager.sequences, compiled.sequences)
    assert all(torch.equal(a, b) for a, b in zip(eager.logits, compiled.logits))
