"""200 steps of random schedules on 3 ranks, for every algorithm, against torch DDP.

Per run: a random bucket cap; per step and rank: a random subset of the heads
in use (find_unused_parameters) and a random number of no_sync micro-steps
before the synced one. Ranks must stay bitwise equal; against torch DDP on the
same schedule parameters agree to float tolerance (with 3 ranks the two sum in
different orders).
"""
import copy
import random

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from dist_harness import run_world

STEPS = 200


class Heads(nn.Module):
    def __init__(self, width=16, heads=4):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.heads = nn.ModuleList(nn.Linear(width, 2) for _ in range(heads))

    def forward(self, x, use):
        h = torch.tanh(self.trunk(x))
        return sum(self.heads[i](h) for i in use)


def _stress(rank, world_size, algorithm):
    schedule = random.Random(1234)  # the same on every rank: caps and micro-step counts
    mine = random.Random(rank)      # this rank's choice of heads
    cap_mb = schedule.choice([0.0005, 0.002, 0.01, 25])
    torch.manual_seed(0)
    model = Heads()
    ref = TorchDDP(copy.deepcopy(model), find_unused_parameters=True, bucket_cap_mb=cap_mb)
    ours = minddp.DDP(copy.deepcopy(model), find_unused_parameters=True, bucket_cap_mb=cap_mb,
                      algorithm=algorithm)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (ref, ours)]
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        micro = schedule.choice([1, 1, 1, 2, 3])
        batches = [(torch.randn(4, 16, generator=g),
                    sorted(mine.sample(range(4), mine.randint(1, 4)))) for _ in range(micro)]
        for ddp, opt in zip((ref, ours), opts):
            opt.zero_grad()
            for i, (x, use) in enumerate(batches):
                if i < micro - 1:
                    with ddp.no_sync():
                        ddp(x, use).square().mean().backward()
                else:
                    ddp(x, use).square().mean().backward()
            opt.step()
    params = [p.detach() for p in ours.module.parameters()]
    for (name, p_ref), p in zip(ref.module.named_parameters(), params):
        torch.testing.assert_close(p, p_ref, rtol=1e-4, atol=1e-5, msg=f"{algorithm}: {name}")
    return torch.cat([p.reshape(-1) for p in params])


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["native", "ring", "tree", "halving_doubling", "auto"])
def test_random_schedules_match_torch(algorithm):
    flat = run_world(_stress, 3, algorithm, timeout=240)
    for rank in (1, 2):
        assert torch.equal(flat[rank], flat[0]), f"{algorithm}: rank {rank} differs from rank 0"
