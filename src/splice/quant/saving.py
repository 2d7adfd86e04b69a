"""Save a quantized model (safetensors + a small JSON of the scheme) and load it back without re-quantizing.

Folder layout::

    model.safetensors      the state dict: float tensors as they are, each quantized linear as ``qweight`` + scales
    splice_quant.json      {"format": 1, "scheme": QuantConfig.to_dict(), "layers": {name: shape + kind}, "tied": ...}

Loading takes the float model skeleton (real or on the meta device), swaps the listed linears for empty quantized
layers and loads the state dict strictly; the kernels' packed layouts are rebuilt on the target device. A meta
skeleton's non-persistent buffers (rotary ``inv_freq``), which no checkpoint holds, are computed on that device.

Both also take an :class:`~splice.InferenceEngine`: a quantized engine (kernel-injected or not) saves its model under
the scheme it was quantized with, and a float engine built the same way (same family, ``replace_with_kernel_inject``
and activation dtype) loads it back, its decode runtime then reading the loaded output head.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..checkpoint import compute_meta_buffers, has_meta_tensors, set_tensors, tensor_groups
from ..kernel_choice import quant_kernel
from ..layers.experts import experts_matrices, experts_of_linears
from .api import HANDLERS, output_head, reason_to_skip
from .layers import QuantizedLinear, fits_spec
from .scheme import QuantConfig, is_qkv_projection

WEIGHTS_NAME = "model.safetensors"
SCHEME_NAME = "splice_quant.json"
FORMAT = 1


def save_quantized(model: nn.Module, directory: str | os.PathLike, config: QuantConfig | None = None) -> Path:
    """Write ``model`` (already quantized with ``config``; for an engine, None means the scheme it was quantized
    with) to ``directory``; returns the folder."""
    model, config = _module_and_scheme(model, config)
    _check_layers_match(model, config)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    state, tied = _dedupe(model.state_dict())
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, folder / WEIGHTS_NAME,
              metadata={"format": "pt"})
    layers = {name: _describe(module) for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    record = {"format": FORMAT, "scheme": config.to_dict(), "layers": layers, "tied": tied}
    (folder / SCHEME_NAME).write_text(json.dumps(record, indent=1), encoding="utf-8")
    return folder


def read_scheme(directory: str | os.PathLike) -> QuantConfig:
    """The ``QuantConfig`` a saved folder was quantized with."""
    return QuantConfig.from_dict(_read_record(Path(directory))["scheme"])


def load_quantized(model: nn.Module, directory: str | os.PathLike, config: QuantConfig | None = None,
                   device: torch.device | str = "cpu") -> nn.Module:
    """Load a folder written by :func:`save_quantized` into the float skeleton ``model`` (changed in place, and
    returned).

    ``config``, when given, must equal the saved scheme (``ValueError`` otherwise). ``model`` may be an
    :class:`~splice.InferenceEngine` (see the module docstring): its model is loaded, and its decode runtime, if any,
    decodes with the loaded output head. Nothing is changed when the folder holds a layer ``model`` does not have.
    """
    engine = model if _is_engine(model) else None
    model = engine.module if engine is not None else model
    folder = Path(directory)
    record = _read_record(folder)
    saved = QuantConfig.from_dict(record["scheme"])
    if config is not None and config != saved:
        raise ValueError(f"{folder} holds weights quantized as {saved}, but {config} was asked for; re-quantize "
                         "from the float model, or load with the saved scheme (splice.quant.read_scheme)")
    _check_skeleton_is_float(model, folder)
    shells = _experts_shells(model, record["layers"], saved, torch.device(device))
    _check_layers_exist(model, folder, record["layers"], shells)
    layers = {name: _saved_layer(model, shells, name, layer, saved, torch.device(device))
              for name, layer in record["layers"].items()}
    state = load_file(folder / WEIGHTS_NAME, device=str(device))
    for alias, kept in record["tied"].items():
        state[alias] = state[kept]
    _check_state_fits(model, layers, state, folder, shells)
    on_meta = has_meta_tensors(model)
    if not on_meta:  # a meta skeleton takes the saved tensors as they are (assign=True)
        _check_float_dtypes(model, layers, state, folder)
    buffers = compute_meta_buffers(model, torch.device(device))  # raises before any change where one cannot be
    for name, shell in shells.items():
        model.set_submodule(name, shell)
    for name, layer in layers.items():
        model.set_submodule(name, layer)
    model.load_state_dict(state, strict=True, assign=on_meta)
    set_tensors(model, buffers)
    for alias, kept in record["tied"].items():  # assign=True gives each name its own Parameter: tie them again
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(kept))
    if engine is None:
        return model
    if engine.runtime is not None:  # the runtime decodes with the loaded output head from now on
        engine.runtime.lm_head = model.get_output_embeddings()
    return engine


def _is_engine(model: nn.Module) -> bool:
    from ..engine import InferenceEngine

    return isinstance(model, InferenceEngine)


def _module_and_scheme(model: nn.Module, config: QuantConfig | None) -> tuple[nn.Module, QuantConfig]:
    """The model to save and its scheme: an engine's model and (unless ``config`` is given) its own scheme."""
    if not _is_engine(model):
        if config is None:
            raise ValueError("save_quantized needs the QuantConfig the model was quantized with; config=None is "
                             "allowed for an InferenceEngine only (it knows its scheme)")
        return model, config
    config = config or QuantConfig.from_inference_config(model.inference_config)
    if config is None:
        raise ValueError("save_quantized was given an engine that was not quantized; allowed: an engine made with "
                         "dtype=torch.int8 or quant={...}")
    return model.module, config


