"""The pipeline's promise when a step fails after every check passed (memory, a file read, another rank): the user's
model is put back as it was — same modules, same parameter objects, same values and dtypes, same outputs — and the
error names the step; where memory does not allow keeping the original weights, or a step overwrote values in place,
the error says the model was left changed."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import splice
from splice import pipeline, rollback
from splice.checkpoint import has_meta_tensors

from .conftest import build_tiny, tiny_llama_config

IDS = torch.tensor([[5, 17, 33, 9, 71, 4]])
STEP_NAMES = [step.__name__ for step in pipeline.STEPS]


class Injected(RuntimeError):
    pass


def failing_after(step):
    """``step``, then a failure: the step's changes are all made when the pipeline sees the error."""
    @functools.wraps(step)
    def apply(stage, plan):
        step(stage, plan)
        raise Injected(f"injected failure after {step.__name__}")
    return apply


def inject_failure(monkeypatch, name: str) -> None:
    steps = [failing_after(step) if step.__name__ == name else step for step in pipeline.STEPS]
    monkeypatch.setattr(pipeline, "STEPS", steps)


def state(model):
    """Everything that must come back: module tree, parameter objects, values, dtypes, devices, flags."""
    return {
        "repr": repr(model),
        "training": [m.training for m in model.modules()],
        "params": [(name, id(p), p.dtype, p.device, p.requires_grad) for name, p in model.named_parameters()],
        "values": {k: v.clone() for k, v in model.state_dict().items()},
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
    }


def assert_same_state(before, after):
    assert before["repr"] == after["repr"] and before["training"] == after["training"]
    assert before["params"] == after["params"] and before["hooks"] == after["hooks"]
    assert before["values"].keys() == after["values"].keys()
    for key, value in before["values"].items():
        other = after["values"][key]
        assert value.dtype == other.dtype and value.device == other.device, key
        assert value.is_meta or torch.equal(value, other), key


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


OPTIONS = {
    "bf16-inject": dict(dtype=torch.bfloat16, replace_with_kernel_inject=True),
    "int8-inject": dict(dtype=torch.int8, replace_with_kernel_inject=True),
    "bf16-plain": dict(dtype=torch.bfloat16),
}


