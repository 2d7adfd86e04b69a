"""The serving scheduler under tensor parallelism (tp=2 on gloo, real processes): rank 0 schedules and broadcasts each
step's plan, rank 1 follows; greedy outputs equal the single-process engine's, and a follower that dies mid-run ends
rank 0's requests with an error within the collective timeout."""
from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest
import torch

from tests.tp.launch import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = [[5, 17, 33, 9, 90, 41, 7], [12, 13, 14], [77, 6, 5, 4, 3, 2, 99, 98, 97], [40, 41]]
NEW_TOKENS = [6, 9, 4, 7]
IDLE_TIMEOUT_S = 4


def tp_engine(model, world: int):
    import splice

    return splice.init_inference(model, tensor_parallel={"tp_size": world}, replace_with_kernel_inject=True,
                                 dtype=torch.float32, max_out_tokens=64)


def greedy_requests(rank: int, world: int) -> dict | None:
    """Rank 0: the single-process engine's greedy tokens, then the same requests through the tp Scheduler (two rows,
    so rows join and leave), idling longer than the collective timeout halfway; rank 1 follows."""
    import splice
    from splice.serve.scheduler import SamplingParams, Scheduler, follow
    from tests.arch.tiny_models import build_family

    model = build_family("llama")
    expected = None
    if rank == 0:
        alone = splice.init_inference(copy.deepcopy(model), dtype=torch.float32, replace_with_kernel_inject=True,
                                      max_out_tokens=64)
        expected = [alone.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None)
                    [0, len(p):].tolist() for p, n in zip(PROMPTS, NEW_TOKENS)]
    engine = tp_engine(model, world)
    if rank != 0:
        follow(engine)
        return None
    scheduler = Scheduler(engine, max_batch=2)
    scheduler.start()
    handles = [scheduler.submit(p, SamplingParams(n, temperature=0)) for p, n in zip(PROMPTS, NEW_TOKENS)]
    got = [[event.token_id for event in handle] for handle in handles[:2]]
    time.sleep(1.5 * IDLE_TIMEOUT_S)  # idle past the collective timeout: the follower must still be there
    got += [[event.token_id for event in handle] for handle in handles[2:]]
    scheduler.shutdown()
    return {"expected": expected, "got": got, "failed": repr(scheduler.failed)}


def follower_dies(rank: int, world: int, out: str) -> None:
    """Rank 1 exits abruptly after a few steps; rank 0 writes what its requests ended with to ``out``."""
    from splice.serve import batch
    from splice.serve.scheduler import SamplingParams, Scheduler, follow
    from tests.arch.tiny_models import build_family

    engine = tp_engine(build_family("llama"), world)
    if rank != 0:
        run = batch.BatchRunner.run
        calls = []

        def run_then_die(self, plan):
            calls.append(plan)
            if len(calls) == 5:
                os._exit(3)
            return run(self, plan)

        batch.BatchRunner.run = run_then_die
        follow(engine)
        return
    scheduler = Scheduler(engine, max_batch=2)
    scheduler.start()
    start = time.monotonic()
    handles = [scheduler.submit([5 + i, 6, 7], SamplingParams(50, temperature=0)) for i in range(3)]
    finals = [list(handle)[-1] for handle in handles]
    seconds = time.monotonic() - start
    try:
        scheduler.submit([5], SamplingParams(2, temperature=0))
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    Path(out).write_text(json.dumps({"reasons": [event.finish_reason for event in finals],
                                     "errors": [event.error for event in finals], "seconds": seconds,
                                     "failed": repr(scheduler.failed), "refused": refused}))
    os._exit(0)  # the group is broken: leave without tearing it down


def test_tp2_greedy_requests_equal_the_single_process_engine():
    results = run_ranks(greedy_requests, 2, timeout=180, env={"SPLICE_DIST_TIMEOUT_S": str(IDLE_TIMEOUT_S)})
    assert results[1] is None
    assert results[0]["got"] == results[0]["expected"] and results[0]["failed"] == "None"


def test_a_follower_that_dies_ends_rank_0s_requests_with_an_error(tmp_path):
    out = tmp_path / "rank0.json"
    with pytest.raises(AssertionError, match=r"exit codes \[0, 3\]"):
        run_ranks(follower_dies, 2, str(out), timeout=120, env={"SPLICE_DIST_TIMEOUT_S": "10"})
    result = json.loads(out.read_text())
    assert result["reasons"] == ["error"] * 3 and all("failed" in error for error in result["errors"])
    assert result["seconds"] < 30 and result["failed"] != "None"
    assert "takes no more requests" in result["refused"]
