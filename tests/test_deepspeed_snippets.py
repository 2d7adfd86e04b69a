"""DeepSpeed's inference snippets, unchanged but for the import (``import splice as deepspeed``), against the
unmodified Hugging Face pipeline: the text-generation pipeline in fp32, bf16 and fp16 with and without kernel
injection, ``engine.module``, the engine standing in for the model, and ``checkpoint=`` JSON loading of a model built
on the meta device; from DeepSpeed's inference tutorial (``ds_engine.module`` handed to the pipeline, the GPT-Neo
end-to-end sampling script, the int8 snippet's ``quantization_setting``), ``init_inference``'s docstring cases and API
docs, and DeepSpeedExamples' text-generation ``inference-test.py`` (its ``DSPipeline``) and ``ds-hf-compare.py``.
Tensor parallelism under torchrun (one node, and two nodes) is in ``tests/tp/test_snippets_tp.py``.
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
    # as DeepSpeed's engine, which sets generate only where the model has it
    assert not hasattr(engine, "generate") and not hasattr(Doubler(), "generate")
    with pytest.raises(AttributeError, match="Doubler has no generate"):
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


def test_inference_tutorial_snippet_hands_engine_module_to_the_pipeline(reference_ids):
    """deepspeed.ai/tutorials/inference-tutorial, "Initializing for Inference": the pipeline gets ``ds_engine.module``
    (the model, its blocks fused), not the engine; Hugging Face's own generate loop then runs over the fused blocks."""
    model, tokenizer = snippet_llama(), byte_tokenizer()
    original = model
    # Initialize the DeepSpeed-Inference engine
    ds_engine = deepspeed.init_inference(model,
                                         tensor_parallel={"tp_size": 1},
                                         dtype=torch.half,
                                         checkpoint=None,
                                         replace_with_kernel_inject=True)
    model = ds_engine.module
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    output = pipe('Input String', max_new_tokens=8)
    assert model is original and model.dtype == torch.half
    assert type(model.model.layers[0]).__name__ != "LlamaDecoderLayer"  # fused
    assert output[0]["generated_text"].startswith("Input String")
    assert_agree(generated_ids(pipe), reference_ids, torch.half)


def test_gpt_neo_tutorial_snippet_samples_as_the_unmodified_pipeline():
    """The inference tutorial's "End-to-End GPT NEO 2.7B Inference" (gpt-neo-2.7b-generation.py), sampling with
    ``min_length=50``: under one seed the kernel-injected pipeline draws the unmodified pipeline's tokens."""
    def sampled(generator):
        torch.manual_seed(1)
        return generator("DeepSpeed is", do_sample=True, min_length=50, max_new_tokens=60,
                         return_tensors=True)[0]["generated_token_ids"]

    expected = sampled(pipeline('text-generation', model=snippet_llama(), tokenizer=byte_tokenizer()))
    local_rank = int(os.getenv('LOCAL_RANK', '0'))
    world_size = int(os.getenv('WORLD_SIZE', '1'))
    generator = pipeline('text-generation', model=snippet_llama(), tokenizer=byte_tokenizer())
    generator.model = deepspeed.init_inference(generator.model,
                                               tensor_parallel={"tp_size": world_size},
                                               dtype=torch.float,
                                               replace_with_kernel_inject=True)
    string = generator("DeepSpeed is", do_sample=True, min_length=50)
    assert local_rank == 0 and not torch.distributed.is_initialized()  # the snippet's print guard takes this branch
    assert string[0]["generated_text"].startswith("DeepSpeed is")
    assert sampled(generator) == expected and len(expected) >= 50


def _docstring_case(case: int, tmp_path: Path, generator) -> None:
    """The four calls of DeepSpeed's ``init_inference`` docstring ("all four cases are valid"); case 2's config is a
    DeepSpeed JSON config file (``config`` may be a dict or a path)."""
    world_size = 1
    if case == 1:  # no config and no kwargs: the defaults
        generator.model = deepspeed.init_inference(generator.model)
    elif case == 2:  # a config and no kwargs
        config = tmp_path / "ds_inference.json"
        config.write_text(json.dumps({"dtype": "fp16", "replace_with_kernel_inject": True,
                                      "tensor_parallel": {"tp_size": 1}, "max_tokens": 1024}))
        generator.model = deepspeed.init_inference(generator.model, config=str(config))
    elif case == 3:  # keyword arguments only
        generator.model = deepspeed.init_inference(generator.model,
                                                   mp_size=world_size,
                                                   dtype=torch.half,
                                                   replace_with_kernel_inject=True)
    else:  # config and keyword arguments, merged
        generator.model = deepspeed.init_inference(generator.model, config={"dtype": torch.half},
                                                   replace_with_kernel_inject=True)


