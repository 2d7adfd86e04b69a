"""Per-rank checkpoint loading and saving.

:func:`load_slices` fills a sharded model (possibly still on the meta device) with only its rank's slices, read with
safetensors' memory-mapped ``get_slice``, one tensor at a time (each file is opened per tensor, so the pages mapped
for one tensor are released before the next): no rank ever holds the whole model.

:func:`save_shards` writes ``save_mp_checkpoint_path``: one ``tp{N}-rank{r}.safetensors`` per rank plus
``splice_tp.json`` (tp size, the plan, the files). Passing that JSON as ``checkpoint`` reloads each rank's file
directly, with the stored plan: no tracing, no slicing.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..checkpoint import (ConvertedTensors, checkpoint_files, checkpoint_renamer, open_safetensors, tensor_groups,
                          tensor_index)
from ..distributed import ParallelContext
from .apply import ShardMap, Slice, cut
from .split import width
from .plan import TPPlan

MANIFEST = "splice_tp.json"
FORMAT = "splice-tp/1"


def unsharded_state(model: nn.Module, shards: ShardMap) -> dict[str, torch.Tensor]:
    """The sharded model's tensors under their unsharded names (what a checkpoint's names are renamed against)."""
    return {shards.get(name, Slice(name)).source: tensor for names, tensor in unique_tensors(model) for name in names}


def renamed_index(model: nn.Module, shards: ShardMap,
                  files: list[Path]) -> tuple[dict[str, tuple[Path, str]], ConvertedTensors]:
    """The unsharded model's tensor name -> (file, the name the checkpoint stores it under), each checkpoint name
    renamed as transformers renames it when loading (GPT-NeoX's ``embed_out`` -> ``lm_head``, a base-model prefix
    added or dropped): the renaming the plan's checkpoint check applied when it approved the checkpoint; and the
    tensors transformers' conversions make from the checkpoint tensors they take, which the index leaves out."""
    state = unsharded_state(model, shards)
    rename = checkpoint_renamer(model, state)
    where = tensor_index(files)
    index, converted = {}, {}
    for stored, file in where.items():
        name, targets = rename(stored)
        if targets:
            converted[stored] = targets
        else:
            index[name] = (file, stored)
    return index, ConvertedTensors(model, state, where, converted)


def load_slices(model: nn.Module, shards: ShardMap, path, chunk_mib: int = 16) -> None:
    """Copy each tensor's slice (per ``shards``; whole tensors otherwise) from the checkpoint into ``model``.

    The model must already have real storage (``splice.checkpoint.materialize`` a meta model first). Reads go in
    chunks of about ``chunk_mib`` straight into the target, each through a freshly opened (memory-mapped) file, so
    neither a temporary copy nor the file's mapped pages grow past one chunk. Raises naming the tensors the
    checkpoint lacks or whose slice has the wrong shape. Checkpoint names are renamed as transformers renames them
    (:func:`renamed_index`); a tensor that transformers' loading fuses from several checkpoint tensors (a mixture of
    experts' per-expert weights) is made whole by transformers' conversion ops, one at a time, and its slice copied.
    """
    index, converted = renamed_index(model, shards, checkpoint_files(path))
    fill(model, shards, index, path, chunk_mib, converted)


def fill(model: nn.Module, shards: ShardMap, index: dict[str, tuple[Path, str]], path, chunk_mib: int = 16,
         converted: ConvertedTensors | None = None) -> None:
    """:func:`load_slices` from ``index`` (model tensor name -> (file, stored name)) and ``converted``."""
    missing, wrong = [], []
    with torch.no_grad():
        for names, target in unique_tensors(model):
            specs = [shards.get(n, Slice(n)) for n in names]
            found = [s for s in specs if s.source in index]
            made = [s for s in specs if converted is not None and s.source in converted] if not found else []
            if made:
                part = slice_in_memory({made[0].source: converted.take(made[0].source)}, made[0])
                if part.shape != target.shape:
                    wrong.append(f"{names[0]} (converted slice {list(part.shape)} vs model {list(target.shape)})")
                else:
                    target.copy_(part)
                continue
            if not found:
                missing.append(names[0])
                continue
            file, stored = index[found[0].source]
            spec = replace(found[0], source=stored)
            shape = slice_shape(file, spec)
            if shape != tuple(target.shape):
                wrong.append(f"{names[0]} (checkpoint slice {list(shape)} vs model {list(target.shape)})")
                continue
            read_into(target, file, spec, chunk_mib * 2**20)
    if missing or wrong:
        raise ValueError(f"checkpoint {str(path)!r} does not fit the sharded model: missing {missing[:8]}, "
                         f"wrong shape {wrong[:8]}")


def slice_shape(file: Path, spec: Slice) -> tuple[int, ...]:
    """The shape ``spec`` gives, from the file header only."""
    with open_safetensors(file) as f:
        shape = list(f.get_slice(spec.source).get_shape())
    if spec.dim is not None:
        shape[spec.dim] = width(spec.ranges)
    return tuple(reversed(shape)) if spec.transpose else tuple(shape)


