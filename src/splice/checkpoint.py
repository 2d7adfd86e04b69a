"""Safetensors checkpoint reading and meta-device materialisation.

Only safetensors are read (never pickles). Shapes come from the file headers, so a checkpoint can be checked against
a model (even one on the meta device) before anything is loaded. Loading streams one tensor at a time, so memory stays
near one copy of the model.
"""
from __future__ import annotations

import copy
import functools
import json
import logging
import os
import re
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Callable, Container, Iterable, Iterator, Mapping, Union

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

log = logging.getLogger("splice")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ACCEPTED = (f"a Hugging Face checkpoint folder (with {SINGLE_FILE} or {INDEX_FILE}), "
            f"a .safetensors file, a .safetensors.index.json file, or a list of .safetensors files")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

Shape = tuple[int, ...]
CheckpointSource = Union[str, os.PathLike, "list[str | os.PathLike]"]


# --------------------------------------------------------------------------------------------------------------------
# Reading headers


@contextmanager
def open_safetensors(file: Path, device: str = "cpu") -> Iterator:
    """``safe_open`` whose failures (a corrupt or truncated file) raise ``ValueError`` naming the file."""
    try:
        with safe_open(file, framework="pt", device=device) as handle:
            yield handle
    except (SafetensorError, OSError) as error:
        raise ValueError(f"checkpoint file {str(file)!r} is not a readable safetensors file ({error}); allowed: a "
                         "complete safetensors file (copy or save it again)") from None


def checkpoint_files(path: CheckpointSource) -> list[Path]:
    """The safetensors files of a checkpoint, in load order.

    ``path``: a Hugging Face folder (``model.safetensors`` or ``model.safetensors.index.json``), one ``.safetensors``
    file, an index JSON, or a list of ``.safetensors`` files (see :func:`load_policy_files` for DeepSpeed's
    load-policy form).
    """
    if isinstance(path, (list, tuple)):
        if not path:
            raise ValueError(f"the checkpoint file list is empty; expected {ACCEPTED}")
        return [file for item in path for file in _single_source_files(Path(item).expanduser(), list_item=True)]
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a path or a list of paths, got {type(path).__name__}: {path!r}")
    return _single_source_files(Path(path).expanduser())


def load_policy_files(policy: dict, base_dir: str | os.PathLike = "") -> list[Path]:
    """The files of a DeepSpeed-style load policy ``{"checkpoints": [...], ...}``, relative to ``base_dir``.

    Only safetensors files are accepted (DeepSpeed's policies usually list pickles, which are refused), and only
    DeepSpeed's list of whole-model files: its pre-sharded and Megatron formats raise naming what to give instead."""
    _refuse_other_formats(policy)
    checkpoints = policy.get("checkpoints") if isinstance(policy, dict) else None
    if isinstance(checkpoints, (str, os.PathLike)):
        checkpoints = [checkpoints]
    if not checkpoints or not isinstance(checkpoints, (list, tuple)):
        raise ValueError(f"checkpoint policy {policy!r} has no 'checkpoints' list of files; expected "
                         f"{{'checkpoints': ['model-00001.safetensors', ...]}} or {ACCEPTED}")
    base = Path(base_dir).expanduser()
    return checkpoint_files([base / name for name in checkpoints])