@pytest.mark.parametrize("case", [1, 2, 3, 4])
def test_init_inference_docstring_cases(case, tmp_path, reference_ids):
    generator = pipeline("text-generation", model=snippet_llama(), tokenizer=byte_tokenizer())
    _docstring_case(case, tmp_path, generator)
    dtype = torch.float32 if case == 1 else torch.half  # case 1 keeps the model's dtype (DeepSpeed's default: fp16)
    assert generator.model.dtype == dtype and generator.model.inference_config.replace_with_kernel_inject == (case > 1)
    assert_agree(generated_ids(generator), reference_ids, dtype)


def test_inference_setup_doc_snippet_takes_the_model_by_keyword():
    """DeepSpeed's API docs ("Inference Setup"): ``engine = deepspeed.init_inference(model=net, config=config)``."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    expected = net(x)
    config = {"dtype": torch.float, "max_out_tokens": 64}
    engine = deepspeed.init_inference(model=net, config=config)
    assert engine.module is net and torch.equal(engine(x), expected)


class DSPipeline():
    """DeepSpeedExamples' inference/huggingface/text-generation/utils.py ``DSPipeline``, as its inference-test.py uses
    it, offline: the snippet model saved to ``repo_root`` stands for ``snapshot_download``, the checkpoints JSON lists
    its safetensors (the original globs ``*.bin``, which splice refuses: see the next test), and ``tokenizer(...)``
    replaces ``batch_encode_plus``, which transformers 5 removed. ``file_paths`` writes the older utils.py's JSON:
    absolute paths and ``"type": config.model_type``."""

    def __init__(self, repo_root: Path, dtype=torch.float16, is_meta=True, device=-1, file_paths=False):
        self.dtype = dtype
        self.device = torch.device("cpu") if device < 0 else torch.device(f"cuda:{device}")
        self.tokenizer = byte_tokenizer()
        self.tokenizer.padding_side = "left"
        self.tokenizer.pad_token = self.tokenizer.eos_token
        if (is_meta):
            '''When meta tensors enabled, use checkpoints'''
            self.config = AutoConfig.from_pretrained(repo_root)
            self.repo_root, self.checkpoints_json = self._generate_json(repo_root, file_paths)
            with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
                self.model = AutoModelForCausalLM.from_config(self.config)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(repo_root)
        self.model.eval()
        if self.dtype == torch.float16:
            self.model.half()

    def __call__(self, inputs=["test"], num_tokens=100, do_sample=False):
        input_list = [inputs] if isinstance(inputs, str) else inputs
        return self.generate_outputs(input_list, num_tokens=num_tokens, do_sample=do_sample)

    def _generate_json(self, repo_root: Path, file_paths: bool):
        checkpoints_json = str(repo_root.parent / "checkpoints.json")
        with open(checkpoints_json, "w", encoding="utf-8") as f:
            if file_paths:
                file_list = [str(entry) for entry in Path(repo_root).rglob("*.safetensors") if entry.is_file()]
                data = {"type": self.config.model_type, "checkpoints": file_list, "version": 1.0}
            else:
                file_list = [str(entry).split('/')[-1] for entry in Path(repo_root).rglob("*.safetensors")
                             if entry.is_file()]
                data = {"type": "BLOOM", "checkpoints": file_list, "version": 1.0}
            json.dump(data, f)
        return str(repo_root), checkpoints_json

    def generate_outputs(self, inputs=["test"], num_tokens=100, do_sample=False):
        generate_kwargs = dict(max_new_tokens=num_tokens, do_sample=do_sample)
        input_tokens = self.tokenizer(inputs, return_tensors="pt", padding=True)
        for t in input_tokens:
            if torch.is_tensor(input_tokens[t]):
                input_tokens[t] = input_tokens[t].to(self.device)
        self.model.to(self.device)
        outputs = self.model.generate(**input_tokens, **generate_kwargs)
        return self.tokenizer.batch_decode(outputs, skip_special_tokens=True)


INPUT_SENTENCES = ["DeepSpeed is a machine learning framework", "He is working on", "He has a", "He got all"]


@pytest.mark.parametrize("dtype, use_meta_tensor, use_kernel, file_paths", [
    ("float32", True, True, False), ("float32", True, False, True), ("float16", True, True, False),
    ("float16", False, True, False)], ids=["fp32-meta-kernel", "fp32-meta-paths", "fp16-meta-kernel", "fp16-kernel"])
def test_inference_test_script(tmp_path, dtype, use_meta_tensor, use_kernel, file_paths):
    """DeepSpeedExamples' text-generation/inference-test.py (batch 4, left-padded, greedy) against the unmodified fp32
    model's batched generate on the same inputs."""
    repo_root = tmp_path / "repo"
    snippet_llama().save_pretrained(repo_root, max_shard_size="100KB")
    expected = DSPipeline.generate_outputs(_reference_pipeline(repo_root), INPUT_SENTENCES, num_tokens=12)

    data_type = getattr(torch, dtype)
    pipe = DSPipeline(repo_root, dtype=data_type, is_meta=use_meta_tensor, device=-1, file_paths=file_paths)
    if use_meta_tensor:
        ds_kwargs = dict(base_dir=pipe.repo_root, checkpoint=pipe.checkpoints_json)
    else:
        ds_kwargs = dict()
    pipe.model = deepspeed.init_inference(pipe.model,
                                          dtype=data_type,
                                          mp_size=1,
                                          replace_with_kernel_inject=use_kernel,
                                          max_tokens=1024,
                                          save_mp_checkpoint_path=None,
                                          **ds_kwargs)
    outputs = pipe(INPUT_SENTENCES, num_tokens=12, do_sample=False)
    config = pipe.model.config  # what Performance.print_perf_stats reads
    assert getattr(config, "num_layers", config.num_hidden_layers) == 2 and config.hidden_size == 64
    assert pipe.model.dtype == data_type
    if data_type == torch.float32:
        assert outputs == expected
    else:
        same = sum(a == b for a, b in zip(outputs, expected))
        assert same >= len(expected) - 1, (outputs, expected)


