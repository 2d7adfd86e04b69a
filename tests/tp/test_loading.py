"""The chunked per-rank reader: every kind of slice, read a few rows at a time, equals slicing in memory."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from splice.tp.apply import Slice
from splice.tp.loading import read_into, read_manifest, slice_in_memory, slice_shape

SPECS = [Slice("w"), Slice("w", 0, ((1, 4), (6, 9))), Slice("w", 1, ((0, 3), (8, 12))),
         Slice("w", 1, ((2, 5),), transpose=True), Slice("w", 0, ((2, 7),), transpose=True),
         Slice("b", 0, ((1, 5),)), Slice("b"), Slice("s")]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("chunk_bytes", [1, 100, 10**9])
def test_chunked_reads_equal_in_memory_slices(tmp_path, spec, chunk_bytes):
    state = {"w": torch.randn(10, 12), "b": torch.randn(7), "s": torch.tensor(3.0)}
    save_file(state, str(tmp_path / "x.safetensors"))
    expected = slice_in_memory(state, spec)
    assert slice_shape(tmp_path / "x.safetensors", spec) == tuple(expected.shape)
    target = torch.empty(expected.shape)
    read_into(target, tmp_path / "x.safetensors", spec, chunk_bytes)
    assert torch.equal(target, expected)


def test_only_splice_manifests_are_manifests(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert read_manifest(tmp_path / "config.json") is None and read_manifest(tmp_path) is None
    (tmp_path / "splice_tp.json").write_text('{"format": "splice-tp/1", "tp_size": 2}')
    assert read_manifest(tmp_path)["tp_size"] == 2 and read_manifest(tmp_path)["folder"] == str(tmp_path)


def test_meta_gemma_shards_load_their_rows_and_get_their_embed_scale_back(tmp_path):
    """Gemma's embedding keeps a non-persistent ``embed_scale`` buffer (not in the checkpoint): a meta model sharded
    per rank and materialised recomputes it inside the vocab-parallel wrapper; with its rows loaded from the HF
    checkpoint, the ranks' parts sum to the unsharded, scaled embedding."""
    from splice.checkpoint import materialize
    from splice.distributed import ParallelContext
    from splice.tp.apply import apply_plan
    from splice.tp.autotp import autotp_plan
    from splice.tp.loading import load_slices
    from tests.arch.tiny_models import build

    original = build("gemma")
    original.save_pretrained(tmp_path)
    ids = torch.tensor([[0, 3, 42, 63, 64, 100, 127]])
    with torch.no_grad():
        expected = original.get_input_embeddings()(ids)
    total = torch.zeros_like(expected)
    for rank in range(2):
        model = build("gemma", meta=True)
        shards = apply_plan(model, autotp_plan(model), ParallelContext(rank, 2))
        load_slices(materialize(model, torch.device("cpu")), shards, tmp_path)
        embedding = model.get_input_embeddings()
        assert float(embedding.embed_scale) == 8.0 and model.lm_head.linear.weight is embedding.weight
        embedding.ctx = ParallelContext()  # this rank's part only: the group would sum the parts
        with torch.no_grad():
            total += embedding(ids)
    assert torch.allclose(total, expected, atol=1e-6)


