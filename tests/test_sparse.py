"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True), reduced as torch's DDP does.

Each rank wraps two copies of one model, one in torch's DDP and one in minddp,
trains both on the same rank-dependent batches (SGD takes sparse gradients),
and compares every .grad after each backward: dense ones bitwise (two ranks:
sums are exact in any order), sparse ones by indices, values and whether they
are coalesced. minddp's ranks must end bitwise identical.
"""
import copy
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp import buckets
from dist_harness import run_world


class BagNet(nn.Module):
    """EmbeddingBag(sparse) -> Linear. `embedding_last` registers the embedding
    after the linear layer, so it lands in bucket 0 (which then cannot carry the
    step check)."""

    def __init__(self, embedding_last=False):
        super().__init__()
        if embedding_last:
            self.fc = nn.Linear(8, 4)
        self.bag = nn.EmbeddingBag(40, 8, mode="sum", sparse=True)
        if not embedding_last:
            self.fc = nn.Linear(8, 4)

    def forward(self, tokens):
        return self.fc(self.bag(tokens))


def _batch(rank, step, micro=0):
    # Rows overlap across ranks and repeat within a bag: the sums must merge them.
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randint(0, 40, (6, 5), generator=g)


def _snapshot(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            out[name] = None
        elif g.is_sparse:
            out[name] = ("sparse", g.is_coalesced(), g._indices().clone(), g._values().clone())
        else:
            out[name] = ("dense", g.clone())
    return out


def _assert_same(ours, theirs, what):
    assert ours.keys() == theirs.keys()
    for name in ours:
        a, b = ours[name], theirs[name]
        assert (a is None) == (b is None), f"{what} {name}: .grad None in one only"
        if a is None:
            continue
        assert a[0] == b[0], f"{what} {name}: layout {a[0]} against torch's {b[0]}"
        if a[0] == "sparse":
            assert a[1] == b[1], f"{what} {name}: coalesced {a[1]} against torch's {b[1]}"
            assert torch.equal(a[2], b[2]), f"{what} {name}: indices differ"
            assert torch.equal(a[3], b[3]), f"{what} {name}: values differ"
        else:
            assert torch.equal(a[1], b[1]), f"{what} {name}: max diff {(a[1] - b[1]).abs().max()}"


def _train(ddp, rank, steps, accumulate):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            sync = micro == accumulate - 1
            with nullcontext() if sync else ddp.no_sync():
                ddp(_batch(rank, step, micro)).square().mean().backward()
        grads.append(_snapshot(ddp.module))
        opt.step()
    return grads


def _parity(rank, world_size, options, hook, accumulate, embedding_last, steps=4):
    torch.manual_seed(0)
    model = BagNet(embedding_last)
    as_view = options.get("gradient_as_bucket_view", False)
    ours_ddp = minddp.DDP(copy.deepcopy(model), **options)
    theirs_ddp = TorchDDP(copy.deepcopy(model), gradient_as_bucket_view=as_view)
    if hook is not None:
        ours_ddp.register_comm_hook(None, hook)
        theirs_ddp.register_comm_hook(None, hook)
    ours = _train(ours_ddp, rank, steps, accumulate)
    theirs = _train(theirs_ddp, rank, steps, accumulate)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        _assert_same(a, b, f"rank {rank} step {step}")
    sparse_buckets = [b for b in ours_ddp.reducer.buckets if b.sparse]
    assert [b.params for b in sparse_buckets] == [[ours_ddp.module.bag.weight]]
    return [p.detach().clone() for p in ours_ddp.module.parameters()]


def _sum_then_divide(state, bucket):
    """test_c10d_gloo.py's hook for sparse gradients: a new tensor as the result."""
    fut = dist.group.WORLD.allreduce([bucket.buffer()]).get_future()
    return fut.then(lambda done: done.value()[0] / dist.get_world_size())


