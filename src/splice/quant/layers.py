"""Quantized linear layers: each holds its packed weight and scales (never a float copy) and calls its kernel.

All of them take any float input ``[..., in_features]``, run the kernel with bf16 activations, and return the input's
dtype. The bias stays in float. ``state_dict()`` holds a device-independent form (``qweight`` plus scales); layers
whose kernel wants another layout (int4; int8 where it keeps tiles) repack it when loading. Which kernel a layer calls
is given to it when it is built (``native``: splice's native GEMVs, else torch's kernels), as ``splice.kernel_choice``
decided: per-channel int8 then runs ``int8_gemv`` or its integer dot products for decode rows (in tiles of 16 rows
where ``native.int8_tiles_ready``), and int4 keeps splice's tile layout for ``int4_gemv``.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from .. import native
from ..native import (int8_group_scales_pack, int8_group_scales_unpack, int8_grouped_tiles_ready, int8_tile_pack,
                      int8_tile_unpack, int8_tiles_ready)
from . import gptq, kernels, qmath
from .scheme import QuantConfig


class QuantizedLinear(nn.Module):
    """Base class: shapes, bias, the float-in/float-out wrapper around ``_matmul``, and the size report.

    Scales are cast to the kernel's dtype on use (a no-op unless someone called ``model.float()`` afterwards)."""

    kind: ClassVar[str]
    use_native: bool = False  # calls splice.native's kernels (fixed when built: a traced forward cannot ask)

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, config: QuantConfig,
                   native: bool = False, dot_products: bool = False) -> QuantizedLinear:
        """Quantize a float ``weight [out, in]`` (on the device the kernel will run on); ``native``: call splice's
        native kernels (CPU, where ``splice.native`` is available), else torch's; ``dot_products``: decode rows on
        integer dot products (``splice.kernel_choice.KernelChoice.dot_products``)."""
        raise NotImplementedError

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, config: QuantConfig,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              native: bool = False, dot_products: bool = False) -> QuantizedLinear:
        """A layer of the right shapes and zero weights, to load a saved state dict into (no quantization runs)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(kernels.COMPUTE_DTYPE).contiguous()
        out = self._matmul(rows).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` this layer computes with (for tests and debugging)."""
        raise NotImplementedError

    def weight_nbytes(self) -> int:
        """Bytes of the stored weight and its scales (the bias excluded)."""
        raise NotImplementedError

    def saved_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every tensor ``state_dict()`` holds (to check a checkpoint before loading it)."""
        return {name: (tuple(t.shape), t.dtype) for name, t in self.state_dict().items()}

    def takes_saved(self, name: str, saved: torch.Tensor) -> bool:
        """Whether ``saved``, a checkpoint's tensor ``name`` of this layer, loads into it."""
        shape, dtype = self.saved_specs()[name]
        return fits_spec(saved, shape, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8WeightOnlyLinear(QuantizedLinear):
    """int8 weights, one bf16 scale per output channel (``qweight [N, K]``, ``scales [N]``) or per group of input
    elements (``qweight [G, N, S]``, ``scales [G, N]``, ``K`` zero-padded to a multiple of ``S``). Where the native
    integer dot products serve every decode row (``tiled``), ``qweight`` holds the per-channel weight as their tiles
    (uint8 ``[N, K]``, ``native.int8_tile_pack``) and ``state_dict()`` the int8 rows. A grouped weight on the native
    integer dot products (``native_grouped``) is kept as int8 rows ``[N, G * S']`` for ``int8_dot_gemv_grouped`` (in
    tiles where ``native.int8_grouped_tiles_ready``), each group zero-padded to ``S'``, whole blocks of 32 (``S`` itself
    where it is one; see :func:`padded_group`), its scales as ``native.int8_group_scales_pack`` lays them out;
    ``state_dict()`` holds the groups and ``[G, N]`` scales."""

    kind = "int8_weight_only"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, qweight: torch.Tensor,
                 scales: torch.Tensor, native: bool = False, dot_products: bool | int = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.to(kernels.COMPUTE_DTYPE))
        # Per channel, same layout either way: the native GEMV runs for the rows it fits, torch's kernels otherwise.
        # Grouped: the native grouped GEMV where padding each group to whole blocks of 32 adds at most half its bytes,
        # the weight then kept as rows of padded groups (or tiles); torch's kernel per group otherwise.
        self.saved_group = qweight.shape[2] if qweight.dim() == 3 else 0
        self.kept_group = padded_group(self.saved_group)
        self.native_grouped = bool(native and dot_products and self.kept_group)
        self.use_native = native and (qweight.dim() == 2 or self.native_grouped)
        self.widen_prompts = self.use_native and _prompts_widened()
        # Decode rows multiplied in integers (whole blocks of 32 inputs only): 8 (or True) rounds them to int8 per
        # block of 32, 16 to int16 per block of 256 (kernel_choice.int16_activations); 0 keeps float products.
        whole_blocks = self.native_grouped or in_features % qmath.ACTIVATION_BLOCK == 0
        dots = self.use_native and dot_products and whole_blocks
        self.use_dot_products = (16 if dot_products == 16 else 8) if dots else 0
        _check_native(native, qweight.device)
        # Where the dot products serve every decode row and read tiles best, the weight is kept in them (uint8 [N, K];
        # ``native.int8_tile_pack``); state_dict() still holds int8 rows (grouped: the groups).
        self.tiled = self.use_native and self._tiles_read_best()
        if self.native_grouped or self.tiled:
            self.qweight = self._kept_form(qweight)
        if self.native_grouped:
            self.scales = int8_group_scales_pack(self.scales)

    def _tiles_read_best(self) -> bool:
        """Whether this layer's decode GEMV reads the weight fastest in tiles: per channel, ``int8_dot_gemv`` where
        ``native.int8_tiles_ready``; grouped, ``int8_dot_gemv_grouped`` where ``native.int8_grouped_tiles_ready``
        and ``int8_dot16_gemv_grouped`` (int16 activations) always."""
        if self.native_grouped:
            return self.use_dot_products == 16 or (self.use_dot_products == 8 and int8_grouped_tiles_ready())
        return self.use_dot_products == 8 and int8_tiles_ready()

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, config: QuantConfig,
                   native: bool = False, dot_products: bool = False) -> Int8WeightOnlyLinear:
        out_features, in_features = weight.shape
        group = config.group_for(in_features)
        if group is None:
            q, scales = qmath.quantize_int8(weight)
            return cls(in_features, out_features, bias, q, scales[:, 0], native, dot_products)
        q, scales = qmath.quantize_int8(qmath.pad_to(weight, 1, group), group)
        grouped = q.reshape(out_features, -1, group).transpose(0, 1).contiguous()
        return cls(in_features, out_features, bias, grouped, scales.t().contiguous(), native, dot_products)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, config: QuantConfig,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              native: bool = False, dot_products: bool = False) -> Int8WeightOnlyLinear:
        group = config.group_for(in_features)
        shape = (out_features,) if group is None else (-(-in_features // group), out_features)
        qshape = (out_features, in_features) if group is None else (*shape, group)
        return cls(in_features, out_features, _zero_bias(bias, out_features, device, dtype),
                   torch.zeros(qshape, dtype=torch.int8, device=device), torch.ones(shape, device=device), native,
                   dot_products)

    @property
    def grouped(self) -> bool:
        return self.native_grouped or self.scales.dim() == 2

    @property
    def group(self) -> int | None:
        """Input elements per scale (None: one scale per output channel)."""
        if not self.grouped:
            return None
        return self.saved_group

    def _kept_form(self, saved: torch.Tensor) -> torch.Tensor:
        """The saved ``qweight`` (int8 rows, or grouped ``[G, N, S]``) as this layer keeps it (rows, or tiles)."""
        rows = _groups_to_rows(qmath.pad_to(saved, 2, self.kept_group)) if self.native_grouped else saved
        return int8_tile_pack(rows) if self.tiled else rows

    @property
    def groups_padded(self) -> bool:
        """Whether the kept weight's columns are not x's: groups zero-padded to whole blocks, or K to whole groups."""
        return self.native_grouped and self.qweight.shape[1] != self.in_features

    def _spread(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` laid out as the kept weight's columns: K zero-padded to whole groups, then each group to
        ``kept_group`` columns."""
        x = qmath.pad_to(x, 1, self.saved_group)
        if self.kept_group == self.saved_group:
            return x
        groups = x.view(x.shape[0], x.shape[1] // self.saved_group, self.saved_group)  # counted: x may have no rows
        return F.pad(groups, (0, self.kept_group - self.saved_group)).flatten(1)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_grouped:
            return kernels.int8_grouped_dot_mm(self._spread(x), self.qweight, self.scales.to(x.dtype),
                                               self.widen_prompts, self.use_dot_products)
        if not self.grouped:  # int8_weight_mm takes the tiles too (a uint8 qweight)
            return kernels.int8_weight_mm(x, self.qweight, self.scales.to(x.dtype), self.use_native,
                                          self.use_dot_products, self.widen_prompts)
        return kernels.int8_grouped_mm(qmath.pad_to(x, 1, self.qweight.shape[2]), self.qweight,
                                       self.scales.to(x.dtype))

    def int8_rows(self) -> torch.Tensor:
        """``qweight`` as int8 rows ``[N, K]`` (per channel, the saved form): the tiles unpacked where the layer keeps
        tiles."""
        return int8_tile_unpack(self.qweight) if self.tiled else self.qweight

    def _saved_qweight(self) -> torch.Tensor:
        """``qweight`` as ``state_dict()`` holds it: int8 rows per channel, ``[G, N, S]`` grouped."""
        if self.native_grouped:
            return self._kept_groups()[..., : self.saved_group].transpose(0, 1).contiguous()
        return self.int8_rows()

    def _kept_groups(self) -> torch.Tensor:
        """A native grouped weight's int8 rows as ``[N, G, S']``, each group with its padding."""
        return self.int8_rows().reshape(self.out_features, -1, self.kept_group)

    def _saved_scales(self) -> torch.Tensor:
        """``scales`` as ``state_dict()`` holds them: ``[N]`` per channel, ``[G, N]`` grouped."""
        return int8_group_scales_unpack(self.scales, self.out_features) if self.native_grouped else self.scales

    def _saved_shapes(self) -> dict[str, tuple[int, ...]]:
        """The saved forms' shapes of the tensors this layer keeps in another layout."""
        if not self.native_grouped:
            return {"qweight": tuple(self.qweight.shape)}
        groups = self.scales.shape[1]
        return {"qweight": (groups, self.out_features, self.saved_group),
                "scales": (groups, self.out_features)}

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tiled or self.native_grouped:
            destination[prefix + "qweight"] = self._saved_qweight()
            destination[prefix + "scales"] = self._saved_scales()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        if self.tiled or self.native_grouped:  # the saved forms, repacked here (a mismatch is reported, never cast)
            state_dict = dict(state_dict)
            for name, wanted in self._saved_shapes().items():
                key, kept = prefix + name, getattr(self, name)
                if key not in state_dict:
                    continue
                saved, dtype = state_dict[key], torch.int8 if name == "qweight" else kept.dtype
                if fits_spec(saved, wanted, dtype):
                    saved = saved.to(kept.device)
                    state_dict[key] = self._kept_form(saved) if name == "qweight" else int8_group_scales_pack(saved)
                else:
                    error_msgs.append(f"{key}: saved {tuple(saved.shape)} {saved.dtype} does not fit this layer's "
                                      f"{wanted} {dtype}")
                    state_dict[key] = kept  # left as it is
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def dequantize(self) -> torch.Tensor:
        if not self.grouped:
            return qmath.dequantize_int8(self.int8_rows(), self.scales[:, None])
        q = self._kept_groups()[..., : self.saved_group] if self.native_grouped else self.qweight.transpose(0, 1)
        q = q.reshape(self.out_features, -1)
        return qmath.dequantize_int8(q, self._saved_scales().t())[:, : self.in_features]

    def weight_nbytes(self) -> int:
        return _nbytes(self.qweight) + _nbytes(self.scales)


class _RepackedWeight(QuantizedLinear):
    """A layer whose kernel layout differs from its saved form: ``state_dict`` writes the tensors of ``_saved_form``
    (``qweight``; int4 also ``scales_and_zeros``), and loading checks them against ``_saved_specs`` and hands them to
    ``_load_saved_form`` to repack. The packed tensors are bound to the device type they were packed on."""

    def _saved_form(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _saved_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def _load_saved_form(self, saved: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def saved_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """As the base class's, without converting the packed weight to its saved form."""
        plain = {name: (tuple(t.shape), t.dtype) for name, t in self._buffers.items()
                 if t is not None and name not in self._non_persistent_buffers_set}
        return {**plain, **self._saved_specs()}

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, tensor in self._saved_form().items():
            destination[prefix + name] = tensor

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        specs = self._saved_specs()
        saved = {}
        for name, (shape, dtype) in specs.items():
            key = prefix + name
            if key in unexpected_keys:
                unexpected_keys.remove(key)
            if key not in state_dict:
                missing_keys.append(key)
            elif self.takes_saved(name, state_dict[key]):
                saved[name] = state_dict[key].to(self.packed.device)
            else:
                error_msgs.append(f"{key}: saved {tuple(state_dict[key].shape)} {state_dict[key].dtype} does not fit "
                                  f"this layer's {shape} {dtype} (a different quantization scheme?)")
        if len(saved) == len(specs):
            self._load_saved_form(saved)

    def _check_device(self, x: torch.Tensor) -> None:
        if x.device.type != self.packed_on:
            raise RuntimeError(f"{type(self).__name__} was packed for {self.packed_on} but runs on {x.device.type}; "
                               "quantize on the target device (quantize(..., device=...)) or save and reload there")


class Int4WeightOnlyLinear(_RepackedWeight):
    """int4 weights in a kernel's layout, ``group`` input elements per bf16 scale and zero: splice's native tiles
    (``native``), else torch's int4 layout for the device.

    ``N`` and ``K`` are zero-padded to what the device's kernels need (CPU and CUDA differ). Saved form: ``qweight
    [N', K' / 2]`` uint8 (two values per byte, see ``qmath.pack_nibbles``) and ``scales_and_zeros [K' / group, N',
    2]``; the layer holds only the packed weight and scales (``packed``, ``packed_scales``; native tiles hold both in
    ``packed``, ``packed_scales`` empty) and converts on saving and loading. A saved form padded for another device
    loads too: its padding is cut or zero-extended to this layer's.
    """

    kind = "int4_weight_only"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, q: torch.Tensor,
                 scales_and_zeros: torch.Tensor, group: int, native: bool = False, dot_products: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.group = group
        self.use_native = native
        self.widen_prompts = native and _prompts_widened()
        # Decode rows rounded to int8 per block and multiplied in integers (groups of whole blocks only).
        self.use_dot_products = 8 if native and dot_products and group % qmath.ACTIVATION_BLOCK == 0 else 0
        _check_native(native, q.device)
        self.register_buffer("packed", torch.empty(0, dtype=torch.uint8), persistent=False)
        self.register_buffer("packed_scales", torch.empty(0, dtype=kernels.COMPUTE_DTYPE), persistent=False)
        self._pack(q, scales_and_zeros)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, config: QuantConfig,
                   native: bool = False, dot_products: bool = False, hessian: torch.Tensor | None = None,
                   act_order: bool = False) -> Int4WeightOnlyLinear:
        """Round-to-nearest, or GPTQ when given the input Hessian ``hessian [in, in]`` (see ``gptq.py``)."""
        out_features, in_features = weight.shape
        group = config.group_for(in_features)
        n_multiple, k_multiple = kernels.int4_padding(weight.device, group)
        padded = qmath.pad_to(qmath.pad_to(weight, 0, n_multiple), 1, k_multiple)
        if hessian is None:
            q, scales_and_zeros = qmath.quantize_int4(padded, group, config.symmetric)
        else:
            hessian = qmath.pad_to(qmath.pad_to(hessian.to(weight.device), 0, k_multiple), 1, k_multiple)
            q, scales_and_zeros = gptq.gptq_int4(padded, hessian, group, config.symmetric, act_order=act_order)
        return cls(in_features, out_features, bias, q, scales_and_zeros, group, native, dot_products)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, config: QuantConfig,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              native: bool = False, dot_products: bool = False) -> Int4WeightOnlyLinear:
        group = config.group_for(in_features)
        n, k = kernels.int4_padded_shape(out_features, in_features, group, torch.device(device))
        return cls(in_features, out_features, _zero_bias(bias, out_features, device, dtype),
                   torch.zeros(n, k, dtype=torch.uint8, device=device), torch.zeros(k // group, n, 2, device=device),
                   group, native, dot_products)

    def _pack(self, q: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        self.packed, self.packed_scales = kernels.int4_pack(q, scales_and_zeros, self.use_native)
        self.packed_on = q.device.type
        self.padded_shape = tuple(q.shape)
        # Saving reads torch's layout back directly when its AVX-512 form checks out here, else via the kernel.
        self.unpackable = not self.use_native and kernels.int4_unpack_verified(self.packed, q)

    def _q(self) -> torch.Tensor:
        n, k = self.padded_shape
        if self.use_native:
            return native.int4_tile_unpack(self.packed)
        if self.unpackable:
            return kernels.int4_unpack_cpu_layout(self.packed, k)
        return kernels.int4_unpack_by_kernel(self.packed, n, k, self.group)

    def _scales_and_zeros(self) -> torch.Tensor:
        """``[K' / group, N', 2]``, the saved form of the scales and zeros."""
        return kernels.int4_unpack_scales(self.packed, self.packed_scales, self.use_native)

    def _saved_form(self) -> dict[str, torch.Tensor]:
        return {"qweight": qmath.pack_nibbles(self._q()), "scales_and_zeros": self._scales_and_zeros()}

    def _saved_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n, k = self.padded_shape
        return {"qweight": ((n, k // 2), torch.uint8), "scales_and_zeros": ((k // self.group, n, 2), torch.bfloat16)}

    def takes_saved(self, name: str, saved: torch.Tensor) -> bool:
        """The saved weight and scales as any device's kernels pad them (so a checkpoint of another group size, whose
        padded shapes differ, is still refused)."""
        if name == "qweight":
            return (saved.dtype == torch.uint8 and saved.dim() == 2
                    and (saved.shape[0], 2 * saved.shape[1]) in self._padded_shapes())
        if name == "scales_and_zeros":
            return (saved.is_floating_point() and saved.dim() == 3 and saved.shape[2] == 2
                    and (saved.shape[1], saved.shape[0] * self.group) in self._padded_shapes())
        return super().takes_saved(name, saved)

    def _padded_shapes(self) -> set[tuple[int, int]]:
        """``(N', K')`` of this layer's features as each device's kernels pad them."""
        return {kernels.int4_padded_shape(self.out_features, self.in_features, self.group, torch.device(device))
                for device in ("cpu", "cuda")}

    def _load_saved_form(self, saved: dict[str, torch.Tensor]) -> None:
        n, k = self.padded_shape
        self._pack(qmath.fit_to(qmath.unpack_nibbles(saved["qweight"]), (n, k)),
                   qmath.fit_to(saved["scales_and_zeros"], (k // self.group, n, 2)))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        self._check_device(x)
        out = kernels.int4_mm(qmath.pad_to(x, 1, self.padded_shape[1]), self.packed, self.group,
                              self.packed_scales.to(x.dtype), self.use_native, self.use_dot_products,
                              self.widen_prompts)
        return out[:, : self.out_features]

    def dequantize(self) -> torch.Tensor:
        return qmath.dequantize_int4(self._q(), self._scales_and_zeros())[: self.out_features, : self.in_features]

    def weight_nbytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.packed_scales)


class Int8DynamicLinear(Int8WeightOnlyLinear):
    """W8A8: int8 weights with one scale per output channel (``qweight [N, K]``, ``scales [N]``), times activations
    rounded to int8 on every call, one symmetric scale per row and block of ``qmath.ACTIVATION_BLOCK`` input elements
    (as llama.cpp's Q8_0 activations). Decode rows on the native kernels multiply in integers (``int8_dot_gemv``);
    otherwise the rounded activations go through the per-channel int8 kernels (de-quantise + one GEMM for prefill;
    torch's kernels elsewhere), so every CPU and CUDA computes the same thing up to the float rounding of the sums.

    Why blocks, not one scale per row (torch's and oneDNN's dynamic quantization): one outlier channel sets a row's
    scale and flattens every other value in it, and the model's outputs then swing with tiny numerical differences
    (the same model's perplexity moved by several percent between two CPUs' float rounding). With blocks of 32 the
    activation rounding costs far less and no longer depends on the CPU.
    """

    kind = "int8_dynamic"

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, config: QuantConfig,
                   native: bool = False, dot_products: bool = False) -> Int8DynamicLinear:
        q, scales = qmath.quantize_int8(weight)
        return cls(weight.shape[1], weight.shape[0], bias, q, scales[:, 0], native, dot_products)

    def _dot_rows(self) -> bool:
        return self.in_features % qmath.ACTIVATION_BLOCK == 0  # every decode row on the native kernels

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.int8_dynamic_mm(x, self.qweight, self.scales.to(x.dtype), self.use_native, self.widen_prompts)


def _prompts_widened() -> bool:
    """Prefill as float32 GEMMs on widened slabs of the weight (``native.prompts_widened``); fixed when a layer is
    built."""
    return native.available() and native.prompts_widened()


def _check_native(native_kernels: bool, device: torch.device) -> None:
    if native_kernels and not native.available_on(device):
        raise ValueError(f"native=True asks for splice's native CPU kernels, which do not run for weights on {device} "
                         "here; allowed: native=False (torch's kernels), or see splice.kernel_choice.quant_kernel")


def _zero_bias(bias: bool, out_features: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor | None:
    return torch.zeros(out_features, device=device, dtype=dtype) if bias else None


def fits_spec(saved: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Same shape, and the same dtype (any float dtype where a float one is expected: scales are cast on loading)."""
    same_kind = saved.dtype == dtype or (saved.is_floating_point() and dtype.is_floating_point)
    return tuple(saved.shape) == shape and same_kind


def padded_group(group: int) -> int:
    """The columns a group of ``group`` inputs takes in the native grouped GEMV's rows: whole blocks of 32 (x is
    rounded per block, each block's sum taking one group's scale), zero-padded; 0 where that would add more than half
    the group's bytes (groups of fewer than 22 inputs, or of 33 to 42: torch's per-group kernel keeps those), or for no
    group."""
    block = qmath.ACTIVATION_BLOCK
    padded = -(-group // block) * block
    return padded if group and 2 * padded <= 3 * group else 0


def _groups_to_rows(grouped: torch.Tensor) -> torch.Tensor:
    """A grouped int8 weight ``[G, N, S]`` as the rows ``[N, G * S]`` the native grouped GEMV reads."""
    groups, n, size = grouped.shape
    return grouped.transpose(0, 1).reshape(n, groups * size).contiguous()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