def test_a_failed_save_leaves_no_manifest_and_no_half_written_file(tmp_path, monkeypatch):
    """save_shards writes each file under a temporary name and the manifest last, after removing an earlier save's:
    a save that fails while writing its shard leaves nothing that loads as a checkpoint, and no temporary files."""
    from splice.distributed import SINGLE_PROCESS
    from splice.tp import loading
    from splice.tp.autotp import autotp_plan
    from tests.arch.tiny_models import build
    model = build("llama")
    plan = autotp_plan(model)
    manifest = loading.save_shards(model, plan, SINGLE_PROCESS, tmp_path, 64)
    assert read_manifest(manifest) is not None and (tmp_path / "tp1-rank0.safetensors").is_file()
    before = (tmp_path / "tp1-rank0.safetensors").read_bytes()

    def fails_midway(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(loading, "save_file", fails_midway)
    with pytest.raises(OSError, match="disk full"):
        loading.save_shards(model, plan, SINGLE_PROCESS, tmp_path, 64)
    assert not manifest.exists() and read_manifest(tmp_path) is None
    assert (tmp_path / "tp1-rank0.safetensors").read_bytes() == before  # the old file, whole, never a partial one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp1-rank0.safetensors"]


def test_a_checkpoint_is_cut_with_the_grain_its_shards_were_saved_with(tmp_path):
    """The manifest records tp_grain_size; loading takes it unless the config names another one, which raises
    before anything changes (the shards' shapes would not fit the model cut at that grain)."""
    from splice.config import resolve_config
    from splice.distributed import SINGLE_PROCESS
    from splice.plan import resolve_grain_size
    from splice.tp import loading
    from splice.tp.autotp import autotp_plan
    from tests.arch.tiny_models import build
    model = build("llama")
    manifest = read_manifest(loading.save_shards(model, autotp_plan(model), SINGLE_PROCESS, tmp_path, 32))
    assert manifest["tp_grain_size"] == 32
    assert resolve_grain_size(resolve_config({"checkpoint": str(tmp_path)}), manifest) == 32
    assert resolve_grain_size(resolve_config({"tensor_parallel": {"tp_grain_size": 32}}), manifest) == 32
    with pytest.raises(ValueError, match=r"cut with tensor_parallel.tp_grain_size=32, but tp_grain_size=64"):
        resolve_grain_size(resolve_config({"tensor_parallel": {"tp_grain_size": 64}}), manifest)
    assert resolve_grain_size(resolve_config({"tensor_parallel": {"tp_grain_size": 16}}), None) == 16


def _renamed_checkpoint(tmp_path, family: str):
    """``family``'s tiny model saved as the hub holds it: GPT-NeoX by save_pretrained (its lm_head stored as
    ``embed_out``), GPT-2 as its base model alone (no ``transformer.`` prefix)."""
    from tests.arch.tiny_models import build

    model = build(family)
    (model.transformer if family == "gpt2" else model).save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("family", ["gpt_neox", "gpt2"])
def test_slices_load_from_names_transformers_renames(tmp_path, family):
    """A checkpoint the plan's check approves through transformers' renaming loads each rank's slices by the same
    renaming: every sharded tensor equals the slice of the original its shard map names."""
    from safetensors import safe_open

    from splice.checkpoint import materialize
    from splice.distributed import ParallelContext
    from splice.tp.apply import apply_plan
    from splice.tp.autotp import autotp_plan
    from splice.tp.loading import load_slices
    from tests.arch.tiny_models import build

    original = _renamed_checkpoint(tmp_path, family)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert "embed_out.weight" in stored if family == "gpt_neox" else "wte.weight" in stored
    state = original.state_dict()
    for rank in range(2):
        model = build(family, meta=True)
        shards = apply_plan(model, autotp_plan(model), ParallelContext(rank, 2))
        load_slices(materialize(model, torch.device("cpu")), shards, tmp_path)
        for name, tensor in model.state_dict().items():
            expected = slice_in_memory(state, shards[name]) if name in shards else state[name]
            assert torch.equal(tensor, expected), (rank, name)


def test_manifests_state_the_vocabulary_grain_and_older_ones_were_cut_by_rows(tmp_path):
    """Saved shards state the unit their vocabulary was cut by (the tp_grain_size); a manifest from before they
    did was cut by single rows, and its plan says so."""
    from splice.distributed import SINGLE_PROCESS
    from splice.tp import loading
    from splice.tp.autotp import autotp_plan
    from tests.arch.tiny_models import build

    model = build("llama")
    manifest = read_manifest(loading.save_shards(model, autotp_plan(model), SINGLE_PROCESS, tmp_path, 32))
    assert manifest["plan"]["vocab_grain"] == 32 and loading.manifest_plan(manifest, 1).vocab_grain == 32
    older = {**manifest, "plan": {k: v for k, v in manifest["plan"].items() if k != "vocab_grain"}}
    assert loading.manifest_plan(older, 1).vocab_grain == 1