def _refuse_other_formats(policy: object) -> None:
    """DeepSpeed's pre-sharded ``ds_model`` JSON (``"checkpoints": {"non_tp": [...], "tp": [...]}``, what its
    save_mp_checkpoint_path writes) and ``"type": "Megatron"`` (per-rank ``mp_rank_*`` pickles) are not read."""
    if not isinstance(policy, dict):
        return
    checkpoints = policy.get("checkpoints")
    if isinstance(checkpoints, dict) and ("tp" in checkpoints or "non_tp" in checkpoints):
        raise ValueError(f"checkpoint policy with 'checkpoints' {{'non_tp': [...], 'tp': [...]}} (type "
                         f"{policy.get('type')!r}) is DeepSpeed's pre-sharded format, per-rank .pt pickles that "
                         "splice does not read; allowed: the original unsharded safetensors checkpoint (splice "
                         "slices each rank's part from it), or a folder of splice's own shards, written by "
                         f"save_mp_checkpoint_path (its splice_tp.json); or {ACCEPTED}")
    if str(policy.get("type", "")).lower() == "megatron":
        raise ValueError(f"checkpoint policy of type {policy['type']!r} lists Megatron-LM checkpoints (per-rank "
                         "mp_rank_* pickles), which splice does not read; allowed: the model converted to a Hugging "
                         "Face safetensors checkpoint (e.g. with transformers' Megatron conversion scripts): "
                         f"{ACCEPTED}")


def _single_source_files(path: Path, list_item: bool = False) -> list[Path]:
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist; expected {ACCEPTED}")
    if path.suffix in PICKLE_SUFFIXES:
        _refuse_pickle(path)
    if list_item:
        if path.is_file() and path.suffix == ".safetensors":
            return [path]
        raise ValueError(f"checkpoint file list entry {str(path)!r} is not a .safetensors file")
    if path.is_dir():
        if (path / SINGLE_FILE).is_file():
            return [path / SINGLE_FILE]
        if (path / INDEX_FILE).is_file():
            return _files_from_json(path / INDEX_FILE)
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            _refuse_pickle(path / pickles[0])
        raise ValueError(f"checkpoint folder {str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}; "
                         f"expected {ACCEPTED}")
    if path.suffix == ".safetensors":
        return [path]
    if path.suffix == ".json":
        return _files_from_json(path)
    raise ValueError(f"checkpoint {str(path)!r} is not a safetensors checkpoint; expected {ACCEPTED}")


def checkpoint_shapes(path: CheckpointSource) -> dict[str, tuple[Shape, torch.dtype]]:
    """Name -> (shape, dtype) of every tensor in the checkpoint, from the file headers only (no tensor data read)."""
    shapes: dict[str, tuple[Shape, torch.dtype]] = {}
    for file in checkpoint_files(path):
        with open_safetensors(file) as f:
            for name in f.keys():
                if name in shapes:
                    raise ValueError(f"checkpoint {str(path)!r}: tensor {name!r} appears in more than one file")
                tensor_slice = f.get_slice(name)
                shapes[name] = (tuple(tensor_slice.get_shape()), _torch_dtype(tensor_slice.get_dtype()))
    return shapes


