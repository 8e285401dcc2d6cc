"""bucket_cap_mb="auto": the plan's model, and the wrapper rebuilding its buckets once.

The planner is checked against brute force on its own model; the rebuild against
torch's DDP (same gradients, every rank bitwise equal) with the plan it makes and
with a forced plan of one bucket per parameter in an order backward does not
follow, so buckets really move and launches really wait.
"""
import copy
import itertools
import random

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp import overlap
from dist_harness import run_world
from models import MODELS, batch


def _brute_force_end(ready, nbytes, alpha, beta):
    """The earliest end over every way of cutting the ready order into buckets."""
    n, best = len(ready), float("inf")
    for cuts in itertools.product([False, True], repeat=n - 1):
        ends = [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        starts = [0] + ends[:-1]
        _, end = overlap.simulate([ready[e - 1] for e in ends],
                                  [sum(nbytes[s:e]) for s, e in zip(starts, ends)],
                                  ready[-1], alpha, beta, 0.0)
        best = min(best, end)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_split_is_optimal_for_its_model(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    ready = sorted(rng.uniform(0, 1000) for _ in range(n))
    nbytes = [rng.randint(1, 100_000) for _ in range(n)]
    alpha, beta = rng.uniform(0, 300), rng.uniform(0, 0.02)
    buckets = overlap._split(list(range(n)), ready, nbytes, alpha, beta)
    assert sorted(i for b in buckets for i in b) == list(range(n))
    _, end = overlap.simulate([ready[b[-1]] for b in buckets],
                              [sum(nbytes[i] for i in b) for b in buckets],
                              ready[-1], alpha, beta, 0.0)
    assert end == pytest.approx(_brute_force_end(ready, nbytes, alpha, beta))


def test_plan_splits_only_where_overlap_is_free():
    # 8 layers of 256 KiB, ready every 10 ms of a backward; the link takes 20 ms per layer.
    params = [torch.zeros(64, 1024) for _ in range(8)]
    times = [10_000.0 * (8 - i) for i in range(8)]  # the last layer first
    free = overlap.plan(params, times, (100.0, 20_000 / 2**18, 0.0))
    assert len(free.buckets) > 1, "a wire-bound link should overlap backward"
    assert free.buckets[0][0] == 7, "the first bucket starts with the first gradient ready"
    assert sorted(i for b in free.buckets for i in b) == list(range(8))
    assert free.end_us < 80_000 + 8 * 20_000, "overlap should beat sending after backward"
    # A reduction that takes backward's cores: overlapping gains nothing (the end is
    # backward, then every byte), and more buckets only cost more alphas.
    busy = overlap.plan(params, times, (100.0, 20_000 / 2**18, 1.0))
    assert busy.end_us == pytest.approx(80_000 + 8 * 20_000, abs=300)
    assert len(busy.buckets) <= 2 < len(free.buckets)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)], nn.Linear(128, 4))


def _one_bucket_per_parameter(params, times, link, sparse=None):
    # registration order: the reverse of when backward makes the gradients
    layout = [[i] for i in range(len(params))]
    return overlap.Plan(layout, [0.0] * len(layout), [0.0] * len(layout), 0.0, link)


def _train(rank, world_size, forced, kwargs, steps=6):
    if forced:
        overlap.plan = _one_bucket_per_parameter
    model = _model()
    ref = TorchDDP(copy.deepcopy(model))
    ours = minddp.DDP(copy.deepcopy(model), bucket_cap_mb="auto", **kwargs)
    probe = [b.indices for b in ours.reducer.buckets]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(8, 128, generator=g)
        for ddp, opt in zip((ref, ours), opts):
            opt.zero_grad()
            ddp(x).square().mean().backward()
        for i, ((n, a), b) in enumerate(zip(ref.module.named_parameters(),
                                            ours.module.parameters())):
            assert torch.equal(a.grad, b.grad), f"step {step}: grad of {n} differs"
            if kwargs.get("gradient_as_bucket_view"):
                bucket, slot = ours.reducer._where[i]
                assert b.grad.data_ptr() == bucket.view(slot).data_ptr(), f"{n}: not a view"
        for opt in opts:
            opt.step()
    planned = [b.indices for b in ours.reducer.buckets]
    assert ours.reducer.planner is None, "the plan never ran"
    if forced:
        assert planned == [[i] for i in range(len(planned))]
    return probe, planned, torch.cat([p.detach().reshape(-1) for p in ours.parameters()])


