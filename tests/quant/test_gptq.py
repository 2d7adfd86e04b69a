"""GPTQ (calibration-based int4): lower output error than round-to-nearest on correlated inputs, same packed layout,
and the errors of its interface."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splice import native
from splice.quant import Int4WeightOnlyLinear, QuantConfig, quantize, sqnr_db
from splice.quant import gptq


def _correlated_inputs(rows: int, features: int) -> torch.Tensor:
    """Inputs with correlated features of very different scales, as a transformer's hidden states have."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(features, features, generator=gen) / features**0.5 + 0.1 * torch.eye(features)
    return (torch.randn(rows, features, generator=gen) @ mix) * torch.linspace(0.2, 3, features)


@pytest.mark.parametrize("group, symmetric", [(32, True), (64, False), (128, True)])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_output_error_vs_round_to_nearest(group, symmetric, act_order):
    torch.manual_seed(0)
    linear = nn.Linear(256, 200)
    calibration, held_out = _correlated_inputs(2048, 256), _correlated_inputs(4096, 256)[2048:]
    hessian = calibration.t() @ calibration
    config = QuantConfig(bits=4, group_size=group, symmetric=symmetric)
    rtn = Int4WeightOnlyLinear.from_float(linear.weight.detach(), linear.bias, config)
    calibrated = Int4WeightOnlyLinear.from_float(linear.weight.detach(), linear.bias, config, hessian=hessian,
                                                 act_order=act_order)
    with torch.no_grad():
        reference = linear(held_out)
        assert sqnr_db(reference, calibrated(held_out)) >= sqnr_db(reference, rtn(held_out)) + 1.0
        # Same layout and kernel: the kernel computes with exactly the de-quantized weights it stores.
        expected = F.linear(held_out.to(torch.bfloat16).float(), calibrated.dequantize(), linear.bias)
        assert (calibrated(held_out) - expected).norm() / expected.norm() < 1e-2



@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
@pytest.mark.parametrize("group, symmetric", [(32, True), (64, False), (256, True)])
@pytest.mark.parametrize("act_order", [False, True])
def test_the_native_sweep_gives_the_torch_loops_codes_exactly(group, symmetric, act_order):
    """The native column sweep replaces the torch loop only where it rounds every step as that loop does."""
    weight = torch.randn(200, 512, generator=torch.Generator().manual_seed(1))
    calibration = _correlated_inputs(1024, 512)
    hessian = calibration.t() @ calibration
    native_codes, native_params = gptq.gptq_int4(weight, hessian, group, symmetric, act_order, native_sweep=True)
    torch_codes, torch_params = gptq.gptq_int4(weight, hessian, group, symmetric, act_order, native_sweep=False)
    assert torch.equal(native_codes, torch_codes), f"{(native_codes != torch_codes).sum()} of {weight.numel()} differ"
    assert torch.equal(native_params, torch_params)
    assert native_codes.min() == 0 and native_codes.max() == 15  # the clamp is exercised at both ends

class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 128)
        self.layers = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(128, 256), "down": nn.Linear(256, 128)})
                                    for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer["down"](F.gelu(layer["up"](h)))
        return h


def test_quantize_with_calibration_ids_uses_the_model_forward():
    torch.manual_seed(0)
    model, ids = _TinyLM(), torch.randint(0, 64, (4, 32))
    with torch.no_grad():
        reference = model(ids)
    rtn_model = _TinyLM()
    rtn_model.load_state_dict(model.state_dict())
    quantize(rtn_model, QuantConfig(bits=4, group_size=32, symmetric=False))
    report = quantize(model, QuantConfig(bits=4, group_size=32, symmetric=False), calibration_ids=ids)
    assert "GPTQ on 4x32 tokens" in report.summary()
    assert all(isinstance(layer[name], Int4WeightOnlyLinear) for layer in model.layers for name in ("up", "down"))
    with torch.no_grad():
        assert sqnr_db(reference, model(ids)) > sqnr_db(reference, rtn_model(ids))


@pytest.mark.parametrize("quantize_head", [False, True])
def test_calibration_skips_the_head_product_only_when_the_head_is_not_calibrated(monkeypatch, quantize_head):
    """A Hugging Face model computes each sequence's last logits only (``logits_to_keep=1``) unless the head itself
    is calibrated (``quantize_lm_head``); the blocks' Hessians are the same either way."""
    from ..conftest import build_tiny, tiny_llama_config

    torch.manual_seed(0)
    model, ids = build_tiny(tiny_llama_config()), torch.randint(0, 100, (2, 16))
    targets = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    full = gptq.run_calibration(model, ids, targets)
    assert full["lm_head"] is not None
    blocks = {name: m for name, m in targets.items() if name != "lm_head"}
    down, head_rows = "model.layers.0.mlp.down_proj", []
    model.lm_head.register_forward_hook(lambda module, inputs, output: head_rows.append(inputs[0].shape[1]))
    torch.testing.assert_close(gptq.run_calibration(model, ids, blocks, head_needed=False)[down], full[down])
    assert head_rows == [1]  # the last token of each sequence only
    seen = []
    monkeypatch.setattr(gptq, "run_calibration", lambda *a, **k: seen.append(k["head_needed"]) or full)
    quantize(model, QuantConfig(bits=4, group_size=32, quantize_lm_head=quantize_head), calibration_ids=ids)
    assert seen == [quantize_head]