def _reference_pipeline(repo_root: Path) -> DSPipeline:
    """The unmodified fp32 model in ``DSPipeline``'s shape (its ``--hf_baseline``)."""
    reference = DSPipeline.__new__(DSPipeline)
    reference.device, reference.tokenizer = torch.device("cpu"), byte_tokenizer()
    reference.tokenizer.padding_side, reference.tokenizer.pad_token = "left", reference.tokenizer.eos_token
    reference.model = AutoModelForCausalLM.from_pretrained(repo_root, dtype=torch.float32).eval()
    return reference


def test_deepspeed_examples_bin_checkpoints_json_is_refused_naming_the_file(tmp_path):
    """DeepSpeedExamples' utils.py lists ``*.bin`` pickles in its checkpoints JSON; splice reads only safetensors and
    says so, naming the file, before any weight is loaded."""
    repo_root = tmp_path / "repo"
    repo_root.mkdir()
    torch.save(snippet_llama().state_dict(), repo_root / "pytorch_model.bin")
    checkpoints_json = tmp_path / "checkpoints.json"
    file_list = [str(entry).split('/')[-1] for entry in Path(repo_root).rglob("*.[bp][it][n]") if entry.is_file()]
    checkpoints_json.write_text(json.dumps({"type": "BLOOM", "checkpoints": file_list, "version": 1.0}))
    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        model = AutoModelForCausalLM.from_config(snippet_llama().config)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin' is a pickle checkpoint \(\.bin\); splice reads only "
                                         r"safetensors.*save_pretrained"):
        deepspeed.init_inference(model, dtype=torch.float16, mp_size=1, base_dir=str(repo_root),
                                 checkpoint=str(checkpoints_json))


def test_ds_hf_compare_script():
    """DeepSpeedExamples' text-generation/ds-hf-compare.py (fp32): every output of the kernel-injected pipeline matches
    the unmodified pipeline's, generated greedily between ``min_length`` and ``max_length``."""
    test_inputs = ["This is a test", "One fish, two fish, red fish,"]
    data_type = getattr(torch, "float32")
    pipe = pipeline('text-generation', model=snippet_llama(), tokenizer=byte_tokenizer(), torch_dtype=data_type)
    base_out_list = []
    for prompt in test_inputs:
        base_out_list += pipe(prompt, do_sample=False, min_length=30, max_length=40)
    pipe.model = deepspeed.init_inference(pipe.model, dtype=data_type, replace_with_kernel_inject=True)
    match_count = 0
    for prompt, base_out in zip(test_inputs, base_out_list):
        ds_out = pipe(prompt, do_sample=False, min_length=30, max_length=40)
        match_count += base_out == ds_out[0]
    assert match_count == len(test_inputs)


def test_inference_tutorial_int8_snippet_names_the_removed_quantization_setting(tmp_path):
    """The inference tutorial's "Datatypes and Quantized Models" snippet passes ``quantization_setting``, which
    DeepSpeed's init_inference no longer takes either: the error names it and what to use, before the model or the
    checkpoint is touched."""
    model = snippet_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantize_groups, mlp_extra_grouping = 8, True
    with pytest.raises(ValueError, match=r"unknown config key 'quantization_setting'; .*dtype=torch\.int8 and "
                                         r"quant=\{'weight': \{'q_groups': N\}\}"):
        deepspeed.init_inference(model,
                                 checkpoint=str(tmp_path / "checkpoint.json"),
                                 dtype=torch.int8,
                                 quantization_setting=(quantize_groups,
                                                       mlp_extra_grouping)
                                 )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