def _check_skeleton_is_float(model: nn.Module, folder: Path) -> None:
    """A ``ValueError`` where ``model`` already holds quantized layers: loading would swap them for the folder's
    (another scheme, say) while an engine kept describing its own scheme."""
    quantized = [name for name, module in model.named_modules() if isinstance(module, QuantizedLinear)]
    if quantized:
        raise ValueError(f"load_quantized needs a float skeleton, but layer {quantized[0]} (and "
                         f"{len(quantized) - 1} more) is already {model.get_submodule(quantized[0]).kind}; allowed: "
                         f"a model or engine built without quantization (no dtype=torch.int8 or quant={{...}}); "
                         f"{folder} brings its own scheme")


def _check_float_dtypes(model: nn.Module, layers: dict[str, QuantizedLinear], state: dict[str, torch.Tensor],
                        folder: Path) -> None:
    """A ``ValueError`` where a float tensor outside the quantized layers (embeddings, norms) was saved in another
    float dtype than the skeleton holds: ``load_state_dict`` would round it silently, and the reloaded model would
    no longer compute what the saved one did."""
    current = {key: t.dtype for key, t in model.state_dict(keep_vars=True).items()
               if key.rpartition(".")[0] not in layers and t.is_floating_point()}
    wrong = [f"{key}: saved {state[key].dtype}, the model holds {dtype}" for key, dtype in current.items()
             if key in state and state[key].dtype != dtype]
    if wrong:
        raise ValueError(f"{folder} does not fit this model's dtype ({wrong[0]}, {len(wrong)} tensors in all); "
                         "allowed: a skeleton in the saved model's float dtype (for dtype=torch.int8: "
                         "dtype=torch.bfloat16)")


