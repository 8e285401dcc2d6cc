"""Uneven inputs with ddp.join(): rank r trains 2(r+1) steps, nobody hangs, and the
result equals a single process replaying every rank's batches."""
import copy

import pytest
import torch

import minddp
from dist_harness import run_world
from models import MODELS, batch

LR = 0.1


def _steps(rank):
    return 2 * (rank + 1)


def _reference(model, name, world_size, divide_by_initial):
    """Plain SGD on the mean gradient of the ranks that still have data."""
    model = copy.deepcopy(model)
    for step in range(_steps(world_size - 1)):
        active = [r for r in range(world_size) if step < _steps(r)]
        model.zero_grad()
        for r in active:
            model(*batch(name, r, step)).square().mean().backward()
        divisor = world_size if divide_by_initial else len(active)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad / divisor
    return model


def _uneven(rank, world_size, name, divide_by_initial):
    torch.manual_seed(0)
    model = MODELS[name]()
    ddp = minddp.DDP(copy.deepcopy(model))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    with ddp.join(divide_by_initial_world_size=divide_by_initial):
        for step in range(_steps(rank)):
            opt.zero_grad()
            ddp(*batch(name, rank, step)).square().mean().backward()
            opt.step()
    mine = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()] +
                     [b.reshape(-1).float() for b in ddp.module.buffers()])
    if name != "deep":
        return mine, None
    ref = _reference(model, name, world_size, divide_by_initial)
    return mine, torch.cat([p.detach().reshape(-1) for p in ref.parameters()])


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_uneven_inputs_match_replay(divide_by_initial):
    results = run_world(_uneven, 3, "deep", divide_by_initial, timeout=90)
    for rank, (mine, ref) in enumerate(results):
        assert torch.equal(mine, results[0][0]), f"rank {rank} differs from rank 0"
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)


def test_uneven_inputs_with_buffers_end_equal():
    results = run_world(_uneven, 3, "batchnorm", True, timeout=90)
    for rank, (mine, _) in enumerate(results):
        assert torch.equal(mine, results[0][0]), f"rank {rank} differs from rank 0"


