"""The shared battery: every registered algorithm and codec, built-in or from a plugin file
(plugins.py loads examples/algorithm_*.py and examples/codec_*.py), tested without naming it.

Each algorithm: exact integer sums of every size and dtype, the same bits on every
rank for float sums, strided input, and through the wrapper against torch's DDP.
Each codec, on every algorithm that can carry it: the same bits on every rank,
non-float32 tensors summed exactly, a sum near the exact one, error feedback that
pays back what one sum lost, and the wrapper's ranks bitwise equal. Elsewhere, also
parametrised from the registry: a dead peer raises (test_faults.py), NCCL's rules
(test_backend_rules.py), the wrapper's parity on more layouts (test_parity.py), the
send patterns of minddp's own algorithms (test_collectives.py).
"""
import copy
import hashlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
import strict_group
from dist_harness import run_world
from minddp import algorithms, compression, registry
from models import MODELS, batch

ALGORITHMS = registry.algorithm_names()
CODECS = registry.codec_names()


def _carriers(codec):
    """The algorithms that can sum with `codec` (every per-hop one; others where the codec
    can be summed whole)."""
    return [a for a in ALGORITHMS if registry.algorithm(a).carries(registry.codec(codec)) is None]


def _values(rank, numel, dtype):
    return ((torch.arange(numel) * 7 + rank * 5) % 11).to(dtype)


def _digest(tensor):
    return hashlib.sha1(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _sums(rank, world_size):
    failures, digests = [], {}
    noise = torch.randn(70_001, generator=torch.Generator().manual_seed(rank))
    for name in ALGORITHMS:
        for numel in (0, 1, world_size + 1, 4099):
            for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
                tensor = _values(rank, numel, dtype)
                expected = sum(_values(r, numel, dtype) for r in range(world_size))
                if minddp.all_reduce(tensor, name) is not tensor or not torch.equal(
                        tensor, expected):
                    failures.append(f"{name}: {numel} x {dtype}")
        digests[name] = _digest(minddp.all_reduce(noise.clone(), name))
        base = _values(rank, 40, torch.float32).reshape(4, 10)
        minddp.all_reduce(base.t()[::2], name)  # a strided view: every other row of base.t()
        expected = _values(rank, 40, torch.float32).reshape(4, 10)
        expected.t()[::2] = sum(_values(r, 40, torch.float32).reshape(4, 10).t()[::2]
                                for r in range(world_size))
        if not torch.equal(base, expected):
            failures.append(f"{name}: strided view")
    return failures, digests


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_algorithm_sums_exactly_and_alike(world_size):
    results = run_world(_sums, world_size, timeout=180)
    for rank, (failures, digests) in enumerate(results):
        assert not failures, f"rank {rank}: wrong sums: {failures}"
        differ = [n for n in ALGORITHMS if digests[n] != results[0][1][n]]
        assert not differ, f"rank {rank}'s float sums differ from rank 0's with {differ}"


def _train_both(rank, world_size, algorithm, compression_name=None, steps=3):
    torch.manual_seed(0)
    model = MODELS["deep"]()
    ref = TorchDDP(copy.deepcopy(model), bucket_cap_mb=0.002)
    ours = minddp.DDP(copy.deepcopy(model), bucket_cap_mb=0.002, algorithm=algorithm,
                      compression=compression_name)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    cosines = []
    for step in range(steps):
        for ddp, opt in zip((ref, ours), opts):
            opt.zero_grad()
            ddp(*batch("deep", rank, step)).square().mean().backward()
        mine = torch.cat([p.grad.reshape(-1) for p in ours.parameters()])
        theirs = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        cosines.append(float(torch.nn.functional.cosine_similarity(mine, theirs, dim=0)))
        if compression_name is None:  # the same sums, in another order: float rounding apart
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        for opt in opts:
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in ours.parameters()]), cosines


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_in_the_wrapper_matches_torch(algorithm):
    results = run_world(_train_both, 3, algorithm, timeout=120)
    for rank, (params, _) in enumerate(results):
        assert torch.equal(params, results[0][0]), f"rank {rank}'s parameters differ"


def _codecs(rank, world_size):
    """Per (codec, algorithm): the result's digest, its relative error, whether
    integers passed exactly, and (error feedback) the error of the mean of many sums."""
    out = {}
    world = dist.group.WORLD
    g = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
    exact = g.double()
    dist.all_reduce(exact)
    for name in CODECS:
        codec = registry.codec(name)
        for algorithm in _carriers(name):
            got = minddp.all_reduce(g.clone(), algorithm, compression=name)
            ints = minddp.all_reduce(_values(rank, 1000, torch.int64), algorithm,
                                     compression=name)
            row = {"digest": _digest(got), "ints": torch.equal(ints, sum(
                _values(r, 1000, torch.int64) for r in range(world_size))),
                   "error": float((got.double() - exact).norm() / exact.norm())}
            if codec.error_feedback:
                fed = compression.ErrorFeedback(algorithms.collective(algorithm, world, codec),
                                                codec)
                total = torch.zeros(5000, dtype=torch.float64)
                for _ in range(32):
                    total += registry.wait_sum(fed, g.clone()).double()
                row["mean_error"] = float((total / 32 - exact).norm() / exact.norm())
            out[name, algorithm] = row
    return out


def test_every_codec_on_every_algorithm_that_carries_it():
    results = run_world(_codecs, 3, timeout=180)
    for (name, algorithm), row in results[0].items():
        case = f"codec {name!r} on {algorithm!r}"
        assert all(r[name, algorithm]["digest"] == row["digest"] for r in results), (
            f"{case}: ranks differ")
        assert row["ints"], f"{case}: int64 values must travel as themselves"
        assert row["error"] < 1.0, f"{case}: relative error {row['error']:.3g}"
        if "mean_error" in row:  # what one sum loses comes back with the next ones
            assert row["mean_error"] < max(0.7 * row["error"], 1e-6), (
                f"{case}: error feedback did not pay back (one sum {row['error']:.3g}, mean "
                f"of 32 {row['mean_error']:.3g})")
    assert {name for name, _ in results[0]} == set(CODECS), "a codec no algorithm carries"


@pytest.mark.parametrize("name", CODECS)
def test_every_codec_in_the_wrapper_keeps_ranks_equal(name):
    algorithm = registry.algorithm_names(per_hop_only=True)[0]
    results = run_world(_train_both, 2, algorithm, name, timeout=120)
    for rank, (params, cosines) in enumerate(results):
        assert torch.equal(params, results[0][0]), f"rank {rank}'s parameters differ"
        # the step still points where torch's exact mean does
        assert min(cosines) > 0.5, cosines


def _codecs_under_nccl_rules(rank, world_size):
    group = strict_group.new_group()
    digests = {}
    noise = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    with strict_group.default_device_refused():
        for name in CODECS:
            for algorithm in _carriers(name):
                got = minddp.all_reduce(noise.clone(), algorithm, group=group, compression=name)
                digests[name, algorithm] = _digest(got)
    return digests


def test_every_codec_under_nccl_rules():
    results = run_world(_codecs_under_nccl_rules, 3, timeout=180, pg_timeout=60)
    for rank, digests in enumerate(results):
        assert digests == results[0], f"rank {rank} differs under NCCL's rules"
