"""Non-finite gradients propagate on every algorithm and compression; large ones survive.

A NaN or inf in one rank's gradient must reach every rank's mean (masking it
would hide a diverging run), and the other parameters must be unharmed. A
gradient far beyond fp16's range (65504) must not become inf through fp16
compression, thanks to the per-tensor scale.
"""
import pytest
import torch
from torch import nn

import minddp
from dist_harness import run_world

ALGORITHMS = ["native", "ring", "tree", "halving_doubling", "auto"]


class TwoVectors(nn.Module):
    def __init__(self, n=37):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.zeros(n)), nn.Parameter(torch.zeros(n))

    def forward(self, x, y):
        return (self.a * x).sum() + (self.b * y).sum()


def _poisoned(rank, world_size, algorithm):
    grads = {}
    for compression in (None, "fp16", "bf16"):
        ddp = minddp.DDP(TwoVectors(), algorithm=algorithm, compression=compression)
        for special in (float("nan"), float("inf")):
            x = torch.arange(37.0) + rank          # the gradient of a is x
            y = torch.full((37,), float(rank + 1))  # the gradient of b is y
            if rank == 1:
                x[5] = special
            ddp.zero_grad()
            ddp(x, y).backward()
            grads[compression, str(special)] = (ddp.module.a.grad.clone(),
                                                ddp.module.b.grad.clone())
    return grads


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_nan_and_inf_reach_every_rank(algorithm):
    world = 3
    results = run_world(_poisoned, world, algorithm)
    mean_b = sum(r + 1 for r in range(world)) / world
    for (compression, special), (a0, _) in results[0].items():  # special: "nan" or "inf"
        what = f"{algorithm}, compression={compression}, {special} on rank 1"
        for rank, grads in enumerate(results):
            a, b = grads[compression, special]
            torch.testing.assert_close(a, a0, rtol=0, atol=0, equal_nan=True,
                                       msg=f"{what}: rank {rank} differs from rank 0")
            if special == "nan":
                assert torch.isnan(a[5]), f"{what}: rank {rank}: NaN was masked: {a[5]}"
            else:
                assert torch.isinf(a[5]) and a[5] > 0, f"{what}: rank {rank}: inf became {a[5]}"
            others = torch.cat([a[:5], a[6:]])
            assert torch.isfinite(others).all(), f"{what}: rank {rank}: non-finite spread: {a}"
            torch.testing.assert_close(b, torch.full_like(b, mean_b), rtol=1e-2, atol=0,
                                       msg=f"{what}: rank {rank}: b harmed")


def _huge(rank, world_size, algorithm):
    ddp = minddp.DDP(TwoVectors(), algorithm=algorithm, compression="fp16")
    x = torch.full((37,), 3e6 * (rank + 1))
    ddp(x, torch.ones(37)).backward()
    return ddp.module.a.grad.clone()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_gradients_beyond_fp16_range_stay_finite(algorithm):
    for a in run_world(_huge, 2, algorithm):
        assert torch.isfinite(a).all(), a
        torch.testing.assert_close(a, torch.full_like(a, 4.5e6), rtol=2 ** -10, atol=0)


def _float64(rank, world_size):
    ddp = minddp.DDP(TwoVectors().double(), algorithm="ring", compression="fp16")
    x = torch.linspace(-1, 1, 37, dtype=torch.float64) * (rank + 1) / 3
    ddp(x, x).backward()
    return ddp.module.a.grad.clone()


def test_float64_buckets_with_compression_are_not_corrupted():
    expected = torch.linspace(-1, 1, 37, dtype=torch.float64) * 0.5  # mean of x/3, 2x/3
    for a in run_world(_float64, 2):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, expected, rtol=0, atol=2 ** -10)
