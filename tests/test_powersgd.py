"""compression="powersgd": the wrapper's gradients against a plain reference of the same
math, bitwise-equal ranks, error feedback, warm-up, and a dead peer mid-step."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minddp
from dist_harness import dies_in_backward, run_world
from minddp.compression import powersgd


def test_orthonormalise_and_worth_compressing():
    p = torch.randn(20, 3, dtype=torch.float64)
    span = p.clone()
    powersgd.orthonormalise_(p)
    torch.testing.assert_close(p.t() @ p, torch.eye(3, dtype=torch.float64))
    # the same column space: projecting the original columns changes nothing
    torch.testing.assert_close(p @ (p.t() @ span), span)
    assert powersgd.worth_compressing((64, 32), 4) and not powersgd.worth_compressing((64,), 4)
    assert not powersgd.worth_compressing((4, 4), 4)  # 4 * (4 + 4) > 16: no gain
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        minddp.PowerSGD(rank=0)


def _reference_step(ms, q, world_size):
    """One PowerSGD step in float64 on every rank's M (already gradient/p + error):
    (result, new q, each rank's new error)."""
    ms = [m.double() for m in ms]
    p = sum(m @ q for m in ms)
    powersgd.orthonormalise_(p)
    q = sum(m.t() @ p for m in ms)
    result = p @ q.t()
    return result, q, [m - result / world_size for m in ms]


def _train(rank, world_size, algorithm, steps, warmup):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 12))
    local = copy.deepcopy(model)
    settings = minddp.PowerSGD(rank=2, warmup_steps=warmup)
    ddp = minddp.DDP(model, algorithm=algorithm, compression=settings)
    reduction = ddp.reducer.reduction
    (bucket,) = ddp.reducer.buckets  # one bucket: the layout below is its own
    state = reduction.states[bucket.index]
    assert len(state.matrices) == 2 and len(state.plain) == 2
    shapes = [grad.shape for grad, _, _, _ in state.matrices]  # (n, m) each
    qs = [q.double().clone() for _, _, _, q in state.matrices]
    errors = [torch.zeros(n, m, dtype=torch.float64) for n, m in shapes]
    # error feedback loses nothing: the results of all steps plus what the ranks still hold
    # back add up to the exact means of all steps
    delivered = [torch.zeros(n, m, dtype=torch.float64) for n, m in shapes]
    owed = [torch.zeros(n, m, dtype=torch.float64) for n, m in shapes]
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 24, generator=g)
        model.zero_grad(set_to_none=True)
        local.zero_grad(set_to_none=True)
        ddp(x).square().sum().backward()
        local(x).square().sum().backward()
        mine = {id(p): lp.grad for p, lp in zip(model.parameters(), local.parameters())}
        for param in model.parameters():
            # every rank holds the same gradient, bit for bit
            gathered = [torch.empty_like(param.grad) for _ in range(world_size)]
            dist.all_gather(gathered, param.grad)
            assert all(torch.equal(gathered[0], t) for t in gathered), "ranks differ"
        for i, ((n, m), param) in enumerate(zip(
                shapes, [p for p in bucket.params if p.dim() == 2])):
            local_m = mine[id(param)].double().view(n, m) / world_size
            every = [torch.empty_like(local_m) for _ in range(world_size)]
            dist.all_gather(every, local_m)
            owed[i] += sum(every)
            delivered[i] += param.grad.double().view(n, m)
            if step < warmup:  # full precision: the exact mean
                torch.testing.assert_close(param.grad.double().view(n, m), sum(every))
                continue
            dist.all_gather(every, local_m + errors[i])
            result, qs[i], new_errors = _reference_step(every, qs[i], world_size)
            errors[i] = new_errors[rank]
            got = param.grad.double().view(n, m)
            torch.testing.assert_close(got, result, rtol=1e-4, atol=1e-5)
            kept = state.matrices[i][1].double()  # this rank's error for the matrix
            torch.testing.assert_close(kept, errors[i], rtol=1e-4, atol=1e-5)
            assert not torch.allclose(got, sum(every), rtol=1e-3), "rank 2 was exact?"
        for param in (p for p in bucket.params if p.dim() == 1):  # biases: exact means
            exact = sum(_gather(mine[id(param)] / world_size))
            torch.testing.assert_close(param.grad, exact, rtol=1e-6, atol=1e-7)
    for i, (_, error, _, _) in enumerate(state.matrices):
        held_back = sum(_gather(error.double()))
        torch.testing.assert_close(delivered[i] + held_back, owed[i],
                                   rtol=1e-4, atol=1e-5)
    return state.steps


def _gather(t):
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t.contiguous())
    return every


@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_matches_the_reference_and_ranks_agree(algorithm):
    assert run_world(_train, 2, algorithm, 5, 2, timeout=120) == [5, 5]


def test_three_ranks_auto():
    assert run_world(_train, 3, "auto", 4, 1, timeout=180) == [4, 4, 4]


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


def _off_the_happy_path(rank, world_size):
    """Branch b unused by every rank at the first compressed step, then used; an inf on
    rank 0 at step 3; ordinary steps after."""
    torch.manual_seed(0)
    ddp = minddp.DDP(TwoBranches(), algorithm="ring", find_unused_parameters=True,
                     compression=minddp.PowerSGD(rank=2, warmup_steps=0))
    seen = []
    for step in range(6):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        if step == 3 and rank == 0:
            x[0, 0] = float("inf")
        ddp.zero_grad(set_to_none=False)
        ddp(x, use_b=step > 0).square().sum().backward()
        b = ddp.module.b.weight.grad
        seen.append((b is not None and bool((b != 0).any()),
                     bool(torch.isfinite(ddp.module.a.weight.grad).all())))
        for p in ddp.parameters():
            if p.grad is not None:
                every = _gather(p.grad)
                bits = [t.view(torch.int32) for t in every]  # NaN == NaN, bit for bit
                assert all(torch.equal(bits[0], t) for t in bits[1:]), f"ranks differ, {step}"
    return seen


def test_unused_then_used_and_a_non_finite_step():
    for seen in run_world(_off_the_happy_path, 2, timeout=120):
        b_has_gradient = [b for b, _ in seen]
        a_finite = [a for _, a in seen]
        # step 0: b unused, its Q would stay zero without a fresh draw; then b learns
        assert b_has_gradient == [False, True, True, True, True, True], seen
        # the inf reaches .grad at step 3 and does not poison the steps after it
        assert a_finite == [True, True, True, False, True, True], seen


def _mismatched_settings(rank, world_size):
    compression = minddp.PowerSGD(rank=2) if rank == 1 else "powersgd"
    try:
        minddp.DDP(nn.Linear(8, 8), compression=compression)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_settings_that_differ_between_ranks_raise_on_every_rank():
    for rank, error in enumerate(run_world(_mismatched_settings, 2)):
        assert "compression=" in error, error
        assert "PowerSGD(rank=4" in error and "PowerSGD(rank=2" in error, error
        assert f"rank {rank}" in error


def test_dead_peer_during_a_compressed_step_raises():
    settings = minddp.PowerSGD(rank=2, warmup_steps=1)
    elapsed, error = run_world(dies_in_backward, 2, settings, timeout=60, expect_dead=(1,))[0]
    assert elapsed is not None and elapsed < 10, error
    assert "minddp (rank 0)" in error and "PowerSGD" in error, error
