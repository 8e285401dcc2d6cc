"""Every misuse gets a clear error that names the problem, the rank and the fix.

Where a mistake is on one rank only (a different model), every rank must
raise, not just the one that differs: otherwise the others hang in the next
collective.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp.errors import first_line
from minddp.model_sync import ModelMismatch
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
        "cap": (nn.Linear(2, 2), {"bucket_cap_mb": "25"}),
        "group": (nn.Linear(2, 2), {"process_group": 5}),
        "not_member": (nn.Linear(2, 2), {"process_group": dist.GroupMember.NON_GROUP_MEMBER}),
        "algorithm": (nn.Linear(2, 2), {"algorithm": "fastest"}),
        "compression": (nn.Linear(2, 2), {"compression": "int4"}),
        "device_ids": (nn.Linear(2, 2), {"device_ids": [0]}),
        "device_ids_cpu": (nn.Linear(2, 2), {"device_ids": [torch.device("cpu")]}),  # timm's
        "output_device": (nn.Linear(2, 2), {"output_device": torch.device("cpu")}),
    }
    errors = {k: _error_of(minddp.DDP, m, **kw) for k, (m, kw) in cases.items()}
    torch_errors = {k: _error_of(TorchDDP, cases[k][0], **cases[k][1])
                    for k in ("device_ids", "device_ids_cpu", "output_device")}
    return errors, torch_errors


def test_construction_errors():
    errors, torch_errors = run_world(_construction_errors, 1)[0]
    expect = {
        "no_params": ["RuntimeError", "rank 0", "doesn't have any parameter that requires"],
        "mixed": ["rank 0", "several devices", "move the whole module"],
        "meta": ["RuntimeError", "rank 0", "meta device", "to_empty"],  # torch's type
        "cap": ["rank 0", "bucket_cap_mb must be a number", "'25'"],
        "group": ["TypeError", "rank 0", "must be a torch.distributed.ProcessGroup", "int 5"],
        "not_member": ["TypeError", "rank 0", "NON_GROUP_MEMBER", "not in that group"],
        "algorithm": ["rank 0", "unknown algorithm 'fastest'", "choose one of"],
        "compression": ["rank 0", "unknown compression 'int4'", "choose one of"],
        "device_ids": ["rank 0", "pass neither for a CPU module"],
    }
    for case, words in expect.items():
        for word in words:
            assert word in errors[case], f"{case}: {word!r} not in {errors[case]!r}"
    for case, torch_error in torch_errors.items():  # torch's type and words, then minddp's
        assert torch_error.startswith("ValueError: DistributedDataParallel device_ids"), torch_error
        assert errors[case].startswith(torch_error), f"{case}: {errors[case]!r}"


def _mismatch(rank, world_size, what):
    width = 6 if (what == "shape" and rank == 2) else 4
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    if what == "count" and rank == 1:
        model.append(nn.Linear(2, 2))
    if what == "buffers" and rank == 1:
        model.register_buffer("extra", torch.zeros(3))
    if what == "frozen" and rank == 1:
        model.append(nn.Linear(2, 2).requires_grad_(False))
    cap = 5 if (what == "settings" and rank == 1) else 25
    return _error_of(minddp.DDP, model, bucket_cap_mb=cap)


@pytest.mark.parametrize("what, words", [
    ("shape", ["ranks 0 and 2", "'0.weight' of shape [4, 4]", "'0.weight' of shape [6, 4]"]),
    ("count", ["ranks 0 and 1", "4 trainable parameters", "rank 1 has 6", "'2.weight'"]),
    ("settings", ["bucket_cap_mb=25 on rank 0 but 5 on rank 1", "same arguments"]),
    # broadcast from rank 0 at construction: on other shapes a rank would abort in gloo
    ("buffers", ["buffers: rank 0 has 0, rank 1 has 1", "extra [3] torch.float32"]),
    ("frozen", ["frozen parameters: rank 0 has 0, rank 1 has 2", "2.weight [2, 2]"]),
])
def test_model_mismatch_raises_on_every_rank(what, words):
    errors = run_world(_mismatch, 3, what)
    assert issubclass(ModelMismatch, RuntimeError)  # torch raises RuntimeError here
    for rank, error in enumerate(errors):
        assert error.startswith("ModelMismatch"), f"rank {rank}: {error}"
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
    not_callable = _error_of(late.register_comm_hook, None, "allreduce")
    return twice, wrong, not_callable


def test_comm_hook_misuse():
    twice, wrong, not_callable = run_world(_bad_hooks, 2)[1]
    assert "only be called once" in twice
    assert "rank 1" in wrong and "returned a tensor of 1 elements" in wrong, wrong
    assert not_callable.startswith("TypeError") and "must be callable" in not_callable


@pytest.mark.parametrize("exc, line", [
    (RuntimeError("gloo: connection reset\nat line 3"), "gloo: connection reset"),
    (RuntimeError("\n  after a blank line\nmore"), "after a blank line"),
    (RuntimeError(), "RuntimeError()"),
    (ValueError("  \n "), "ValueError('  \\n ')"),
])
def test_first_line_never_comes_back_empty(exc, line):
    assert first_line(exc) == line


def _empty_messages(rank, world_size):
    """A reduction and a finalize that fail with exceptions that carry no message."""
    def no_message(state, bucket):  # a comm hook whose future fails with RuntimeError()
        future = torch.futures.Future()
        future.set_exception(RuntimeError())
        return future

    hooked = minddp.DDP(DeepNet())
    hooked.register_comm_hook(None, no_message)
    failed = _error_of(lambda: hooked(*batch("deep", rank, 0)).sum().backward())
    later = _error_of(hooked, *batch("deep", rank, 1))

    def bare(b):  # finalize fails without a word (the reducer's own code, say)
        raise RuntimeError()

    plain = minddp.DDP(DeepNet())
    plain.reducer._collect = bare
    finalize = _error_of(lambda: plain(*batch("deep", rank, 0)).sum().backward())
    after = _error_of(plain, *batch("deep", rank, 1))
    return failed, later, finalize, after


def test_failures_without_a_message_still_say_what_failed():
    for rank, (failed, later, finalize, after) in enumerate(run_world(_empty_messages, 2)):
        assert failed.startswith("RuntimeError") and f"rank {rank}" in failed, failed
        assert "communication hook failed" in failed and failed.endswith("Cause: RuntimeError()")
        assert "previous backward pass failed" in later and "communication hook" in later, later
        assert finalize == "RuntimeError: ", finalize  # the cause itself, re-raised
        assert "previous backward pass failed" in after, after
        assert after.endswith("Cause: RuntimeError()"), after


def _misuse(rank, world_size, case):
    """One misuse, run the same way through torch's DDP and minddp: the gradients
    each leaves must be the same (torch ignores, for synchronisation, every
    gradient outside the backward of a synced forward)."""
    torch.manual_seed(0)
    model = DeepNet()
    grads = []
    for wrap in (TorchDDP, minddp.DDP):
        ddp = wrap(copy.deepcopy(model))
        x = batch("deep", rank, 0)[0]
        if case == "backward_twice":
            out = ddp(x).sum()
            out.backward(retain_graph=True)
            out.backward()  # the second accumulates locally
        elif case == "module_called_directly":
            ddp(x).sum().backward()
            ddp.module(x).square().sum().backward()  # a local auxiliary loss
        elif case == "backward_after_no_sync":
            with ddp.no_sync():
                late = ddp(x).sum()
            late.backward()  # its forward ran inside no_sync: local
            ddp(batch("deep", rank, 1)[0]).sum().backward()  # reduces the sum
        elif case == "hook_registered_after_backward":
            ddp(x).sum().backward()
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            ddp(batch("deep", rank, 1)[0]).sum().backward()
        grads.append([p.grad.clone() for p in ddp.module.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("case", ["backward_twice", "module_called_directly",
                                  "backward_after_no_sync", "hook_registered_after_backward"])
def test_misuse_behaves_as_in_torch(case):
    assert run_world(_misuse, 2, case) == [True, True]


def _rank_local_buffers(rank, world_size):
    model = nn.Linear(2, 2)
    model.register_buffer("seen", torch.zeros(rank + 1))  # its own size on each rank
    ddp = minddp.DDP(model, broadcast_buffers=False, algorithm="native")  # never synced
    ddp(torch.ones(1, 2)).sum().backward()
    return ddp.module.seen.numel()


def test_unsynced_buffers_may_differ_between_ranks_as_in_torch():
    assert run_world(_rank_local_buffers, 2) == [1, 2]
