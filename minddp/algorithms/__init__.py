"""All-reduce algorithms, one module each, behind one calling convention.

Every algorithm module provides `all_reduce(tensor, group) -> tensor`: an in-place
sum over `group`, called by every rank of the group with a tensor of the same
shape and dtype, returning the same tensor. A module may also provide
`all_reduce_async(tensor, group) -> Future` when the backend can run it without
a thread of ours (the native one).
"""
import torch.distributed as dist

from minddp.algorithms import native

# name -> module. Algorithms written on point-to-point ops register here.
ALGORITHMS = {"native": native}

# Names the wrapper accepts; "auto" picks among ALGORITHMS.
CHOICES = ("auto", "ring", "tree", "native")


def resolve(algorithm):
    """Return the module for an algorithm name, or raise a ValueError naming the choices."""
    if algorithm == "auto":
        return ALGORITHMS["native"]
    if algorithm in ALGORITHMS:
        return ALGORITHMS[algorithm]
    if algorithm in CHOICES:
        raise NotImplementedError(
            f"minddp: algorithm={algorithm!r} is not implemented yet in this version; "
            f"available: {sorted(ALGORITHMS)} or 'auto'")
    raise ValueError(f"minddp: unknown algorithm {algorithm!r}; choose one of {list(CHOICES)}")


def all_reduce(tensor, algorithm="ring", group=None):
    """Sum `tensor` in place over `group` (default: the world) with `algorithm`.

    Every rank of the group must call it with a tensor of the same shape and
    dtype. Returns the tensor.
    """
    group = group if group is not None else dist.group.WORLD
    return resolve(algorithm).all_reduce(tensor, group)
