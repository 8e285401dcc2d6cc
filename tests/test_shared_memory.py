"""algorithm="shared_memory": buckets live in files every rank maps and are summed in place;
what cannot be shared falls back or says why; codecs ride on it. (The shared battery,
test_battery.py, tests its sums and codecs like every registered algorithm's; test_faults.py
that a dead peer raises.)"""
import glob
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from dist_harness import run_world
from minddp import algorithms, compression, registry
from minddp.algorithms import shared_memory


def _model(width=64):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def _left_behind():
    return glob.glob(os.path.join(shared_memory.DIRECTORY,
                                  f"minddp-{shared_memory._owner_tag()}-*"))


def _train(rank, world_size, algorithm, as_view):
    # 1 MiB buckets (at least shared_memory.MIN_BYTES: smaller ones stay ordinary memory)
    ddp = minddp.DDP(_model(512), algorithm=algorithm, bucket_cap_mb=1,
                     gradient_as_bucket_view=as_view)
    ref = TorchDDP(_model(512), bucket_cap_mb=1)
    state = shared_memory._groups[ddp.engine.group]
    linked = [b.buffer.untyped_storage().data_ptr() in state.linked for b in ddp.reducer.buckets]
    equal, digests = [], []
    for step in range(3):
        x = torch.randint(-4, 5, (8, 512), generator=torch.Generator().manual_seed(rank + step))
        ddp(x.float()).square().sum().backward()
        ref(x.float()).square().sum().backward()
        # torch's bits on 2 ranks; on more, sums in another order (as ring's)
        equal.append(all((torch.equal if world_size == 2 else _close)(a.grad, b.grad)
                         for a, b in zip(ddp.parameters(), ref.parameters())))
        digests.append(torch.cat([p.grad.view(-1) for p in ddp.parameters()]).sum().item())
        if as_view:
            ddp.zero_grad(set_to_none=False)  # writes into the shared buckets
            ref.zero_grad(set_to_none=False)
    shared_grads = any(p.grad.is_shared() for p in ddp.parameters())
    return linked, equal, digests, state.scratch is None, _left_behind(), shared_grads


@pytest.mark.parametrize("world_size, algorithm, as_view", [
    (2, "shared_memory", False), (3, "shared_memory", True), (2, "auto", False)])
def test_buckets_are_shared_and_summed_in_place(world_size, algorithm, as_view):
    results = run_world(_train, world_size, algorithm, as_view, timeout=120)
    for linked, equal, digests, no_scratch, left, shared_grads in results:
        assert not shared_grads  # .grad is never a view of a shared file
        assert len(linked) >= 4, linked
        # every bucket mapped by every rank; with gradient_as_bucket_view .grad is a view of
        # its bucket, which stays ordinary memory (pickled through torch.multiprocessing)
        assert all(linked) if not as_view else not any(linked), linked
        assert equal == [True] * 3  # torch DDP's gradients
        assert digests == results[0][2]  # the same on every rank
        # nothing was copied in: the buckets were summed where they are (and auto timed
        # the algorithm on storage like theirs)
        assert no_scratch or as_view
        assert left == []  # every file unlinked once mapped


def _mixed(rank, world_size):
    """Rank 0 passes a linked buffer, rank 1 a plain tensor: both copy in."""
    group = dist.group.WORLD
    numel = shared_memory.MIN_BYTES // 4
    buffer = shared_memory.allocate(numel, torch.float32, "cpu", group)
    shared_memory.setup([buffer], group)
    tensor = buffer if rank == 0 else torch.zeros(numel)
    tensor.copy_(torch.arange(numel, dtype=torch.float32) * (rank + 1))
    minddp.all_reduce(tensor, "shared_memory")
    return torch.equal(tensor, torch.arange(numel, dtype=torch.float32) * 3)


def test_a_shared_buffer_on_some_ranks_only_still_sums():
    assert run_world(_mixed, 2, timeout=60) == [True, True]