@pytest.mark.parametrize("forced", [False, True], ids=["planned", "forced-layout"])
@pytest.mark.parametrize("kwargs", [{}, {"gradient_as_bucket_view": True},
                                    {"algorithm": "ring"}], ids=["auto", "view", "ring"])
def test_rebuilt_buckets_match_torch(forced, kwargs):
    results = run_world(_train, 2, forced, kwargs)
    (probe, planned, params), (_, other_plan, other) = results
    assert planned == other_plan, "ranks planned different buckets"
    assert torch.equal(params, other), "ranks ended with different parameters"
    assert len(probe) > 1, "the probe layout should have several sizes to measure"


def _uneven(rank, world_size):
    """Rank 0 runs out of data before the plan: it must take part in it joined."""
    torch.manual_seed(0)
    ddp = minddp.DDP(MODELS["deep"](), bucket_cap_mb="auto")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for step in range(1 if rank == 0 else 6):
            opt.zero_grad()
            ddp(*batch("deep", rank, step)).square().mean().backward()
            opt.step()
    assert ddp.reducer.planner is None, f"rank {rank} did not take part in the plan"
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])


def test_joined_rank_takes_part_in_the_plan():
    results = run_world(_uneven, 3, timeout=90)
    for rank, params in enumerate(results):
        assert torch.equal(params, results[0]), f"rank {rank} differs from rank 0"


def _powersgd_across_the_plan(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    ddp = minddp.DDP(model, bucket_cap_mb="auto",
                     compression=minddp.PowerSGD(rank=2, warmup_steps=1))
    reduction, moved = ddp.reducer.reduction, None
    for step in range(overlap.PLAN_AT + 1):
        old = reduction.states
        g = torch.Generator().manual_seed(10 * step + rank)
        ddp(torch.randn(8, 64, generator=g)).square().mean().backward()
        if reduction.states is not old:  # the plan replaced the buckets in this step
            errors = lambda states: {id(p): v for s in states.values()  # noqa: E731
                                     for p, v in s.error_views()}
            was, now = errors(old), errors(reduction.states)
            moved = (step, set(was) == set(now) and all(torch.equal(was[k], now[k]) for k in was),
                     any(v.abs().sum() > 0 for v in now.values()))
    steps = {s.steps for s in reduction.states.values()}
    return moved, steps, [p.grad.clone() for p in ddp.parameters()]


def test_powersgd_keeps_its_error_feedback_across_the_plan():
    results = run_world(_powersgd_across_the_plan, 2)
    for moved, steps, _ in results:
        assert moved is not None, "the buckets were never replaced"
        step, same, nonzero = moved
        assert step == overlap.PLAN_AT - 1 and nonzero
        assert same, "the error feedback changed with the buckets"
        assert steps == {overlap.PLAN_AT + 1}, "the step count restarted with the new buckets"
    for a, b in zip(results[0][2], results[1][2]):
        assert torch.equal(a, b), "ranks' gradients differ after the plan"


def _timeline_and_errors(rank, world_size, path):
    ddp = minddp.DDP(_model(), bucket_cap_mb="auto", timeline=path)
    for _ in range(overlap.PLAN_AT):
        ddp(torch.randn(4, 128)).sum().backward()
    plans = [e for e in ddp.timeline.events if e["name"] == "bucket plan"]
    messages = []
    for kwargs in ({"bucket_cap_mb": "big"}, {"bucket_cap_mb": "auto", "bucket_cap_mb_list": [1]}):
        with pytest.raises(ValueError) as e:
            minddp.DDP(_model(), **kwargs)
        messages.append(str(e.value))
    return plans, messages


def test_plan_is_on_the_timeline_and_bad_caps_are_refused(tmp_path):
    plans, messages = run_world(_timeline_and_errors, 2, str(tmp_path / "t"))[0]
    assert len(plans) == 1 and plans[0]["args"]["buckets"] >= 1
    assert {"alpha_us", "beta_us_per_mb", "slowdown", "ready_ms", "done_ms"} <= set(
        plans[0]["args"])
    assert "a number of MiB or 'auto'" in messages[0] and "rank 0" in messages[0]
    assert "not both" in messages[1]
