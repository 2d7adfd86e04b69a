"""dtype conversion against Hugging Face models built directly in that dtype."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import splice

from ..conftest import build_tiny, tiny_llama_config

IDS = torch.tensor([[5, 17, 33, 9, 71, 4, 1, 2]])


def reference_in(dtype, state_dict, config):
    """HF's own way to get a model in ``dtype``: build it in that dtype and load the fp32 weights."""
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.load_state_dict(state_dict)
    return model


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                         ("fp32", torch.float32), ("torch.bfloat16", torch.bfloat16)])
def test_dtype_converts_parameters_and_matches_hf(name, dtype):
    config = tiny_llama_config(tie_word_embeddings=True)
    model = build_tiny(config)
    reference = reference_in(dtype, model.state_dict(), config)
    engine = splice.init_inference(model, dtype=name)
    assert all(p.dtype == dtype for p in engine.module.parameters())
    persistent = dict(engine.module.state_dict())
    assert all(t.dtype == dtype for t in persistent.values() if t.is_floating_point())
    assert engine.module.lm_head.weight is engine.module.model.embed_tokens.weight  # still tied
    inv_freq = engine.module.model.rotary_emb.inv_freq  # a computed table: keeps fp32, as HF keeps it
    assert inv_freq.dtype == torch.float32
    with torch.no_grad():
        expected = reference(IDS).logits
    torch.testing.assert_close(engine(IDS).logits, expected, rtol=0, atol=0)


def test_default_keeps_model_dtype():
    model = build_tiny(tiny_llama_config(), dtype=torch.bfloat16)
    engine = splice.init_inference(model)
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    report = engine.step_report("dtype")
    assert not report.converted and report.dtype == "torch.bfloat16"


def test_int8_runs_activations_in_bf16_and_quantizes_the_linears():
    model = build_tiny(tiny_llama_config())
    engine = splice.init_inference(model, dtype="int8")
    report = engine.step_report("dtype")
    assert report.converted and report.int8 and report.dtype == "torch.bfloat16"
    assert engine.module.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not any(type(m) is torch.nn.Linear for m in engine.module.model.layers.modules())


def keeping_llama():
    """A Llama class that asks, as some transformers families do, for its final norm (in fp16) and its lm_head (in
    fp16 and bf16) to be loaded in fp32."""
    from transformers import LlamaForCausalLM

    class KeepingLlama(LlamaForCausalLM):
        _keep_in_fp32_modules = ["model.norm"]
        _keep_in_fp32_modules_strict = ["lm_head"]

    return KeepingLlama


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_keeps_in_fp32_what_from_pretrained_keeps(dtype, tied, tmp_path):
    cls = keeping_llama()
    torch.manual_seed(0)
    model = cls(tiny_llama_config(tie_word_embeddings=tied)).eval()
    model.save_pretrained(tmp_path)
    reference = cls.from_pretrained(tmp_path, dtype=dtype).eval()
    engine = splice.init_inference(model, dtype=dtype)
    got, expected = engine.module.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    module = engine.module
    # untied, the reference keeps the lm_head in fp32; tied, it follows the embedding (its name in the checkpoint)
    assert module.lm_head.weight.dtype == (dtype if tied else torch.float32)
    assert (module.lm_head.weight is module.model.embed_tokens.weight) == tied
    assert module.model.norm.weight.dtype == (torch.float32 if dtype == torch.float16 else dtype)
    if dtype == torch.float16 and not tied:  # final norm and lm_head both fp32: the HF forward runs on this mix
        with torch.no_grad():
            torch.testing.assert_close(engine(IDS).logits, reference(IDS).logits, rtol=0, atol=0)
