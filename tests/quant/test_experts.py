"""splice.quant.experts: a mixture of experts' 3-D weights quantized as one linear per expert and matrix, against the
unmodified Hugging Face model (fp32, same weights) and against the de-quantized weights; transposed and biased experts;
what stays in float; the quantized experts saved and loaded again."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import splice
from splice.config import SpliceIgnoredOptionWarning
from splice.quant import QuantConfig, QuantizedLinear, load_quantized, quantize, save_quantized, sqnr_db
from splice.layers.experts import experts_of_linears
from splice.quant.experts import reason_experts_stay_float
from tests.arch.tiny_models import MOE_FAMILIES, build
from tests.quant.dequantized import dequantized_copy

#: the mixtures of experts tensor parallelism is tested on, and GPT-OSS (biased experts, gate and up interleaved)
FAMILIES = (*MOE_FAMILIES, "gpt_oss")
PROMPT = torch.tensor([[5, 17, 33, 9, 90, 41, 7, 64, 3, 100, 12, 55]])


def _logits(model: nn.Module, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


#: scheme -> (config, least SQNR in dB of the logits against the de-quantized weights', against the float model's)
SCHEMES = {"int8": (QuantConfig(), 40, 35), "int8-g32": (QuantConfig(group_size=32), 40, 35),
           "int4-g32": (QuantConfig(bits=4, group_size=32), 38, 15)}


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_experts_matrix_is_quantized_and_computes_as_its_dequantized_weight(family, scheme):
    config, against_dequantized, against_float = SCHEMES[scheme]
    reference = build(family)
    model = build(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpliceIgnoredOptionWarning)  # nothing of note stays in float
        report = quantize(model, config)
    experts = model.model.layers[0].mlp.experts
    assert [type(layer) for layer in experts.gate_up_proj] == [type(experts.down_proj[0])] * 4
    assert isinstance(experts.down_proj[3], QuantizedLinear) and not hasattr(experts, "gate_up_proj_bias")
    assert type(experts) is type(reference.model.layers[0].mlp.experts)  # the model's own class, hooks and flags
    assert {f"model.layers.{i}.mlp.experts.{m}.{e}" for i in range(2) for m in ("gate_up_proj", "down_proj")
            for e in range(4)} <= set(report.quantized)
    router = "router" if family == "gpt_oss" else "gate"
    routers = {f"model.layers.{i}.mlp.{router}.weight" for i in range(2)}
    assert report.kept_float.keys() == {*routers, "lm_head"}  # the head by the scheme's default
    assert all("router" in report.kept_float[name] for name in routers)
    assert model.get_parameter(f"model.layers.0.mlp.{router}.weight").dtype == torch.float32
    got = _logits(model)
    assert sqnr_db(_logits(dequantized_copy(model)), got) > against_dequantized
    assert sqnr_db(_logits(reference), got) > against_float


@pytest.mark.parametrize("family", [*FAMILIES, "deepseek_v3"])  # DeepSeek-V3: a dense first layer, shared experts
def test_int8_experts_pick_the_reference_tokens(family):
    """On the reference's greedy continuation (teacher-forced, so one near-tie does not change every later token; the
    end-of-sequence id held back so that it runs 32 tokens): the int8 engine's next-token picks agree with the fp32
    model's at 90 % of the positions or more."""
    reference = build(family)
    sequence = reference.generate(PROMPT, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    engine = splice.init_inference(build(family), dtype="int8")
    new = slice(PROMPT.shape[1] - 1, -1)
    picks = [_logits(model, sequence)[0, new].argmax(-1) for model in (reference, engine)]
    assert (picks[1] == picks[0]).float().mean() >= 0.9, picks


class _Experts(nn.Module):
    """transformers' experts interface as its decorator sets it: flags, 3-D weights, biases where it has them."""

    def __init__(self, is_transposed=False, has_bias=False, post_norm=False, experts=3, hidden=32, features=16):
        super().__init__()
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, has_bias, is_transposed, True
        self.has_post_expert_norm = post_norm
        self.act_fn = nn.SiLU()
        up, down = (experts, 2 * features, hidden), (experts, hidden, features)
        self.gate_up_proj = nn.Parameter(torch.randn(*up).transpose(1, 2) if is_transposed else torch.randn(*up))
        self.down_proj = nn.Parameter(torch.randn(*down).transpose(1, 2) if is_transposed else torch.randn(*down))
        if has_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.randn(experts, 2 * features))
            self.down_proj_bias = nn.Parameter(torch.randn(experts, hidden))

    def _apply_gate(self, projected):
        gate, up = projected.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """The eager reference: each token through each of its experts, weighted, summed."""
        out = torch.zeros_like(hidden_states)
        for token in range(hidden_states.shape[0]):
            for slot, expert in enumerate(top_k_index[token].tolist()):
                up = self.gate_up_proj[expert].t() if self.is_transposed else self.gate_up_proj[expert]
                down = self.down_proj[expert].t() if self.is_transposed else self.down_proj[expert]
                projected = hidden_states[token] @ up.t() + (self.gate_up_proj_bias[expert] if self.has_bias else 0)
                routed = self._apply_gate(projected) @ down.t() + (self.down_proj_bias[expert] if self.has_bias else 0)
                out[token] += routed * top_k_weights[token, slot]
        return out


