"""GPTQ for int4 weights: calibration-based rounding that compensates each column's error on the columns not yet
quantized (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers").

For a linear ``y = x W^T`` the output error of a quantized ``Q`` over calibration inputs ``X`` is
``tr((W - Q) H (W - Q)^T)`` with ``H = X^T X``. GPTQ quantizes ``W`` one input column at a time (groupwise scale and
zero as ``qmath.int4_params`` fits them, taken when a group starts, from the already-updated weights) and spreads the
column's rounding error over the remaining columns through the upper Cholesky factor of ``H^-1``. The output is the
same codes + scales/zeros that round-to-nearest produces, so the packed layout, kernels and saving are unchanged.

``run_calibration`` runs the model's own float forward once over calibration token ids and accumulates ``H`` for
every target linear through forward hooks; every linear is then quantized against its own ``H``. (Sequential
calibration, block by block through the already-quantized blocks, was tried: with torch's int4 kernels at 2048 rows
it took ~10 minutes on SmolLM2-135M here.)
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from .. import native
from ..layers.widened_linear import prompts_in_float32
from . import qmath

DAMP = 0.1  # fraction of the mean Hessian diagonal added to its diagonal (GPTQ's percdamp; 0.01 overfit the few
#            thousand calibration tokens we have: held-out output error of a SmolLM2 down_proj rose above RTN's)
BLOCK = 128  # columns per lazy batch update (rounded to whole groups)


def gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group: int, symmetric: bool, act_order: bool = False,
              damp: float = DAMP, native_sweep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ-quantize ``weight [N, K]`` with input Hessian ``hessian [K, K]``; same return as ``qmath.quantize_int4``:
    ``(q [N, K] uint8 values 0..15, scales_and_zeros [K / group, N, 2] float32)``.

    Scales and zeros are rounded to bf16 (what the layer stores) before the codes are chosen, so the compensated error
    is the one the kernel will really see. ``act_order``: quantize columns by decreasing ``H`` diagonal, with every
    group's scale and zero fixed up front from the original weights (so groups stay contiguous in the layout).
    ``native_sweep``: each block's column-by-column sweep runs as one native call where the native kernels are
    available (the same codes as the torch loop, whose per-column calls cost many times more), else in torch.
    """
    n, k = weight.shape
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += torch.eye(k, dtype=h.dtype, device=h.device) * (damp * torch.diagonal(h).mean())
    static = None
    if act_order:
        static = _bf16_params(w.reshape(n, k // group, group), symmetric)  # each [N, K / group]
        perm = torch.argsort(torch.diagonal(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
        column_group = perm // group
        column_params = static[0][:, column_group], static[1][:, column_group]  # [N, K], in quantization order
        order = perm.tolist()
    else:
        order = range(k)
    hinv = _upper_cholesky_of_inverse(h)
    q = torch.zeros(n, k, dtype=torch.float32, device=w.device)
    scales = torch.zeros(n, k // group, device=w.device)
    zeros = torch.zeros(n, k // group, device=w.device)
    block = group * max(1, BLOCK // group)  # whole groups
    sweep = _native_sweep if native_sweep and w.device.type == "cpu" and native.available() else _torch_sweep
    for start in range(0, k, block):
        stop = min(start + block, k)
        columns = order[start:stop]
        w1, hinv1 = w[:, start:stop].contiguous(), hinv[start:stop, start:stop].contiguous()
        codes, err1 = torch.empty_like(w1), torch.empty_like(w1)
        if static is not None:
            sweep(w1, hinv1, 0, stop - start, column_params[0][:, start:stop].contiguous(),
                  column_params[1][:, start:stop].contiguous(), codes, err1)
        else:
            _sweep_by_group(sweep, w1, hinv1, columns, group, symmetric, scales, zeros, codes, err1)
        q[:, columns] = codes
        w[:, stop:] -= err1 @ hinv[start:stop, stop:]
    if static is not None:
        scales, zeros = static
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return q.to(torch.uint8), scales_and_zeros


def _sweep_by_group(sweep, w1: torch.Tensor, hinv1: torch.Tensor, columns, group: int, symmetric: bool,
                    scales: torch.Tensor, zeros: torch.Tensor, codes: torch.Tensor, err1: torch.Tensor) -> None:
    """The block's sweep one group at a time (columns in weight order): each group's scale and zero fitted, as its
    first column comes, to the (already compensated) weights it holds then, and written into ``scales`` / ``zeros``."""
    for i in range(0, len(columns), group):
        g = columns[i] // group
        s, z = _bf16_params(w1[:, i:i + group].unsqueeze(1), symmetric, search=True)
        scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
        sweep(w1, hinv1, i, min(i + group, len(columns)), s.contiguous(), z.contiguous(), codes, err1)


def _native_sweep(w1, hinv1, first, end, scales, zeros, codes, err1) -> None:
    """:func:`_torch_sweep` as one native call (``splice_kernels.gptq_columns``), with the same codes."""
    torch.ops.splice_kernels.gptq_columns(w1, hinv1, first, end, scales, zeros, codes, err1)


def _torch_sweep(w1: torch.Tensor, hinv1: torch.Tensor, first: int, end: int, scales: torch.Tensor,
                 zeros: torch.Tensor, codes: torch.Tensor, err1: torch.Tensor) -> None:
    """GPTQ's sweep over columns ``[first, end)`` of the block ``w1 [N, B]``: each column rounded to its code (into
    ``codes``) with its scale and zero (``scales`` / ``zeros`` ``[N, end - first]``, or ``[N, 1]`` for all), and its
    rounding error, scaled by ``hinv1``'s diagonal (into ``err1``), spread over the block's later columns."""
    for i in range(first, end):
        p = 0 if scales.shape[1] == 1 else i - first
        scale, zero, column = scales[:, p], zeros[:, p], w1[:, i]
        code = torch.sub(column, zero, out=codes[:, i]).div_(scale).add_(8).round_().clamp_(0, 15)
        value = (code - 8).mul_(scale).add_(zero)
        err = torch.sub(column, value, out=err1[:, i]).div_(hinv1[i, i])
        if i + 1 < w1.shape[1]:
            w1[:, i + 1:] -= err[:, None] * hinv1[i, i + 1:]


def _bf16_params(grouped: torch.Tensor, symmetric: bool, search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros fitted to ``grouped`` (``search``: the symmetric scale search, for a group fitted as it
    starts), in bf16 precision; scales keep their sign (a negative one puts the largest magnitude on code -8)."""
    scales, zeros = qmath.int4_params(grouped, symmetric, search=search)
    bf16 = torch.bfloat16
    scales = scales.to(bf16).float()
    tiny = torch.finfo(bf16).tiny
    return torch.where(scales.abs() < tiny, torch.full_like(scales, tiny), scales), zeros.to(bf16).float()


def _upper_cholesky_of_inverse(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of ``h^-1``, adding more damping if ``h`` is numerically not positive definite."""
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    extra = 0.0
    for _ in range(6):
        lower, info = torch.linalg.cholesky_ex(h + extra * eye)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper
        extra = max(extra * 10, 1e-2 * float(torch.diagonal(h).mean()))
    raise ValueError("GPTQ: the calibration Hessian is not positive definite even after damping; calibrate on "
                     "more tokens")


class HessianHooks:
    """Forward hooks that accumulate ``X^T X`` (float32, summed over every input row) for each named linear.

    Linears called one after another on the very same input tensor (q/k/v, gate/up) share one matrix."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.hessians: dict[str, torch.Tensor] = {}
        self._last: tuple | None = None
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            x = inputs[0]
            if self._last is not None and self._last[0] is x:
                self.hessians.setdefault(name, self.hessians[self._last[1]])  # the same object: counted once
                return
            rows = x.detach().reshape(-1, x.shape[-1]).float()
            if name not in self.hessians:
                self.hessians[name] = torch.zeros(rows.shape[1], rows.shape[1], device=rows.device)
            self.hessians[name].addmm_(rows.t(), rows)
            self._last = (x, name)
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._last = None


def run_calibration(model: nn.Module, calibration_ids: torch.Tensor, modules: dict[str, nn.Module],
                    batch_size: int = 4, head_needed: bool = True) -> dict[str, torch.Tensor]:
    """``{name: H}`` for ``modules`` from the model's own forward over ``calibration_ids [B, T]``, ``batch_size``
    sequences at a time (16-bit linears in float32 on a CPU without 16-bit arithmetic: ``prompts_in_float32``).
    Without ``head_needed`` a Hugging Face model computes the logits of each sequence's last token only
    (``logits_to_keep=1``): the output head's product over every token is a large share of the work, for nothing."""
    hooks = HessianHooks(modules)
    device = next(model.parameters(), torch.empty(0)).device
    options = {} if head_needed or "logits_to_keep" not in inspect.signature(model.forward).parameters else {
        "logits_to_keep": 1}
    try:
        with torch.no_grad(), prompts_in_float32(model):
            for rows in calibration_ids.split(batch_size):
                model(rows.to(device), **options)
    finally:
        hooks.remove()
    missing = sorted(set(modules) - set(hooks.hessians))
    if missing:
        raise ValueError(f"GPTQ calibration: the model's forward never called {missing[:3]}"
                         f"{' ...' if len(missing) > 3 else ''}; these linears cannot be calibrated")
    return hooks.hessians
