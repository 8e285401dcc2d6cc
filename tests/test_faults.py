"""A dead or stuck peer: every other rank raises, soon, saying who it waited for.

Rank `victim` of a 3-rank world dies (SIGKILL) or stops at a chosen point; the
survivors must raise from the wrapper's constructor, forward or backward
within the configured timeout (5 s here), with a message naming the bucket,
the algorithm and the peer, and then exit cleanly (the harness fails a rank
that hangs on its way out).
"""
import os
import signal
import time

import pytest
import torch

import minddp
from minddp import registry
from dist_harness import run_world
from models import DeepNet, batch

TIMEOUT = 5


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_survivors(rank, survivors, meeting):
    """Stay alive until every survivor has failed too. The store that names the
    peer lives in rank 0's process; and on a tree a rank may only notice the
    death through its parent, which must not vanish first. A file per rank
    serves as the meeting point: the process group is broken by now."""
    open(os.path.join(meeting, str(rank)), "w").close()
    deadline = time.monotonic() + 2 * TIMEOUT
    while time.monotonic() < deadline and len(os.listdir(meeting)) < survivors:
        time.sleep(0.05)


def _fault(rank, world_size, when, victim, meeting, algorithm):
    doomed = rank == victim
    torch.distributed.barrier()  # every rank is past the harness's own set-up
    if doomed and when == "construction":
        _die()
    if doomed and when == "setup":  # dies as auto times its candidates with the others
        from minddp import reduction
        reduction.setup_collective = lambda *args, **kwargs: _die()
    t0 = time.monotonic()
    try:
        ddp = minddp.DDP(DeepNet(), bucket_cap_mb=0.002, timeout=TIMEOUT, algorithm=algorithm)
        for step in range(3):
            out = ddp(*batch("deep", rank, step))
            if doomed and step == 1 and when == "before_backward":
                _die()
            if doomed and step == 1 and when == "stuck":
                time.sleep(4 * TIMEOUT)
                _die()
            if doomed and step == 1 and when == "mid_backward":
                # dies once backward has reached the middle of the network
                ddp.module.layers[4].weight.register_hook(lambda grad: _die())
            t0 = time.monotonic()
            out.square().mean().backward()
    except Exception as e:  # noqa: BLE001 - what each survivor saw is the result
        elapsed = time.monotonic() - t0
        _wait_for_survivors(rank, world_size - 1, meeting)
        return elapsed, str(e)
    return None, "no error"


@pytest.mark.parametrize("when, victim, algorithm", [
    ("construction", 2, "auto"), ("setup", 2, "auto"), ("before_backward", 2, "auto"),
    ("mid_backward", 1, "auto"),
    ("stuck", 2, "auto"), ("before_backward", 0, "auto"),
    *[("before_backward", 2, name) for name in registry.algorithm_names()
      if registry.algorithm(name).bind is None]])
def test_survivors_raise_naming_the_peer(when, victim, algorithm, tmp_path):
    results = run_world(_fault, 3, when, victim, str(tmp_path), algorithm, timeout=60,
                        expect_dead=(victim,))
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        elapsed, error = result
        assert elapsed is not None, f"rank {rank} trained on without its peer: {error}"
        assert elapsed < TIMEOUT + 3, f"rank {rank} took {elapsed:.1f}s to notice"
        assert f"minddp (rank {rank})" in error, error
        if when == "construction":
            assert "start-up agreement" in error, error
            continue
        if when == "setup":
            assert "setting up 'auto' with the other ranks failed" in error, error
            continue
        # The first reduction of the iteration to fail is named: a bucket (with
        # the algorithm), or the step check that precedes them (reducer.py).
        assert (("bucket" in error and f"algorithm '{algorithm}'" in error) or
                ("the step check with the backend's all-reduce" in error)), error
        if victim == 0:  # the store lives on rank 0: the peer cannot be named
            assert "rank 0 may be the one that died" in error, error
        elif when == "mid_backward":
            assert "iteration 1" in error, error
        else:
            assert f"waiting for rank {victim} (last entered iteration 0)" in error, error


def _hook_on_one_rank(rank, world_size, hooked, timeout, meeting):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = minddp.DDP(DeepNet(), timeout=timeout)
    if rank == hooked:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    t0 = time.monotonic()
    try:
        ddp(*batch("deep", rank, 0)).sum().backward()
    except RuntimeError as e:
        elapsed = time.monotonic() - t0
        _wait_for_survivors(rank, world_size, meeting)  # rank 0's store holds the note
        return elapsed, str(e)
    return None, "no error"


def test_a_comm_hook_on_one_rank_only_fails_every_rank_at_once(tmp_path):
    # Rank 1's hook all-reduces on the gradient group where ranks 0 and 2 run minddp's
    # own algorithm: nothing pairs. Ranks 0 and 1 see their neighbour differ; rank 2,
    # whose neighbour (0) reduces as it does, reads the note rank 0 or 1 leaves.
    timeout = 40
    for rank, (elapsed, error) in enumerate(run_world(_hook_on_one_rank, 3, 1, timeout,
                                                      str(tmp_path), timeout=90)):
        assert elapsed is not None, f"rank {rank} trained with a hook on rank 1 only"
        assert elapsed < timeout / 2, f"rank {rank} waited {elapsed:.1f}s: the timeout's error"
        assert "a communication hook" in error and "minddp's own reduction" in error, error
        assert "register_comm_hook" in error, error


def _dead_peer_in_a_subgroup(rank, world_size, meeting):
    """A wrapper over global ranks 1 and 2 (ranks 0 and 1 of its group); rank 2 dies."""
    group = torch.distributed.new_group([1, 2])
    if rank == 0:
        _wait_for_survivors(rank, 2, meeting)
        return None
    ddp = minddp.DDP(DeepNet(), process_group=group, timeout=TIMEOUT)
    ddp(*batch("deep", rank, 0)).sum().backward()
    out = ddp(*batch("deep", rank, 1))
    if rank == 2:
        _die()
    try:
        out.sum().backward()
    except RuntimeError as e:
        _wait_for_survivors(rank, 2, meeting)
        return str(e)
    return "no error"


def test_a_dead_peer_in_a_subgroup_is_named_by_its_global_rank(tmp_path):
    error = run_world(_dead_peer_in_a_subgroup, 3, str(tmp_path), timeout=60,
                      expect_dead=(2,))[1]
    assert "waiting for rank 2 (1 in the wrapper's group) (last entered iteration 0)" in error, \
        error