def _uneven_like_torch(rank, world_size, wrap, **kwargs):
    """BatchNorm trained inside join() with uneven inputs, then two steps after it:
    parameters and buffers."""
    torch.manual_seed(0)
    model = MODELS["batchnorm"]()
    ddp = wrap(model, **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    with ddp.join():
        for step in range(_steps(rank)):
            opt.zero_grad()
            ddp(*batch("batchnorm", rank, step)).square().mean().backward()
            opt.step()
    for step in (100, 101):  # buffers now differ by rank: the second forward shows the source
        ddp(*batch("batchnorm", rank, step)).square().mean().backward()
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def _both_wrappers(rank, world_size, broadcast_buffers):
    kwargs = {"broadcast_buffers": broadcast_buffers}
    return (_uneven_like_torch(rank, world_size, torch.nn.parallel.DistributedDataParallel,
                               **kwargs),
            _uneven_like_torch(rank, world_size, lambda m, **kw: minddp.DDP(
                m, algorithm="native", **kw), **kwargs))


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_uneven_inputs_buffers_come_from_the_rank_torch_picks(broadcast_buffers):
    # torch broadcasts buffers inside join(), the final model, and buffers in every forward
    # after a join, from the highest rank (still training); with broadcast_buffers=False it
    # sends none. BatchNorm's running statistics show which rank they came from. Two ranks,
    # so that sums are bitwise torch's too (at three, the bucket layouts' orders of addition
    # differ in the last bit: docs/differences.md, "bucket layout").
    results = run_world(_both_wrappers, 2, broadcast_buffers, timeout=90)
    for rank, (theirs, ours) in enumerate(results):
        for i, (a, b) in enumerate(zip(theirs, ours)):
            assert torch.equal(a, b), f"rank {rank}: tensor {i} differs from torch DDP's"


class _SometimesC(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x, use_c):
        return self.a(x).sum(1) + (self.c(x).sum(1) if use_c else 0)


def _unused_after_a_peer_joined(rank, world_size):
    """find_unused_parameters: rank 1 joins after one step, in which both ranks used c;
    rank 0 never uses c again. Each step's c.grad (None or zeros), and c at the end."""
    seen = []
    for wrap in (torch.nn.parallel.DistributedDataParallel, minddp.DDP):
        torch.manual_seed(0)
        model = _SometimesC()
        ddp = wrap(model, find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        grads = []
        with ddp.join():
            for step in range(4 if rank == 0 else 1):
                ddp(torch.ones(2, 4) * (rank + 1), step == 0).sum().backward()
                grads.append(None if model.c.weight.grad is None else
                             model.c.weight.grad.clone())
                opt.step()
                opt.zero_grad()
        seen.append((grads, model.c.weight.detach().clone()))
    return seen


def test_a_parameter_unused_after_a_peer_joined_gets_torchs_gradient():
    # torch's joined rank adds its last summed used map, not zeros: c counts as used (a
    # zero .grad, which momentum acts on) where no training rank used it.
    for rank, ((their_grads, theirs), (our_grads, ours)) in enumerate(
            run_world(_unused_after_a_peer_joined, 2, timeout=60)):
        assert len(our_grads) == len(their_grads)
        for step, (a, b) in enumerate(zip(their_grads, our_grads)):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), \
                f"rank {rank} step {step}: torch {a}, minddp {b}"
        assert torch.equal(ours, theirs), f"rank {rank}: c differs from torch DDP's"


def _exhausted_message(rank, world_size, wrap):
    model = wrap(torch.nn.Linear(2, 2))
    try:
        with model.join(throw_on_early_termination=True):
            for _ in range(1 + rank):
                model(torch.ones(1, 2)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


def _messages(rank, world_size):
    return (_exhausted_message(rank, world_size, torch.nn.parallel.DistributedDataParallel),
            _exhausted_message(rank, world_size, minddp.DDP))


def test_early_termination_says_what_torch_says_on_every_rank():
    for rank, (theirs, ours) in enumerate(run_world(_messages, 2, timeout=60)):
        assert theirs is not None and ours == theirs, f"rank {rank}: {ours!r} vs {theirs!r}"


def _generic_join(rank, world_size, wrap, with_zero, throw):
    """torch's Join([ddp, ...]) with uneven inputs: parameters and buffers, or the error."""
    from torch.distributed.algorithms import Join as TorchJoin
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.manual_seed(0)
    model = MODELS["batchnorm"]()
    ddp = wrap(model)
    if with_zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=LR)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    try:
        with TorchJoin([ddp, opt] if with_zero else [ddp], throw_on_early_termination=throw):
            for step in range(_steps(rank)):
                opt.zero_grad()
                ddp(*batch("batchnorm", rank, step)).square().mean().backward()
                opt.step()
    except RuntimeError as e:
        return str(e)
    for step in (99, 100):  # training goes on after it; buffers from the rank torch picks
        ddp(*batch("batchnorm", rank, step)).sum().backward()
    with ddp.join():  # and ddp.join() works after a torch Join
        for step in range(_steps(1 - rank)):
            ddp(*batch("batchnorm", rank, 200 + step)).sum().backward()
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def _generic_both(rank, world_size, with_zero, throw):
    return [_generic_join(rank, world_size, wrap, with_zero, throw)
            for wrap in (torch.nn.parallel.DistributedDataParallel,
                         lambda m: minddp.DDP(m, algorithm="native"))]


@pytest.mark.parametrize("with_zero, throw", [(False, False), (True, False), (False, True)],
                         ids=["ddp", "ddp+zero", "throw"])
def test_torch_generic_join_drives_minddp_as_torch_ddp(with_zero, throw):
    for rank, (theirs, ours) in enumerate(run_world(_generic_both, 2, with_zero, throw,
                                                    timeout=90)):
        if throw:
            assert isinstance(theirs, str) and ours == theirs, (rank, theirs, ours)
            continue
        assert not isinstance(ours, str), f"rank {rank}: {ours}"
        for i, (a, b) in enumerate(zip(theirs, ours)):
            assert torch.equal(a, b), f"rank {rank}: tensor {i} differs from torch DDP's"