def _fp16(rank, world_size):
    out = []
    for numel in (1, world_size + 1, 50_001):  # a slice empty, slices of 1 and 2, large ones
        g = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        exact, magnitude = g.double(), g.abs().double()
        dist.all_reduce(exact)
        dist.all_reduce(magnitude)
        got = minddp.all_reduce(g.clone(), "shared_memory", compression="fp16")
        out.append((got, exact, magnitude))
    return out


def test_fp16_gives_every_rank_the_same_bits_near_the_exact_sum():
    results = run_world(_fp16, 3, timeout=60)
    for i, (got, exact, magnitude) in enumerate(results[0]):
        assert all(torch.equal(r[i][0], got) for r in results), f"{got.numel()}: ranks differ"
        # each value is encoded twice, in its rank's slice and in its owner's sum; fp16
        # rounds each by at most 2^-11 of it (a power-of-two scale: no subnormals here),
        # and the fp32 adds a little more
        bound = 2.0 ** -10 * (magnitude + exact.abs())
        assert ((got.double() - exact).abs() <= bound).all(), got.numel()


def _fed_back(rank, world_size):
    codec = registry.codec("int8")
    g = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
    exact = g.double()
    dist.all_reduce(exact)
    once = minddp.all_reduce(g.clone(), "shared_memory", compression="int8")
    fed = compression.ErrorFeedback(
        algorithms.collective("shared_memory", dist.group.WORLD, codec), codec)
    total = torch.zeros(5000, dtype=torch.float64)
    for _ in range(32):
        total += registry.wait_sum(fed, g.clone()).double()
    relative = [float((t - exact).norm() / exact.norm()) for t in (once.double(), total / 32)]
    return relative, total


def test_error_feedback_pays_back_what_one_sum_lost():
    results = run_world(_fed_back, 3, timeout=60)
    for (one, mean), total in results:
        assert torch.equal(total, results[0][1])  # ranks alike, sum after sum
        # what one sum loses comes back with the next ones (as test_battery.py checks)
        assert 0 < mean < 0.7 * one, (one, mean)


def _sizes_differ(rank, world_size):
    said = []
    for numel in (4 + rank, 4):  # then the group is done for: its files' state is unknown
        try:
            minddp.all_reduce(torch.ones(numel), "shared_memory")
            said.append("no error")
        except RuntimeError as e:
            said.append(str(e))
    return said


def test_different_sizes_raise_on_every_rank_and_end_the_group():
    for rank, (error, after) in enumerate(run_world(_sizes_differ, 2, timeout=60)):
        assert f"(rank {rank})" in error and "different sizes" in error, error
        assert f"(rank {rank})" in after and "failed midway" in after, after
        assert "new process group" in after, after


def _apart(rank, world_size):
    """Ranks that cannot map one another's files (as on two hosts): auto leaves the
    algorithm out and trains, the algorithm named alone says why."""
    shared_memory._boot_id = lambda: f"host-{rank}"
    from minddp.algorithms import auto
    runnable = auto.runnable(dist.group.WORLD)
    ddp = minddp.DDP(_model(), algorithm="auto")
    ddp(torch.ones(2, 64)).sum().backward()
    try:
        minddp.all_reduce(torch.ones(4), "shared_memory")
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    return "shared_memory" in runnable, error, _left_behind()


def test_ranks_that_cannot_share_are_refused_with_the_fix():
    for rank, (offered, error, left) in enumerate(run_world(_apart, 2, timeout=120)):
        assert not offered
        assert f"(rank {rank})" in error and "choose another algorithm" in error, error
        assert left == []


def _no_room(rank, world_size):
    """No /dev/shm (or a full one): the buckets stay ordinary memory, auto leaves the
    algorithm out, the wrapper trains."""
    shared_memory.DIRECTORY = "/nonexistent-minddp-shm"
    from minddp.algorithms import auto
    ddp = minddp.DDP(_model(), algorithm="auto")
    ddp(torch.ones(2, 64)).sum().backward()
    return ("shared_memory" in auto.runnable(dist.group.WORLD),
            [p.grad.sum().item() for p in ddp.parameters()][:1])


