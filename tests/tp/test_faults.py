"""Faults: bad sizes and policies raise clear errors on every rank; a rank that raises ends the group non-zero
within 60 s, under torch.multiprocessing and under torchrun."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tp import suite, workers
from tests.tp.launch import free_port, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
SCRIPT = Path(__file__).with_name("torchrun_script.py")


def test_bad_sizes_and_policies_raise_on_every_rank():
    results = [r["bad"] for r in suite.tp2()]
    assert results[0] == results[1]
    messages = results[0]
    assert "tp_size=2 is larger than the model's 1 attention heads" in messages["too_many_ranks_for_heads"]
    assert "['mlp.down']" in messages["policy_bad_name"] and "mlp.down_proj" in messages["policy_bad_name"]
    assert "GRU matches no module" in messages["policy_wrong_class"]
    assert "LlamaDecoderLayer" in messages["policy_wrong_class"]
    assert "tp_size=3 is larger than the world size 2" in messages["tp_larger_than_world"]


def test_a_world_that_tp_size_does_not_divide_is_refused_on_every_rank():
    """3 processes, tp_size=2: every rank raises the same error naming the rank left over (none hangs in a
    collective: the groups are checked before any is made), and the processes stay usable."""
    messages = {r["not_divisible"] for r in suite.tp3()}
    assert len(messages) == 1
    message = messages.pop()
    assert "tp_size=2 does not divide the world size 3" in message and "[[0, 1]] would leave rank(s) [2]" in message


def test_a_rank_that_raises_ends_the_group():
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_ranks(workers.raise_after_parity, 2, timeout=90, env={"SPLICE_DIST_TIMEOUT_S": "20"})
    assert time.monotonic() - start < 60
    text = str(failure.value)
    assert "rank 1 fails on purpose" in text and "--- rank 0" in text  # rank 0 failed too, not hung


def test_torchrun_parity_then_a_failing_rank_ends_the_group():
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert "PARITY ok rank 0" in done.stdout and "PARITY ok rank 1" in done.stdout, done.stderr[-3000:]
    assert done.returncode != 0 and time.monotonic() - start < 60
    assert "rank 1 fails on purpose" in done.stderr


def test_torchrun_cli_with_more_tp_than_processes_says_so_once():
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "splice.cli", "generate", "--tp", "4", "--model", "no-such-model",
                           "Hi"], capture_output=True, text=True, timeout=120)
    said = [line for line in done.stderr.splitlines() if line.startswith("splice: error:")]
    assert done.returncode != 0 and len(said) == 1, done.stderr[-3000:]
    assert "tp_size=4 is larger than the world size 2" in said[0]  # before the (unknown) model is looked up
