"""Gradient readiness (minddp/readiness.py): the C++ hooks and their pure-torch twin.

Both implementations count the same way (a unit test drives each through one
script of arrivals and compares), the C++ one's modes do what they say in a
real backward, and the wrapper trains exactly as torch's DDP with either one,
in the cases that use every mode: plain steps, unused parameters under
no_sync, static_graph with a parameter used twice, and gradient_as_bucket_view.
"""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minddp import readiness
from dist_harness import run_world

KINDS = [readiness.PyReadiness] + ([readiness.Readiness] if readiness.Readiness else [])
needs_extension = pytest.mark.skipif(readiness.Readiness is None,
                                     reason="needs minddp._C (the C++ hooks)")


def _make(kind, params, calls):
    r = kind(params, lambda i, defined: calls.append(("gradient", i, defined)),
             lambda b: calls.append(("bucket", b)), lambda i: calls.append(("extra", i)))
    r.set_layout([0, 0, 1, 1, 1], 2)
    return r


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_counting_is_the_same_in_both(kind):
    params = [nn.Parameter(torch.ones(2)) for _ in range(5)]
    r = _make(kind, params, [])
    r.reset([1, 2, 1, 1, 1])
    # parameter 1 needs two arrivals; bucket 0 fills with its second
    script = [(0, readiness.NOT_FULL), (1, readiness.NOT_FULL), (2, readiness.NOT_FULL),
              (1, 0), (1, readiness.EXTRA), (4, readiness.NOT_FULL), (3, 1)]
    for index, expected in script:
        assert r.mark(index) == expected, (index, expected)
    assert [r.is_ready(i) for i in range(5)] == [True] * 5
    assert (r.pending(0), r.pending(1)) == (0, 0)
    r.reset([1] * 5)  # a new backward starts from scratch
    assert (r.pending(0), r.pending(1), r.is_ready(3)) == (2, 3, False)
    r.set_layout([1, 0, 0, 0, 0], 2)  # buckets changed (bucket_cap_mb="auto")
    assert (r.pending(0), r.pending(1)) == (4, 1)
    r.remove()


def _backward(params):
    (params[0] * 2 + params[1] * 3 + params[2] * 4).sum().backward()


@needs_extension
def test_cpp_modes_in_a_real_backward():
    params = [nn.Parameter(torch.ones(3)) for _ in range(3)]
    calls = []
    r = readiness.Readiness(params, lambda i, d: calls.append(("gradient", i, d)),
                            lambda b: calls.append(("bucket", b)),
                            lambda i: calls.append(("extra", i)))
    r.set_layout([1, 0, 0], 2)
    r.reset([1, 1, 1])
    _backward(params)  # PYTHON, the mode a new Readiness starts in
    assert sorted(calls) == [("gradient", 0, True), ("gradient", 1, True), ("gradient", 2, True)]
    calls.clear()
    r.set_mode(readiness.COUNT)
    _backward(params)
    assert sorted(calls) == [("bucket", 0), ("bucket", 1)]  # once each, nothing per gradient
    calls.clear()
    _backward(params)  # not reset: every arrival is one too many
    assert sorted(calls) == [("extra", 0), ("extra", 1), ("extra", 2)]
    calls.clear()
    used = torch.zeros(3, dtype=torch.int32)
    r.set_mode(readiness.IGNORE, used)
    (params[1] * 2).sum().backward()
    assert calls == [] and used.tolist() == [0, 1, 0]
    with pytest.raises(RuntimeError, match="CPU int32"):
        r.set_mode(readiness.IGNORE, torch.zeros(3))
    r.set_mode(readiness.PYTHON)
    r.remove()
    _backward(params)
    assert calls == [], "a removed hook still ran"


@needs_extension
def test_cpp_hook_raises_the_callbacks_own_exception():
    params = [nn.Parameter(torch.ones(2))]

    def on_bucket(b):
        raise NotImplementedError("from the bucket callback")

    r = readiness.Readiness(params, None, on_bucket, None)
    r.set_layout([0], 1)
    r.reset([1])
    r.set_mode(readiness.COUNT)
    with pytest.raises(NotImplementedError, match="from the bucket callback"):
        params[0].sum().backward()
    r.remove()


class _Net(nn.Module):
    """A block checkpointed twice (static_graph: two gradients per backward), heads
    used on even and odd steps only (find_unused_parameters), a parameter never used.
    The block's weights are large enough to be scaled as they are copied into their
    bucket (buckets.SCALED_COPY_ELEMENTS)."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 2048), nn.Tanh(), nn.Linear(2048, 8))
        self.even, self.odd = nn.Linear(8, 4), nn.Linear(8, 4)
        self.spare = nn.Linear(8, 8)

    def forward(self, x, step, reentrant):
        h = checkpoint(self.block, x, use_reentrant=True) if reentrant else self.block(x)
        if reentrant:
            h = checkpoint(self.block, h, use_reentrant=True)
        return (self.even if step % 2 == 0 else self.odd)(h)


def _train(rank, world_size, kwargs, use_extension):
    import copy

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import minddp

    readiness.USE_EXTENSION = use_extension
    torch.manual_seed(0)
    model = _Net()
    reentrant = kwargs.get("static_graph", False)
    out = []
    for wrap, kw in ((TorchDDP, {}), (minddp.DDP, {"algorithm": "native"})):
        ddp = wrap(copy.deepcopy(model), **kwargs, **kw)
        if wrap is minddp.DDP:
            kind = type(ddp.reducer.readiness)
            assert kind is (readiness.Readiness if use_extension else readiness.PyReadiness)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        grads = []
        for step in range(12):  # the C++ hooks count from the 11th (logging samples 10)
            opt.zero_grad(set_to_none=step % 2 == 0)
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(4, 8, generator=g).requires_grad_(reentrant)
            if kwargs.get("find_unused_parameters"):  # one micro-step under no_sync
                with ddp.no_sync():
                    ddp(x, step + 1, reentrant).sum().backward()
            ddp(x, 0 if reentrant else step, reentrant).square().mean().backward()
            grads.append([None if p.grad is None else p.grad.clone()
                          for p in ddp.module.parameters()])
            opt.step()
        out.append(grads)
    # Past the iterations torch's logging samples, the C++ hooks count (COUNT mode)
    counted = ddp.reducer._ready_order is None and not ddp.reducer._measuring
    return out, counted


@pytest.mark.parametrize("use_extension", [
    False, pytest.param(True, marks=needs_extension)], ids=["python-hooks", "cpp-hooks"])
@pytest.mark.parametrize("kwargs", [
    {"find_unused_parameters": True},
    {"static_graph": True},
    {"gradient_as_bucket_view": True, "find_unused_parameters": True, "bucket_cap_mb": 0.001}],
    ids=["unused-no_sync", "static-reentrant", "bucket-view-tiny-buckets"])
def test_wrapper_matches_torch_with_either_hooks(kwargs, use_extension):
    for rank, ((theirs, ours), counted) in enumerate(run_world(_train, 2, kwargs,
                                                               use_extension)):
        assert counted, "the last backward was sampled: the hooks' COUNT mode went untested"
        for step, (a, b) in enumerate(zip(theirs, ours)):
            for i, (x, y) in enumerate(zip(a, b)):
                assert (x is None) == (y is None), f"rank {rank} step {step} parameter {i}"
                assert x is None or torch.equal(x, y), f"rank {rank} step {step} parameter {i}"
