"""minddp: PyTorch DistributedDataParallel, rebuilt in readable Python.

    ddp = minddp.DistributedDataParallel(model)   # or minddp.DDP
    loss = ddp(batch).sum(); loss.backward()      # .grad is the mean over ranks
    minddp.replace_torch_ddp()                    # frameworks building torch's DDP get minddp's
"""
from minddp import algorithms
from minddp import compression as _compression
from minddp.ddp import DistributedDataParallel
from minddp.powersgd import PowerSGD
from minddp.swap import replace_torch_ddp

DDP = DistributedDataParallel


def all_reduce(tensor, algorithm="ring", group=None, compression=None):
    """Sum `tensor` in place over `group` (default: the world) with `algorithm`; return it.

    Every rank of the group must call it with a tensor of the same shape and
    dtype. compression="fp16" | "bf16" sends float32 tensors as 16-bit values
    and accumulates in fp32 (minddp.compression); the result is bitwise equal
    on every rank.
    """
    if compression is None:
        return algorithms.all_reduce(tensor, algorithm, group)
    return _compression.all_reduce(tensor, algorithm, group, compression)

__all__ = ["DDP", "DistributedDataParallel", "PowerSGD", "all_reduce", "replace_torch_ddp"]