def read_into(target: torch.Tensor, file: Path, spec: Slice, chunk_bytes: int) -> None:
    """Copy ``spec``'s slice of the file's tensor into ``target``, a chunk of source rows at a time."""
    dest = target.t() if spec.transpose else target  # indexed like the source from here on
    if dest.dim() == 0:
        with open_safetensors(file) as f:
            dest.copy_(f.get_tensor(spec.source))
        return
    for src_index, dst_index in _pieces(dest.shape, spec, chunk_bytes // max(1, dest[0].numel() * dest.element_size())):
        with open_safetensors(file) as f:  # reopened: the mapping is released each time
            dest[dst_index].copy_(f.get_slice(spec.source)[src_index])


def _pieces(dest_shape, spec: Slice, rows_per_chunk: int):
    """(source index, destination index) pairs covering the slice, at most ``rows_per_chunk`` source rows each."""
    step = max(1, rows_per_chunk)
    if spec.dim == 0:
        offset = 0
        for a, b in spec.ranges:
            for c0 in range(a, b, step):
                c1 = min(c0 + step, b)
                yield (slice(c0, c1),), (slice(offset + c0 - a, offset + c1 - a),)
            offset += b - a
        return
    for r0 in range(0, dest_shape[0], step):
        rows = (slice(r0, min(r0 + step, dest_shape[0])),)
        if spec.dim is None:
            yield rows, rows
            continue
        lead, offset = rows + (slice(None),) * (spec.dim - 1), 0
        for a, b in spec.ranges:
            yield lead + (slice(a, b),), lead + (slice(offset, offset + b - a),)
            offset += b - a


def unique_tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each distinct parameter/persistent buffer once, with all the names it goes by (tied weights)."""
    state = model.state_dict(keep_vars=True)
    return [(names, state[names[0]]) for names in tensor_groups(state)]


def slice_in_memory(state: dict[str, torch.Tensor], spec: Slice) -> torch.Tensor:
    """One checkpoint slice (``spec``) from an in-memory state dict (used by tests)."""
    value = state[spec.source]
    value = value if spec.dim is None else cut(value, spec.dim, spec.ranges)
    return value.t() if spec.transpose else value


# --------------------------------------------------------------------------------------------------------------------
# save_mp_checkpoint_path


def save_shards(model: nn.Module, plan: TPPlan, ctx: ParallelContext, path: str | os.PathLike, grain: int) -> Path:
    """Write this rank's shard and (rank 0) the manifest; returns the manifest path. Collective: all ranks call.
    The manifest records ``grain`` (the tp_grain_size the shards were cut with): loading cuts the model the same way.

    The folder only ever holds a manifest whose files are complete: rank 0 removes an earlier save's manifest first,
    each file is written under a temporary name and renamed into place, and the manifest is written last, once every
    rank has its file. A save that fails midway leaves no manifest (nothing that loads as a checkpoint)."""
    folder = Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    tp = ctx.world_size
    files = [f"tp{tp}-rank{r}.safetensors" for r in range(tp)]
    tensors, ties = {}, []
    for names, tensor in unique_tensors(model):
        tensors[names[0]] = tensor.detach().contiguous()
        if len(names) > 1:
            ties.append(names)
    manifest = folder / MANIFEST
    if ctx.rank == 0:
        manifest.unlink(missing_ok=True)
    ctx.barrier()
    _write_atomically(folder / files[ctx.rank],
                      lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT, "rank": str(ctx.rank)}))
    ctx.barrier()
    if ctx.rank == 0:
        stated = replace(plan, vocab_grain=plan.vocab_grain or grain)  # the vocabulary cut, for loading
        data = {"format": FORMAT, "tp_size": tp, "tp_grain_size": grain, "files": files, "ties": ties,
                "plan": stated.to_dict()}
        _write_atomically(manifest, lambda tmp: tmp.write_text(json.dumps(data, indent=1)))
    ctx.barrier()
    return manifest


def _write_atomically(target: Path, write) -> None:
    """``write(tmp)`` a file beside ``target``, then rename it to ``target`` (no reader sees it half-written)."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def read_manifest(path: str | os.PathLike) -> dict | None:
    """The manifest if ``path`` is a splice tensor-parallel checkpoint (its JSON or its folder), else None."""
    path = Path(path).expanduser()
    path = path / MANIFEST if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    return {**data, "folder": str(path.parent)}


def manifest_plan(manifest: dict, tp: int) -> TPPlan:
    if manifest["tp_size"] != tp:
        raise ValueError(f"checkpoint {manifest['folder']!r} was saved for tensor_parallel.tp_size="
                         f"{manifest['tp_size']}, but tp_size={tp}; allowed: tp_size={manifest['tp_size']}, or load "
                         "the original unsharded checkpoint")
    plan = TPPlan.from_dict(manifest["plan"])
    # shards saved before manifests stated the vocabulary's unit were cut by single rows
    return plan if plan.vocab_grain is not None else replace(plan, vocab_grain=1)


def manifest_grain_size(manifest: dict, grain: int, grain_given: bool) -> int:
    """The tp_grain_size to cut the model with before loading ``manifest``'s shards: the one they were cut with (a
    manifest without it: ``grain``). A ``grain`` the config sets explicitly must be that one."""
    saved = manifest.get("tp_grain_size")
    if saved is None or saved == grain:
        return grain
    if grain_given:
        raise ValueError(f"checkpoint {manifest['folder']!r} holds shards cut with tensor_parallel.tp_grain_size="
                         f"{saved}, but tp_grain_size={grain}; allowed: tp_grain_size={saved} (or leave it out), or "
                         "load the original unsharded checkpoint")
    return saved


def load_shard(model: nn.Module, manifest: dict, rank: int) -> None:
    """Load this rank's saved shard into the (materialised) sharded model, by name, no slicing."""
    file = Path(manifest["folder"]) / manifest["files"][rank]
    fill(model, {}, {name: (file, name) for name in tensor_index([file])}, file)

