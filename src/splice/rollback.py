"""Rollback: the user's model as it was before the pipeline, put back if a step fails.

The steps change the model in place (cast, fill, shard, fuse, quantize, wrap, move). :class:`Rollback` records,
before the first step, every module's attributes (the containers of submodules, parameters, buffers and hooks copied
one level deep) and, for every parameter and buffer, the tensor its ``.data`` held. Only references are kept, so
taking it is free, but the original weights then stay in memory until the pipeline ends, next to what the steps
build from them: :func:`affordable` says whether memory allows that. :meth:`Rollback.restore` puts every module's
attributes and every tensor's data back, and names the tensors a step overwrote in place (their old values are gone:
loading a checkpoint into a model that already had weights of the same dtype does that; loaded into another dtype or
device, the checkpoint lands in the converted copies and the originals come back intact).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .machine import free_bytes


@dataclass(frozen=True)
class _SavedTensor:
    tensor: torch.Tensor  # the parameter or buffer object the model holds
    data: torch.Tensor  # its data before the pipeline (a detached alias: shares the storage and the version counter)
    version: int | None  # None: a tensor made in inference mode, which keeps no version counter
    requires_grad: bool


class Rollback:
    """The model's state before the pipeline (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.modules = [(module, _copy_attributes(module.__dict__)) for module in model.modules()]
        self.names = {id(t): name for name, t in [*model.named_parameters(remove_duplicate=False),
                                                  *model.named_buffers(remove_duplicate=False)]}
        tensors = {id(t): t for module in model.modules()
                   for t in [*module._parameters.values(), *module._buffers.values()] if t is not None}
        self.tensors = [_SavedTensor(t, t.detach(), None if t.is_inference() else t._version, t.requires_grad)
                        for t in tensors.values()]

    @property
    def counts_writes(self) -> bool:
        """Whether every tensor keeps a version counter (none was made in inference mode), so that :meth:`restore`
        names only tensors a step did write into."""
        return all(saved.version is not None for saved in self.tensors)

    def restore(self) -> list[str]:
        """Put the model back; returns the names of the tensors whose values were overwritten in place, or may have
        been (a tensor made in inference mode keeps no version counter to show it was not), empty where the model
        equals its state before the pipeline."""
        held = _storages(self.modules[0][0]) if self.modules else set()  # what the steps left, before it goes
        for module, attributes in self.modules:
            module.__dict__.clear()
            module.__dict__.update(_copy_attributes(attributes))
        overwritten = []
        for saved in self.tensors:
            if _overwritten(saved, held):
                overwritten.append(self.names.get(id(saved.tensor), "<unnamed tensor>"))
            saved.tensor.data = saved.data
            saved.tensor.requires_grad_(saved.requires_grad)
        return overwritten


def affordable(model: nn.Module) -> tuple[bool, str]:
    """Whether memory allows keeping the model's original weights until the pipeline ends (at worst the steps build a
    whole converted copy next to them), and why. Weights on the meta device cost nothing to keep."""
    held: dict[str, int] = {}
    for tensor in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        if tensor.device.type != "meta":
            held[tensor.device.type] = held.get(tensor.device.type, 0) + tensor.numel() * tensor.element_size()
    for device, size in held.items():
        free = free_bytes(device)
        if free is not None and free < size:
            return False, (f"keeping its {size / 2**30:.1f} GiB of original weights on {device} during the pipeline "
                           f"needs more than the {free / 2**30:.1f} GiB free")
    return True, "its original weights are kept until the pipeline ends"


def _copy_attributes(attributes: dict) -> dict:
    """A copy of a module's ``__dict__`` whose containers (submodules, parameters, buffers, hooks) are new ones."""
    return {name: value.copy() if isinstance(value, (dict, set)) else value for name, value in attributes.items()}


def _overwritten(saved: _SavedTensor, held: set[tuple]) -> bool:
    """Whether the original values may have been written over (meta tensors have none to lose). Its version counter
    moved, but a tensor keeps its counter when its data is replaced (and shares it with aliases of its original data),
    so the write may have gone elsewhere. It went into the original data where the tensor, or another tensor of the
    model (``held``: the storages the steps left in it), still holds that data. Data that nothing holds any more was
    either replaced by a conversion to another dtype or device (the dtype step; the load step's move to the home
    device), which comes before any step writes weights, so the writes went into the converted copy; or replaced
    otherwise (gathered into one buffer), where the answer errs on the side of "overwritten". A tensor made in
    inference mode has no counter: only the rest of the test applies."""
    if saved.data.is_meta or (saved.version is not None and saved.data._version == saved.version):
        return False
    if _storage(saved.tensor) == _storage(saved.data) or _storage(saved.data) in held:
        return True
    return saved.tensor.dtype == saved.data.dtype and saved.tensor.device == saved.data.device


def _storages(model: nn.Module) -> set[tuple]:
    """The memory the model's parameters and buffers hold now."""
    return {_storage(t) for t in [*model.parameters(), *model.buffers()] if not t.is_meta}


def _storage(tensor: torch.Tensor) -> tuple:
    return tensor.device, tensor.untyped_storage().data_ptr()
