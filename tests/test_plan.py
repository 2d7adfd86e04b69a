"""plan.resolve's decisions about where the weights live: keep_module_on_host leaves them on the CPU, which a float
model runs on as well as on the device, while quantized weights are packed on the device for its kernels, so the two
together on an accelerator are refused before anything changes. Off CUDA the plan for device 'cuda' is resolved
without running it; the CUDA-marked tests run the whole call where a GPU is."""
from __future__ import annotations

import pytest
import torch

import splice
from splice.config import resolve_config
from splice.distributed import SINGLE_PROCESS
from splice.plan import resolve

from .conftest import build_tiny, tiny_llama_config

INT4 = {"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 32}}}
QUANTIZATIONS = {
    "int8": ({"dtype": torch.int8}, "int8_weight_only"),
    "int4": (INT4, "int4_weight_only"),
    "w8a8": ({"quant": {"enabled": True, "activation": {"enabled": True}}}, "int8_dynamic"),
}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def plan_on(device: str, model=None, **config):
    """The plan for ``config`` on ``device``, resolved without running it (``device`` need not exist here)."""
    model = model if model is not None else build_tiny(tiny_llama_config())
    return resolve(resolve_config(config), model, SINGLE_PROCESS, torch.device(device))


def refused(device: str, kind: str) -> str:
    return (rf"keep_module_on_host=True with quantization \({kind}\) on device '{device}': quantizing packs the "
            rf"weights on cuda for its kernels, then keep_module_on_host would move them to the CPU.*allowed: "
            rf"keep_module_on_host=False \(quantized for and placed on '{device}'\), device='cpu' \(quantized for the "
            r"CPU and kept there\), or keep_module_on_host=True without quantization")


def snapshot(model) -> dict:
    return {name: (type(module), [(p.device, p.dtype, p.clone()) for p in module.parameters(recurse=False)])
            for name, module in model.named_modules()}


def assert_unchanged(model, before: dict) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (kind, params) in before.items():
        assert after[name][0] is kind, name
        for (device, dtype, value), (device2, dtype2, value2) in zip(params, after[name][1]):
            assert (device, dtype) == (device2, dtype2) and torch.equal(value, value2), name


@pytest.mark.parametrize("name", QUANTIZATIONS)
def test_keep_module_on_host_with_quantization_for_cuda_is_refused_at_plan_time(name):
    config, kind = QUANTIZATIONS[name]
    model = build_tiny(tiny_llama_config())
    before = snapshot(model)
    with pytest.raises(ValueError, match=refused("cuda", kind)):
        plan_on("cuda", model, keep_module_on_host=True, **config)
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", QUANTIZATIONS)
def test_keep_module_on_host_with_quantization_on_the_cpu_packs_where_the_weights_stay(name):
    config, kind = QUANTIZATIONS[name]
    plan = plan_on("cpu", keep_module_on_host=True, **config)
    assert plan.quant.kind == kind and plan.device == plan.home == torch.device("cpu") and plan.keep_on_host


@pytest.mark.parametrize("name", QUANTIZATIONS)
def test_quantization_for_cuda_without_keep_module_on_host_is_placed_on_cuda(name):
    config, kind = QUANTIZATIONS[name]
    plan = plan_on("cuda", **config)
    assert plan.quant.kind == kind and plan.device == plan.home == torch.device("cuda") and not plan.keep_on_host


def test_keep_module_on_host_without_quantization_for_cuda_keeps_the_float_weights_on_the_cpu():
    plan = plan_on("cuda", keep_module_on_host=True, dtype=torch.bfloat16)
    assert plan.quant is None and plan.device == torch.device("cuda") and plan.home == torch.device("cpu")


@needs_cuda
@pytest.mark.parametrize("name", QUANTIZATIONS)
def test_keep_module_on_host_with_quantization_on_cuda_raises_before_the_model_changes(name):
    config, kind = QUANTIZATIONS[name]
    model = build_tiny(tiny_llama_config())
    before = snapshot(model)
    device = f"cuda:{torch.cuda.current_device()}"
    with pytest.raises(ValueError, match=refused(device, kind)):
        splice.init_inference(model, keep_module_on_host=True, **config)
    assert_unchanged(model, before)


@needs_cuda
def test_keep_module_on_host_on_cuda_leaves_a_float_model_that_runs_on_the_cpu_and_once_moved_on_cuda():
    reference = build_tiny(tiny_llama_config())
    ids = torch.randint(0, reference.config.vocab_size, (2, 7))
    with torch.no_grad():
        expected = reference(ids).logits
    engine = splice.init_inference(build_tiny(tiny_llama_config()), keep_module_on_host=True)
    assert {p.device.type for p in engine.module.parameters()} == {"cpu"}
    assert engine.step_report("place").device == "cpu" and engine.step_report("place").keep_module_on_host
    torch.testing.assert_close(engine(ids).logits, expected)
    engine.to("cuda")
    torch.testing.assert_close(engine(ids.cuda()).logits.cpu(), expected, rtol=1e-4, atol=1e-4)


# ---- quantized shards: a row-parallel linear is quantized on each rank's share of its inputs ----------------------
def plan_at_two_ranks(**config):
    from splice.distributed import ParallelContext

    model = build_tiny(tiny_llama_config())  # hidden 64, intermediate 128: o_proj takes 32 inputs a rank at tp 2
    return resolve(resolve_config({"tensor_parallel": {"tp_size": 2}, **config}), model,
                   ParallelContext(rank=0, world_size=2), torch.device("cpu"))


@pytest.mark.parametrize("weight, problem", [
    ({"num_bits": 4, "group_size": 64}, "group_size=64 is larger than the layer's in_features=32"),
    ({"num_bits": 4, "q_groups": 2}, "q_groups=2 gives int4 groups of 16 for in_features=32"),
])
def test_a_scheme_that_fits_the_whole_layer_but_not_a_ranks_shard_raises_at_plan_time(weight, problem):
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.self_attn\.o_proj is split by its inputs over "
                                         r"tensor_parallel\.tp_size=2 ranks \(row-parallel\), and rank 0 quantizes "
                                         rf"32 of its 64: {problem}"):
        plan_at_two_ranks(quant={"enabled": True, "weight": weight})


def test_kernel_injection_at_two_ranks_refuses_a_norm_over_every_head_before_any_change():
    """OLMo 2's q_norm spans every head: no rank can run it on its share, so the plan is refused and the model left
    untouched."""
    from splice.distributed import ParallelContext

    from .arch.tiny_models import build_family

    model = build_family("olmo2")
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"model_type='olmo2' normalises each whole q and k projection.*tensor "
                                         r"parallelism cannot split its attention; allowed: tp_size=1"):
        resolve(resolve_config({"tensor_parallel": {"tp_size": 2}, "replace_with_kernel_inject": True}), model,
                ParallelContext(rank=0, world_size=2), torch.device("cpu"))
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_a_scheme_that_fits_every_shard_resolves_at_two_ranks():
    plan = plan_at_two_ranks(quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 32}})
    assert plan.quant.kind == "int4_weight_only" and plan.tp_plan is not None
