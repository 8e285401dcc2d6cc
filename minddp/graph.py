"""Which parameters an output depends on: a walk of the autograd graph.

`find_unused_parameters=True` needs it: a parameter the forward pass did not
touch gets no gradient, so its hook never fires and its bucket would never be
ready. The reducer marks such parameters ready up front instead.
"""
import torch


def tensors_in(obj):
    """Every tensor in a nested structure of lists, tuples, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from tensors_in(getattr(obj, name))


def reached_parameters(outputs):
    """ids of the leaf tensors (parameters) that backward from `outputs` would reach."""
    reached, seen = set(), set()
    # An output that is itself a parameter is not counted, as torch's reducer counts none:
    # its gradient comes through the sink (ddp._through_sink).
    stack = [t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold the leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return reached
