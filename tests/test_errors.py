"""Every misuse gets a clear error that names the problem, the rank and the fix.

Where a mistake is on one rank only (a different model), every rank must
raise, not just the one that differs: otherwise the others hang in the next
collective.
"""
import warnings

import pytest
import torch
from torch import nn

import minddp
from dist_harness import run_world
from models import BranchNet, DeepNet, batch


def _error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_uninitialised_process_group():
    with pytest.raises(RuntimeError, match="not initialised.*init_process_group"):
        minddp.DDP(nn.Linear(2, 2))


def _construction_errors(rank, world_size):
    frozen = nn.Linear(2, 2).requires_grad_(False)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    cases = {
        "no_params": (frozen, {}),
        "mixed": (mixed, {}),
        "meta": (nn.Linear(2, 2, device="meta"), {}),
        "cap": (nn.Linear(2, 2), {"bucket_cap_mb": 0}),
        "algorithm": (nn.Linear(2, 2), {"algorithm": "fastest"}),
        "compression": (nn.Linear(2, 2), {"compression": "int8"}),
        "device_ids": (nn.Linear(2, 2), {"device_ids": [0]}),
    }
    return {k: _error_of(minddp.DDP, m, **kw) for k, (m, kw) in cases.items()}


def test_construction_errors():
    errors = run_world(_construction_errors, 1)[0]
    expect = {
        "no_params": ["rank 0", "no parameter that requires grad"],
        "mixed": ["rank 0", "several devices", "move the whole module"],
        "meta": ["rank 0", "meta device", "to_empty"],
        "cap": ["rank 0", "bucket_cap_mb must be a positive", "0"],
        "algorithm": ["rank 0", "unknown algorithm 'fastest'", "choose one of"],
        "compression": ["rank 0", "unknown compression 'int8'", "choose one of"],
        "device_ids": ["rank 0", "device_ids=[0]", "device_ids=None for CPU"],
    }
    for case, words in expect.items():
        for word in words:
            assert word in errors[case], f"{case}: {word!r} not in {errors[case]!r}"


def _mismatch(rank, world_size, what):
    width = 6 if (what == "shape" and rank == 2) else 4
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    if what == "count" and rank == 1:
        model.append(nn.Linear(2, 2))
    cap = 5 if (what == "settings" and rank == 1) else 25
    return _error_of(minddp.DDP, model, bucket_cap_mb=cap)


@pytest.mark.parametrize("what, words", [
    ("shape", ["ranks 0 and 2", "'0.weight' of shape [4, 4]", "'0.weight' of shape [6, 4]"]),
    ("count", ["ranks 0 and 1", "4 trainable parameters", "rank 1 has 6", "'2.weight'"]),
    ("settings", ["bucket_cap_mb=25 on rank 0 but 5 on rank 1", "same arguments"]),
])
def test_model_mismatch_raises_on_every_rank(what, words):
    errors = run_world(_mismatch, 3, what)
    for rank, error in enumerate(errors):
        assert error.startswith("ValueError"), f"rank {rank}: {error}"
        assert f"rank {rank}" in error
        for word in words:
            assert word in error, f"rank {rank}: {word!r} not in {error!r}"


def _unused_without_find_unused(rank, world_size):
    torch.manual_seed(0)
    ddp = minddp.DDP(BranchNet())
    ddp(batch("branch", rank, 0)[0], True).sum().backward()  # the right head gets no grad
    return _error_of(ddp, batch("branch", rank, 1)[0], True)


def test_unused_parameter_reported_at_next_forward():
    for rank, error in enumerate(run_world(_unused_without_find_unused, 2)):
        for word in [f"rank {rank}", "right.weight", "right.bias", "find_unused_parameters=True"]:
            assert word in error, f"rank {rank}: {word!r} not in {error!r}"


def _bad_hooks(rank, world_size):
    def wrong_size(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer()[:1])
        return fut

    ddp = minddp.DDP(DeepNet(), bucket_cap_mb=25)
    ddp.register_comm_hook(None, wrong_size)
    twice = _error_of(ddp.register_comm_hook, None, wrong_size)
    wrong = _error_of(lambda: ddp(*batch("deep", rank, 0)).sum().backward())
    late = minddp.DDP(DeepNet())
    late(*batch("deep", rank, 0)).sum().backward()
    after_backward = _error_of(late.register_comm_hook, None, wrong_size)
    not_callable = _error_of(late.register_comm_hook, None, "allreduce")
    return twice, wrong, after_backward, not_callable


def test_comm_hook_misuse():
    twice, wrong, after_backward, not_callable = run_world(_bad_hooks, 2)[1]
    assert "only be called once" in twice
    assert "rank 1" in wrong and "returned a tensor of 1 elements" in wrong, wrong
    assert "before the first backward" in after_backward
    assert "must be callable" in not_callable


def _misuse(rank, world_size):
    ddp = minddp.DDP(DeepNet())
    x = batch("deep", rank, 0)[0]
    out = ddp(x).sum()
    out.backward(retain_graph=True)
    twice = _error_of(out.backward)
    fresh = minddp.DDP(DeepNet())
    direct = _error_of(lambda: fresh.module(x).sum().backward())

    with ddp.no_sync():
        late = ddp(x).sum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        late.backward()
    outside_no_sync = [str(w.message) for w in caught]

    ddp.module.extra = nn.Linear(2, 2)
    added = _error_of(ddp, x)

    sparse = minddp.DDP(nn.Embedding(10, 3, sparse=True))
    sparse_error = _error_of(lambda: sparse(torch.tensor([[1, 2]])).sum().backward())
    return twice, direct, outside_no_sync, added, sparse_error


def test_misuse_during_training():
    twice, direct, outside_no_sync, added, sparse = run_world(_misuse, 2)[1]
    assert "rank 1" in twice and "already consumed" in twice and "twice" in twice, twice
    assert "called directly" in direct and "ddp(inputs)" in direct, direct
    assert len(outside_no_sync) == 1 and "inside no_sync()" in outside_no_sync[0]
    assert "changed after it was wrapped: extra.weight, extra.bias" in added, added
    assert "sparse gradient" in sparse and "'weight'" in sparse, sparse
