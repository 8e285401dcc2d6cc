"""torch._dynamo.config.optimize_ddp = "python_reducer": the compiler reduces gradients.

In this mode (set before the wrapper is built) torch's DDP leaves its reducer
unarmed and gives each parameter a post-accumulate-grad hook that divides its
gradient by the world size and all-reduces it with a functional collective.
Compiled autograd traces those hooks into the backward graph, where inductor
fuses the all-reduces into buckets of its own (`_fuse_ddp_communication`); the
forward is the module's alone (no buffer broadcast, no join), so dynamo traces
it whole. minddp does the same, so a script written for this mode runs
unchanged; minddp's own buckets, algorithms and codecs take no part in it.

    if python_reducer.active():
        python_reducer.configure(bucket_cap_mb, bucket_cap_mb_list)  # before building
        handles = python_reducer.register(ddp, params)
"""
import sys
import weakref


def active():
    """Whether dynamo's optimize_ddp asks for the Python reducer. Its config lives in
    torch._dynamo, so where that is not imported nobody has set it."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and dynamo.utils.get_optimize_ddp_mode() == "python_reducer"


def configure(bucket_cap_mb, bucket_cap_mb_list):
    """torch's settings for the mode, with its refusal of per-bucket caps. `bucket_cap_mb`
    is the constructor's argument as given; torch hands inductor whole MiB, 25 for None
    (inductor's bucketing pass multiplies it)."""
    if bucket_cap_mb_list:
        raise AssertionError("when using bucket_cap_mb_list, python reducer is not supported")
    import torch._inductor.config as inductor
    inductor._fuse_ddp_communication = True
    if bucket_cap_mb != "auto":  # minddp's own plan means nothing to inductor: its default
        cap = 25 if bucket_cap_mb is None else bucket_cap_mb
        inductor._fuse_ddp_bucket_size = int(cap * (1 << 20)) // (1 << 20)


def register(ddp, params):
    """A post-accumulate-grad hook on each of `params`, those ddp reduces; returns their
    handles."""
    import torch.distributed._functional_collectives as fcol
    ref = weakref.ref(ddp)  # the hooks live as long as the parameters

    def reduce(param):
        wrapper = ref()
        if wrapper is None or not wrapper.require_backward_grad_sync or param.grad is None:
            return
        group = wrapper.process_group
        gradient = fcol.all_reduce(param.grad / group.size(), "sum", group)
        param.grad.copy_(gradient)

    return [param.register_post_accumulate_grad_hook(reduce) for param in params]
