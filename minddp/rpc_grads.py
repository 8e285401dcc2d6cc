"""DDP under distributed autograd (torch.distributed.rpc): where gradients live.

`dist_autograd.backward(context_id, losses)` leaves `.grad` alone: each
parameter's gradient accumulates in the context, and
`dist_autograd.get_gradients(context_id)` returns it. torch's reducer reads
and writes gradients there when a context is current (its
runGradCallbackForVariable); minddp does the same through get_gradients, whose
tensors are the context's own, so in-place writes land in the context. The
context is the one current on the thread that runs the wrapper's forward: its
backward runs on RPC's threads, where Python cannot ask for it. A plain
loss.backward() of such a forward writes .grad, as in torch: the reducer tells
it apart by the first full bucket, none of whose gradients is in the context.
"""
import torch.distributed as dist

if dist.is_available() and dist.rpc.is_available():
    from torch._C._distributed_autograd import _current_context
    from torch.distributed import autograd as dist_autograd
    from torch.distributed.rpc import api as rpc_api
else:  # a torch built without RPC has no distributed autograd either
    rpc_api = None


def current_context():
    """The id of the distributed autograd context current on this thread, or None."""
    if rpc_api is None or not rpc_api._is_current_rpc_agent_set():
        return None
    try:
        return _current_context()._context_id()
    except RuntimeError:  # no context on this thread
        return None


def gradients(params, context):
    """Each parameter's gradient in distributed autograd context `context` (the
    context's own tensor), None where it has none. Outside a context the reducer
    reads .grad itself (Bucket.grads)."""
    found = dist_autograd.get_gradients(context)
    return [found.get(p) for p in params]