CASES = {
    "plain": ({}, None, 1, False),
    "grad_as_view": ({"gradient_as_bucket_view": True}, None, 1, False),
    "allreduce_hook": ({}, default_hooks.allreduce_hook, 1, False),
    "sum_then_divide_hook": ({}, _sum_then_divide, 1, False),
    "ring": ({"algorithm": "ring"}, None, 1, False),
    "ring_as_view": ({"algorithm": "ring", "gradient_as_bucket_view": True}, None, 1, False),
    "no_sync": ({}, None, 3, False),
    "no_sync_hook": ({}, default_hooks.allreduce_hook, 2, False),
    "sparse_bucket_0": ({"algorithm": "ring"}, None, 1, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_parity_with_torch(case):
    ranks = run_world(_parity, 2, *CASES[case], timeout=90)
    for ours, other in zip(*ranks):
        assert torch.equal(ours, other), "ranks differ"


def _compressed(rank, world_size, compression):
    """A lossy codec or PowerSGD cannot sum a sparse gradient: the sparse bucket
    goes through the backend's all-reduce and matches torch's exactly."""
    torch.manual_seed(0)
    model = BagNet()
    ours = minddp.DDP(copy.deepcopy(model), compression=compression)
    theirs = TorchDDP(copy.deepcopy(model))
    for step in range(3):
        for ddp in (ours, theirs):
            ddp.zero_grad()
            ddp(_batch(rank, step)).square().mean().backward()
        a, b = _snapshot(ours.module), _snapshot(theirs.module)
        _assert_same({"bag.weight": a["bag.weight"]}, {"bag.weight": b["bag.weight"]},
                     f"{compression} step {step}")
        torch.testing.assert_close(a["fc.weight"][1], b["fc.weight"][1], rtol=1e-2, atol=1e-3)
    return torch.cat([p.grad.to_dense().reshape(-1) for p in ours.module.parameters()])


@pytest.mark.parametrize("compression", ["fp16", "powersgd"])
def test_sparse_bucket_bypasses_compression(compression):
    a, b = run_world(_compressed, 2, compression, timeout=90)
    assert torch.equal(a, b), "ranks differ"


def _planned(rank, world_size):
    torch.manual_seed(0)
    model = BagNet()
    ours = minddp.DDP(copy.deepcopy(model), bucket_cap_mb="auto")
    theirs = TorchDDP(copy.deepcopy(model))
    a, b = _train(ours, rank, 5, 1), _train(theirs, rank, 5, 1)
    for step, (x, y) in enumerate(zip(a, b)):
        _assert_same(x, y, f"step {step}")
    for bucket in ours.reducer.buckets:
        weights = [p is ours.module.bag.weight for p in bucket.params]
        assert not any(weights) or weights == [True], "the sparse weight shares a bucket"
    return True


def test_planned_buckets_keep_sparse_parameters_alone():
    assert run_world(_planned, 2, timeout=120) == [True, True]


class _DenseUse(nn.Module):
    """The embedding's weight also used outside it: its gradient turns dense."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)

    def forward(self, x):
        return self.emb(x).sum() + self.emb.weight.sum()


class _SparseUse(nn.Module):
    """A plain parameter given a sparse gradient by F.embedding(sparse=True)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, x):
        return nn.functional.embedding(x, self.table, sparse=True).sum()


def _errors(rank, world_size):
    x = torch.tensor([1, 2, 3])
    raised = []
    for model_type in (_DenseUse, _SparseUse):
        kinds = []
        for wrap in (TorchDDP, minddp.DDP):
            ddp = wrap(model_type())
            try:
                ddp(x).backward()
                kinds.append(None)
            except Exception as e:  # noqa: BLE001 - compared with torch's below
                kinds.append((type(e), str(e)))
        raised.append(kinds)
    (torch_dense, ours_dense), (torch_sparse, ours_sparse) = raised
    assert torch_dense[0] is ours_dense[0] is RuntimeError
    assert "Expected variable to have sparse gradient" in torch_dense[1]
    assert "Expected variable to have sparse gradient" in ours_dense[1]
    assert f"rank {rank}" in ours_dense[1] and "'emb.weight'" in ours_dense[1]
    assert torch_sparse[0] is ours_sparse[0] is NotImplementedError
    assert f"rank {rank}" in ours_sparse[1] and "'table'" in ours_sparse[1]
    assert "sparse=True" in ours_sparse[1]
    return True


def test_sparse_and_dense_gradient_mismatches_raise_as_torch():
    assert run_world(_errors, 2, timeout=60) == [True, True]


def test_sparse_parameters_get_buckets_of_their_own_in_ready_order():
    model = BagNet()
    named = list(model.named_parameters())
    sparse = buckets.expect_sparse_gradient(model, named)
    assert sparse == [True, False, False]
    params = [p for _, p in named]
    # torch's order: the linear layer's gradients come first, the embedding's last.
    assert buckets.assign(params, [1 << 20], sparse) == [[2, 1], [0]]
    built = buckets.build(params, [1 << 20], stamp=True, sparse=sparse)
    assert [b.sparse for b in built] == [False, True]
    assert built[0].carrier is not None and built[1].buffer is None
    last = BagNet(embedding_last=True)
    params = [p for _, p in last.named_parameters()]
    sparse = buckets.expect_sparse_gradient(last, list(last.named_parameters()))
    built = buckets.build(params, [1 << 20], stamp=True, sparse=sparse)
    assert built[0].sparse and built[0].carrier is None  # the step check goes on its own
    with pytest.raises(ValueError, match="a bucket of its own"):
        buckets.allocate(params, [[2, 1, 0]], sparse=sparse)
