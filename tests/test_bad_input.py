"""The bad-input corpus: every entry is refused with a ValueError / TypeError (API) or a ``splice: error:`` line on
stderr and exit code 2 (CLI) that names the bad value and what is allowed. None may end in a traceback, a hang or a
silently wrong result. Inputs that are odd but meaningful (a prompt of special tokens only, no prompt at all) are
checked to give exactly what Hugging Face gives on the unmodified model.

Semantics chosen where it is a judgment call:

* an empty prompt: ``input_ids`` of length 0 raises; ``input_ids=None`` starts from the model's BOS token, as
  transformers' ``generate`` (and its text-generation pipeline, for ``""``) does; the CLI does the same for ``""``;
* ``max_new_tokens=0`` raises, as transformers 5 does (it no longer returns the prompt);
* sampling values are checked even with ``do_sample=False``: a NaN or negative value is a bug in the caller either way;
  ``temperature=0`` means greedy, so it raises only together with ``do_sample=True``.
"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import splice

from .conftest import build_tiny, run_cli, tiny_llama_config

NAN = float("nan")
ALLOWED = re.compile(r"allowed|accepted|expected", re.IGNORECASE)


# ---- checkpoints and files ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A tiny model saved whole and in shards, and broken copies of both."""
    root = tmp_path_factory.mktemp("bad_input")
    model = build_tiny(tiny_llama_config())
    model.save_pretrained(root / "good")
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    data = (root / "good" / "model.safetensors").read_bytes()
    paths = {"good": root / "good"}

    def variant(name: str, edit) -> None:
        folder = root / name
        folder.mkdir()
        for item in (root / "good").iterdir():
            (folder / item.name).write_bytes(item.read_bytes())
        edit(folder)
        paths[name] = folder

    variant("truncated", lambda f: (f / "model.safetensors").write_bytes(data[: len(data) // 2]))
    variant("empty_file", lambda f: (f / "model.safetensors").write_bytes(b""))
    variant("garbage", lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 4096))
    variant("no_tensors", lambda f: save_file({}, str(f / "model.safetensors")))
    variant("int_weights", _store_one_weight_as_int32)
    variant("u16", _write_unknown_dtype)
    variant("config_list", lambda f: (f / "config.json").write_text("[1, 2]"))
    sharded = root / "sharded"
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    paths["missing_shard"] = sharded
    (root / "list.json").write_text(json.dumps([{"dtype": "bf16"}]))
    (root / "latin1.json").write_bytes('{"dtype": "bf16", "note": "caf\xe9"}'.encode("latin-1"))
    paths["config_list_file"], paths["config_latin1_file"] = root / "list.json", root / "latin1.json"
    return paths


def _write_unknown_dtype(folder: Path) -> None:
    """A well-formed safetensors file whose one tensor has a dtype splice does not read (unsigned 16-bit)."""
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "U16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))


def _store_one_weight_as_int32(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = (tensors[name] * 100).to(torch.int32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


# (entry, kind of call, file, error, pattern naming the value)
CHECKPOINT_CORPUS = [
    ("truncated file", "truncated", ValueError, r"model\.safetensors' is not a readable safetensors file"),
    ("empty file", "empty_file", ValueError, r"model\.safetensors' is not a readable safetensors file"),
    ("corrupt header", "garbage", ValueError, r"model\.safetensors' is not a readable safetensors file"),
    ("file without tensors", "no_tensors", ValueError, r"missing from the checkpoint: model\."),
    ("float weight stored as int32", "int_weights", ValueError,
     r"model\.layers\.0\.mlp\.up_proj\.weight \(checkpoint int32 vs model float32\)"),
    ("unsupported dtype", "u16", ValueError, r"unsupported safetensors dtype 'U16'; allowed: BF16, BOOL, F16"),
    ("missing shard in an index", "missing_shard", ValueError, r"model-0000\d-of-0000\d\.safetensors' does not exist"),
]


@pytest.mark.parametrize("name, folder, error, pattern", CHECKPOINT_CORPUS, ids=[e[0] for e in CHECKPOINT_CORPUS])
def test_init_inference_refuses_the_checkpoint_and_leaves_the_model(files, name, folder, error, pattern):
    model = build_tiny(tiny_llama_config(), seed=1)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    checkpoint = files[folder] / "model.safetensors" if folder != "missing_shard" else files[folder]
    with pytest.raises(error, match=pattern) as raised:
        splice.init_inference(model, checkpoint=str(checkpoint), replace_with_kernel_inject=True)
    assert ALLOWED.search(str(raised.value)), str(raised.value)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"


LOAD_CORPUS = [entry for entry in CHECKPOINT_CORPUS if entry[1] != "no_tensors"] + [
    ("config.json holding a list", "config_list", ValueError,
     r"config\.json holds a JSON list; allowed: a JSON object"),
]


@pytest.mark.parametrize("name, folder, error, pattern", LOAD_CORPUS, ids=[e[0] for e in LOAD_CORPUS])
def test_load_refuses_the_folder(files, name, folder, error, pattern):
    with pytest.raises(error, match=pattern) as raised:
        splice.load(files[folder])
    assert ALLOWED.search(str(raised.value)), str(raised.value)


CONFIG_CORPUS = [
    ("JSON config file holding a list", "config_list_file", ValueError,
     r"list\.json' holds a JSON list; allowed: a JSON object"),
    ("JSON config file that is not UTF-8", "config_latin1_file", ValueError,
     r"latin1\.json' is not UTF-8 text \(byte 0xe9 at offset \d+\); allowed: a UTF-8 JSON object"),
]


@pytest.mark.parametrize("name, file, error, pattern", CONFIG_CORPUS, ids=[e[0] for e in CONFIG_CORPUS])
def test_init_inference_refuses_the_config_file(files, name, file, error, pattern):
    with pytest.raises(error, match=pattern):
        splice.init_inference(build_tiny(tiny_llama_config()), config=str(files[file]))


def test_a_config_that_is_a_list_is_a_type_error():
    with pytest.raises(TypeError, match="config must be None, a dict, a path to a JSON file .* got list"):
        splice.init_inference(build_tiny(tiny_llama_config()), config=[{"dtype": "bf16"}])


# ---- requests -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["plain", "injected"])
def engines(request):
    """(reference HF model, splice engine) with the same weights: pad id 0, BOS 1, EOS 2, vocabulary 128."""
    reference = build_tiny(tiny_llama_config())
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=request.param == "injected",
                                   max_out_tokens=64)
    return reference, engine


IDS = torch.tensor([[1, 5, 6, 7]])
REQUEST_CORPUS = [
    ("empty prompt", dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError,
     r"input_ids has shape \(1, 0\): an empty prompt; allowed: at least one token"),
    ("token id past the vocabulary", dict(input_ids=torch.tensor([[1, 128]])), ValueError,
     r"token id 128; allowed: 0 <= id < vocab_size=128"),
    ("negative token id", dict(input_ids=torch.tensor([[1, -3]])), ValueError, r"token id -3; allowed"),
    ("float token ids", dict(input_ids=torch.tensor([[1.0, 5.0]])), TypeError, r"integer tensor, got dtype"),
    ("1-D token ids", dict(input_ids=torch.tensor([1, 5, 6, 7])), ValueError,
     r"input_ids has shape \(4,\); allowed for generate: \[batch, length\], e\.g\. ids\[None\]"),
    ("3-D token ids", dict(input_ids=torch.ones(1, 1, 4, dtype=torch.long)), ValueError,
     r"input_ids has shape \(1, 1, 4\); allowed for generate: \[batch, length\]"),
    ("all-padding row (mask)", dict(input_ids=torch.tensor([[0, 0], [1, 5]]),
                                    attention_mask=torch.tensor([[0, 0], [1, 1]])), ValueError,
     r"row\(s\) \[0\] of the batch are padding only .*allowed: at least one real token per row"),
    ("all-padding row (pad ids)", dict(input_ids=torch.tensor([[1, 5], [0, 0]])), ValueError,
     r"row\(s\) \[1\] of the batch are padding only"),
    ("mask of another shape", dict(input_ids=IDS, attention_mask=torch.ones(1, 3)), ValueError,
     r"attention_mask has shape \(1, 3\); allowed: a tensor the shape of input_ids"),
    ("max_new_tokens 0", dict(input_ids=IDS, max_new_tokens=0), ValueError,
     r"max_new_tokens=0; allowed: an integer >= 1"),
    ("negative max_new_tokens", dict(input_ids=IDS, max_new_tokens=-2), ValueError, r"max_new_tokens=-2; allowed"),
    ("too long for max_out_tokens", dict(input_ids=IDS, max_new_tokens=61), ValueError,
     r"= 65 exceeds max_out_tokens=64; allowed"),
    ("negative temperature", dict(input_ids=IDS, do_sample=True, temperature=-1.0), ValueError,
     r"temperature=-1\.0; allowed: a number >= 0"),
    ("NaN temperature", dict(input_ids=IDS, do_sample=True, temperature=NAN), ValueError, r"temperature=nan; allowed"),
    ("NaN temperature, greedy", dict(input_ids=IDS, temperature=NAN), ValueError, r"temperature=nan; allowed"),
    ("temperature 0 while sampling", dict(input_ids=IDS, do_sample=True, temperature=0.0), ValueError,
     r"temperature=0 with do_sample=True; allowed: .*do_sample=False"),
    ("temperature as text", dict(input_ids=IDS, do_sample=True, temperature="hot"), TypeError,
     r"temperature='hot' \(str\); allowed"),
    ("negative top_k", dict(input_ids=IDS, do_sample=True, top_k=-1), ValueError,
     r"top_k=-1; allowed: an integer >= 0"),
    ("fractional top_k", dict(input_ids=IDS, do_sample=True, top_k=2.5), ValueError, r"top_k=2\.5; allowed"),
    ("top_p above 1", dict(input_ids=IDS, do_sample=True, top_p=1.5), ValueError,
     r"top_p=1\.5; allowed: a number in \(0, 1\]"),
    ("top_p 0", dict(input_ids=IDS, do_sample=True, top_p=0.0), ValueError,
     r"top_p=0\.0; allowed: a number in \(0, 1\]"),
    ("negative top_p", dict(input_ids=IDS, do_sample=True, top_p=-0.5), ValueError, r"top_p=-0\.5; allowed"),
    ("NaN top_p", dict(input_ids=IDS, do_sample=True, top_p=NAN), ValueError, r"top_p=nan; allowed"),
    ("negative repetition_penalty", dict(input_ids=IDS, repetition_penalty=-1.0), ValueError,
     r"repetition_penalty=-1\.0; allowed: a number > 0"),
    ("repetition_penalty 0", dict(input_ids=IDS, repetition_penalty=0.0), ValueError, r"repetition_penalty=0\.0"),
    ("NaN repetition_penalty", dict(input_ids=IDS, repetition_penalty=NAN), ValueError, r"repetition_penalty=nan"),
    ("negative min_new_tokens", dict(input_ids=IDS, min_new_tokens=-1), ValueError, r"min_new_tokens=-1; allowed"),
]


@pytest.mark.parametrize("name, request_kwargs, error, pattern", REQUEST_CORPUS, ids=[e[0] for e in REQUEST_CORPUS])
def test_generate_refuses_the_request(engines, name, request_kwargs, error, pattern):
    _, engine = engines
    with pytest.raises(error, match=pattern):
        engine.generate(**{"max_new_tokens": 4, **request_kwargs})


@pytest.mark.parametrize("ids", [torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long)],
                         ids=["no tokens", "no rows"])
def test_forward_refuses_an_empty_batch(engines, ids):
    _, engine = engines
    with pytest.raises(ValueError, match=r"input_ids has shape \(\d, \d\): an empty prompt; allowed"):
        engine(ids)


def test_generate_refuses_1d_ids_given_positionally_before_any_work(engines):
    _, engine = engines
    engine.module.generate, calls = (lambda *args, **kwargs: calls.append(1)), []
    try:
        with pytest.raises(ValueError, match=r"input_ids has shape \(6,\); allowed for generate: \[batch, length\]"):
            engine.generate(torch.randint(3, 128, (6,)), max_new_tokens=3)
    finally:
        del engine.module.generate
    assert not calls


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "injected"])
def test_forward_takes_ids_of_shape_length_where_the_model_does(inject):
    """OPT's forward takes ``[length]`` ids (as a batch of one): the engine's forward passes them on."""
    from .arch.tiny_models import build_family

    reference = build_family("opt")
    engine = splice.init_inference(copy.deepcopy(reference), replace_with_kernel_inject=inject, max_out_tokens=64)
    ids = torch.randint(3, 128, (6,))
    with torch.inference_mode():
        expected = reference(ids).logits
        torch.testing.assert_close(engine(ids).logits, expected, rtol=0, atol=1e-4)