def _files_from_json(path: Path) -> list[Path]:
    """Shards of a safetensors index (``weight_map``) or files of a load-policy JSON (``checkpoints``)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path)!r} is not readable JSON: {e}") from None
    if isinstance(data, dict) and "checkpoints" in data and "weight_map" not in data:
        return load_policy_files(data, data.get("base_dir") or path.parent)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{str(path)!r} is neither a safetensors index (a 'weight_map' object) nor a load policy "
                         f"(a 'checkpoints' list)")
    return checkpoint_files([path.parent / name for name in dict.fromkeys(weight_map.values())])


def _refuse_pickle(path: Path) -> None:
    raise ValueError(f"{str(path)!r} is a pickle checkpoint ({path.suffix}); splice reads only safetensors, because "
                     f"unpickling can run arbitrary code. Convert it once with transformers' "
                     f"save_pretrained(..., safe_serialization=True); expected {ACCEPTED}")


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point or dtype.is_complex else "integer"


def _torch_dtype(name: str) -> torch.dtype:
    if name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported safetensors dtype {name!r}; allowed: {', '.join(sorted(_SAFETENSORS_DTYPES))}")
    return _SAFETENSORS_DTYPES[name]


# --------------------------------------------------------------------------------------------------------------------
# Checking a checkpoint against a model


@dataclass
class CheckpointMatch:
    """How a checkpoint's tensors line up with a model's state dict."""

    names: dict[str, str] = field(default_factory=dict)  # checkpoint name -> model name, for what gets loaded
    missing: list[str] = field(default_factory=list)  # in the model, in no form in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the model
    wrong_shape: list[tuple[str, Shape, Shape]] = field(default_factory=list)  # (name, checkpoint shape, model shape)
    wrong_dtype: list[tuple[str, torch.dtype, torch.dtype]] = field(default_factory=list)  # a float tensor stored
    # as integers or the reverse: (name, checkpoint dtype, model dtype); float-to-float is a conversion, not an error
    conversions: list[Conversion] = field(default_factory=list)  # model tensors transformers' ops fuse or split
    failed_conversions: list[str] = field(default_factory=list)  # "target: why", where those ops refuse the tensors
    ignored: list[str] = field(default_factory=list)  # in the checkpoint, deliberately not loaded

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape or self.wrong_dtype or self.failed_conversions)

    def describe(self, limit: int = 5) -> str:
        parts = []
        for label, items in (("missing from the checkpoint", self.missing),
                             ("unexpected in the checkpoint", self.unexpected),
                             ("that transformers' weight conversion (fusing or splitting) cannot make",
                              self.failed_conversions)):
            if items:
                parts.append(f"{len(items)} {label}: {_first(items, limit)}")
        if self.wrong_shape:
            shown = [f"{name} (checkpoint {list(f)} vs model {list(m)})" for name, f, m in self.wrong_shape]
            parts.append(f"{len(shown)} with the wrong shape: {_first(shown, limit)}")
        if self.wrong_dtype:
            shown = [f"{name} (checkpoint {str(f).removeprefix('torch.')} vs model {str(m).removeprefix('torch.')})"
                     for name, f, m in self.wrong_dtype]
            parts.append(f"{len(shown)} with a dtype of the wrong kind (allowed: a float tensor in any float dtype, "
                         f"an integer one in any integer dtype): {_first(shown, limit)}")
        return "; ".join(parts)


def match_checkpoint(model: nn.Module, shapes: dict[str, tuple[Shape, torch.dtype]]) -> CheckpointMatch:
    """Compare checkpoint headers with the model's persistent state (works on meta).

    Tied tensors need only one of their names. Checkpoint names go through the same renamings transformers applies
    when loading (legacy names such as GPT-NeoX ``embed_out`` -> ``lm_head``, an added or dropped base-model prefix).
    Model tensors that transformers' conversion ops make from several checkpoint tensors (a mixture of experts'
    per-expert weights stacked into one tensor) are matched by running those ops on meta tensors of the headers'
    shapes: the names and shapes they give must be the model's.
    """
    state = model.state_dict(keep_vars=True)
    match = CheckpointMatch()
    rename = checkpoint_renamer(model, state)
    ignored = _ignored_checkpoint_name(model)
    found: dict[str, Shape] = {}  # model name -> checkpoint shape
    converted: list[str] = []  # checkpoint names a conversion takes
    for file_name, (shape, dtype) in shapes.items():
        name, targets = rename(file_name)
        if name in state and not targets:
            match.names[file_name] = name
            found[name] = shape
            if _dtype_kind(dtype) != _dtype_kind(state[name].dtype):
                match.wrong_dtype.append((name, dtype, state[name].dtype))
        elif ignored(name):
            match.ignored.append(file_name)
        elif targets:
            converted.append(file_name)
        else:
            match.unexpected.append(file_name)
    match.conversions = checkpoint_conversions(model, state, converted)
    failed: set[str] = set()  # first targets of conversions that raised (reported as such, not as missing)
    for conversion in match.conversions:
        try:
            made = convert(model, conversion, lambda stored: torch.empty(shapes[stored][0], dtype=shapes[stored][1],
                                                                         device="meta"))
        except Exception as e:  # transformers' ops raise what their torch calls raise
            counts = Counter(pattern for pattern, _ in conversion.sources)
            match.failed_conversions.append(f"{conversion.first} from {len(conversion.sources)} tensors ("
                                            f"{', '.join(f'{n} of {p}' for p, n in counts.items())}): {e}")
            failed.add(conversion.first)
            continue
        for name, tensor in made.items():
            if name not in state:
                match.unexpected.append(name)
            else:
                found[name] = tuple(tensor.shape)
    for names in tensor_groups(state):
        present = [n for n in names if n in found]
        if not present and failed.isdisjoint(names):
            match.missing.append(names[0])
        for name in present:
            if found[name] != tuple(state[name].shape):
                match.wrong_shape.append((name, found[name], tuple(state[name].shape)))
    return match


def _ignored_checkpoint_name(model: nn.Module) -> Callable[[str], bool]:
    """Whether a checkpoint tensor (by its model name) is deliberately not loaded: a non-persistent buffer of the
    model, a key its ``_keys_to_ignore_on_load_unexpected`` patterns match, or a tensor whose last two name parts
    (module and attribute) are those of one of its non-persistent buffers: older conversions saved the rotary
    ``inv_freq`` in every layer (``model.layers.N.self_attn.rotary_emb.inv_freq``), which transformers ignores too."""
    buffers = _non_persistent_buffer_names(model)
    exact = set(buffers)
    suffixes = {".".join(name.split(".")[-2:]) for name in buffers if "." in name}
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []

    def ignored(name: str) -> bool:
        return (name in exact or ".".join(name.split(".")[-2:]) in suffixes
                or any(re.search(pattern, name) for pattern in patterns))

    return ignored


def _transformers_mapping(model: nn.Module):
    """transformers' loading transforms for ``model``: (renamings, converters, base-model prefix), or None for a model
    that is not a transformers model, or a transformers without conversion mappings (exact names only then)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)],
            getattr(model, "base_model_prefix", None) or None)


