"""``splice``'s package: bad input to init_inference raises before anything changes the user's model; the public
names are imported on first use, so ``import splice`` stays light."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import splice

from .conftest import build_tiny, tiny_llama_config


def snapshot(model):
    return {name: (t.detach().clone(), t.device, t.dtype) for name, t in model.state_dict().items()}


def assert_unchanged(model, before):
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (tensor, device, dtype) in before.items():
        new, new_device, new_dtype = after[name]
        assert (new_device, new_dtype) == (device, dtype), name
        assert torch.equal(new, tensor), name


BAD_INPUTS = [
    ({"dtype": "bf16", "max_out_token": 8}, ValueError, "max_out_tokens"),
    ({"dtype": "bf16", "tensor_parallel": {"tp_size": 0}}, ValueError, "tp_size"),
    ({"dtype": "fp8"}, ValueError, "fp8"),
    ({"dtype": "bf16", "max_out_tokens": 0}, ValueError, "max_out_tokens"),
    ({"dtype": "bf16", "enable_cuda_graph": True, "device": "cpu"}, ValueError, "enable_cuda_graph"),
    ({"dtype": "bf16", "checkpoint": "/nonexistent/ckpt"}, ValueError, "/nonexistent/ckpt"),
]


@pytest.mark.parametrize("config, error, message", BAD_INPUTS)
def test_bad_input_leaves_model_unchanged(config, error, message):
    model = build_tiny(tiny_llama_config())
    before = snapshot(model)
    with pytest.raises(error, match=message):
        splice.init_inference(model, config)
    assert_unchanged(model, before)


def test_mismatched_checkpoint_leaves_model_unchanged(tmp_path):
    other = build_tiny(tiny_llama_config(hidden_size=32, intermediate_size=64))
    other.save_pretrained(tmp_path)
    model = build_tiny(tiny_llama_config())
    before = snapshot(model)
    with pytest.raises(ValueError, match="shape"):
        splice.init_inference(model, dtype="bf16", checkpoint=str(tmp_path))
    assert_unchanged(model, before)


def test_injecting_an_already_injected_model_names_the_earlier_call():
    model = build_tiny(tiny_llama_config())
    engine = splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    ids = torch.tensor([[3, 4, 5]])
    logits = engine(ids).logits
    with pytest.raises(ValueError, match="already kernel-injected by an earlier init_inference"):
        splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    assert torch.equal(engine(ids).logits, logits)  # the first engine still runs as it did


@pytest.mark.parametrize("first", [{"dtype": torch.int8}, {"quant": {"enabled": True, "weight": {"num_bits": 4}}},
                                   {"replace_with_kernel_inject": False, "dtype": "bf16", "quant": {
                                       "enabled": True, "activation": {"enabled": True}}}],
                         ids=["int8", "int4", "w8a8"])
def test_injecting_a_model_an_earlier_call_quantized_names_that_call(first):
    """The earlier call's quantized linears are not the layers kernel injection fuses: a ValueError naming one,
    where an AttributeError came from deep in the checks."""
    model = build_tiny(tiny_llama_config())
    engine = splice.init_inference(model, **first)
    ids = torch.tensor([[3, 4, 5]])
    logits = engine(ids).logits
    with pytest.raises(ValueError, match=r"already changed by splice \(an earlier init_inference or splice\.quant\."
                                         r"quantize: model\.layers\.0\.self_attn\.q_proj is splice's Int\w+Linear\)"
                                         r".*allowed: the original model"):
        splice.init_inference(model, replace_with_kernel_inject=True, max_out_tokens=32)
    assert torch.equal(engine(ids).logits, logits)


@pytest.mark.parametrize("again", [{"dtype": torch.int8}, {"quant": {"enabled": True, "weight": {"num_bits": 4}}}],
                         ids=["int8", "int4"])
def test_quantizing_a_model_splice_quantized_raises_naming_a_quantized_layer(again):
    """splice.quant.quantize's layers are not linears: a second scheme would have quantized the head alone and
    reported itself as the model's. Running the quantized model as it is stays allowed."""
    from splice.quant import QuantConfig, quantize

    model = build_tiny(tiny_llama_config())
    quantize(model, QuantConfig(bits=4, group_size=32))
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        logits = model(ids).logits
    with pytest.raises(ValueError, match=r"quantization \(int\w+\) asked for a model splice has already quantized \("
                                         r"an earlier init_inference or splice\.quant\.quantize: model\.layers\.0\."
                                         r"self_attn\.q_proj is Int4WeightOnlyLinear\); allowed: the float model"):
        splice.init_inference(model, **again)
    engine = splice.init_inference(model)
    assert torch.equal(engine(ids).logits, logits)


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_a_device_splice_does_not_run_on_raises_before_any_step(device):
    """device='meta' was accepted and moved the user's weights to the meta device (gone); 'mps' failed in the place
    step with torch's own RuntimeError. Both are refused up front, naming the value and the allowed devices."""
    model = build_tiny(tiny_llama_config())
    before = snapshot(model)
    with pytest.raises(ValueError, match=f"'{device}' is not a device splice runs on; allowed: .*'cpu'"):
        splice.init_inference(model, device=device)
    assert_unchanged(model, before)


