"""Save a quantized model (safetensors + a small JSON of the scheme) and load it back without re-quantizing.

Folder layout::

    model.safetensors      the state dict: float tensors as they are, each quantized linear as ``qweight`` + scales
    splice_quant.json      {"format": 1, "scheme": QuantConfig.to_dict(), "layers": {name: shape + kind}, "tied": ...}

Loading takes the float model skeleton (real or on the meta device), swaps the listed linears for empty quantized
layers and loads the state dict strictly; the kernels' packed layouts are rebuilt on the target device.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..checkpoint import has_meta_tensors, tensor_groups
from ..kernel_choice import quant_kernel
from .api import HANDLERS
from .layers import QuantizedLinear
from .scheme import QuantConfig

WEIGHTS_NAME = "model.safetensors"
SCHEME_NAME = "splice_quant.json"
FORMAT = 1


def save_quantized(model: nn.Module, directory: str | os.PathLike, config: QuantConfig) -> Path:
    """Write ``model`` (already quantized with ``config``) to ``directory``; returns the folder."""
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
    """Load a folder written by :func:`save_quantized` into the float skeleton ``model`` (changed in place).

    ``config``, when given, must equal the saved scheme (``ValueError`` otherwise).
    """
    folder = Path(directory)
    record = _read_record(folder)
    saved = QuantConfig.from_dict(record["scheme"])
    if config is not None and config != saved:
        raise ValueError(f"{folder} holds weights quantized as {saved}, but {config} was asked for; re-quantize "
                         "from the float model, or load with the saved scheme (splice.quant.read_scheme)")
    for name, layer in record["layers"].items():
        model.set_submodule(name, _empty_layer(model, name, layer, saved, torch.device(device)))
    state = load_file(folder / WEIGHTS_NAME, device=str(device))
    for alias, kept in record["tied"].items():
        state[alias] = state[kept]
    model.load_state_dict(state, strict=True, assign=has_meta_tensors(model))
    for alias, kept in record["tied"].items():  # assign=True gives each name its own Parameter: tie them again
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(kept))
    return model


def _describe(module: QuantizedLinear) -> dict:
    return {"kind": module.kind, "in_features": module.in_features, "out_features": module.out_features,
            "bias": module.bias is not None}


def _empty_layer(model: nn.Module, name: str, layer: dict, config: QuantConfig,
                 device: torch.device) -> QuantizedLinear:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and model.get_submodule(name) in (head, getattr(head, "linear", None)):
        config = config.head_scheme() or config
    if layer["kind"] != config.kind:
        raise ValueError(f"layer {name} was saved as {layer['kind']!r} but the scheme says {config.kind!r}")
    current = model.get_submodule(name)
    weight = getattr(current, "weight", None)
    dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.bfloat16
    kernel = quant_kernel(config, device)
    return HANDLERS[layer["kind"]].empty(layer["in_features"], layer["out_features"], layer["bias"], config, device,
                                         dtype, native=kernel.native, dot_products=kernel.dot_products)


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