def test_without_dev_shm_the_wrapper_trains_without_it():
    (offered0, grad0), (offered1, grad1) = run_world(_no_room, 2, timeout=120)
    assert not offered0 and not offered1
    assert grad0 == grad1


def _full(rank, world_size):
    """Room for the probe, none for buckets or scratch files (a 64 MiB /dev/shm filled up):
    every sum goes over gloo instead, on every rank; nothing raises."""
    create = shared_memory._create
    shared_memory._create = lambda nbytes: create(nbytes) if nbytes <= 64 else None
    ddp = minddp.DDP(_model(512), algorithm="shared_memory", bucket_cap_mb=1)
    ref = TorchDDP(_model(512), bucket_cap_mb=1)
    x = torch.randint(-4, 5, (8, 512), generator=torch.Generator().manual_seed(rank)).float()
    ddp(x).square().sum().backward()
    ref(x).square().sum().backward()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(ddp.parameters(), ref.parameters()))
    values = torch.arange(1 << 19, dtype=torch.float32) * (rank + 1)
    compression.all_reduce(values, "shared_memory", compression="fp16")
    near = torch.allclose(values, torch.arange(1 << 19, dtype=torch.float32) * 3, rtol=1e-3)
    return same, near, shared_memory._groups[dist.group.WORLD].scratch is None


def test_without_room_for_the_files_sums_go_over_gloo():
    assert run_world(_full, 2, timeout=120) == [(True, True, True)] * 2


def _phases(rank, world_size, flags):
    """Sums in a row, of every kind (a shared bucket, copied in, encoded, tiny), with the
    phases ordered by flags in shared memory or by gloo ("some": one rank has no flags,
    so no rank uses them)."""
    shared_memory.USE_FLAGS = flags == "all" or (flags == "some" and rank == 0)
    group = dist.new_group(backend="gloo")
    numel = shared_memory.MIN_BYTES // 4
    bucket = shared_memory.allocate(numel, torch.float32, "cpu", group)
    shared_memory.setup([bucket], group)
    sums = []
    for step in range(6):
        for tensor, codec in ((bucket, None), (torch.empty(numel), None),
                              (torch.empty(numel + step), "fp16"), (torch.empty(3), None)):
            values = torch.arange(tensor.numel(), dtype=torch.float32) + step
            tensor.copy_(values * (rank + 1))
            minddp.all_reduce(tensor, "shared_memory", group=group, compression=codec)
            want = values * sum(range(1, world_size + 1))
            sums.append(torch.equal(tensor, want) if codec is None else
                        torch.allclose(tensor, want, rtol=2.0 ** -9))
    return shared_memory._groups[group].words is not None, sums


@pytest.mark.parametrize("flags", ["all", "some", "none"])
def test_phases_by_flags_or_by_gloo_sum_alike(flags):
    for used, sums in run_world(_phases, 3, flags, timeout=120):
        assert used == (flags == "all" and shared_memory.flag_wait is not None)
        assert all(sums), sums


def _slow_reader(rank, world_size, flags):
    """Rank 1 reads the others' sums late in every call (a pause after "summed"), while
    the others start the next sum at once: that must wait for it (the scratch files
    have no "read" phase; the next call's agree is one)."""
    import time
    shared_memory.USE_FLAGS = flags
    group = dist.new_group(backend="gloo")
    state = shared_memory._state(group)
    if rank == 1:
        passed, barrier = [], state.barrier

        def barrier_then_pause():
            barrier()
            passed.append(1)
            if len(passed) % 3 == 0:  # agree, written, summed: then the reads
                time.sleep(0.1)
        state.barrier = barrier_then_pause
    sums = []
    for step in range(6):
        for codec in (None, "fp16"):  # copied in; encoded
            values = torch.arange(50_000, dtype=torch.float32) * (step + 1)
            got = minddp.all_reduce(values * (rank + 1), "shared_memory", group=group,
                                    compression=codec)
            want = values * sum(range(1, world_size + 1))
            sums.append(torch.equal(got, want) if codec is None else
                        torch.allclose(got, want, rtol=2.0 ** -9))
    return sums


