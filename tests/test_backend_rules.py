"""NCCL's rules, tested on CPU through a strict double of NCCL (strict_group.py).

The double refuses a tensor off its device, an ungrouped send and receive with
one peer at once, and a receive matched (by posting order, as NCCL matches)
with a send of another size or tag. Every algorithm, with and without fp16
compression, on 2, 3 and 4 ranks, runs through it and through gloo on the same
inputs, inside `default_device_refused()`: a tensor some code makes without a
device lands on meta and is refused, as NCCL would refuse it on the CPU.
Inputs are small integers, so every sum is exact, with compression too.
"""
import hashlib

import pytest
import torch
import torch.distributed as dist

import minddp
import strict_group
from dist_harness import run_world, time_auto_briefly
from minddp import compression, devices, registry
from minddp.algorithms import auto

ALGORITHMS = registry.algorithm_names()  # every registered one, plugins included
CPU = torch.device("cpu")


def _values(rank, numel, dtype):
    return ((torch.arange(numel, device=CPU) * 7 + rank * 5) % 11).to(dtype)


def _reduce(tensor, algorithm, compressed, group):
    if compressed:
        return compression.all_reduce(tensor, algorithm, group=group)
    return minddp.all_reduce(tensor, algorithm, group=group)


def _digest(tensor):
    return hashlib.sha1(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _sums(rank, world_size):
    time_auto_briefly()
    group = strict_group.new_group()
    results, digests = {}, {}
    noise = torch.randn(70_000, generator=torch.Generator().manual_seed(rank))
    with strict_group.default_device_refused():
        for algorithm in ALGORITHMS:
            # auto times its candidates on each new size: fewer sizes keep it short.
            sizes = ([0, 1, world_size - 1, 2 * world_size + 1, 1000, 70_000]
                     if algorithm != "auto" else [1, 1000])
            for compressed in (False, True):
                for numel in sizes:
                    for dtype in (torch.float32, torch.int64):
                        got = []
                        for on in (dist.group.WORLD, group):  # gloo, then NCCL's rules
                            tensor = _values(rank, numel, dtype)
                            assert _reduce(tensor, algorithm, compressed, on) is tensor
                            got.append(tensor)
                        results[(algorithm, compressed, numel, dtype)] = got
                base = _values(rank, 6 * (world_size + 3), torch.float32).reshape(6, -1)
                _reduce(base.t()[::2], algorithm, compressed, group)  # every other column
                results[(algorithm, compressed, "non-contiguous")] = [base]
                lossy = _reduce(noise.clone(), algorithm, compressed, group)
                digests[(algorithm, compressed)] = _digest(lossy)
    return results, digests, dict(group.posted)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_algorithm_under_nccl_rules_sums_as_on_gloo(world_size):
    outcomes = run_world(_sums, world_size, timeout=300, pg_timeout=60)
    for rank, (results, digests, posted) in enumerate(outcomes):
        for key, got in results.items():
            if key[2] == "non-contiguous":
                base = got[0]
                expected = sum(_values(r, base.numel(), torch.float32)
                               for r in range(world_size)).reshape(6, -1)
                expected[:, 1::2] = _values(rank, base.numel(), torch.float32).reshape(6, -1)[
                    :, 1::2]
                assert torch.equal(base, expected), f"{key} on rank {rank}"
                continue
            algorithm, compressed, numel, dtype = key
            expected = sum(_values(r, numel, torch.int64) for r in range(world_size)).to(dtype)
            gloo, strict = got
            assert torch.equal(gloo, expected), f"{key} on gloo, rank {rank}: {gloo[:8]}"
            assert torch.equal(strict, expected), f"{key} under NCCL's rules, rank {rank}: " \
                                                  f"{strict[:8]}"
        assert digests == outcomes[0][1], f"rank {rank} ended with other bits than rank 0"
        # Every message went in a group: none could wait on another of its own rank.
        assert posted["ungrouped"] == 0 and posted["grouped"] > 0, posted


def _refusals(rank, world_size):
    peer = 1 - rank
    group = strict_group.new_group()
    refused = {}
    with strict_group.default_device_refused():
        try:
            dist.all_reduce(torch.ones(2), group=group)  # made on the default device
        except strict_group.StrictRuleError as e:
            refused["device"] = str(e)
        # Rank 0 posts a receive and then a send to rank 1 outside a group;
        # rank 1 sends in a group, which lets rank 0's receive finish.
        if rank == 0:
            received = group.recv([torch.zeros(2, device=CPU)], peer, 0)
            try:
                group.send([torch.zeros(2, device=CPU)], peer, 0)
            except strict_group.StrictRuleError as e:
                refused["ungrouped"] = str(e)
            received.wait()
        else:
            op = dist.P2POp(dist.isend, torch.ones(2, device=CPU), group=group, group_peer=peer)
            for work in dist.batch_isend_irecv([op]):
                work.wait()
        # Two messages of different tags, received in the other order: gloo
        # matches them by tag, so this works there; NCCL matches by posting
        # order and would cross them. Last: the double's group is unusable after.
        for on in (dist.group.WORLD, group):
            works = dist.batch_isend_irecv(_crossed_messages(rank, on))
            if on is dist.group.WORLD:
                for work in works:
                    work.wait()
            elif rank == 1:  # rank 0 returns: its data sends are never matched
                try:
                    for work in works:
                        work.wait()
                except strict_group.StrictRuleError as e:
                    refused["order"] = str(e)
    return refused


def _crossed_messages(rank, group):
    """Rank 0 sends 3 elements with tag 1, then 5 with tag 2; rank 1 receives the 5 first."""
    if rank == 0:
        return [dist.P2POp(dist.isend, torch.ones(n, device=CPU), group=group, group_peer=1,
                           tag=tag) for n, tag in ((3, 1), (5, 2))]
    return [dist.P2POp(dist.irecv, torch.zeros(n, device=CPU), group=group, group_peer=0,
                       tag=tag) for n, tag in ((5, 2), (3, 1))]


def test_the_double_refuses_what_nccl_refuses():
    sender, receiver = run_world(_refusals, 2, timeout=60, pg_timeout=20)
    for refused in (sender, receiver):
        assert "on meta" in refused["device"] and "group_device" in refused["device"]
    assert "outside a group" in sender["ungrouped"] and "batch_isend_irecv" in sender["ungrouped"]
    assert "posting order" in receiver["order"], receiver
    assert "tag 2" in receiver["order"] and "tag 1" in receiver["order"], receiver


def _unknown_rules(rank, world_size):
    group = strict_group.new_group()
    devices.DEVICE_BACKENDS.discard(strict_group.BACKEND)  # a backend whose rules p2p lacks
    try:
        out = {"runnable": auto.runnable(group)}
        tensor = _values(rank, 10, torch.float32)
        minddp.all_reduce(tensor, "auto", group=group)
        out["auto"] = tensor
        try:
            minddp.all_reduce(_values(rank, 10, torch.float32), "ring", group=group)
        except ValueError as e:
            out["ring"] = str(e)
        return out
    finally:
        devices.DEVICE_BACKENDS.add(strict_group.BACKEND)


def test_auto_offers_only_what_the_backend_can_run():
    for out in run_world(_unknown_rules, 2, timeout=60):
        # those registered without a backend rule (the backend's own; plugins' on its ops)
        assert out["runnable"] == [n for n in registry.algorithm_names(auto_only=True)
                                   if registry.algorithm(n).runs_on is None]
        expected = _values(0, 10, torch.float32) + _values(1, 10, torch.float32)
        assert torch.equal(out["auto"], expected)
        assert "rules are not known" in out["ring"] and "native" in out["ring"], out["ring"]
