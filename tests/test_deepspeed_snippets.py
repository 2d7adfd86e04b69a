"""DeepSpeed's inference snippets, unchanged but for the import (``import splice as deepspeed``), against the
unmodified Hugging Face pipeline: the text-generation pipeline in fp32, bf16 and fp16 with and without kernel
injection, ``engine.module``, the engine standing in for the model, and ``checkpoint=`` JSON loading of a model built
on the meta device. Tensor parallelism under torchrun (one node, and two nodes) is in ``tests/tp/test_snippets_tp.py``.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, pipeline

import splice as deepspeed
from splice import InferenceConfig

from .snippet_models import PROMPTS, byte_tokenizer, generated_ids, snippet_llama, tiny_bert, wordpiece_tokenizer

#: A CPU without fp16 arithmetic (AMD Zen 4: AVX-512 BF16, no AVX512-FP16, no AMX), as oneDNN and splice see it.
ZEN4 = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "SPLICE_NATIVE_AMX": "0"}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference_ids():
    """The unmodified fp32 pipeline's greedy tokens for every prompt."""
    return generated_ids(pipeline("text-generation", model=snippet_llama(), tokenizer=byte_tokenizer()))


def assert_agree(ids: list[list[int]], reference: list[list[int]], dtype: torch.dtype) -> None:
    """fp32: every token equal. 16-bit: each prompt's first five tokens equal and at least 90 % of all positions
    (a rounding difference may flip a later near-tie, after which the continuations part ways)."""
    if dtype == torch.float32:
        assert ids == reference
        return
    assert all(row[:5] == ref[:5] for row, ref in zip(ids, reference)), (ids, reference)
    same = sum(a == b for row, ref in zip(ids, reference) for a, b in zip(row, ref))
    assert same >= 0.9 * sum(len(ref) for ref in reference), (ids, reference)


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "inject"])
@pytest.mark.parametrize("dtype", [torch.float, torch.bfloat16, torch.half], ids=["fp32", "bf16", "fp16"])
def test_text_generation_pipeline_snippet(dtype, inject, reference_ids):
    pipe = pipeline("text-generation", model=snippet_llama(), tokenizer=byte_tokenizer())
    pipe.model = deepspeed.init_inference(pipe.model, mp_size=1, dtype=dtype, replace_with_kernel_inject=inject)
    assert pipe.model.dtype == dtype and pipe.model.module.dtype == dtype
    assert_agree(generated_ids(pipe), reference_ids, dtype)
    text = pipe(PROMPTS[0], do_sample=False, max_new_tokens=20)[0]["generated_text"]
    assert text.startswith(PROMPTS[0]) and len(text) > len(PROMPTS[0])


