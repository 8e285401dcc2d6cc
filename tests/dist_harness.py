"""Run a function on every rank of a freshly spawned world, as pytest's helper.

    results = run_world(fn, world_size, *args, timeout=60)
    results = run_world(fn, 1, *args, backend="nccl")   # GPU tests: rank r on cuda:r

`fn(rank, world_size, *args)` runs in each child process with the default
process group already initialised (gloo over loopback unless `backend` says
otherwise) and one intra-op thread, so several ranks fit on a 2-core machine.
It must be a module-level function (children are forked from a server that
pickles it by name). The return values, one per rank, come back as a list.

Failure handling is the point of this module:
- a rank that raises sends its traceback; the others are killed and the test
  fails with that traceback (the first failing rank's, naming the rank);
- a world that does not finish within `timeout` seconds is killed and the test
  fails with "hung", listing the ranks that had not finished.
"""
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import time
import traceback

import plugins

# Every test module imports this one before it reads the registry, in the parent
# and (unpickling its function) in every rank: both see the plugins' entries.
plugins.load_all()

_CTX = mp.get_context("forkserver")
# The fork server imports torch once; every world is then forked from a process
# that never ran a torch op, which is both fast and safe with OpenMP. What the
# server has imported, every rank has for free; what it has not, every rank of
# every world imports again. So it also imports:
# - torch._dynamo (with sympy): about 1.8 s of CPU, which torch spends on the
#   first forward through minddp's or torch's DDP and on the first optimizer,
#   so in nearly every rank; preloading it halves the suite's CPU time;
# - pytest and minddp, which every rank imports with its test's module (the
#   one that defines its function), and matplotlib.pyplot (benchmark and
#   example tests).
# None of them runs a torch op or starts a thread. Names only: the server of
# Python 3.11 does not get the tests' sys.path. One that is missing is skipped
# (ImportError); one that fails otherwise stops the server, and its traceback
# shows in the captured stderr of the test that started it.
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "pytest", "minddp",
                             "matplotlib.pyplot"])


class WorldFailed(AssertionError):
    """A rank raised, died, or the world hung; the message says which."""


def _ephemeral_ports():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port():
    """A port for the world's store, free now and below the ephemeral range: a port the
    kernel hands out (bind to 0) may be given again, before rank 0 binds it, to one of
    the gloo connections other tests' worlds are making (seen: EADDRINUSE in CI)."""
    low, _ = _ephemeral_ports()
    start = max(1024, low - 16384)
    # Each pytest-xdist worker draws from its own share, so that two workers' worlds
    # never pick the same port in the moment between the check and rank 0's bind (a
    # worker xdist starts again takes a higher number: it shares with one, as before).
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    share = (low - start) // workers
    if share >= 256:
        start += share * (int(worker) % workers if worker.isdigit() else 0)
    else:  # a narrow range below the ephemeral one: all of it, for every worker
        share = low - start
    rng = random.Random()
    for _ in range(200 if share > 0 else 0):
        port = rng.randrange(start, start + share)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken (unlikely): the kernel's choice after all
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, pg_timeout, backend, fn, args, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        if backend == "nccl":
            # NCCL drives the GPU that is current when the group first
            # communicates, and cannot put two ranks on one GPU: rank r gets cuda:r.
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        value = fn(rank, world_size, *args)
        # Plain pickle copies tensor data in-band; the queue's own pickler would
        # pass a file descriptor that dies with this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", (time.time(), traceback.format_exc())))
        # Flush the queue, then exit without running the process group's
        # destructor: it could block on peers that are themselves stuck.
        results.close()
        results.join_thread()
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer may already be gone
        pass


def _failure_report(world_size, rank, error, results, procs, heard, grace=1.0):
    """Describe a failed world, earliest failure first: the other ranks' errors
    are usually consequences of it (a peer closed the connection). A rank that
    sent nothing (not in `heard`) is described by its process: a death by a
    signal (a crash in native code) leaves no traceback, and may be the cause."""
    errors, finished = {rank: error}, set(heard)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            r, status, value = results.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if status == "error":
            errors[r] = value
        else:
            finished.add(r)
    order = sorted(errors, key=lambda r: errors[r][0])
    first = order[0]
    report = f"rank {first} of {world_size} failed:\n{errors[first][1]}"
    for r in order[1:]:
        last_line = errors[r][1].strip().splitlines()[-1]
        report += f"\nthen rank {r} failed: {last_line}"
    for r, proc in enumerate(procs):
        if r not in errors and r not in finished:
            code = proc.exitcode
            state = "still running" if code is None else f"exited with code {code}"
            report += f"\nrank {r} sent no result: {state}"
    return report


