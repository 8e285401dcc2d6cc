"""static_graph=True: what it promises, against torch's DDP on the same steps.

Reentrant activation checkpointing runs a segment's backward inside the outer
one, and a block checkpointed twice in one forward hands its parameters two
gradients per backward: without static_graph both DDPs refuse that, with it
both reduce once all of a parameter's gradients have arrived. A parameter
no rank ever uses keeps no .grad. Non-reentrant checkpointing around the whole
wrapper runs its forward again inside backward.
"""
import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import minddp
from dist_harness import run_world


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)
        self.spare = nn.Linear(8, 8)  # never used

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=True)
        h = checkpoint(self.block, h, use_reentrant=True)  # the same parameters again
        return self.head(h)


def _inputs(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g).requires_grad_()


def _static(rank, world_size, static):
    torch.manual_seed(0)
    model = Checkpointed()
    results = []
    for wrap in (TorchDDP, minddp.DDP):
        ddp = wrap(copy.deepcopy(model), static_graph=static)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        grads = []
        try:
            for step in range(4):
                opt.zero_grad()
                ddp(_inputs(rank, step)).square().sum().backward()
                grads.append([None if p.grad is None else p.grad.clone()
                              for p in ddp.module.parameters()])
                opt.step()
        except RuntimeError as e:  # torch's words, which its own tests match
            grads.append(f"{type(e).__name__}, torch's words: "
                         f"{'Expected to mark a variable ready only once.' in str(e)}")
        results.append(grads)
    return results


def _same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


@pytest.mark.parametrize("static", [True, False])
def test_reentrant_checkpointing_as_in_torch(static):
    for rank, (theirs, ours) in enumerate(run_world(_static, 2, static)):
        assert len(theirs) == len(ours), (rank, theirs[-1], ours[-1])
        for step, (a, b) in enumerate(zip(theirs, ours)):
            assert _same(a, b), f"rank {rank}, step {step}: torch {a!r:.80}, minddp {b!r:.80}"
        if static:
            assert all(isinstance(step, list) for step in ours), "static graph must train"
            assert ours[-1][-1] is None and ours[-1][-2] is None, "the spare layer got a .grad"
        else:
            assert ours[-1] == "RuntimeError, torch's words: True", ours[-1]


def _whole_wrapper_checkpointed(rank, world_size, static):
    """checkpoint(ddp, x, use_reentrant=False): backward runs the wrapper's forward again,
    with static_graph after the step's backward has begun."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
    results = []
    for wrap in (TorchDDP, minddp.DDP):
        ddp = wrap(copy.deepcopy(model), static_graph=static)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            checkpoint(ddp, _inputs(rank, step), use_reentrant=False).square().sum().backward()
            opt.step()
        results.append([t.detach().clone() for t in (*ddp.parameters(), *ddp.buffers())])
    return results


@pytest.mark.parametrize("static", [True, False])
def test_checkpointing_the_whole_wrapper_as_in_torch(static):
    # static: minddp found its backward running when the forward ran again, and raised
    for rank, (theirs, ours) in enumerate(run_world(_whole_wrapper_checkpointed, 2, static)):
        for i, (a, b) in enumerate(zip(theirs, ours)):
            assert torch.equal(a, b), f"rank {rank}, tensor {i}: {a} where torch has {b}"


def _set_too_late(rank, world_size):
    ddp = minddp.DDP(nn.Linear(4, 4))
    ddp(torch.ones(2, 4)).sum().backward()
    try:
        ddp._set_static_graph()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_set_static_graph_after_training_raises():
    # torch's words, which its own test matches.
    for rank, error in enumerate(run_world(_set_too_late, 2)):
        assert "should be called before training loop starts" in error, error
        assert f"rank {rank}" in error, error
