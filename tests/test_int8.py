"""compression="int8": bitwise-equal ranks, the error bound of every hop, error feedback
that makes the delivered gradients good on average, refused where it cannot work, and a
dead peer mid-step."""
import pytest
import torch
from torch import nn

import minddp
from minddp import compression
from dist_harness import dies_in_backward, run_world

HOP = 0.5 / 127  # one encoding errs by at most this share of its largest magnitude


def _all_reduce(rank, world_size, algorithm):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(50_001, generator=g) * 10.0 ** (rank - 1)  # ranks differ in magnitude
    reduced = minddp.all_reduce(x.clone(), algorithm, compression="int8")
    return x, reduced


@pytest.mark.parametrize("algorithm", ["ring", "tree", "halving_doubling", "auto"])
def test_int8_all_reduce_is_bitwise_equal_and_within_its_bound(algorithm):
    world = 3
    results = run_world(_all_reduce, world, algorithm, timeout=90)
    exact = sum(x for x, _ in results)
    for _, reduced in results:
        assert torch.equal(reduced, results[0][1]), "ranks differ"
    error = (results[0][1] - exact).abs().max()
    # every rank's values and every re-encoded partial sum err by at most HOP * their max
    assert 0 < error <= world * HOP * sum(x.abs().max() for x, _ in results) * 1.001


def _refused(rank, world_size):
    messages = []
    with pytest.raises(ValueError) as e:
        minddp.DDP(nn.Linear(4, 4), algorithm="native", compression="int8")
    messages.append(str(e.value))
    with pytest.raises(ValueError) as e:
        minddp.all_reduce(torch.ones(8), "native", compression="int8")
    messages.append(str(e.value))
    return messages


def test_int8_on_the_backends_sum_is_refused():
    for message in run_world(_refused, 2)[0]:
        assert "int8" in message and "ring" in message


def _same_gradient_every_step(rank, world_size, feedback):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))
    ddp = minddp.DDP(model, algorithm="ring", compression="int8")
    if not feedback:
        reduction = ddp.reducer.reduction
        reduction.job = reduction.job.job  # the plain int8 sum, no error feedback
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    exact = torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        model(x).square().mean(), list(model.parameters()))])
    steps, delivered = 20, []
    for _ in range(steps):  # the model never changes: the same local gradient every step
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        delivered.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return exact, delivered


@pytest.mark.parametrize("feedback", [True, False], ids=["feedback", "no-feedback"])
def test_error_feedback_makes_the_average_exact(feedback):
    results = run_world(_same_gradient_every_step, 2, feedback)
    mean = sum(exact for exact, _ in results) / 2
    delivered = results[0][1]
    for other in results[1][1]:
        assert any(torch.equal(other, d) for d in delivered), "ranks differ"
    first = (delivered[0] - mean).norm()
    average = (sum(delivered) / len(delivered) - mean).norm()
    assert first > 0
    # With feedback what one step's own encoding misses, later steps deliver (about a third
    # is left: the rounding of partial sums at later hops is not fed back); without, every
    # step misses the same.
    if feedback:
        assert average < 0.5 * first, (average, first)
    else:
        assert average > 0.9 * first, (average, first)


def test_dead_peer_during_an_int8_step_raises():
    elapsed, error = run_world(dies_in_backward, 2, "int8", timeout=60, expect_dead=(1,))[0]
    assert elapsed is not None and elapsed < 10, error
    assert "minddp (rank 0)" in error, error


def test_error_feedback_clears_a_non_finite_error():
    codec = compression.Codec("int8")
    summed = []
    feedback = compression.ErrorFeedback(lambda t: summed.append(t.clone()) or t, codec, chunk=4)
    x = torch.tensor([1.0, 0.3, float("inf"), 2.0, 0.7, 0.1, 0.2, 0.9])
    feedback(x.clone())
    (error,) = feedback.errors.values()
    assert torch.isfinite(error).all() and error[:4].eq(0).all() and error[4:].ne(0).any()
    assert len(summed) == 1
