"""The harness itself: a failing rank's traceback reaches the report, hangs fail."""
import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import WorldFailed, run_world


def _sum_ranks(rank, world_size):
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("planted failure on rank one")
    dist.barrier()  # the other ranks block here until they are killed


def _rank1_raises_while_rank0_sleeps(rank, world_size):
    if rank == 1:
        raise ValueError("planted failure on rank one")
    time.sleep(60)  # sends nothing: the report says how its process stands


def _rank0_hangs(rank, world_size):
    if rank == 0:
        time.sleep(600)


def test_results_come_back_from_every_rank():
    assert run_world(_sum_ranks, 3) == [6, 6, 6]


def test_failing_rank_traceback_is_reported():
    with pytest.raises(WorldFailed, match=r"(?s)rank 1 of 2 failed.*planted failure on rank one"):
        run_world(_rank1_raises, 2, timeout=30)


def test_a_rank_that_sent_nothing_is_described_by_its_process():
    with pytest.raises(WorldFailed, match=r"(?s)planted failure on rank one.*"
                                          r"rank 0 sent no result: still running"):
        run_world(_rank1_raises_while_rank0_sleeps, 2, timeout=30)


def test_hung_world_fails_with_timeout():
    start = time.monotonic()
    with pytest.raises(WorldFailed, match=r"hung: ranks \[0\]"):
        run_world(_rank0_hangs, 2, timeout=5)
    assert time.monotonic() - start < 20
