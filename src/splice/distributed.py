"""Parallel state, passed explicitly: never global."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelContext:
    """Who this process is within its tensor-parallel group.

    ``group`` is a ``torch.distributed`` process group, or ``None`` for a single process.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the group (no-op for one process)."""
        if self.enabled:
            torch.distributed.all_reduce(tensor, group=self.group)
        return tensor


SINGLE_PROCESS = ParallelContext()
