"""compression="int8": bitwise-equal ranks, the error bound of every hop, error feedback
that makes the delivered gradients good on average, refused where it cannot work, and a
dead peer mid-step."""
import pytest
import torch
from torch import nn

import minddp
from minddp import algorithms, compression, registry
from dist_harness import dies_in_backward, run_world

HOP = 0.5 / 127  # one encoding errs by at most this share of its largest magnitude


def _all_reduce(rank, world_size, algorithm):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(50_001, generator=g) * 10.0 ** (rank - 1)  # ranks differ in magnitude
    reduced = minddp.all_reduce(x.clone(), algorithm, compression="int8")
    return x, reduced


@pytest.mark.parametrize("algorithm", registry.algorithm_names(per_hop_only=True))
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


def _same_gradient_every_step(rank, world_size, algorithm, feedback):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))
    ddp = minddp.DDP(model, algorithm=algorithm, compression="int8")
    if not feedback:
        reduction = ddp.reducer.reduction
        reduction.collective = reduction.collective.collective  # plain int8, no feedback
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    exact = torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        model(x).square().mean(), list(model.parameters()))])
    steps, delivered = 20, []
    for _ in range(steps):  # the model never changes: the same local gradient every step
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        delivered.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return exact, delivered


# 3 ranks: the tree has a rank between a leaf and the root, halving-doubling folds one in
@pytest.mark.parametrize("algorithm,world,feedback", [
    ("ring", 3, True), ("tree", 3, True), ("halving_doubling", 3, True), ("auto", 2, True),
    ("ring", 2, False)])
def test_error_feedback_makes_the_average_exact(algorithm, world, feedback):
    results = run_world(_same_gradient_every_step, world, algorithm, feedback)
    mean = sum(exact for exact, _ in results) / world
    delivered = results[0][1]
    for _, other_rank in results[1:]:
        for other, mine in zip(other_rank, delivered):
            assert torch.equal(other, mine), "ranks differ"
    first = (delivered[0] - mean).norm()
    average = (sum(delivered) / len(delivered) - mean).norm()
    assert first > 0
    # With feedback each sum returns what every hop's rounding took from the one before,
    # so over n steps the mean misses only the last step's rounding, about 1/n of one
    # step's error (1/20 here); without, every step misses the same.
    if feedback:
        assert average < 0.1 * first, (average, first)
    else:
        assert average > 0.9 * first, (average, first)


def test_dead_peer_during_an_int8_step_raises():
    elapsed, error = run_world(dies_in_backward, 2, "int8", timeout=60, expect_dead=(1,))[0]
    assert elapsed is not None and elapsed < 10, error
    assert "minddp (rank 0)" in error, error


def _inf_then_finite(rank, world_size):
    int8 = registry.codec("int8")
    job = compression.ErrorFeedback(
        algorithms.collective("ring", torch.distributed.group.WORLD, int8), int8)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    bucket = x.clone()
    if rank == 0:
        bucket[1500] = float("inf")  # the int8 block holding it decodes as NaN on every rank
    first = job(bucket).clone()
    bucket.copy_(x)
    return first, job(bucket).clone(), x


def test_error_feedback_drops_a_non_finite_record():
    (first, second, x0), (_, _, x1) = run_world(_inf_then_finite, 2)
    assert first.isnan().any() and first[:1000].isfinite().all()
    # the next step's values are finite, and what the NaN block recorded is not carried on
    assert second.isfinite().all()
    assert (second - (x0 + x1)).abs().max() < 0.1


def _overflow_then_finite(rank, world_size):
    """Through the wrapper: one rank's loss is inf at step 1 (what GradScaler skips)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))  # one int8 block
    ddp = minddp.DDP(model, compression="int8", algorithm="ring")
    finite = []
    for step in range(4):
        loss = ddp(torch.randn(4, 8)).square().mean()
        (loss * float("inf") if step == 1 and rank == 1 else loss).backward()
        finite.append(all(p.grad.isfinite().all() for p in model.parameters()))
        model.zero_grad()
    return finite


def test_one_overflow_step_leaves_the_next_ones_finite():
    # Bucket 0's step-check slots sit in its last int8 block: summed through the codec,
    # the NaN that step left in them made every later step's block NaN too.
    for rank, finite in enumerate(run_world(_overflow_then_finite, 2)):
        assert finite == [True, False, True, True], f"rank {rank}: {finite}"


def _half_encoded(rank, world_size):
    """An algorithm that encodes only half of the tensor: error feedback must refuse it."""
    from minddp.algorithms import p2p

    def body(link):
        peer = 1 - link.rank
        link.exchange([(peer, link.flat[:2048])], [(peer, link.flat[2048:])], "add", 7)

    tensor = torch.ones(4096)
    with pytest.raises(RuntimeError) as e:
        p2p.run("half", body, tensor, None, registry.codec("int8"), error=torch.zeros(4096))
    return str(e.value)


def test_error_feedback_refuses_an_algorithm_that_skips_elements():
    for message in run_world(_half_encoded, 2):
        assert "minddp half all-reduce" in message and "exactly once" in message, message
