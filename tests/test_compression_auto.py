"""compression="auto": each bucket's choice follows the timings, fp16 is dropped when its
error is over budget, and every rank decides alike (bitwise-equal results).

The timings are replaced by fixed ones so the choice is known; the real timing
runs in test_auto_times_the_real_link."""
import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp import compression_auto
from dist_harness import run_world


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])


def _train(rank, world_size, fp16_faster, budget, steps=3):
    if fp16_faster is not None:
        exact_s, fp16_s = (2e-3, 1e-3) if fp16_faster else (1e-3, 2e-3)
        compression_auto.interleaved = lambda fns, *a, **k: [exact_s, fp16_s]
    compression_auto.ERROR_BUDGET = budget
    model = _model()
    ref = TorchDDP(copy.deepcopy(model), bucket_cap_mb=0.3)
    ours = minddp.DDP(copy.deepcopy(model), bucket_cap_mb=0.3, compression="auto",
                      timeline="unused")
    reduction = ours.reducer.reduction
    chosen = dict(reduction.compressed)
    worst = []
    for step in range(steps):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(step + 10 * rank))
        for ddp in (ref, ours):
            ddp.zero_grad()
            ddp(x).square().mean().backward()
        worst.append(max(float((a.grad - b.grad).abs().max())
                         for a, b in zip(ref.parameters(), ours.parameters())))
    offs = [e["name"] for e in ours.timeline.events if e["name"].startswith("compression off")]
    grads = torch.cat([p.grad.reshape(-1) for p in ours.parameters()])
    return chosen, dict(reduction.compressed), worst, offs, grads


def _ranks_equal(results):
    for rank, r in enumerate(results[1:], 1):
        assert torch.equal(r[-1], results[0][-1]), f"rank {rank}'s gradients differ"


def test_fp16_where_it_is_faster():
    results = run_world(_train, 2, True, 1e-2)
    _ranks_equal(results)
    chosen, now, worst, offs, _ = results[0]
    assert len(chosen) > 1 and all(chosen.values()) and now == chosen and not offs
    assert 0 < max(worst) < 1e-3, "fp16 results should be close to, not equal to, torch's"


def test_full_precision_where_fp16_is_slower():
    results = run_world(_train, 2, False, 1e-2)
    _ranks_equal(results)
    chosen, _, worst, _, _ = results[0]
    assert not any(chosen.values()) and max(worst) == 0.0


def test_error_over_budget_goes_back_to_full_precision():
    results = run_world(_train, 2, True, 0.0)  # any fp16 error is too much
    _ranks_equal(results)
    chosen, now, worst, offs, _ = results[0]
    assert all(chosen.values()) and not any(now.values())
    assert sorted(offs) == sorted(f"compression off b{b}" for b in chosen)
    assert max(worst) == 0.0, "the step that measured the error must deliver the exact sum"


def test_auto_times_the_real_link():
    results = run_world(_train, 2, None, 1e-2)
    _ranks_equal(results)
    assert results[0][0] == results[1][0], "ranks chose differently"
    assert len(results[0][0]) >= 2, "every bucket should have a decision"
