"""A new all-reduce in one file: "direct", every rank gathers every tensor and adds them.

    import minddp; minddp.registry.load("examples/algorithm_direct.py")   # or import it
    ddp = minddp.DDP(model, algorithm="direct")
    minddp.all_reduce(t, algorithm="direct")
    torchrun --nproc_per_node=2 benchmarks/compare.py --plugin examples/algorithm_direct.py \
        --configs torch_ddp,minddp_direct,minddp_auto

Registering it is all it takes: the wrapper, minddp.all_reduce, algorithm="auto"
(which times it against the others on every bucket size, as it has no cost
formula here), compare.py and collectives.py rows, and the shared test battery
(tests/test_battery.py loads every examples/algorithm_*.py) all find it by name.

Cost for n bytes on p ranks: one all-gather, each rank receives (p-1) n bytes
and adds p tensors: latency-optimal (one step) but p/2 times the ring's traffic,
so it can only win on small buckets, which is what auto finds out.

Every rank ends bitwise identical: each adds the same p tensors in rank order.
"""
import torch
import torch.distributed as dist

import minddp


@minddp.register_algorithm("direct")
def direct_all_reduce(tensor, group):
    """In-place sum of `tensor` over `group`: gather every rank's, add them in rank order."""
    p = dist.get_world_size(group)
    if p == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.contiguous().view(-1)  # all_gather sends whole contiguous buffers
    gathered = torch.empty(p, flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather(list(gathered.unbind(0)), flat, group=group)
    # One tensor at a time, not gathered.sum(0): a reduction kernel may pair the
    # values differently on another machine; this order is the same on every rank.
    total = gathered[0].clone()
    for piece in gathered[1:]:
        total += piece
    tensor.copy_(total.view_as(tensor))
    return tensor
