"""The backend's own all-reduce (gloo's ring/halving-doubling, NCCL's ring/tree).

Cost: whatever the backend does; it is the baseline every other algorithm is
measured against. It is asynchronous: the backend queues the work on its own
threads, so several buckets can be in flight at once.
"""
import torch.distributed as dist

from minddp import registry


def all_reduce_async(tensor, group):
    """Start an in-place sum of `tensor` over `group`; return the backend's Future of
    [tensor]. Its own: a then() would add a Python call on the backend's thread per
    bucket, and its wait() raises the backend's error as it is."""
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def all_reduce(tensor, group):
    """In-place sum of `tensor` over `group` (every rank calls it); returns the tensor."""
    if not tensor.is_contiguous():  # gloo would reduce the wrong elements of a strided view
        tensor.copy_(all_reduce(tensor.contiguous(), group))
        return tensor
    dist.all_reduce(tensor, group=group)
    return tensor


def cost(nbytes, p, c):
    """Predicted seconds: the line fitted to the backend's all-reduce (cost_model.Costs)."""
    return c.native_alpha + c.native_beta * nbytes


registry.register_algorithm("native", all_reduce, cost=cost, launch=all_reduce_async)