class _Exact(nn.Module):
    """A float linear as the quantized layers are built (weight [out, in], bias), to check the routing alone."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight.detach().clone(), None if bias is None else bias.detach().clone()

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


#: routings of tokens to two experts each: no expert in every row; expert 0 in every row; one token
ROUTINGS = [[[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]], [[0, 2], [1, 0], [0, 1], [0, 1], [2, 0]], [[2, 1]]]


@pytest.mark.parametrize("routing", ROUTINGS, ids=["some", "every", "one"])
@pytest.mark.parametrize("flags", [dict(), dict(is_transposed=True), dict(has_bias=True),
                                   dict(is_transposed=True, has_bias=True)])
def test_transposed_and_biased_experts_route_as_the_eager_forward(flags, routing):
    torch.manual_seed(0)
    experts = _Experts(**flags)
    index = torch.tensor(routing)
    hidden = torch.randn(len(index), 32)
    weights = torch.rand(len(index), 2)
    hooked = []
    experts.register_forward_hook(lambda module, args, out: hooked.append(out.shape))
    copied = experts_of_linears(experts, _Exact)
    with torch.no_grad():
        expected, got = experts(hidden, index, weights), copied(hidden, index, weights)
    assert torch.allclose(got, expected, atol=1e-4)
    assert hooked == [(len(index), 32)] * 2  # the copy keeps the module's hooks (a tensor-parallel all-reduce, say)
    assert isinstance(experts.gate_up_proj, nn.Parameter) and experts.forward.__func__ is _Experts.forward  # unchanged


def test_experts_with_a_norm_after_each_expert_stay_in_float():
    assert "norm after each expert" in reason_experts_stay_float(_Experts(post_norm=True))
    assert reason_experts_stay_float(_Experts()) is None


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_quantized_experts_are_saved_and_load_into_a_meta_skeleton(family, tmp_path):
    engine = splice.init_inference(build(family), dtype="int8", quant={"weight": {"q_groups": 2}})
    save_quantized(engine, tmp_path)
    loaded = load_quantized(build(family, meta=True), tmp_path)
    assert isinstance(loaded.model.layers[1].mlp.experts.down_proj[2], QuantizedLinear)
    with torch.no_grad():
        assert torch.equal(engine(PROMPT).logits, loaded(PROMPT).logits)


def test_a_folder_of_quantized_experts_refuses_a_skeleton_with_other_experts(tmp_path):
    save_quantized(splice.init_inference(build("mixtral"), dtype="int8"), tmp_path)
    skeleton = build("mixtral", meta=True, intermediate_size=64)
    with pytest.raises(ValueError, match=r"layer model.layers.0.mlp.experts.gate_up_proj.0 was saved as .*'in_features"
                                         r"': 64, 'out_features': 256.* but the model's experts make"):
        load_quantized(skeleton, tmp_path)
    assert isinstance(skeleton.model.layers[0].mlp.experts.gate_up_proj, nn.Parameter)  # unchanged
