"""Parallel state, passed explicitly: never global.

:func:`build_parallel_context` turns the config into a :class:`ParallelContext`: it honours a user's
``tensor_parallel.tp_group`` (or ``mpu``) as given, otherwise initialises the default group under ``torchrun``
(env:// rendezvous; gloo on CPU, NCCL on CUDA) with a bounded collective timeout, and splits the world into
consecutive tensor-parallel groups (data-parallel replicas of the model when the world is a multiple of ``tp_size``).

A world that is *not* a multiple of ``tp_size`` is refused, on every rank alike, before any tensor-parallel group is
made (world 5, tp 2: groups [0, 1], [2, 3] would leave rank 4 without a group). The alternatives are worse for the
user: giving rank 4 a smaller group (tp 1) means it must hold the whole model, which tensor parallelism was asked for
because it does not fit; leaving it idle means ``init_inference`` returns something that is not a model on that rank,
so the user's script fails later and less clearly (or waits forever for a peer). The error names the groups, the
rank(s) left over, the ``tp_size`` values that divide the world and the world sizes that fit ``tp_size``.

The collective timeout (seconds) is ``$SPLICE_DIST_TIMEOUT_S``, default 30: a rank whose peer died or raised fails
within that time instead of hanging (under ``torchrun`` the launcher also stops the other ranks as soon as one fails).
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

TIMEOUT_ENV = "SPLICE_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(ValueError):
    """The processes torchrun started cannot run ``tp_size`` (not started by torchrun, too few, a world it does not
    divide): decided from the environment alone, so every rank raises the same error."""


@dataclass(frozen=True)
class ParallelContext:
    """Who this process is within its tensor-parallel group.

    ``group`` is a ``torch.distributed`` process group, or ``None`` for a single process. ``replica`` /
    ``replicas``: which of the data-parallel copies of the model this group is, and how many there are.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None
    replica: int = 0
    replicas: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the group (no-op for one process)."""
        if self.enabled:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along the last dimension; rank ``i`` holds ``sizes[i]`` columns."""
        if not self.enabled:
            return tensor
        padded = F.pad(tensor, (0, max(sizes) - tensor.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank of the group."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group or dist.group.WORLD, 0), group=self.group)
        return box[0]

    def sync_rng(self) -> None:
        """Give every rank rank 0's random state, so sampling picks the same token everywhere (as DeepSpeed does)."""
        if not self.enabled:
            return
        torch.set_rng_state(self.broadcast_object(torch.get_rng_state()))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(self.broadcast_object(torch.cuda.get_rng_state()))

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)


SINGLE_PROCESS = ParallelContext()


def timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"${TIMEOUT_ENV}={value!r} is not a positive number of seconds")
    return seconds


def build_parallel_context(config, device: torch.device | str = "cpu") -> ParallelContext:
    """The tensor-parallel context for ``config`` (an ``InferenceConfig``); ``device`` (only its type matters) picks
    the backend. Call it before resolving the CUDA device: under torchrun it makes ``cuda:$LOCAL_RANK`` current."""
    tp_config = config.tensor_parallel
    group = user_group(tp_config)
    if group is not None:
        return _context_from_group(group, tp_config.tp_size)
    tp = tp_config.tp_size
    if tp == 1:
        return SINGLE_PROCESS
    init_default_group(torch.device(device), tp)
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = tp_groups(world, tp)
    mine = _new_groups(groups, rank)
    return ParallelContext(rank % tp, tp, mine, rank // tp, len(groups))


def user_group(tp_config) -> Any:
    """The process group the user gave: ``tp_group``, else the ``mpu``'s tensor/model-parallel group, else None."""
    if tp_config.tp_group is not None:
        return tp_config.tp_group
    mpu = tp_config.mpu
    if mpu is None:
        return None
    for getter in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        if callable(getattr(mpu, getter, None)):
            return getattr(mpu, getter)()
    raise TypeError(f"tensor_parallel.mpu={mpu!r} has neither get_tensor_model_parallel_group() nor "
                    "get_model_parallel_group()")


def _context_from_group(group: Any, tp: int) -> ParallelContext:
    if not dist.is_initialized():
        raise ValueError("tensor_parallel.tp_group/mpu was given but torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group first")
    size = dist.get_world_size(group)
    if tp not in (1, size):
        raise ValueError(f"tensor_parallel.tp_size={tp} does not match the given tp_group, which has {size} ranks; "
                         f"allowed: tp_size={size} or leave it at 1")
    world = dist.get_world_size()
    return ParallelContext(dist.get_rank(group), size, group, dist.get_rank() // size, max(1, world // size))


def init_default_group(device: torch.device, tp: int) -> None:
    """Initialise the default process group from torchrun's environment, unless it already is."""
    if dist.is_initialized():
        return
    check_launch(tp)
    if device.type == "cuda":  # one GPU per process: LOCAL_RANK's (resolve_device afterwards picks it up)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s()))
    # The group splice made is splice's to close: DeepSpeed-style scripts never destroy it, and a process that exits
    # with it open can abort in its communication threads' destructors ("terminate called without an active
    # exception") after its work is done.
    atexit.register(_destroy_default_group)


def check_launch(tp: int, command: str | None = None) -> None:
    """Raise :class:`LaunchError` unless torchrun's environment can run ``tp`` ranks: callers check it before loading
    a model, which a refused launch would load for nothing. ``command``: what the advice runs under torchrun (the
    command line's own), else a user script, which may pass its own tp_group instead."""
    if tp == 1 or dist.is_initialized():
        return
    missing = [key for key in _TORCHRUN_ENV if key not in os.environ]
    if missing:
        how = f"`torchrun --nproc-per-node {tp} {command}`" if command else \
            f"`torchrun --nproc-per-node {tp} your_script.py`, or pass tp_group"
        raise LaunchError(f"tensor_parallel.tp_size={tp} needs torch.distributed, but this process was not started "
                          f"by torchrun (environment lacks {', '.join(missing)}); launch it with {how}")
    tp_groups(int(os.environ["WORLD_SIZE"]), tp)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def local_device(device: torch.device | str) -> torch.device:
    """This process's device: ``cuda`` becomes ``cuda:$LOCAL_RANK`` under torchrun; others stay as they are."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def tp_groups(world: int, tp: int) -> list[list[int]]:
    """Consecutive groups of ``tp`` ranks: world 4, tp 2 -> [[0, 1], [2, 3]]."""
    if tp > world:
        raise LaunchError(f"tensor_parallel.tp_size={tp} is larger than the world size {world} (processes started); "
                          f"allowed: 1..{world}, or start {tp} processes (torchrun --nproc-per-node {tp})")
    groups = [list(range(start, start + tp)) for start in range(0, world - world % tp, tp)]
    if world % tp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        left = list(range(world - world % tp, world))
        fits = [world - world % tp, world - world % tp + tp] if world >= tp else [tp]
        raise LaunchError(f"tensor_parallel.tp_size={tp} does not divide the world size {world}: the consecutive "
                          f"tensor-parallel groups {groups} would leave rank(s) {left} with no group; allowed "
                          f"tp_size values for {world} processes: {divisors}, or start a multiple of {tp} processes "
                          f"({' or '.join(map(str, fits))})")
    return groups


def _new_groups(groups: list[list[int]], rank: int) -> Any:
    """Create every group (a collective call: all ranks create all groups, in order); return this rank's."""
    if len(groups) == 1:
        return None  # the default group
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s()))
        if rank in ranks:
            mine = group
    return mine