GENERATION_CONFIG_CORPUS = [
    ("top_p above 1", dict(do_sample=True, top_p=1.5, max_new_tokens=2), r"top_p=1\.5; allowed"),
    ("NaN temperature", dict(do_sample=True, temperature=NAN, max_new_tokens=2), r"temperature=nan; allowed"),
    ("temperature 0 while sampling", dict(do_sample=True, temperature=0.0, max_new_tokens=2),
     r"temperature=0 with do_sample=True; allowed"),
    ("negative top_k", dict(do_sample=True, top_k=-1, max_new_tokens=2), r"top_k=-1; allowed"),
    ("negative repetition_penalty", dict(repetition_penalty=-1.0, max_new_tokens=2), r"repetition_penalty=-1\.0"),
    ("negative min_new_tokens", dict(min_new_tokens=-1, max_new_tokens=2), r"min_new_tokens=-1; allowed"),
    ("too long for max_out_tokens", dict(max_new_tokens=61), r"= 65 exceeds max_out_tokens=64; allowed"),
    ("max_length too long", dict(max_length=65), r"= 65 exceeds max_out_tokens=64; allowed"),
]


@pytest.mark.parametrize("passed", ["keyword", "positional"])
@pytest.mark.parametrize("name, options, pattern", GENERATION_CONFIG_CORPUS,
                         ids=[e[0] for e in GENERATION_CONFIG_CORPUS])
