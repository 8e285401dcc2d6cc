"""minddp: PyTorch DistributedDataParallel, rebuilt in readable Python.

    ddp = minddp.DistributedDataParallel(model)   # or minddp.DDP
    loss = ddp(batch).sum(); loss.backward()      # .grad is the mean over ranks
    minddp.replace_torch_ddp()                    # frameworks building torch's DDP get minddp's
    minddp.register_algorithm("mine", fn)         # a new all-reduce, everywhere (registry.py)
    minddp.register_codec("mine8", encode, decode)  # a new codec on every hop
"""
from minddp import algorithms
from minddp import compression as _compression
from minddp.compression import PowerSGD
from minddp.ddp import DistributedDataParallel
from minddp.registry import register_algorithm, register_codec
from minddp.swap import replace_torch_ddp

DDP = DistributedDataParallel


def all_reduce(tensor, algorithm="ring", group=None, compression=None):
    """Sum `tensor` in place over `group` (default: the world) with `algorithm`; return it.

    Every rank of the group must call it with a tensor of the same shape and
    dtype. `algorithm` and `compression` are registered names (registry.py):
    compression="fp16" | "bf16" | "int8" | a registered codec encodes every
    hop and accumulates in fp32; the result is bitwise equal on every rank.
    """
    if compression is None:
        return algorithms.all_reduce(tensor, algorithm, group)
    return _compression.all_reduce(tensor, algorithm, group, compression)


__all__ = ["DDP", "DistributedDataParallel", "PowerSGD", "all_reduce", "register_algorithm",
           "register_codec", "replace_torch_ddp"]