def checkpoint_renamer(model: nn.Module, state: dict[str, torch.Tensor]) -> Callable[[str], tuple[str, list[str]]]:
    """checkpoint name -> (model name, the model names a transformers conversion op fills from it: empty where it
    needs none), using transformers' own key mapping."""
    mapping = _transformers_mapping(model)
    if mapping is None:
        return lambda name: (name, [])
    from transformers.core_model_loading import rename_source_key

    renamings, converters, prefix = mapping

    def rename(name: str) -> tuple[str, list[str]]:
        renamed, converter_pattern = rename_source_key(name, renamings, converters, prefix, state)
        if converter_pattern is None:
            return renamed, []
        return renamed, _conversion_targets(renamed, converter_pattern, converters)

    return rename


def _conversion_targets(renamed: str, source_pattern: str, converters: list) -> list[str]:
    """The model names a conversion fills: transformers renames a source key to the converter's first target, and a
    one-to-many converter (a fused qkv split into q, k, v) fills the others beside it."""
    for converter in converters:
        first, *others = converter.target_patterns
        if source_pattern in converter.source_patterns and first in renamed:
            return [renamed, *(renamed.replace(first, target) for target in others)]
    return [renamed]


@dataclass
class Conversion:
    """Checkpoint tensors that one of transformers' weight converters turns into model tensors (a layer's per-expert
    ``w1`` and ``w3`` stacked and joined into its experts' ``gate_up_proj``): the model name transformers files the
    conversion under (its first target), the converter, and its sources as (source pattern, checkpoint name) in
    transformers' loading order (checkpoint names in natural order: expert 2 before expert 10)."""

    first: str
    converter: object
    sources: list[tuple[str, str]] = field(default_factory=list)


def checkpoint_conversions(model: nn.Module, state: Mapping[str, torch.Tensor],
                           stored_names: Iterable[str]) -> list[Conversion]:
    """The conversions that fill model tensors from ``stored_names`` (checkpoint names that transformers converts),
    grouped as transformers' loading groups them; ``state`` holds the model's (unsharded) tensor names."""
    mapping = _transformers_mapping(model)
    if mapping is None:
        return []
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters, prefix = mapping
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    groups: dict[str, Conversion] = {}
    for stored in sorted(stored_names, key=dot_natural_key):
        renamed, pattern = rename_source_key(stored, renamings, converters, prefix, state)
        if pattern is not None:
            groups.setdefault(renamed, Conversion(renamed, by_pattern[pattern])).sources.append((pattern, stored))
    return list(groups.values())