@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("step", STEP_NAMES)
def test_a_failing_step_leaves_the_model_as_it_was(monkeypatch, step, options):
    model = build_tiny(tiny_llama_config())
    model.train()  # init_inference puts the engine's model in eval mode; a failed call must not
    reference = copy.deepcopy(model).eval()
    before = state(model)
    inject_failure(monkeypatch, step)
    with pytest.raises(Injected) as failure:
        splice.init_inference(model, **OPTIONS[options])
    assert failure.value.__notes__ == [f"splice: init_inference failed in its {step} step; the model was put back as "
                                       "it was before the call"]
    assert_same_state(before, state(model))
    assert torch.equal(logits(model.eval()), logits(reference))
    monkeypatch.undo()  # and it converts as if nothing had happened
    engine = splice.init_inference(model, **OPTIONS[options])
    expected = splice.init_inference(copy.deepcopy(reference), **OPTIONS[options])
    assert torch.equal(engine.generate(IDS, max_new_tokens=4, do_sample=False),
                       expected.generate(IDS, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("step", ["convert_dtype", "load_weights", "fuse"])
def test_a_meta_model_stays_on_meta(monkeypatch, tmp_path, step):
    config = tiny_llama_config()
    build_tiny(config).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = build_tiny(config)
    before = state(model)
    inject_failure(monkeypatch, step)
    with pytest.raises(Injected, match="injected") as failure:
        splice.init_inference(model, checkpoint=str(tmp_path), dtype=torch.bfloat16, replace_with_kernel_inject=True)
    assert "the model was put back as it was before the call" in str(failure.value.__notes__)
    assert has_meta_tensors(model) and all(p.is_meta for p in model.parameters())
    assert_same_state(before, state(model))


def test_values_overwritten_in_place_are_named(monkeypatch, tmp_path):
    """Loading a checkpoint into a model that has weights of the same dtype writes over them: those values cannot
    come back, and the error says which."""
    config = tiny_llama_config()
    build_tiny(config, seed=1).save_pretrained(tmp_path)
    model = build_tiny(config)
    inject_failure(monkeypatch, "load_weights")
    with pytest.raises(Injected) as failure:
        splice.init_inference(model, checkpoint=str(tmp_path))
    note = str(failure.value.__notes__)
    assert "put back as it was, except the values of model.embed_tokens.weight" in note and "load it again" in note
    assert "which a step overwrote in place: load it again" in note  # certain: every tensor counts its writes


@pytest.mark.parametrize("step", ["load_weights", "fuse"])
def test_a_checkpoint_loaded_into_another_dtype_leaves_the_originals_restorable(monkeypatch, tmp_path, step):
    """With dtype= another than the model's, the checkpoint is loaded into the converted tensors and the originals
    are kept: the model comes back exactly, and the note says so."""
    config = tiny_llama_config()
    build_tiny(config, seed=1).save_pretrained(tmp_path)
    model = build_tiny(config)
    before = state(model)
    inject_failure(monkeypatch, step)
    with pytest.raises(Injected) as failure:
        splice.init_inference(model, checkpoint=str(tmp_path), dtype=torch.bfloat16)
    assert failure.value.__notes__ == [f"splice: init_inference failed in its {step} step; the model was put back as "
                                       "it was before the call"]
    assert_same_state(before, state(model))


@pytest.mark.parametrize("options", [dict(replace_with_kernel_inject=True), dict(dtype=torch.int8)],
                         ids=["inject", "int8"])
def test_a_model_made_in_inference_mode_is_converted(options):
    """Weights made (or loaded) in inference mode keep no version counter: the pipeline runs on them all the same and
    gives the reference's greedy tokens (fp32 injected) or its int8 outputs within int8's bounds."""
    with torch.inference_mode():
        model = build_tiny(tiny_llama_config())
        reference = copy.deepcopy(model)
        engine = splice.init_inference(model, max_out_tokens=64, **options)
        expected = reference.generate(IDS, max_new_tokens=8, do_sample=False)
        if "dtype" not in options:
            assert torch.equal(engine.generate(IDS, max_new_tokens=8, do_sample=False), expected)
        else:
            got, want = engine(IDS).logits, reference(IDS).logits
            assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_a_model_made_in_inference_mode_is_put_back_and_the_note_says_what_it_cannot_tell(monkeypatch):
    """A failed step puts such a model back. Its weights converted to another dtype, their original values were never
    written: the note names none of them. Kept in their dtype (the rotary buffers bf16 leaves in float32, every
    tensor without dtype), nothing shows they were not written in place: the note names them as values a step may
    have overwritten. Either way the values are the ones before the call."""
    inject_failure(monkeypatch, "fuse")
    with torch.inference_mode():
        model = build_tiny(tiny_llama_config())
        before = state(model)
        with pytest.raises(Injected) as failure:
            splice.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True)
        note = str(failure.value.__notes__)
        assert "put back as it was" in note and ".weight" not in note  # only buffers bf16 leaves in float32 named
        assert_same_state(before, state(model))
        with pytest.raises(Injected) as failure:
            splice.init_inference(model, replace_with_kernel_inject=True)
        assert "except the values of model.embed_tokens.weight" in str(failure.value.__notes__)
        assert "or may have: tensors made in inference mode" in str(failure.value.__notes__)
        assert_same_state(before, state(model))


def test_without_memory_for_a_rollback_the_error_says_the_model_changed(monkeypatch):
    model = build_tiny(tiny_llama_config())
    monkeypatch.setattr(rollback, "free_bytes", lambda device: 1024)
    inject_failure(monkeypatch, "fuse")
    with pytest.raises(Injected) as failure:
        splice.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True)
    note = str(failure.value.__notes__)
    assert "failed in its fuse step; the model was left partly converted" in note
    assert "needs more than the 0.0 GiB free" in note and "load it again" in note


def sharding_fails_on_every_rank(rank: int, world: int) -> dict:
    """Under tensor parallelism: each rank's model comes back whole after a failure past the shard step."""
    model = build_tiny(tiny_llama_config())
    reference = copy.deepcopy(model)
    before = state(model)
    pipeline.STEPS = [failing_after(step) if step.__name__ == "shard" else step for step in pipeline.STEPS]
    try:
        splice.init_inference(model, tensor_parallel={"tp_size": world}, replace_with_kernel_inject=True)
    except Injected as failure:
        assert_same_state(before, state(model))
        return {"note": failure.__notes__[-1], "same_logits": torch.equal(logits(model), logits(reference))}
    return {"note": None}


@pytest.mark.slow
def test_a_failure_after_sharding_restores_every_rank():
    from tests.tp.launch import run_ranks

    for result in run_ranks(sharding_fails_on_every_rank, 2, timeout=120):
        assert result["note"] == "splice: init_inference failed in its shard step; the model was put back as it " \
                                 "was before the call"
        assert result["same_logits"]