def test_a_cuda_index_past_the_machine_s_devices_raises(monkeypatch):
    from splice.config import resolve_config
    from splice.plan import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(resolve_config(device="cuda:1")) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device='cuda:2', but this machine has 2 CUDA device\(s\); allowed: "
                       r"'cuda', 'cuda:0' \.\.\. 'cuda:1', or 'cpu'"):
        resolve_device(resolve_config(device="cuda:2"))


@pytest.mark.parametrize("options, pattern", [
    ({"base_dir": "/tmp/ck"}, r"base_dir='/tmp/ck' has no effect: no checkpoint is given"),
    ({"checkpoint_config": {"base_dir": "/tmp/ck"}},
     r"checkpoint_config\.base_dir='/tmp/ck' has no effect: no checkpoint is given"),
    ({"tensor_parallel": {"tp_grain_size": 32}},
     r"tensor_parallel\.tp_grain_size=32 has no effect at tensor_parallel\.tp_size=1"),
])
def test_options_with_nothing_to_act_on_warn_by_name(options, pattern):
    """A checkpoint root without a checkpoint, a split granularity with nothing split: accepted, but they would
    vanish, so they warn (SpliceIgnoredOptionWarning) naming the option and value; the model is still built."""
    from splice.config import SpliceIgnoredOptionWarning

    with pytest.warns(SpliceIgnoredOptionWarning, match=pattern):
        engine = splice.init_inference(build_tiny(tiny_llama_config()), **options)
    assert engine.step_report("load").summary() == "skipped (no checkpoint)"


def test_not_a_module_raises():
    with pytest.raises(TypeError, match="nn.Module"):
        splice.init_inference("llama")


#: What splice's public names bring in: importing the package or a light submodule must not.
ENGINE_MODULES = ("splice.engine", "splice.generation", "transformers.generation")


def test_import_splice_leaves_the_engine_for_first_use():
    """In a fresh interpreter: ``import splice`` and its light submodules do not import the engine's stack; the first
    use of a public name does."""
    code = (f"import sys, splice, splice.native, splice.machine, splice.config\n"
            f"loaded = [m for m in {ENGINE_MODULES!r} if m in sys.modules]\n"
            f"assert not loaded, f'imported eagerly: {{loaded}}'\n"
            f"from splice import InferenceEngine\n"
            f"assert InferenceEngine.__module__ == 'splice.engine' and 'splice.engine' in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_the_public_names_resolve():
    from splice import InferenceConfig, InferenceEngine, OnDevice, init_inference, load
    from splice.config import InferenceConfig as config_class
    from splice.engine import InferenceEngine as engine_class
    from splice.models import load as load_function
    from splice.ondevice import OnDevice as on_device_class

    assert (InferenceEngine, InferenceConfig, OnDevice, load) == (engine_class, config_class, on_device_class,
                                                                  load_function)
    assert splice.InferenceEngine is engine_class and callable(init_inference)
    assert set(splice.__all__) <= set(dir(splice)) and splice.__version__
    star: dict = {}
    exec("from splice import *", star)
    assert set(splice.__all__) <= set(star)
    with pytest.raises(AttributeError, match="no_such_name"):
        splice.no_such_name
