"""Pieces that let ``torch.compile`` trace splice's decode step.

``packed_linear`` wraps oneDNN's linear on a pre-packed (opaque, ``torch._mkldnn`` layout) weight as a custom op:
inductor cannot lower ``mkldnn._linear_pointwise`` on a weight it did not pack itself, but it calls a custom op as
is. So the compiled step runs the very weights the eager path packed at injection (no second, frozen copy) while
inductor fuses everything between the GEMVs.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("splice::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T + b`` for a weight packed by ``mkldnn._reorder_linear_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_fake(x, weight, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))