def _experts_shells(model: nn.Module, layers: dict, config: QuantConfig, device: torch.device) -> dict[str, nn.Module]:
    """For each experts module of the skeleton whose quantized linears the folder holds (``experts.down_proj.0``,
    ...), the quantized copy :func:`~splice.layers.experts.experts_of_linears` makes of it, with empty layers of the
    saved kind to load into; the skeleton is not changed."""
    def empty(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantizedLinear:
        return _empty_quantized(weight.shape[1], weight.shape[0], bias is not None, weight, config, device)

    return {name: experts_of_linears(module, empty) for name, module in model.named_modules()
            if experts_matrices(module) is not None and any(saved.startswith(f"{name}.") for saved in layers)}


def _saved_layer(model: nn.Module, shells: dict[str, nn.Module], name: str, layer: dict, config: QuantConfig,
                 device: torch.device) -> QuantizedLinear:
    """The empty quantized layer the folder's layer ``name`` loads into: one of an experts shell's, checked against
    the saved description, or a new one for a linear of the skeleton."""
    owner = next((shell_name for shell_name in shells if name.startswith(f"{shell_name}.")), None)
    if owner is None:
        return _empty_layer(model, name, layer, config, device)
    made = shells[owner].get_submodule(name[len(owner) + 1:])
    if _describe(made) != layer:
        raise ValueError(f"layer {name} was saved as {layer}, but the model's experts make {_describe(made)}; "
                         "allowed: a skeleton of the saved model's architecture and sizes")
    return made


def _check_layers_exist(model: nn.Module, folder: Path, layers: dict, shells: dict[str, nn.Module]) -> None:
    """A ``ValueError`` naming the saved quantized layers ``model`` has no module for (a checkpoint of a
    kernel-injected engine needs a kernel-injected skeleton, and the other way round)."""
    modules = dict(model.named_modules())
    modules.update({f"{owner}.{name}": module for owner, shell in shells.items()
                    for name, module in shell.named_modules() if name})
    missing = [name for name in layers if name not in modules]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(f"{folder} holds quantized layers the model has no module for: {shown}; load it into a "
                         "model built as the saved one was (a kernel-injected engine's checkpoint into an engine "
                         "made with replace_with_kernel_inject=True, a plain model's into a plain model)")


def _check_state_fits(model: nn.Module, layers: dict[str, QuantizedLinear], state: dict[str, torch.Tensor],
                      folder: Path, shells: dict[str, nn.Module]) -> None:
    """A ``ValueError`` naming the tensors ``state`` lacks, has in excess, or holds in another shape or kind of dtype
    than ``model`` with ``layers`` in place would take: checked before any change, as ``load_state_dict`` would
    raise only after replacing the layers and copying every tensor that fits."""
    expected = _expected_specs(model, layers, shells)
    problems = [f"missing {key}" for key in expected if key not in state]
    problems += [f"unexpected {key}" for key in state if key not in expected]
    problems += [f"{key}: saved {tuple(state[key].shape)} {state[key].dtype}, the model takes {shape} {dtype}"
                 for key, (shape, dtype) in expected.items()
                 if key in state and not _takes(layers, key, state[key], shape, dtype)]
    if problems:
        shown = "; ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ValueError(f"{folder} does not fit this model ({shown}); allowed: a skeleton of the saved model's "
                         "architecture and sizes, built as the saved one was")


def _takes(layers: dict[str, QuantizedLinear], key: str, saved: torch.Tensor, shape: tuple[int, ...],
           dtype: torch.dtype) -> bool:
    """Whether the checkpoint's tensor ``key`` loads: ``shape`` and ``dtype``, or else what its quantized layer takes
    besides (int4: another device's padding)."""
    if fits_spec(saved, shape, dtype):
        return True
    name, _, leaf = key.rpartition(".")
    return name in layers and layers[name].takes_saved(leaf, saved)


def _expected_specs(model: nn.Module, layers: dict[str, QuantizedLinear], shells: dict[str, nn.Module]) -> dict:
    """``{key: (shape, dtype)}`` of ``model.state_dict()`` once each of ``shells`` (experts) and then of ``layers``
    replaces the module of its name."""
    specs = {key: (tuple(t.shape), t.dtype) for key, t in model.state_dict(keep_vars=True).items()
             if key.rpartition(".")[0] not in layers and key.rpartition(".")[0] not in shells}
    for owner, shell in shells.items():  # the experts' own tensors besides their quantized layers
        specs.update({f"{owner}.{key}": (tuple(t.shape), t.dtype) for key, t in shell.state_dict(keep_vars=True).items()
                      if f"{owner}.{key}".rpartition(".")[0] not in layers})
    for name, layer in layers.items():
        specs.update({f"{name}.{key}": spec for key, spec in layer.saved_specs().items()})
    return specs