def run_world(fn, world_size, *args, timeout=60, pg_timeout=None, expect_dead=(),
              backend="gloo"):
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return their results.

    `pg_timeout` (seconds) is the process group's timeout inside the children;
    by default a little under `timeout`, so collectives blocked on a dead peer
    raise before the harness gives up on the world. Ranks in `expect_dead` are
    meant to die or get stuck (fault tests): nobody waits for them, their
    result is None, and they are killed once the others have finished. Every
    other rank must also exit promptly after returning: a rank that hangs on
    its way out fails the test.

    `backend` is the default group's: "gloo", or "nccl", which puts rank r on
    cuda:r and so needs a GPU per rank (one GPU: a world of one). Tests whose
    ranks share one GPU use gloo and pick the device themselves.
    """
    if backend == "nccl":
        import torch

        gpus = torch.cuda.device_count()
        if gpus < world_size:
            raise ValueError(f"run_world: an NCCL world of {world_size} ranks needs a GPU per "
                             f"rank, this machine has {gpus}; use backend='gloo' to share one")
    pg_timeout = pg_timeout or max(5, int(timeout * 0.6))
    port = free_port()
    results = _CTX.Queue()
    procs = [_CTX.Process(target=_child, daemon=True,
                          args=(r, world_size, port, pg_timeout, backend, fn, args,
                                results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    values, deadline = {}, time.monotonic() + timeout
    try:
        while len(values) < world_size - len(expect_dead):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(values) - set(expect_dead))
                raise WorldFailed(f"world of {world_size} hung: ranks {missing} did not "
                                  f"finish within {timeout}s")
            try:
                rank, status, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and
                        r not in expect_dead and p.exitcode not in (None, 0)]
                if dead:
                    # Give a dying rank a moment to deliver its traceback.
                    try:
                        rank, status, value = results.get(timeout=2)
                    except queue.Empty:
                        raise WorldFailed(f"rank {dead[0]} died with exit code "
                                          f"{procs[dead[0]].exitcode} and no traceback") from None
                else:
                    continue
            if rank in expect_dead:
                continue
            if status == "error":
                raise WorldFailed(_failure_report(world_size, rank, value, results, procs,
                                                  set(values) | set(expect_dead)))
            values[rank] = pickle.loads(value)
        for r, p in enumerate(procs):
            if r not in expect_dead:
                p.join(timeout=20)
                if p.is_alive():
                    raise WorldFailed(f"rank {r} returned but did not exit within 20s "
                                      f"(stuck in a destructor or a thread?)")
        return [values.get(r) for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)


def dies_in_backward(rank, world_size, compression):
    """A two-layer wrapper with `compression` on the ring; rank 1 dies (SIGKILL) after the
    forward of its third step. Returns (seconds rank 0's backward took to raise, the
    error), or (None, "no error")."""
    import signal

    import torch
    from torch import nn

    import minddp

    ddp = minddp.DDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)), timeout=5,
                     algorithm="ring", compression=compression)
    for step in range(3):
        out = ddp(torch.randn(4, 64)).sum()
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            out.backward()
        except RuntimeError as e:
            return time.monotonic() - t0, str(e)
    return None, "no error"


def time_auto_briefly():
    """In a rank: auto times each new size in its fewest rounds (FEWEST_ROUNDS), not in
    up to a second's worth. For tests of what auto sums, not of what it picks (the rounds
    have tests of their own in test_collectives.py): in a sweep over many sizes the
    timing is otherwise most of the time."""
    from minddp.algorithms import auto

    auto.MIN_ROUNDS, auto.SIZE_BUDGET_S = auto.FEWEST_ROUNDS, 0.0
