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
