"""compression="auto": each bucket's codec follows the timings (fp16, int8 or none), a
codec is dropped when its error is over budget, and every rank decides alike
(bitwise-equal results).

The timings are replaced by fixed ones so the choice is known; the real timing
runs in test_auto_times_the_real_link."""
import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp.compression import auto as compression_auto
from dist_harness import run_world

# seconds per bucket reduction: (full precision, fp16, int8)
TIMINGS = {"fp16": (2e-3, 1e-3, 0.98e-3),   # int8 not 5% faster than fp16
           "int8": (2e-3, 1e-3, 0.5e-3),
           None: (1e-3, 2e-3, 3e-3)}
# what a bucket's sum may differ from torch's: fp16's and int8's rounding
TOLERANCE = {"fp16": 1e-3, "int8": 2e-2}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])


def _train(rank, world_size, fastest, budget, algorithm="auto", steps=3):
    if fastest != "real":
        compression_auto.interleaved = lambda fns, *a, **k: list(TIMINGS[fastest][:len(fns)])
    compression_auto.ERROR_BUDGET = dict.fromkeys(compression_auto.ERROR_BUDGET, budget)
    model = _model()
    ref = TorchDDP(copy.deepcopy(model), bucket_cap_mb=0.3)
    ours = minddp.DDP(copy.deepcopy(model), bucket_cap_mb=0.3, compression="auto",
                      algorithm=algorithm, timeline="unused")
    reduction = ours.reducer.reduction
    chosen = dict(reduction.compressed)
    worst = []
    for step in range(steps):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(step + 10 * rank))
        for ddp in (ref, ours):
            ddp.zero_grad()
            ddp(x).square().mean().backward()
        worst.append(max(float(((a.grad - b.grad).norm() / a.grad.norm()))
                         for a, b in zip(ref.parameters(), ours.parameters())))
    offs = [e["name"] for e in ours.timeline.events if e["name"].startswith("compression off")]
    grads = torch.cat([p.grad.reshape(-1) for p in ours.parameters()])
    return chosen, dict(reduction.compressed), worst, offs, grads


def _ranks_equal(results):
    for rank, r in enumerate(results[1:], 1):
        assert torch.equal(r[-1], results[0][-1]), f"rank {rank}'s gradients differ"


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_the_fastest_codec_where_it_is_clearly_faster(codec):
    results = run_world(_train, 2, codec, 1.0)
    _ranks_equal(results)
    chosen, now, worst, offs, _ = results[0]
    assert len(chosen) > 1 and set(chosen.values()) == {codec} and now == chosen and not offs
    assert 0 < max(worst) < TOLERANCE[codec], "results should be close to, not equal to, torch's"


def test_full_precision_where_compression_is_slower():
    results = run_world(_train, 2, None, 1.0)
    _ranks_equal(results)
    chosen, _, worst, _, _ = results[0]
    assert set(chosen.values()) == {None} and max(worst) == 0.0


def test_native_never_takes_int8():
    results = run_world(_train, 2, "int8", 1.0, "native")  # int8 timed fastest, not offered
    _ranks_equal(results)
    assert set(results[0][0].values()) == {"fp16"}


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_error_over_budget_goes_back_to_full_precision(codec):
    results = run_world(_train, 2, codec, 0.0)  # any error is too much
    _ranks_equal(results)
    chosen, now, worst, offs, _ = results[0]
    assert set(chosen.values()) == {codec} and set(now.values()) == {None}
    assert sorted(offs) == sorted(f"compression off b{b}" for b in chosen)
    assert max(worst) == 0.0, "the step that measured the error must deliver the exact sum"


def test_auto_times_the_real_link():
    results = run_world(_train, 2, "real", 1.0)
    _ranks_equal(results)
    assert results[0][0] == results[1][0], "ranks chose differently"
    assert len(results[0][0]) >= 2, "every bucket should have a decision"
