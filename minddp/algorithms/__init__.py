"""All-reduce algorithms, one module each, each registered by name (registry.py).

Every algorithm is an in-place sum, `all_reduce(tensor, group)`, called by
every rank of the group with a tensor of the same shape and dtype. minddp's
own are written on send/recv through p2p.py's link, which lets a codec
(compression) encode every hop: `all_reduce(tensor, group, codec=None,
error=None)`.

    ring              reduce-scatter + all-gather, 2(p-1) steps, bandwidth-optimal
    tree              binary-tree reduce + broadcast, 2 log p steps, pipelined
    halving_doubling  recursive halving + doubling, 2 log p steps, bandwidth-optimal
    native            the backend's all-reduce (gloo / NCCL), asynchronous
    shared_memory     ranks on one host: reduce-scatter + all-gather through /dev/shm
    auto              per bucket size, the fastest registered one: predicted, then timed

Importing this package registers them, in that order (auto's order of
preference on a tie). A new one registers itself the same way
(minddp.register_algorithm) from any file.
"""
import torch.distributed as dist

from minddp import registry
from minddp.algorithms import (  # noqa: F401  (register)
    ring, tree, halving_doubling, native, shared_memory, auto)


def collective(algorithm, group, codec=None):
    """`collective(tensor) -> tensor or Future`: the registered `algorithm` summing over
    `group`, with `codec` (a registered Codec) where given (registry.Algorithm.collective).

    It may have `collective.setup(buffers, provisional=False)` (auto): see
    reduction.setup_collective.
    """
    return registry.algorithm(algorithm).collective(group, codec)


def all_reduce(tensor, algorithm="ring", group=None, codec=None):
    """Sum `tensor` in place over `group` (default: the world) with `algorithm`.

    Every rank of the group must call it with a tensor of the same shape and
    dtype. Returns the tensor. The first call on a gloo group of one of
    minddp's send/recv algorithms also opens the group's reverse lane
    (lanes.py), a second group over the same ranks.
    """
    group = group if group is not None else dist.group.WORLD
    entry = registry.algorithm(algorithm)
    if codec is None:  # the plain, synchronous form (native's takes strided views too)
        result = entry.all_reduce(tensor, group)
        if result is not None and result is not tensor:
            tensor.copy_(result)
        return tensor
    return registry.wait_sum(entry.collective(group, codec), tensor)
