"""Start real worker processes (torch.multiprocessing, spawn) that form a gloo group on a free local port.

``run_ranks(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` processes with torchrun's environment
variables set (so ``splice.distributed.build_parallel_context`` initialises the group as under torchrun), one torch
thread each, and a hard deadline. It returns every rank's return value, or raises with the failing ranks' tracebacks.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, args: tuple, out: str, env: dict) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1", **env})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 120, env: dict | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; see the module docstring."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, out, env or {})) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {r: Path(out, f"{r}.err").read_text() for r in range(world) if Path(out, f"{r}.err").exists()}
        if hung or errors or any(p.exitcode for p in procs):
            detail = "\n".join(f"--- rank {r}:\n{text}" for r, text in errors.items())
            raise AssertionError(f"ranks hung past {timeout}s: {hung}; exit codes {[p.exitcode for p in procs]}\n"
                                 f"{detail}")
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]