def test_a_bad_value_in_the_generation_config_is_refused_too(engines, passed, name, options, pattern):
    """Hugging Face's generate takes the generation config as its second positional argument as well."""
    from transformers import GenerationConfig

    _, engine = engines
    config = GenerationConfig(eos_token_id=None, **options)
    with pytest.raises(ValueError, match=pattern):
        if passed == "keyword":
            engine.generate(IDS, generation_config=config)
        else:
            engine.generate(IDS, config)


@pytest.mark.parametrize("name, args, error, pattern", [
    ("a mask where the generation config goes", (IDS, torch.ones_like(IDS)), TypeError,
     r"generation_config=tensor\(.*\(Tensor\); allowed: a transformers GenerationConfig or None"),
    ("more positional arguments than generate takes", (IDS,) + (None,) * 20, TypeError,
     r"too many positional arguments; allowed: positional arguments in the order \(inputs, generation_config, "),
], ids=lambda value: value if isinstance(value, str) else "")
def test_generate_refuses_the_positional_arguments(engines, name, args, error, pattern):
    _, engine = engines
    with pytest.raises(error, match=pattern):
        engine.generate(*args)


def test_a_positional_generation_config_and_processor_give_what_hf_does(engines, caplog):
    """Positional arguments bind as in Hugging Face's ``generate(inputs, generation_config, logits_processor, ...)``:
    the config's length and sampling options and the processor all apply, token for token as on the HF model; a
    kernel-injected engine runs a config it implements in its native loop."""
    from transformers import GenerationConfig, LogitsProcessorList, SuppressTokensLogitsProcessor

    reference, engine = engines
    ids = torch.tensor([[1, 5, 6, 7], [1, 9, 3, 4]])
    config = GenerationConfig(max_new_tokens=9, min_new_tokens=9, do_sample=False, repetition_penalty=1.3,
                              eos_token_id=2, pad_token_id=0)
    expected = reference.generate(ids, config)
    with caplog.at_level("INFO", logger="splice"):
        got = engine.generate(ids, config)
    assert not [r for r in caplog.records if "not in the native loop" in r.getMessage()]
    assert got.shape == (2, 4 + 9) and torch.equal(got, expected)
    processors = LogitsProcessorList([SuppressTokensLogitsProcessor(expected[:, 4:].flatten().tolist())])
    expected = reference.generate(ids, config, processors)
    got = engine.generate(ids, config, processors)
    assert torch.equal(got, expected) and not torch.isin(got[:, 4:], processors[0].suppress_tokens).any()