def test_fp16_on_a_cpu_without_fp16_math_runs_and_names_the_dtype_it_computes_in(reference_ids):
    """On a Zen-4-like CPU fp16 with kernel injection runs (no oneDNN packing, which needs AVX512-FP16: torch's
    converting GEMV for decode, an fp32 GEMM on widened weights for prompts) and gives the fp32 tokens; the check
    phase warns that bf16 is the dtype this CPU computes in (fp32 on a CPU without AVX512-BF16 either, such as an
    AVX2-only one, which the emulation cannot add features to)."""
    script = (
        "import json, sys, warnings, torch; sys.path.insert(0, sys.argv[1])\n"
        "from transformers import pipeline\n"
        "import splice as deepspeed\n"
        "from tests.snippet_models import byte_tokenizer, generated_ids, snippet_llama\n"
        "pipe = pipeline('text-generation', model=snippet_llama(), tokenizer=byte_tokenizer())\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    pipe.model = deepspeed.init_inference(pipe.model, mp_size=1, dtype=torch.half,\n"
        "                                          replace_with_kernel_inject=True)\n"
        "print(json.dumps({'ids': generated_ids(pipe), 'warnings': [str(w.message) for w in caught],\n"
        "                  'kernel': pipe.model.step_report('kernels').float_linears.kernel,\n"
        "                  'fp16_supported': torch.ops.mkldnn._is_mkldnn_fp16_supported(),\n"
        "                  'bf16_supported': torch.ops.mkldnn._is_mkldnn_bf16_supported()}))\n")
    env = {**os.environ, **ZEN4, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["fp16_supported"] is False  # the emulation took: oneDNN sees no fp16 arithmetic
    assert result["kernel"] == "widened"
    faster = "dtype=torch.bfloat16" if result["bf16_supported"] else "dtype=torch.float32"
    assert any("dtype=torch.float16" in w and faster in w for w in result["warnings"]), result["warnings"]
    assert_agree(result["ids"], reference_ids, torch.half)


def test_engine_module_is_the_model_and_the_engine_stands_in_for_it():
    model = snippet_llama()
    engine = deepspeed.init_inference(model, mp_size=1, dtype=torch.float, replace_with_kernel_inject=True)
    assert engine.module is model
    assert engine.config is model.config and engine.generation_config is model.generation_config
    assert engine.device == model.device and engine.dtype == torch.float32
    assert engine.can_generate() and engine.main_input_name == "input_ids"
    assert engine.prepare_inputs_for_generation.__self__ is model
    assert isinstance(engine.inference_config, InferenceConfig) and engine.inference_config.replace_with_kernel_inject
    # setting an attribute the model has sets it on the model (what its generate reads)
    engine.generation_config = GenerationConfig(max_new_tokens=3, do_sample=False)
    assert model.generation_config.max_new_tokens == 3 and "generation_config" not in engine.__dict__
    assert engine.generate(torch.tensor([[5, 6, 7]])).shape == (1, 6)
    # the engine's own attributes stay its own, and new ones land on the engine
    engine.note = "mine"
    assert engine.note == "mine" and not hasattr(model, "note")
    with pytest.raises(AttributeError, match="neither InferenceEngine nor the model it wraps .*'no_such_thing'"):
        engine.no_such_thing
    assert not hasattr(engine, "no_such_thing")
    assert [name for name, _ in engine.named_children()] == ["module"]
    assert list(engine.state_dict()) == [f"module.{key}" for key in model.state_dict()]


def test_engine_of_a_plain_module_has_only_its_attributes():
    class Doubler(torch.nn.Module):
        scale = 2.0

        def forward(self, x):
            return x * self.scale

    engine = deepspeed.init_inference(Doubler())
    assert engine.scale == 2.0 and torch.equal(engine(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(AttributeError, match="generation_config"):
        engine.generation_config
    with pytest.raises(TypeError, match="Doubler has no generate"):
        engine.generate(torch.ones(1, 2, dtype=torch.long))
    assert copy.deepcopy(engine).scale == 2.0


@pytest.mark.parametrize("dtype", [torch.float, torch.half], ids=["fp32", "fp16"])
@pytest.mark.parametrize("inject", [False, True], ids=["plain", "inject"])
def test_bert_fill_mask_snippet(inject, dtype):
    """DeepSpeed's BERT fill-mask snippet, on the plain path and kernel-injected (the encoder's layers fused): the
    unmodified pipeline's top 5 tokens, and in fp32 its scores too."""
    text = "The capital of France is [MASK]."
    expected = pipeline("fill-mask", model=tiny_bert(), tokenizer=wordpiece_tokenizer())(text)
    pipe = pipeline("fill-mask", model=tiny_bert(), tokenizer=wordpiece_tokenizer())
    pipe.model = deepspeed.init_inference(pipe.model, mp_size=1, dtype=dtype, replace_with_kernel_inject=inject)
    got = pipe(text)
    assert [g["token"] for g in got] == [e["token"] for e in expected]
    if dtype == torch.float:
        assert got == expected


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "inject"])
def test_checkpoint_json_snippet_on_a_meta_model(tmp_path, inject, reference_ids):
    """DeepSpeed's big-model snippet: build the model on meta with ``OnDevice``, write the checkpoints JSON
    (``{"type": ..., "checkpoints": [...], "version": 1.0}``) and pass it with ``base_dir``."""
    repo_root = tmp_path / "repo"
    snippet_llama().save_pretrained(repo_root, max_shard_size="100KB")
    file_list = sorted(p.name for p in repo_root.glob("*.safetensors"))
    assert len(file_list) > 1
    checkpoints_json = tmp_path / "checkpoints.json"
    with open(checkpoints_json, "w") as f:
        json.dump({"type": "ds_model", "checkpoints": file_list, "version": 1.0}, f)

    config = AutoConfig.from_pretrained(repo_root)
    with deepspeed.OnDevice(dtype=torch.float32, device="meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = deepspeed.init_inference(model, mp_size=1, base_dir=str(repo_root), dtype=torch.float32,
                                     checkpoint=str(checkpoints_json), replace_with_kernel_inject=inject)
    pipe = pipeline("text-generation", model=model, tokenizer=byte_tokenizer())
    assert generated_ids(pipe) == reference_ids
