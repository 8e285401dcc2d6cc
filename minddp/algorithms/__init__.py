"""All-reduce algorithms, one module each, behind one calling convention.

Every algorithm module provides `all_reduce(tensor, group, codec=None) ->
tensor`: an in-place sum over `group`, called by every rank of the group with
a tensor of the same shape and dtype, returning the same tensor. `codec`
(compression) routes every hop through encode/decode (see p2p.py); the
backend's own all-reduce ("native") takes none, and also offers
`all_reduce_async(tensor, group) -> Future`. `tensor` may also be a list of
tensors of one dtype, reduced as their concatenation, each in place: our own
algorithms run on the pieces where they lie (the wrapper's large gradients),
native reduces a concatenated copy.

    ring              reduce-scatter + all-gather, 2(p-1) steps, bandwidth-optimal
    tree              binary-tree reduce + broadcast, 2 log p steps, pipelined
    halving_doubling  recursive halving + doubling, 2 log p steps, bandwidth-optimal
    native            the backend's all-reduce (gloo / NCCL)
    auto              per bucket, the one the measured cost model predicts fastest
"""
import torch.distributed as dist

from minddp.algorithms import auto, native

ALGORITHMS = {"auto": auto, **auto.CANDIDATES}

# Names the wrapper accepts.
CHOICES = tuple(ALGORITHMS)


def resolve(algorithm):
    """Return the module for an algorithm name, or raise a ValueError naming the choices."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"minddp: unknown algorithm {algorithm!r}; choose one of "
                         f"{list(CHOICES)}")
    return ALGORITHMS[algorithm]


def planner(algorithm, group, codec=None):
    """The wrapper's per-bucket job: `job(bucket, group) -> bucket or Future of it`.

    Every rank of `group` must call it with the same arguments at the same
    time: for "auto" it measures the links now (a collective). `codec` is
    passed to every call (compression); "native" cannot take one.
    """
    resolve(algorithm)
    if codec is not None and algorithm == "native":
        raise ValueError("minddp: algorithm='native' runs the backend's own all-reduce, which "
                         "cannot route hops through a codec; use 'ring', 'tree', "
                         "'halving_doubling' or 'auto' with compression.")
    chooser = (auto.Chooser(group, with_native=codec is None, codec=codec)
               if algorithm == "auto" else None)

    def pick(bucket):
        return chooser.pick(bucket) if chooser is not None else algorithm

    def job(bucket, group):
        name = pick(bucket)
        if name == "native":
            return native.all_reduce_async(bucket, group)
        return ALGORITHMS[name].all_reduce(bucket, group, codec=codec)

    job.__name__ = f"{algorithm}_all_reduce"
    job.chooser = chooser  # auto: the wrapper has it decide for its buckets up front
    # Whether a bucket of this size may come as a list of pieces in place
    # (see p2p.run): our own algorithms, not the backend's, which needs a copy.
    job.takes_pieces = lambda bucket: pick(bucket) != "native"
    return job


def all_reduce(tensor, algorithm="ring", group=None):
    """Sum `tensor` in place over `group` (default: the world) with `algorithm`.

    Every rank of the group must call it with a tensor of the same shape and
    dtype. Returns the tensor. The first call on a gloo group also opens the
    group's reverse lane (lanes.py), a second group over the same ranks.
    """
    group = group if group is not None else dist.group.WORLD
    return resolve(algorithm).all_reduce(tensor, group)
