"""All-reduce algorithms, one module each, behind one calling convention.

Every algorithm module provides `all_reduce(tensor, group, codec=None) ->
tensor`: an in-place sum over `group`, called by every rank of the group with
a tensor of the same shape and dtype, returning the same tensor. `codec`
(compression) routes every hop through encode/decode (see p2p.py); the
backend's own all-reduce ("native") takes none, and also offers
`all_reduce_async(tensor, group) -> Future`.

    ring              reduce-scatter + all-gather, 2(p-1) steps, bandwidth-optimal
    tree              binary-tree reduce + broadcast, 2 log p steps, pipelined
    halving_doubling  recursive halving + doubling, 2 log p steps, bandwidth-optimal
    native            the backend's all-reduce (gloo / NCCL)
    auto              per bucket size, the fastest: predicted by the cost model, then timed

`planner` turns a name (and a compression) into the wrapper's per-bucket job;
this is the one place where names become code.
"""
import functools

import torch
import torch.distributed as dist

from minddp.algorithms import auto, native

ALGORITHMS = {"auto": auto, **auto.CANDIDATES}

# Names the wrapper accepts.
CHOICES = tuple(ALGORITHMS)

_choosers = {}  # (group, codec) -> auto.Chooser: wrappers on one group share its timings


def resolve(algorithm):
    """Return the module for an algorithm name, or raise a ValueError naming the choices."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"minddp: unknown algorithm {algorithm!r}; choose one of "
                         f"{list(CHOICES)}")
    return ALGORITHMS[algorithm]


def runner(name, group, codec=None):
    """`run(tensor) -> tensor or Future`: algorithm `name` summing over `group`.

    `codec` (compression.Codec) goes on every hop of our own algorithms; the
    backend's all-reduce cannot decode per hop, so "native" with a codec
    compresses, sums in 16 bits and decompresses (compression.native_all_reduce).
    """
    if name == "native":
        if codec is None:
            run = functools.partial(native.all_reduce_async, group=group)
            run.nonblocking = True  # comm.py may launch it from the training thread
            return run
        from minddp import compression
        return functools.partial(compression.native_all_reduce, group=group, codec=codec)
    return functools.partial(resolve(name).all_reduce, group=group, codec=codec)


def planner(algorithm, group, codec=None):
    """The wrapper's per-bucket job: `job(bucket) -> bucket or Future of it`, a sum over `group`.

    `job.setup(buffers, provisional=False)`, where present ("auto"), decides
    for each buffer's size now: a collective (every rank, same buffers, same
    point of its program), which times the candidates once per size, group and
    codec; provisional=True (sizes in use only briefly) asks the model alone.
    """
    resolve(algorithm)
    if algorithm != "auto":
        return runner(algorithm, group, codec)
    # A codec rides on our own hops only: native is no candidate with one.
    names = [n for n in auto.CANDIDATES if codec is None or n != "native"]
    runs = {name: runner(name, group, codec) for name in names}

    def chooser():
        if (group, codec) not in _choosers:
            _choosers[group, codec] = auto.Chooser(group, with_native=codec is None, codec=codec)
        return _choosers[group, codec]

    def job(bucket):
        return runs[chooser().pick(bucket)](bucket)

    job.setup = lambda buffers, provisional=False: chooser().tune(buffers, not provisional)
    return job


def sum_now(job, tensor):
    """Run a planner job on `tensor` and wait: for reductions that need a sum's result before
    their next step (PowerSGD), on the communication thread. Sums in place; returns `tensor`."""
    result = job(tensor)
    if isinstance(result, torch._C.Future):  # the base of torch.futures.Future
        result = result.wait()
    if isinstance(result, (list, tuple)):
        result = result[0]
    if result is not tensor:
        tensor.copy_(result)
    return tensor


def all_reduce(tensor, algorithm="ring", group=None):
    """Sum `tensor` in place over `group` (default: the world) with `algorithm`.

    Every rank of the group must call it with a tensor of the same shape and
    dtype. Returns the tensor. The first call on a gloo group also opens the
    group's reverse lane (lanes.py), a second group over the same ranks.
    """
    group = group if group is not None else dist.group.WORLD
    return resolve(algorithm).all_reduce(tensor, group)
