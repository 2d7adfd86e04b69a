"""quantize(model, QuantConfig) on whole models: which linears it replaces, what it keeps, how outputs change."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from splice.config import SpliceIgnoredOptionWarning
from splice.quant import QuantConfig, QuantizedLinear, plan, quantize, sqnr_db
from tests.conftest import build_tiny, tiny_llama_config
from tests.quant.dequantized import dequantized_copy


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("config, min_sqnr", [
    (QuantConfig(), 30), (QuantConfig(activations=True), 25), (QuantConfig(bits=4, group_size=32), 12),
])
def test_quantizes_every_block_linear_and_keeps_lm_head(tiny_llama, config, min_sqnr):
    reference = copy.deepcopy(tiny_llama)
    report = quantize(tiny_llama, config)
    linears = [n for n, m in reference.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(report.quantized + list(report.kept_float)) == sorted(linears)
    assert list(report.kept_float) == ["lm_head"]
    assert isinstance(tiny_llama.lm_head, nn.Linear) and isinstance(tiny_llama.model.embed_tokens, nn.Embedding)
    ids = torch.randint(0, 128, (2, 16))
    assert sqnr_db(_logits(reference, ids), _logits(tiny_llama, ids)) >= min_sqnr
    assert report.ratio <= (0.55 if config.bits == 8 else 0.4)
    assert config.kind in report.summary()


def test_quantize_lm_head_and_skip_qkv(tiny_llama):
    report = quantize(tiny_llama, QuantConfig(quantize_lm_head=True, quantize_qkv=False))
    assert isinstance(tiny_llama.lm_head, QuantizedLinear)
    assert isinstance(tiny_llama.model.layers[0].self_attn.q_proj, nn.Linear)
    assert sorted(report.kept_float) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2)
                                               for p in "qkv")


def test_tied_head_stays_tied():
    model = build_tiny(tiny_llama_config(tie_word_embeddings=True))
    quantize(model, QuantConfig(bits=4, group_size=32))
    assert model.lm_head.weight is model.model.embed_tokens.weight


class _SubclassedLinear(nn.Linear):
    pass


class _RowParallel(nn.Module):
    """The shape splice asks of tensor-parallel layers: a wrapper around a plain nn.Linear, collective outside it."""

    def __init__(self, linear: nn.Linear, all_reduce) -> None:
        super().__init__()
        self.linear, self.all_reduce = linear, all_reduce

    def forward(self, x):
        return self.all_reduce(self.linear(x))


def test_wrapped_parallel_linear_keeps_its_collective_and_subclasses_are_left_alone():
    calls = []

    def all_reduce(t):
        calls.append(t.shape)
        return t

    model = nn.Sequential(_RowParallel(nn.Linear(64, 32), all_reduce), _SubclassedLinear(32, 32))
    report = quantize(model, QuantConfig())
    assert report.quantized == ["0.linear"]
    assert "subclasses nn.Linear" in report.kept_float["1"]
    model(torch.randn(3, 64))
    assert calls == [torch.Size([3, 32])]


def test_rejects_other_config_types(tiny_llama):
    with pytest.raises(TypeError, match="QuantConfig"):
        quantize(tiny_llama, {"bits": 8})


def test_scheme_that_cannot_fit_a_layer_raises_before_changing_the_model(tiny_llama):
    with pytest.raises(ValueError, match="q_groups=3"):
        quantize(tiny_llama, QuantConfig(q_groups=3))  # 64 and 128 inputs
    assert not any(isinstance(m, QuantizedLinear) for m in tiny_llama.modules())


def test_quantized_int8_weights_are_not_views_so_they_can_move():
    """``quantize_int8``'s codes are a tensor of their own: a view would keep its float-shaped base alive after the
    weights are gathered on huge pages (it did: llama-1b int8 held 2.2 GB instead of 1.3 GB)."""
    from splice.quant import qmath

    q, _ = qmath.quantize_int8(torch.randn(8, 64))
    assert q._base is None and q.shape == (8, 64)


# ---------------------------------------------------------------- quant.qkv.enabled=False on other architectures
def _tiny_distilbert():
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                              max_position_embeddings=72)
    return DistilBertModel(config).eval()


def _tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    return T5ForConditionalGeneration(config).eval()


_DISTILBERT_QKV = {f"transformer.layer.{i}.attention.{p}_lin" for i in range(2) for p in "qkv"}
_T5_QKV = ({f"{stack}.block.{i}.layer.0.SelfAttention.{p}" for stack in ("encoder", "decoder") for i in range(2)
            for p in "qkv"}
           | {f"decoder.block.{i}.layer.1.EncDecAttention.{p}" for i in range(2) for p in "qkv"})


def _float_linears(model):
    return {name for name, module in model.named_modules() if type(module) is nn.Linear}


@pytest.mark.parametrize("build, qkv", [(_tiny_distilbert, _DISTILBERT_QKV), (_tiny_t5, _T5_QKV)],
                         ids=["distilbert", "t5"])
def test_qkv_left_in_float_keeps_exactly_the_attention_projections_of_other_architectures(build, qkv):
    import splice

    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the setting matches: nothing to warn about
        engine = splice.init_inference(model, dtype="int8", quant={"qkv": {"enabled": False}}, device="cpu")
    assert _float_linears(engine.module) == qkv
    report = engine.step_report("quantize").quant
    assert set(report.kept_float) == qkv and report.quantized


def test_qkv_setting_that_matches_no_projection_warns_before_the_model_changes():
    """Mamba has no attention: quant.qkv.enabled=False cannot apply, and says so at plan time."""
    import splice
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=1))
    before = _float_linears(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="quant.qkv.enabled=False")
        with pytest.raises(SpliceIgnoredOptionWarning, match="no query/key/value projection was recognised"):
            splice.init_inference(model, dtype="int8", quant={"qkv": {"enabled": False}}, device="cpu")
    assert _float_linears(model) == before and before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        splice.init_inference(model, dtype="int8", quant={"qkv": {"enabled": False}}, device="cpu")
    assert len([w for w in caught if "quant.qkv.enabled=False" in str(w.message)]) == 1


# ---------------------------------------------------------------- weights held outside linears
def _with_table(model: nn.Module, shape: tuple[int, int]) -> nn.Module:
    """``model`` with a matrix of ``shape`` held by its first MLP, outside any linear."""
    model.model.layers[0].mlp.register_parameter("table", nn.Parameter(torch.randn(shape)))
    return model


def test_a_matrix_outside_linears_stays_in_float_listed_in_the_report_and_warned_once(tiny_llama):
    import splice

    model = _with_table(tiny_llama, (64, 512))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = splice.init_inference(model, dtype="int8", device="cpu")
    warned = [str(w.message) for w in caught if issubclass(w.category, SpliceIgnoredOptionWarning)]
    assert len(warned) == 1
    assert f"32,768 parameters in 1 tensors ({32768 / (32768 + linear):.0%} of the model's" in warned[0]
    report = engine.step_report("quantize").quant
    assert "model.layers.0.mlp.table" in report.kept_float and "kept in float: none" not in report.summary()
    assert engine.module.get_parameter("model.layers.0.mlp.table").is_floating_point()
    assert isinstance(engine.module.model.layers[0].self_attn.q_proj, QuantizedLinear)


def test_a_small_matrix_outside_linears_is_listed_without_a_warning(tiny_llama):
    _with_table(tiny_llama, (4, 4))  # 16 of ~100k
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, report = plan(tiny_llama, QuantConfig())
    assert "model.layers.0.mlp.table" in report.kept_float and not report.notes


def test_quantize_reports_what_plan_warns(tiny_llama):
    model = _with_table(tiny_llama, (64, 512))
    with pytest.warns(SpliceIgnoredOptionWarning, match="stay in float"):
        _, planned = plan(model, QuantConfig())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = quantize(model, QuantConfig())
    assert report.notes == planned.notes and len(report.notes) == 1 and "note: " in report.summary()


# ---------------------------------------------------------------- group sizes
@pytest.mark.parametrize("weight", [{"num_bits": 8, "group_size": 1000}, {"num_bits": 4, "group_size": 256}])
def test_a_group_wider_than_a_layer_raises_naming_it_before_the_model_changes(tiny_llama, weight):
    import splice

    before = {name: tensor.clone() for name, tensor in tiny_llama.state_dict().items()}
    with pytest.raises(ValueError, match="allowed") as error:
        splice.init_inference(tiny_llama, quant={"enabled": True, "weight": weight}, device="cpu")
    assert (f"layer model.layers.0.self_attn.q_proj (in_features=64): group_size={weight['group_size']}"
            in str(error.value))
    assert not any(isinstance(m, QuantizedLinear) for m in tiny_llama.modules())
    assert all(torch.equal(tiny_llama.state_dict()[k], v) for k, v in before.items())


#: scheme -> (config, least SQNR in dB of the logits against the de-quantized weights', against the float model's)
FALCON_SCHEMES = {"int4": (QuantConfig(bits=4, group_size=32), 33, 15),
                  "int8-g48": (QuantConfig(group_size=48), 33, 30),
                  "w8a8": (QuantConfig(activations=True), 30, 30),
                  "int4-gptq": (QuantConfig(bits=4, group_size=32), 33, 15)}


@pytest.mark.parametrize("scheme", list(FALCON_SCHEMES))
@pytest.mark.parametrize("family", ["falcon", "falcon:new_architecture"])
def test_falcon_linears_are_quantized_like_nn_linear(family, scheme):
    """transformers' FalconLinear computes ``input @ weight.T + bias``: every block linear is replaced, and the
    output follows the de-quantized weights (and the float model within the scheme's error)."""
    from tests.arch.tiny_models import build_family, padded_batch

    model = build_family(family)
    float_model = copy.deepcopy(model)
    falcon_linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    config, min_sqnr_vs_dequantized, min_sqnr_vs_float = FALCON_SCHEMES[scheme]
    ids = torch.randint(3, 128, (2, 24)) if scheme == "int4-gptq" else None
    report = quantize(model, config, calibration_ids=ids)
    assert sorted(report.quantized) == sorted(falcon_linears) and list(report.kept_float) == ["lm_head"]
    assert all(isinstance(model.get_submodule(name), QuantizedLinear) for name in falcon_linears)
    batch, mask = padded_batch()
    with torch.no_grad():
        quantized = model(batch, attention_mask=mask).logits[mask.bool()]
        dequantized = dequantized_copy(model)(batch, attention_mask=mask).logits[mask.bool()]
        reference = float_model(batch, attention_mask=mask).logits[mask.bool()]
    assert sqnr_db(dequantized, quantized) >= min_sqnr_vs_dequantized
    assert sqnr_db(reference, quantized) >= min_sqnr_vs_float


def test_falcon_without_kernel_injection_quantizes_its_block_linears():
    import splice
    from tests.arch.tiny_models import build_family, padded_batch

    model = build_family("falcon")
    float_model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpliceIgnoredOptionWarning)
        engine = splice.init_inference(model, dtype=torch.int8, replace_with_kernel_inject=False)
    quantized = [name for name, m in engine.module.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 9  # 4 per block, and the int8 output head
    batch, mask = padded_batch()
    with torch.no_grad():
        out = engine(batch, attention_mask=mask).logits[mask.bool()].float()
        dequantized = dequantized_copy(engine.module)(batch, attention_mask=mask).logits[mask.bool()].float()
        reference = float_model(batch, attention_mask=mask).logits[mask.bool()]
    assert sqnr_db(dequantized, out) >= 32 and sqnr_db(reference, out) >= 28


@pytest.mark.parametrize("bias", [True, False])
def test_the_plain_linear_subclasses_compute_f_linear(bias):
    """The allow-list's classes are quantized as nn.Linear is, so each must compute exactly ``F.linear``."""
    import importlib

    from splice.quant.api import PLAIN_LINEAR_SUBCLASSES

    torch.manual_seed(0)
    for path, name in PLAIN_LINEAR_SUBCLASSES:
        layer = getattr(importlib.import_module(path), name)(48, 24, bias=bias)
        x = torch.randn(3, 5, 48)
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


class _ScaledLinear(nn.Linear):
    """A subclass with behaviour of its own: a replacement would drop the scaling."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_subclassed_linears_holding_a_material_share_are_warned():
    model = nn.Sequential(nn.Linear(64, 64), _ScaledLinear(64, 64), nn.Linear(64, 64))
    with pytest.warns(SpliceIgnoredOptionWarning, match=r"1 linear layer\(s\) \(33% .*_ScaledLinear.*the largest: 1\)"):
        plan(model, QuantConfig())
    report = quantize(model, QuantConfig())
    assert report.quantized == ["0", "2"] and "subclasses nn.Linear" in report.kept_float["1"]
    assert any("_ScaledLinear" in note for note in report.notes)


def test_quantizing_a_quantized_model_again_is_refused_naming_a_layer(tiny_llama):
    quantize(tiny_llama, QuantConfig(bits=4, group_size=32))
    modules = list(tiny_llama.modules())
    with pytest.raises(ValueError, match=r"already quantized: layer model\.layers\.0\.self_attn\.q_proj is "
                                         r"Int4WeightOnlyLinear .*allowed: the float model"):
        quantize(tiny_llama, QuantConfig())
    assert list(tiny_llama.modules()) == modules