def _check_layers_match(model: nn.Module, config: QuantConfig) -> None:
    """A ``ValueError`` before anything is written where ``config`` does not describe ``model``'s layers (a
    quantized layer of another kind or group, a q/k/v projection it keeps in float, a float linear it quantizes,
    the output head included): the folder would record a scheme its weights do not have, and refuse to load."""
    head = output_head(model)
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinear):
            if reason_to_skip(name, module, head, config) == "":  # a float linear the scheme would quantize
                raise ValueError(f"layer {name} is in float, but {config} quantizes it; allowed: the QuantConfig "
                                 "the model was quantized with")
            continue
        if not config.quantize_qkv and is_qkv_projection(name):
            raise ValueError(f"layer {name} is {module.kind}, but {config} keeps q/k/v projections in float; "
                             "allowed: the QuantConfig the model was quantized with")
        scheme = _layer_scheme(model, module, config)
        if scheme is None or module.kind != scheme.kind or _group(module) != scheme.group_for(module.in_features):
            wanted = "float (the scheme keeps the output head in float)" if scheme is None else (
                f"{scheme.kind} with groups of {scheme.group_for(module.in_features)}")
            raise ValueError(f"layer {name} is {module.kind} with groups of {_group(module)}, but {config} makes it "
                             f"{wanted}; allowed: the QuantConfig the model was quantized with")


def _group(module: QuantizedLinear) -> int | None:
    """Input elements per scale of a quantized layer (None: one scale per output row)."""
    return getattr(module, "group", None)


def _layer_scheme(model: nn.Module, module: nn.Module, config: QuantConfig) -> QuantConfig | None:
    """The scheme ``config`` gives ``module``: the output head's own (None: float), else ``config``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and module in (head, getattr(head, "linear", None)):
        return config.head_scheme()
    return config


def _describe(module: QuantizedLinear) -> dict:
    return {"kind": module.kind, "in_features": module.in_features, "out_features": module.out_features,
            "bias": module.bias is not None}


def _empty_layer(model: nn.Module, name: str, layer: dict, config: QuantConfig,
                 device: torch.device) -> QuantizedLinear:
    config = _layer_scheme(model, model.get_submodule(name), config) or config
    if layer["kind"] != config.kind:
        raise ValueError(f"layer {name} was saved as {layer['kind']!r} but the scheme says {config.kind!r}")
    weight = getattr(model.get_submodule(name), "weight", None)
    return _empty_quantized(layer["in_features"], layer["out_features"], layer["bias"], weight, config, device)


def _empty_quantized(in_features: int, out_features: int, bias: bool, weight: torch.Tensor | None,
                     config: QuantConfig, device: torch.device) -> QuantizedLinear:
    """An empty layer of ``config``'s kind to load saved weights into, for the kernels ``device`` runs, its float
    tensors (the bias) in the dtype of the float ``weight`` it stands in for (bf16 where there is none)."""
    dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.bfloat16
    kernel = quant_kernel(config, device)
    return HANDLERS[config.kind].empty(in_features, out_features, bias, config, device, dtype,
                                       native=kernel.native, dot_products=kernel.dot_products)


def _dedupe(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory (tied embeddings): keep the first name, map the others to it."""
    groups = tensor_groups(state)
    return {names[0]: state[names[0]] for names in groups}, {alias: names[0] for names in groups for alias in names[1:]}


def _read_record(folder: Path) -> dict:
    path = folder / SCHEME_NAME
    if not path.is_file():
        raise ValueError(f"{folder} is not a splice quantized checkpoint: {SCHEME_NAME} is missing")
    record = json.loads(path.read_text(encoding="utf-8"))
    if record.get("format") != FORMAT or record.get("scheme", {}).get("kind") not in HANDLERS:
        raise ValueError(f"{path}: unknown format {record.get('format')!r} / scheme kind "
                         f"{record.get('scheme', {}).get('kind')!r}; allowed: format {FORMAT}, kinds "
                         f"{sorted(HANDLERS)}")
    return record
