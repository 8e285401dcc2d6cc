"""Compressed all-reduce and compressed DDP: codecs, rank agreement, no overflow, training parity.

The kernels themselves are tested in test_compression_ops.py.
"""
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import minddp
from dist_harness import run_world
from minddp import algorithms, compression, registry
from minddp.compression import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every registered algorithm but the ones that choose among the others (auto).
ALGORITHMS = [a for a in registry.algorithm_names() if registry.algorithm(a).bind is None]
KERNELS = ["reference"] + (["extension"] if compression.HAVE_EXTENSION else [])
TOLERANCE = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7}


def _kernels(name):
    return reference if name == "reference" else torch.ops.minddp


def test_codec_round_trip_and_pass_through():
    codec = compression.KernelCodec(torch.float16, kernels=reference)
    chunk = torch.randn(100) * 1e5  # past fp16's range without the scale
    wire = codec.encode(chunk)
    assert [t.dtype for t in wire] == [torch.float16, torch.float32]
    dst = torch.ones(100)
    codec.decode_add_(dst, wire)
    torch.testing.assert_close(dst, chunk + 1, rtol=0, atol=TOLERANCE["fp16"] * 1e5 * 4)
    codec.decode_(dst, wire)
    torch.testing.assert_close(dst, chunk, rtol=0, atol=TOLERANCE["fp16"] * 1e5 * 4)
    for other in (torch.arange(5), torch.randn(5, dtype=torch.float64)):
        assert codec.encode(other)[0] is other  # Horovod's rule: not float32, not compressed
    with pytest.raises(ValueError, match="choose one of"):
        registry.codec("int4")


def test_missing_extension_is_reported_once_and_pure_torch_works():
    code = ("import sys, warnings; sys.modules['minddp._C'] = None\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import minddp.compression as c, torch\n"
            "    import minddp.compression\n"
            "print(len(w), str(w[0].message)); assert not c.HAVE_EXTENSION\n"
            "print(minddp.registry.codec('bf16').encode(torch.ones(3))[1].item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("1 ") and "make setup" in out.stdout
    assert out.stdout.strip().endswith("16384.0")


def _all_reduce(rank, world_size, algorithm, kind, kernels):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(10_001, generator=g) * 10.0 ** (rank - 1)  # ranks differ in magnitude
    x[rank] = 7e4  # one big value per rank: the sum passes fp16's largest value
    world = torch.distributed.group.WORLD
    if kernels == "reference":
        codec = compression.KernelCodec(compression.DTYPES[kind], kernels=reference)
        codec.name = kind
        reduced = registry.wait_sum(registry.algorithm(algorithm).collective(world, codec),
                                    x.clone())
    else:
        reduced = minddp.all_reduce(x.clone(), algorithm, compression=kind)
    run = algorithms.collective(algorithm, world, registry.codec(kind))  # as the wrapper does
    ints = run(torch.arange(10) * (rank + 1))
    ints = ints.wait() if isinstance(ints, torch.futures.Future) else ints
    return x, reduced, ints


# Every algorithm on the extension's kernels; the pure-torch fallback on two of them.
CASES = [(a, k) for a in ALGORITHMS for k in KERNELS if k == "extension" or a in ("native", "ring")]


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("algorithm,kernels", CASES)
def test_compressed_all_reduce_is_bitwise_equal_on_every_rank(algorithm, kernels, kind):
    world = 3
    results = run_world(_all_reduce, world, algorithm, kind, kernels, timeout=90)
    exact = sum(r[0] for r in results)
    for _, reduced, ints in results:
        assert torch.equal(reduced, results[0][1])
        assert torch.equal(ints, torch.arange(10) * 6)  # integers pass through, exact
        assert torch.isfinite(reduced).all()
        # Each rank's value and each re-encoded partial sum errs by at most tol * max.
        bound = world * TOLERANCE[kind] * sum(r[0].abs().max() for r in results)
        assert (reduced - exact).abs().max() <= bound


class Huge(nn.Module):
    """Gradients up to ~1e6, far past fp16's largest value 65504."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _huge_grads(rank, world_size, algorithm, kind):
    grads = {}
    for setting in (None, kind):
        torch.manual_seed(0)
        ddp = minddp.DDP(Huge(), algorithm=algorithm, compression=setting, bucket_cap_mb=0.001)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)) * 300
        (ddp(x) ** 2).sum().backward()
        grads[setting] = [p.grad.clone() for p in ddp.parameters()]
    return grads[None], grads[kind]


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ddp_gradients_never_overflow(algorithm, kind):
    results = run_world(_huge_grads, 2, algorithm, kind, timeout=90)
    full, packed = results[0]
    assert max(g.abs().max() for g in full) > 65504  # the premise
    for exact, got in zip(full, packed):
        assert torch.isfinite(got).all()
        assert (got - exact).abs().max() <= 2 * TOLERANCE[kind] * exact.abs().max()
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(packed, other[1]))


def _train(rank, world_size, algorithm, steps):
    from benchmarks.workloads import SimpleTransformer, _text_batch, lm_loss

    losses = []
    # The uncompressed baseline on the backend's all-reduce: the same sums, sooner.
    for name, setting in (("native", None), (algorithm, "fp16")):
        torch.manual_seed(0)
        ddp = minddp.DDP(SimpleTransformer(), algorithm=name, compression=setting)
        opt = torch.optim.AdamW(ddp.parameters(), lr=5e-4, weight_decay=0.01)
        torch.manual_seed(rank)  # the same dropout masks in both runs
        # Random tokens hold nothing to learn but themselves: cycling over 4
        # small batches lets the loss fall far enough to compare the runs.
        for step in range(steps):
            (ids, mask), labels = _text_batch(rank, step % 4, 2, seq_len=32)
            opt.zero_grad()
            lm_loss(ddp(ids, mask), labels).backward()
            opt.step()
        ddp.eval()
        (ids, mask), labels = _text_batch(rank, 0, 2, seq_len=32)
        with torch.no_grad():
            losses.append(lm_loss(ddp(ids, mask), labels).item())
    return losses


def test_fp16_training_matches_uncompressed_loss():
    algorithm = "ring" if "ring" in ALGORITHMS else "native"
    (plain, packed), _ = run_world(_train, 2, algorithm, 50, timeout=240)
    assert plain < 7.0, plain  # it learned in 50 steps (ln 8000 = 8.99 at the start)
    assert abs(packed - plain) <= 0.01 * plain, (plain, packed)