@pytest.mark.parametrize("flags", [True, False], ids=["flags", "gloo"])
def test_a_late_reader_still_reads_the_sum_it_waited_for(flags):
    if flags and shared_memory.flag_wait is None:
        pytest.skip("minddp._C is not built: no flags")
    for sums in run_world(_slow_reader, 3, flags, timeout=120):
        assert all(sums), sums


def _lost_between_phases(rank, world_size, how, timeout):
    """Rank 1 dies, or stops, after the copy-in's "written" phase: its peers wait for it
    at "summed", on the flags."""
    import datetime
    import time
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    state = shared_memory._state(group)
    assert state.words is not None  # the flags order the phases here
    if rank == 1:
        passed, barrier = [], state.barrier

        def barrier_then_lost():
            passed.append(1)
            if len(passed) == 3:  # agree, written, then not summed
                if how == "stuck":
                    time.sleep(3 * timeout)
                os.kill(os.getpid(), 9)
            barrier()
        state.barrier = barrier_then_lost
    t0 = time.monotonic()
    try:
        minddp.all_reduce(torch.ones(1 << 18), "shared_memory", group=group)
    except RuntimeError as e:
        return time.monotonic() - t0, str(e)
    return None, "no error"


@pytest.mark.skipif(shared_memory.flag_wait is None, reason="minddp._C is not built: no flags")
@pytest.mark.parametrize("how", ["dies", "stuck"])
def test_a_peer_lost_between_phases_raises_naming_it(how):
    timeout = 3
    results = run_world(_lost_between_phases, 3, how, timeout, timeout=60, expect_dead=(1,))
    for rank in (0, 2):
        elapsed, error = results[rank]
        assert elapsed is not None, f"rank {rank} summed without rank 1"
        assert f"(rank {rank}): rank 1" in error, error
        if how == "dies":  # seen within the flags' 50 ms naps, not at the timeout
            assert "process exited" in error and elapsed < 2, (elapsed, error)
        else:
            assert f"within the group's timeout ({timeout} s)" in error, error
            assert timeout - 0.5 < elapsed < timeout + 2, elapsed


@pytest.mark.skipif(shared_memory.flag_wait is None, reason="minddp._C is not built: no flags")
def test_ctrl_c_stops_a_wait_for_a_peer():
    """A rank waiting on a flag that never comes still takes Ctrl-C (within the 50 ms
    naps), not only the peer or the group's timeout."""
    import signal
    import threading
    import time
    word = torch.zeros(4, dtype=torch.int32)
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        shared_memory.flag_wait([word.data_ptr()], 1, [os.getpid()], 30.0)
    assert time.monotonic() - start < 5
    assert shared_memory.flag_wait([word.data_ptr()], 0, [os.getpid()], 1.0) == (0, -1)


def test_files_a_killed_process_left_are_swept_by_the_next(tmp_path, monkeypatch):
    """A rank killed while its wrapper was set up leaves its bucket's file (nobody
    unlinked it); the next process to make one removes such files of dead processes of
    its pid namespace, and only those."""
    monkeypatch.setattr(shared_memory, "DIRECTORY", str(tmp_path))
    # tmp_path is on the machine's disk, whose free share is not this test's subject (it
    # failed once where /tmp had under the quarter free that /dev/shm must keep).
    monkeypatch.setattr(shared_memory, "_room_for", lambda nbytes: True)
    namespace = shared_memory._owner_tag().split("-")[0]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {"dead": f"minddp-{namespace}-{dead.pid}-0f", "alive": f"minddp-{namespace}-1-0f",
             "elsewhere": f"minddp-{namespace}1-{dead.pid}-0f", "other": "other-file"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    monkeypatch.setattr(shared_memory, "_swept", False)
    path, _ = shared_memory._create(128)
    left = set(os.listdir(tmp_path)) - {os.path.basename(path)}
    assert left == {names["alive"], names["elsewhere"], names["other"]}, left
