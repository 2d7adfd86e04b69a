"""splice.distributed: building the ParallelContext (groups, torchrun environment, user groups) and its collectives."""
from __future__ import annotations

import pytest
import torch

from splice.config import resolve_config
from splice.distributed import SINGLE_PROCESS, build_parallel_context, local_device, timeout_s, tp_groups

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def test_tp1_is_the_single_process_context():
    ctx = build_parallel_context(resolve_config({}), "cpu")
    assert ctx is SINGLE_PROCESS and not ctx.enabled
    t = torch.ones(3)
    assert ctx.all_reduce(t) is t and torch.equal(ctx.all_gather_last(t, [3]), t)


def test_tp2_outside_torchrun_says_how_to_launch(monkeypatch):
    for key in TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match=r"tp_size=2 needs torch.distributed.*torchrun --nproc-per-node 2"):
        build_parallel_context(resolve_config({"tensor_parallel": {"tp_size": 2}}), "cpu")


def test_groups_are_consecutive_replicas():
    assert tp_groups(4, 2) == [[0, 1], [2, 3]]
    assert tp_groups(3, 3) == [[0, 1, 2]]
    assert tp_groups(6, 3) == [[0, 1, 2], [3, 4, 5]]


def test_bad_group_sizes_name_the_values():
    with pytest.raises(ValueError, match=r"tp_size=4 is larger than the world size 2.*allowed: 1..2"):
        tp_groups(2, 4)
    with pytest.raises(ValueError, match=r"tp_size=2 does not divide the world size 3.*allowed tp_size values for 3 "
                                         r"processes: \[1, 3\], or start a multiple of 2 processes \(2 or 4\)"):
        tp_groups(3, 2)


def test_a_world_that_is_not_a_multiple_of_tp_size_is_refused_naming_the_rank_left_over():
    """World 5, tp 2: [0, 1] and [2, 3] would be replicas, rank 4 would have no group. Refused (see the
    splice.distributed docstring for why neither a tp=1 group nor an idle rank 4 is offered)."""
    with pytest.raises(ValueError, match=r"groups \[\[0, 1\], \[2, 3\]\] would leave rank\(s\) \[4\] with no group; "
                                         r"allowed tp_size values for 5 processes: \[1, 5\], or start a multiple of 2 "
                                         r"processes \(4 or 6\)"):
        tp_groups(5, 2)
    with pytest.raises(ValueError, match=r"groups \[\[0, 1, 2\]\] would leave rank\(s\) \[3, 4\]"):
        tp_groups(5, 3)
    assert tp_groups(6, 2) == [[0, 1], [2, 3], [4, 5]]


def test_local_device_follows_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_device("cuda") == torch.device("cuda", 3)
    assert local_device("cuda:1") == torch.device("cuda", 1)
    assert local_device("cpu") == torch.device("cpu")


def test_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPLICE_DIST_TIMEOUT_S", "7.5")
    assert timeout_s() == 7.5
    monkeypatch.setenv("SPLICE_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="'soon' is not a positive number"):
        timeout_s()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_user_group_and_mpu_are_honoured_and_collectives_work():
    from tests.tp import suite

    results = [r["distributed"] for r in suite.tp2()]
    for rank, r in enumerate(results):
        assert r["same_group"] and r["mpu_group"], r
        assert (r["rank"], r["size"]) == (rank, 2)
        assert "tp_size=3 does not match the given tp_group, which has 2 ranks" in r["mismatch"]
        assert r["gathered"] == [0.0, 1.0, 1.0]
    assert results[0]["random"] == results[1]["random"]  # rank 0's RNG state was broadcast
