"""Optimizers run in backward (`torch.distributed.optim._apply_optimizer_in_backward`).

That function gives each parameter its own optimizers (`param._in_backward_optimizers`)
and a hook on its gradient accumulator that steps them as soon as the gradient is
there. Under data parallelism that is too early: the gradient is this rank's alone,
so every rank would step on a different one and the replicas would part. torch's
DDP therefore removes those hooks when its first forward runs and steps the
optimizers itself once a bucket's average is in (its
`_apply_optim_in_backward_hook`), then sets those parameters' `.grad` to None at
the end of backward. minddp does the same, bucket by bucket as finalize writes
each one back (reducer.py), so the optimizers step on the average, in the same
backward, and the results are torch's.

Where torch's hook makes a side stream to step on (`torch.Stream()`), on a machine
without an accelerator torch 2.13 raises "Cannot access accelerator device"; minddp
steps on the current stream and trains there too (docs/differences.md).
"""


def take_over(params):
    """The indices of `params` (the wrapper's, in the reducer's order) that carry
    optimizers run in backward; their hooks from `_apply_optimizer_in_backward` are
    removed, so only the reducer steps them (on the averaged gradient)."""
    indices = [i for i, p in enumerate(params) if hasattr(p, "_in_backward_optimizers")]
    if indices:
        from torch.distributed.optim.apply_optimizer_in_backward import (
            param_to_optim_hook_handle_map,
        )
        for i in indices:
            for handle in param_to_optim_hook_handle_map.get(params[i], []):
                handle.remove()
    return frozenset(indices)


def step(bucket, views, stepped):
    """Step the optimizers of `bucket`'s parameters whose indices are in `stepped`, each
    on its averaged gradient (`views`, the bucket's sums shaped like its parameters).
    As torch's hook: every such parameter of the bucket steps, one no rank used too (on
    the zeros its slot holds), and its `.grad` is the average while its optimizers run."""
    for slot, index in enumerate(bucket.indices):
        if index not in stepped:
            continue
        param = bucket.params[slot]
        param.grad = views[slot]
        for optimizer in param._in_backward_optimizers:
            optimizer.step()


def clear(params, stepped):
    """End of backward: the stepped parameters' `.grad` is None, as torch leaves it."""
    for index in stepped:
        params[index].grad = None
