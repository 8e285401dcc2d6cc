"""minddp: PyTorch DistributedDataParallel, rebuilt in readable Python.

    ddp = minddp.DistributedDataParallel(model)   # or minddp.DDP
    loss = ddp(batch).sum(); loss.backward()      # .grad is the mean over ranks
"""
from minddp.algorithms import all_reduce
from minddp.ddp import DistributedDataParallel

DDP = DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel", "all_reduce"]