@pytest.mark.parametrize("prompt", [[[1]], [[1, 2]], [[2, 2, 2]]], ids=["bos", "bos eos", "eos eos eos"])
def test_a_prompt_of_special_tokens_only_generates_what_hf_does(engines, prompt):
    reference, engine = engines
    ids = torch.tensor(prompt)
    options = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(engine.generate(ids, **options), reference.generate(ids, **options))


def test_no_prompt_starts_from_bos_as_hf_does(engines):
    reference, engine = engines
    got = engine.generate(input_ids=None, max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert got[0, 0] == 1 and torch.equal(got, reference.generate(max_new_tokens=5, do_sample=False, eos_token_id=None))


# ---- the command line -----------------------------------------------------------------------------------------------
def assert_cli_error(code: int, out: str, err: str, pattern: str) -> None:
    assert code == 2, (out, err)
    assert "Traceback" not in err
    assert re.search(r"^splice: error: .*" + pattern, err, re.MULTILINE), err
    assert ALLOWED.search(err.splitlines()[-1]), err
    assert out == "" or out.endswith("\n")


CLI_CORPUS = [
    ("top-p above 1", ["--top-p", "1.5", "hi"], r"--top-p: 1\.5 is not allowed; allowed: a number in \(0, 1\]"),
    ("top-p 0", ["--top-p", "0", "hi"], r"--top-p: 0 is not allowed; allowed: a number in \(0, 1\]"),
    ("NaN top-p", ["--top-p", "nan", "hi"], r"--top-p: nan is not allowed"),
    ("negative temperature", ["--temperature", "-1", "hi"],
     r"--temperature: -1 is not allowed; allowed: a number >= 0"),
    ("NaN temperature", ["--temperature", "nan", "hi"], r"--temperature: nan is not allowed"),
    ("top-k 0", ["--top-k", "0", "hi"], r"--top-k: 0 is not allowed; allowed: an integer >= 1"),
    ("top-k as text", ["--top-k", "many", "hi"], r"--top-k: 'many' is not allowed; allowed: an integer >= 1"),
    ("negative repetition penalty", ["--repetition-penalty", "-1", "hi"],
     r"--repetition-penalty: -1 is not allowed"),
    ("max-new-tokens 0", ["--max-new-tokens", "0", "hi"],
     r"--max-new-tokens: 0 is not allowed; allowed: an integer >= 1"),
    ("max-out-tokens 0", ["--max-out-tokens", "0", "hi"], r"--max-out-tokens: 0 is not allowed"),
    ("greedy and a temperature", ["--greedy", "--temperature", "0.7", "hi"],
     r"--greedy asks for greedy decoding, which --temperature 0\.7 does not apply to; allowed: one of them"),
    ("temperature 0 and top-p", ["--temperature", "0", "--top-p", "0.9", "hi"],
     r"--temperature 0 asks for greedy decoding, which --top-p 0\.9 does not apply to"),
    ("non-UTF-8 prompt", ["caf\udce9"], r"PROMPT is not UTF-8 text \(character 3 is not\); allowed: UTF-8 text"),
    ("three positionals", ["smollm2-135m-instruct", "two", "prompts"],
     r"expected \[MODEL\] PROMPT, got 3 positional argument\(s\)"),
    ("two different models", ["model-a", "--model", "model-b", "hi"],
     r"the model is given twice, 'model-a' and --model"),
    ("unknown model", ["no-such-model", "hi"], r"unknown model 'no-such-model'.*accepted: a built-in model name"),
]


@pytest.mark.parametrize("name, argv, pattern", CLI_CORPUS, ids=[e[0] for e in CLI_CORPUS])
def test_cli_refuses(capsys, name, argv, pattern):
    assert_cli_error(*run_cli(["generate", *argv], capsys), pattern)


BENCH_CORPUS = [
    ("no new tokens", ["--new", "0"], r"--new: 0 is not allowed; allowed: an integer >= 1"),
    ("an empty prompt", ["--prompt", "0"], r"--prompt: 0 is not allowed; allowed: an integer >= 1"),
    ("batch 0", ["--batch", "0,1"], r"--batch: 0,1 is not allowed; allowed: comma-separated integers >= 1"),
    ("batch as text", ["--batch", "x"], r"--batch: 'x' is not allowed"),
    ("no timed runs", ["--repeat", "0"], r"--repeat: 0 is not allowed"),
    ("no threads", ["--threads", "0"], r"--threads: 0 is not allowed"),
]


@pytest.mark.parametrize("name, argv, pattern", BENCH_CORPUS, ids=[e[0] for e in BENCH_CORPUS])
def test_bench_refuses(capsys, name, argv, pattern):
    assert_cli_error(*run_cli(["bench", *argv], capsys), pattern)


@pytest.mark.parametrize("name, folder, error, pattern", LOAD_CORPUS, ids=[e[0] for e in LOAD_CORPUS])
def test_cli_refuses_the_model_folder(files, capsys, name, folder, error, pattern):
    assert_cli_error(*run_cli(["generate", str(files[folder]), "hi"], capsys), pattern)


@pytest.mark.parametrize("name, file, error, pattern", CONFIG_CORPUS, ids=[e[0] for e in CONFIG_CORPUS])
def test_cli_refuses_the_config_file_before_loading_a_model(files, capsys, name, file, error, pattern):
    assert_cli_error(*run_cli(["generate", "--model", "no-such-model", "--config", str(files[file]), "hi"], capsys),
                     pattern)


def test_cli_refuses_a_prompt_file_that_is_not_utf8(tmp_path, capsys):
    (tmp_path / "prompt.txt").write_bytes(b"caf\xe9")
    assert_cli_error(*run_cli(["generate", "--prompt-file", str(tmp_path / "prompt.txt")], capsys),
                     r"--prompt-file .*prompt\.txt: byte 0xe9 at offset 3 is not UTF-8; allowed: UTF-8 text")


def test_cli_as_a_process_refuses_non_utf8_argv_and_a_truncated_checkpoint(files):
    """What the OS hands over: argv bytes that are not UTF-8; and a checkpoint error, through the installed script."""
    for argv, pattern in ((["generate", b"caf\xe9"], "PROMPT is not UTF-8 text"),
                          (["generate", str(files["truncated"]), "hi"], "is not a readable safetensors file")):
        result = subprocess.run([sys.executable, "-m", "splice.cli", *argv], capture_output=True, timeout=300)
        err = result.stderr.decode("utf-8", "replace")
        assert result.returncode == 2 and "Traceback" not in err, err
        assert err.splitlines()[-1].startswith("splice: error: ") and pattern in err, err