def test_linears_called_on_the_same_input_share_one_hessian():
    x = torch.randn(10, 8)
    a, b, c = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(4, 4)
    hooks = gptq.HessianHooks({"a": a, "b": b, "c": c})
    c(a(x) + b(x))
    hooks.remove()
    assert hooks.hessians["a"] is hooks.hessians["b"]
    torch.testing.assert_close(hooks.hessians["a"], x.t() @ x)


def test_calibration_errors_name_the_choices():
    model = _TinyLM()
    with pytest.raises(ValueError, match="int4 weights only"):
        quantize(model, QuantConfig(), calibration_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor"):
        quantize(model, QuantConfig(bits=4), calibration_ids=torch.zeros(1, 4))


def test_gptq_model_saves_and_reloads_with_the_same_scheme(tmp_path):
    from splice.quant import load_quantized, save_quantized

    torch.manual_seed(0)
    model, ids = _TinyLM(), torch.randint(0, 64, (2, 32))
    skeleton = _TinyLM()
    config = QuantConfig(bits=4, group_size=64, symmetric=True)
    quantize(model, config, calibration_ids=ids, act_order=True)
    save_quantized(model, tmp_path, config)
    load_quantized(skeleton, tmp_path, config)
    with torch.no_grad():
        torch.testing.assert_close(skeleton(ids), model(ids))


def test_a_hessian_that_fails_midway_leaves_the_model_as_it_was(monkeypatch):
    """GPTQ refuses a Hessian it cannot factor (here NaN, as an fp16 overflow gives) on the second layer in order:
    the layer quantized before it is put back, so the model is the float one the call was given."""
    torch.manual_seed(0)
    model, ids = _TinyLM(), torch.randint(0, 64, (2, 32))
    modules = list(model.modules())
    real = gptq.run_calibration

    def poisoned(*args, **kwargs):
        hessians = real(*args, **kwargs)
        hessians["layers.0.down"] = torch.full_like(hessians["layers.0.down"], float("nan"))
        return hessians

    monkeypatch.setattr(gptq, "run_calibration", poisoned)
    with pytest.raises(ValueError, match="not positive definite"):
        quantize(model, QuantConfig(bits=4, group_size=32, symmetric=False), calibration_ids=ids)
    assert list(model.modules()) == modules


@pytest.mark.parametrize("bad", [500, -1])
def test_calibration_ids_outside_the_vocabulary_are_refused_naming_the_id(bad):
    from ..conftest import build_tiny, tiny_llama_config

    model = build_tiny(tiny_llama_config())  # 128 token ids
    with pytest.raises(ValueError, match=rf"token id {bad} .*allowed: 0\.\.127"):
        quantize(model, QuantConfig(bits=4, group_size=32), calibration_ids=torch.tensor([[1, bad, 3]]))
    assert not any(isinstance(m, Int4WeightOnlyLinear) for m in model.modules())


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_calibration_ids_longer_than_the_learned_positions_are_refused_before_any_change(family):
    """GPT-2's and OPT's tiny models learn 256 positions: longer sequences would fail in the calibration forward."""
    from splice.quant.api import check_calibration_ids
    from tests.arch.tiny_models import build_family

    model = build_family(family)
    modules = list(model.modules())
    ids, config = torch.randint(3, 100, (2, 300)), QuantConfig(bits=4, group_size=32)
    message = r"calibration_ids of shape \(2, 300\) .*256 learned positions.*allowed: at most 256 tokens"
    with pytest.raises(ValueError, match=message):
        check_calibration_ids(ids, config, model)  # what plan-time checks call
    with pytest.raises(ValueError, match=message):
        quantize(model, config, calibration_ids=ids)
    assert list(model.modules()) == modules
    assert check_calibration_ids(ids[:, :256], config, model).shape == (2, 256)


@pytest.mark.parametrize("ids", [torch.tensor([[True, False, True]]), [[True, False, True]], [[1.0, 2.0, 3.0]]],
                         ids=["bool-tensor", "bool-lists", "float-lists"])
def test_calibration_ids_that_are_not_integers_are_refused(ids):
    model = _TinyLM()
    with pytest.raises(ValueError, match=r"integer tensor .*got dtype=torch\.(bool|float32)"):
        quantize(model, QuantConfig(bits=4, group_size=32), calibration_ids=ids)
    assert not any(isinstance(m, Int4WeightOnlyLinear) for m in model.modules())


def test_calibration_ids_need_a_model_with_a_token_embedding():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"calibration_ids need a model with a token embedding.*Sequential.*"
                                         r"allowed: calibration_ids=None"):
        quantize(model, QuantConfig(bits=4, group_size=32), calibration_ids=torch.zeros(1, 4, dtype=torch.long))
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