def convert(model: nn.Module, conversion: Conversion, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model tensors ``conversion`` makes, by name, from its sources as ``read(checkpoint name)`` gives them (run
    through transformers' own ops, on a copy of its converter: the converter collects its inputs)."""
    converter = copy.deepcopy(conversion.converter)
    for pattern, stored in conversion.sources:
        converter.add_tensor(conversion.first, stored, pattern, functools.partial(read, stored))
    made = converter.convert(conversion.first, model=model, config=getattr(model, "config", None))
    return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}


class ConvertedTensors:
    """Model tensors that transformers' conversions make from a checkpoint's files, for loading them a slice at a time
    (tensor parallelism): ``take(name)`` runs the conversion that makes ``name`` when first asked, and keeps that
    conversion's other outputs (a split's siblings) until they are taken. ``state`` holds the model's unsharded
    names, ``where`` each checkpoint name's file (:func:`tensor_index`) and ``targets`` the checkpoint names a
    conversion takes, each with the model names it fills (:func:`checkpoint_renamer`'s second item)."""

    def __init__(self, model: nn.Module, state: Mapping[str, torch.Tensor], where: dict[str, Path],
                 targets: dict[str, list[str]]):
        self.model, self.where = model, where
        conversions = checkpoint_conversions(model, state, targets)
        self.by_target = {name: c for c in conversions for name in targets[c.sources[0][1]]}
        self.made: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.by_target

    def take(self, name: str) -> torch.Tensor:
        if name not in self.made:
            self.made.update(convert(self.model, self.by_target[name],
                                     lambda stored: _read(self.where[stored], stored)))
        return self.made.pop(name)


def load_conversions(model: nn.Module, conversions: list[Conversion], files: list[Path], progress: bool) -> None:
    """Fill the model tensors ``conversions`` make, one conversion (a layer's experts) in memory at a time."""
    if not conversions:
        return
    where = tensor_index(files)
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for conversion in tqdm(conversions, desc="splice: converting checkpoint tensors", unit="tensor",
                               disable=not progress, leave=False):
            for name, value in convert(model, conversion, lambda stored: _read(where[stored], stored)).items():
                state[name].copy_(value)


def check_checkpoint(model: nn.Module, path: CheckpointSource) -> CheckpointMatch:
    """Raise ValueError if the checkpoint's names or shapes don't fit the model. Reads headers only; never changes
    the model."""
    match = match_checkpoint(model, checkpoint_shapes(path))
    if not match.ok:
        _refuse_splice_quantized(path)
        raise ValueError(f"checkpoint {str(path)!r} does not match the model ({type(model).__name__}): "
                         f"{match.describe()}; allowed: a checkpoint of this architecture and size")
    return match


def _refuse_splice_quantized(path: CheckpointSource) -> None:
    """A folder written by ``splice.quant.save_quantized`` holds packed weights under other names than the float
    model's: say so, and what loads it, rather than listing every name."""
    from .quant.saving import SCHEME_NAME

    folders = {file.parent for file in checkpoint_files(path)}
    quantized = sorted(str(folder) for folder in folders if (folder / SCHEME_NAME).is_file())
    if quantized:
        raise ValueError(f"checkpoint {str(path)!r} is a splice quantized checkpoint ({SCHEME_NAME} in "
                         f"{quantized[0]!r}), which checkpoint= does not read; allowed: a float safetensors "
                         "checkpoint, or this folder loaded with splice.quant.load_quantized(model, folder) into the "
                         "float model or into an engine built as the saved one was (docs/quantization.md)")


# --------------------------------------------------------------------------------------------------------------------
# Loading


def load_checkpoint(model: nn.Module, path: CheckpointSource, device: str | torch.device, *,
                    progress: bool = True) -> nn.Module:
    """Load the checkpoint's weights into ``model`` on ``device``, streaming one tensor at a time.

    A model with meta tensors is materialised first (``to_empty``); its tied weights are tied again and its
    non-persistent buffers (e.g. rotary ``inv_freq``) recomputed. A normal model is moved to ``device`` and its
    weights overwritten. Each tensor is converted to the dtype of the model's tensor it lands in. Tensors that
    transformers' loading fuses from several checkpoint tensors (a mixture of experts' per-expert weights) are made
    by transformers' own conversion ops, one layer's at a time.

    Tied names the checkpoint holds with different values (saved from an untied model) are untied, each loading its
    own tensor, with a warning: what transformers' ``from_pretrained`` does.
    """
    device = torch.device(device)
    match = check_checkpoint(model, path)  # before the model is touched
    files = checkpoint_files(path)
    untie = differing_tied_names(model, files, match.names)
    if untie:
        log.warning("splice: checkpoint %r holds tied tensors under several names with different values (%s); "
                    "they are loaded untied, as transformers' from_pretrained does. Set tie_word_embeddings=False "
                    "in the model's config to silence this warning", str(path),
                    "; ".join(f"{name} differs from {kept}" for name, kept in untie.items()))
    if has_meta_tensors(model):
        materialize(model, device)
    else:
        model.to(device)
    _untie(model, list(untie))
    _stream_weights(model, files, match.names, progress)
    load_conversions(model, match.conversions, files, progress)
    return model


def differing_tied_names(model: nn.Module, files: list[Path], names: dict[str, str]) -> dict[str, str]:
    """Tied model names whose checkpoint tensors differ from the tensor loaded under the group's first present name:
    name -> that first name (:func:`tied_names_differing`). Only groups with several names in the checkpoint are
    read, in the model's dtype."""
    state = model.state_dict(keep_vars=True)
    source = {model_name: file_name for file_name, model_name in names.items()}
    where = functools.cache(lambda: tensor_index(files))  # read only where a group has two names to compare
    return tied_names_differing(state, source, lambda kept, name: _equal_tensors(
        where(), source[kept], source[name], state[kept].dtype))


def tied_names_differing(state: Mapping[str, torch.Tensor], present: Container[str],
                         equal: Callable[[str, str], bool]) -> dict[str, str]:
    """For each group of tied names in ``state`` (one tensor under several names), the names among ``present`` whose
    value ``equal`` finds other than the group's first present name's: name -> that first name."""
    differing = {}
    for group in tensor_groups(state):
        kept, *others = [name for name in group if name in present] or [None]
        differing.update({name: kept for name in others if not equal(kept, name)})
    return differing


def tensor_index(files: list[Path]) -> dict[str, Path]:
    """Tensor name -> the file holding it (headers only)."""
    index = {}
    for file in files:
        with open_safetensors(file) as f:
            index.update(dict.fromkeys(f.keys(), file))
    return index


def _equal_tensors(where: dict[str, Path], first: str, second: str, dtype: torch.dtype) -> bool:
    """Whether two checkpoint tensors of one shape hold equal values in ``dtype``, compared ``_MAPPED_BYTES`` of rows
    at a time (a vocabulary-sized table is not read whole)."""
    with open_safetensors(where[first]) as f:
        shape = f.get_slice(first).get_shape()
    if not shape:
        return _read(where[first], first).to(dtype).equal(_read(where[second], second).to(dtype))
    rows = max(1, _MAPPED_BYTES // max(1, _numel(shape[1:]) * dtype.itemsize))
    for start in range(0, shape[0], rows):
        part = slice(start, start + rows)
        if not _read(where[first], first, part).to(dtype).equal(_read(where[second], second, part).to(dtype)):
            return False
    return True


def _read(file: Path, name: str, rows: slice | None = None) -> torch.Tensor:
    """A checkpoint tensor, or its ``rows``, from a freshly opened file (its mapped pages released after)."""
    with open_safetensors(file) as f:
        return f.get_tensor(name) if rows is None else f.get_slice(name)[rows]


def _untie(model: nn.Module, names: list[str]) -> None:
    """Give each of ``names`` a tensor of its own (uninitialised, like the one it shared) and drop it from
    transformers' record of the model's ties, so that nothing ties it again."""
    for name in names:
        shared = _get_tensor(model, name)
        own = torch.empty_like(shared)
        _set_tensor(model, name, nn.Parameter(own, shared.requires_grad) if isinstance(shared, nn.Parameter) else own)
    ties = getattr(model, "all_tied_weights_keys", None)
    if names and isinstance(ties, dict):
        for target in [target for target, source in ties.items() if target in names or source in names]:
            del ties[target]


def parameter_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters (a tied weight counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in chain(model.parameters(), model.buffers()))


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Give a meta model real (uninitialised) storage on ``device``, keep its ties, and recompute the non-persistent
    buffers that were meta. Non-persistent buffers that already had values keep them. Weights are left garbage.

    The buffers are computed first, so a buffer that cannot be recomputed raises while the model is still untouched.
    """
    device = torch.device(device)
    ties = _tied_groups(model)
    kept = {name: buf.to(device) for name, buf in _non_persistent_buffers(model) if not buf.is_meta}
    computed = compute_meta_buffers(model, device)
    model.to_empty(device=device)
    for names in ties:
        for name in names[1:]:
            _set_tensor(model, name, _get_tensor(model, names[0]))
    set_tensors(model, {**kept, **computed})
    return model


def _stream_weights(model: nn.Module, files: list[Path], names: dict[str, str], progress: bool) -> None:
    """Copy each checkpoint tensor into the model's tensor ``names[name]``, one at a time.

    ``safe_open`` maps the file and keeps every page it has read mapped (counted in RSS) until it is closed, so the
    file is reopened every ``_MAPPED_BYTES``: RSS then stays near one model copy instead of model + file.
    """
    state = model.state_dict(keep_vars=True)
    batches = [(file, batch) for file in files for batch in _read_batches(file, names)]
    total = sum(len(batch) for _, batch in batches)
    with torch.no_grad(), tqdm(total=total, desc="splice: loading checkpoint", unit="tensor", disable=not progress,
                                leave=False) as bar:
        for file, batch in batches:
            with open_safetensors(file) as f:
                for name in batch:
                    state[names[name]].copy_(f.get_tensor(name))
                    bar.update()


_MAPPED_BYTES = 64 << 20


def _read_batches(file: Path, wanted: dict[str, str]) -> list[list[str]]:
    """The file's tensors that are ``wanted``, in groups of about ``_MAPPED_BYTES`` (headers only)."""
    batches: list[list[str]] = [[]]
    size = 0
    with open_safetensors(file) as f:
        for name in f.keys():
            if name not in wanted:
                continue
            tensor_slice = f.get_slice(name)
            nbytes = _numel(tensor_slice.get_shape()) * _torch_dtype(tensor_slice.get_dtype()).itemsize
            if batches[-1] and size + nbytes > _MAPPED_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(name)
            size += nbytes
    return [names for names in batches if names]


def _numel(shape: list[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


# --------------------------------------------------------------------------------------------------------------------
# Non-persistent buffers


def compute_meta_buffers(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Fresh values on ``device`` for the model's non-persistent buffers that are on meta (see
    :func:`compute_buffers`; the model is not changed: :func:`set_tensors` puts them in)."""
    return compute_buffers(model, [name for name, buf in _non_persistent_buffers(model) if buf.is_meta], device)


def compute_buffers(model: nn.Module, names: Iterable[str], device: torch.device) -> dict[str, torch.Tensor]:
    """Fresh values on ``device`` for the named non-persistent buffers, computed the way their owner initialises them.

    A module may define ``init_buffers()`` (for splice's own layers); otherwise a transformers model's
    ``_init_weights(module)`` is used, which is how transformers itself fills non-persistent buffers (e.g. rotary
    ``inv_freq``/``original_inv_freq``, for every rope type) after loading from the meta device. It runs on a copy of
    each owning module whose parameters stay on meta, so ``model`` is not changed. A buffer that nothing rewrote
    raises rather than becoming garbage.
    """
    by_module: dict[str, list[str]] = defaultdict(list)
    for name in names:
        module_name, _, attr = name.rpartition(".")
        by_module[module_name].append(attr)
    owners = _pretrained_owners(model) if by_module else {}
    computed: dict[str, torch.Tensor] = {}
    not_recomputed = []
    for module_name, attrs in by_module.items():
        module = copy.deepcopy(model.get_submodule(module_name))  # cheap: its tensors are on meta
        before = {}
        for attr in attrs:
            module._buffers[attr] = torch.empty_like(module._buffers[attr], device=device)
            before[attr] = (module._buffers[attr], module._buffers[attr]._version)
        with torch.no_grad():
            if callable(getattr(module, "init_buffers", None)):
                module.init_buffers()
            elif owners.get(module_name) is not None:
                owners[module_name]._init_weights(module)
        for attr, (old, version) in before.items():
            name = f"{module_name}.{attr}" if module_name else attr
            new = module._buffers.get(attr)
            if new is not None and not new.is_meta and (new is not old or new._version != version):
                computed[name] = new
            else:
                not_recomputed.append(name)
    if not_recomputed:
        raise ValueError(
            f"cannot recompute the non-persistent buffer(s) {not_recomputed} of the meta model: they are not in the "
            f"checkpoint and neither the module's init_buffers() nor a transformers _init_weights rewrote them. Build "
            f"the model on a real device instead of meta, or give the module an init_buffers() method")
    return computed


def _pretrained_owners(model: nn.Module) -> dict[str, nn.Module | None]:
    """Module name -> the nearest enclosing transformers PreTrainedModel (itself included), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        PreTrainedModel = ()  # noqa: N806
    owners: dict[str, nn.Module | None] = {}

    def visit(module: nn.Module, name: str, owner: nn.Module | None) -> None:
        if isinstance(module, PreTrainedModel):
            owner = module
        owners[name] = owner
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, owner)

    visit(model, "", None)
    return owners


def _non_persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    found = []
    for module_name, module in model.named_modules():
        for attr in module._non_persistent_buffers_set:
            buf = module._buffers.get(attr)
            if buf is not None:
                found.append((f"{module_name}.{attr}" if module_name else attr, buf))
    return found


def _non_persistent_buffer_names(model: nn.Module) -> list[str]:
    return [name for name, _ in _non_persistent_buffers(model)]


# --------------------------------------------------------------------------------------------------------------------
# Small helpers


def tensor_groups(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The names of ``state`` grouped by the tensor they hold, in order of first appearance: tied weights (one object,
    or the same memory in a detached ``state_dict()``) share a group, e.g. lm_head.weight and embed_tokens.weight."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(_tensor_key(tensor), []).append(name)
    return list(groups.values())


def _tensor_key(tensor: torch.Tensor) -> tuple:
    """One object is one tensor; real tensors are also the same when they view the same memory the same way (meta
    and empty tensors have no memory to tell them apart)."""
    if tensor.is_meta or tensor.numel() == 0:
        return ("object", id(tensor))
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride())


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter or buffer object (e.g. lm_head.weight and model.embed_tokens.weight)."""
    named = dict(chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)))
    return [names for names in tensor_groups(named) if len(names) > 1]


def _get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def set_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Put each tensor in the model's parameter or buffer slot of its name, as it is."""
    for name, tensor in tensors.items():
        _set_tensor(model, name, tensor)


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = tensor
    else:
        module._buffers[attr] = tensor


def _first(items: list[str], limit: int) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
