"""A backward that breaks on one rank, and wrapping a model again.

The "skip the batch" loop: rank 0's backward raises once and every rank
catches every error and goes on. Buckets pair by launch order alone, so if
nothing noticed, rank 0's next iteration would pair with its peer's current
one. The contract (torch's, made stronger): no rank ever returns from
backward with a gradient that is not the true mean, and every rank raises a
clear error within the process group's timeout.
"""
import copy
import gc
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from dist_harness import run_world
from models import DeepNet, batch

PG_TIMEOUT = 20
STEPS = 4


class _RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises: a caught OOM or a NaN guard, in the loss."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in the loss's backward")


def _true_mean(model, world_size, step):
    """Each parameter's mean gradient over every rank's batch, computed locally."""
    model = copy.deepcopy(model)
    model.zero_grad()
    for r in range(world_size):
        (model(*batch("deep", r, step)).square().mean() / world_size).backward()
    return [p.grad.clone() for p in model.parameters()]


def _skip_a_batch(rank, world_size, where, compression):
    torch.manual_seed(0)
    ddp = minddp.DDP(DeepNet(), bucket_cap_mb=0.002, algorithm="ring", compression=compression)
    assert len(ddp.reducer.buckets) > 4
    if where == "model" and rank == 0:
        # layers[6] lies mid-network: the buckets of the later layers go first
        fired = []

        def fail_once(grad):
            if not fired:
                fired.append(True)
                raise RuntimeError("injected failure in the model's backward")
        ddp.module.layers[6].weight.register_hook(
            lambda g: fail_once(g) if ddp.reducer.forwards == 2 else None)
    outcomes = []
    for step in range(STEPS):
        ddp.zero_grad()
        start = time.monotonic()
        try:
            loss = ddp(*batch("deep", rank, step)).square().mean()
            if where == "loss" and rank == 0 and step == 1:
                loss = _RaiseInBackward.apply(loss)
            loss.backward()
        except RuntimeError as e:
            outcomes.append(("error", time.monotonic() - start, str(e)))
            continue
        want = _true_mean(ddp.module, world_size, step)
        tolerance = 1e-5 if compression is None else 4e-3  # fp16 on the wire
        exact = all(torch.allclose(p.grad, w, rtol=tolerance, atol=tolerance * 1e-2)
                    for p, w in zip(ddp.module.parameters(), want))
        outcomes.append(("ok", exact))
    # Stay a while, as a training loop would: the peer must learn of the
    # break from the note, not from this process's exit closing connections.
    time.sleep(3)
    return outcomes


# The step check rides in bucket 0 with an exact reduction; with compression
# (lossy) it takes a collective of its own: both ways are tested.
@pytest.mark.parametrize("where, compression", [("model", None), ("loss", None),
                                                ("loss", "fp16")])
def test_skip_a_batch_never_gives_wrong_gradients(where, compression):
    results = run_world(_skip_a_batch, 2, where, compression, timeout=3 * PG_TIMEOUT,
                        pg_timeout=PG_TIMEOUT)
    for rank, outcomes in enumerate(results):
        assert outcomes[0] == ("ok", True), f"rank {rank}, step 0: {outcomes[0]}"
        for step, outcome in enumerate(outcomes[1:], start=1):
            assert outcome[0] == "error", \
                f"rank {rank}, step {step}: backward returned after the break: {outcome}"
            _, seconds, message = outcome
            assert seconds < PG_TIMEOUT, f"rank {rank}, step {step}: {seconds:.1f}s"
            if rank == 0 and step == 1:
                assert "injected failure" in message, message
            else:
                assert f"minddp (rank {rank})" in message, message
    # What each rank was told, once the break was found.
    if where == "model":
        told = results[0][2][2]
        assert "did not finish" in told and "never reduced" in told, told
        told = results[1][1][2]
        assert "rank 0 abandoned iteration 1" in told, told
    else:
        for rank in range(2):
            told = results[rank][2 - rank][2]
            assert "out of step" in told and "No gradient" in told, (rank, told)


def _rewrap(rank, world_size, how):
    torch.manual_seed(0)
    model = DeepNet()
    reference = TorchDDP(copy.deepcopy(model), bucket_cap_mb=0.002)
    first = minddp.DDP(model, bucket_cap_mb=0.002, algorithm="ring")
    for step in range(2):
        for ddp in (reference, first):
            ddp.zero_grad()
            ddp(*batch("deep", rank, step)).square().mean().backward()
    if how == "close":
        first.close()
    elif how == "context":
        with first:
            pass
    else:
        del first
        gc.collect()
    if how != "garbage":  # a synced forward of the closed wrapper would reduce nothing
        with pytest.raises(RuntimeError, match=f"rank {rank}.*hooks were removed"):
            first(*batch("deep", rank, 9))
        with torch.no_grad():
            first(*batch("deep", rank, 9))
    second = minddp.DDP(model, bucket_cap_mb=0.004, algorithm="tree")
    for step in range(2, 4):
        for ddp in (reference, second):
            ddp.zero_grad()
            ddp(*batch("deep", rank, step)).square().mean().backward()
    return all(torch.equal(p.grad, q.grad)
               for p, q in zip(reference.module.parameters(), second.module.parameters()))


@pytest.mark.parametrize("how", ["close", "context", "garbage"])
def test_rewrapping_a_model_trains_exactly(how):
    assert run_world(_rewrap, 2, how) == [True, True]


def _converted_after_wrapping(rank, world_size):
    ddp = minddp.DDP(DeepNet(), algorithm="native")
    ddp(*batch("deep", rank, 0)).square().mean().backward()
    ddp.double()  # new gradient accumulators: the hooks are left on the old ones
    x = batch("deep", rank, 1)[0].double()
    ddp(x).square().mean().backward()  # local only, as torch's DDP would do silently
    with pytest.raises(RuntimeError, match=f"rank {rank}.*torch.float64.*was torch.float32"):
        ddp(x)
    with pytest.raises(RuntimeError, match="after wrapping"):  # and every forward after
        ddp(x)
    return True


def test_dtype_changed_after_wrapping_is_caught_at_the_next_forward():
    assert run_world(_converted_after_wrapping, 2) == [True, True]


class _Branchy(torch.nn.Module):
    """fc3 takes part only when `use` says so; `outside` hands it out instead, to be
    used after forward (torch's test_find_unused_parameters_kwarg)."""

    def __init__(self, bias=False):
        super().__init__()
        self.fc1, self.fc2 = (torch.nn.Linear(4, 4, bias=False) for _ in range(2))
        self.fc3 = torch.nn.Linear(4, 4, bias=bias)

    def forward(self, x, use=True, outside=False):
        x = self.fc2(torch.relu(self.fc1(x)))
        if outside:
            return x, self.fc3
        return self.fc3(x) if use else x


def _first_error(ddp, steps):
    """The message of the first error in `steps`: (use, outside) a step each."""
    for use, outside in steps:
        try:
            out = ddp(torch.ones(2, 4), use, outside)
            if outside:
                out = out[1](out[0])
            out.sum().backward()
        except RuntimeError as e:
            return str(e)
    return None


def _torchs_lines(rank, world_size, debug):
    import os

    import torch.distributed as dist

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug  # torch's reducer reads it when built
    dist.set_debug_level_from_env()
    cases = {"unused": ({}, [(True, False), (False, False), (True, False)]),
             "graph changed": ({"static_graph": True},
                               [(True, False), (True, False), (False, False), (True, False)]),
             "marked twice": ({"find_unused_parameters": True}, [(True, True)]),
             # fc3.weight and fc3.bias: torch names them sorted, not in index order
             "two unused": ({"bias": True}, [(True, False), (False, False), (True, False)])}
    told = {}
    for case, (kwargs, steps) in cases.items():
        bias = kwargs.pop("bias", False)
        for kind, wrapper in [("torch", TorchDDP), ("minddp", minddp.DDP)]:
            torch.manual_seed(0)
            told[case, kind] = _first_error(wrapper(_Branchy(bias), **kwargs), steps)
    return told


# What torch's distributed_test.py looks for in these errors.
_UNUSED = ["Expected to have finished reduction in the prior iteration",
           "passing the keyword argument `find_unused_parameters=True`",
           "`forward` function outputs participate in calculating loss"]
_GRAPH_CHANGED = [
    "Expected to have finished reduction in the prior iteration before starting a new one. "
    "This error indicates that your training graph has changed in this iteration, e.g., one "
    "parameter is used in first iteration, but then got unused in the second iteration. this "
    "is not compatible with static_graph set to True.\n"]
# Where debugging is off, torch names the parameters by index only, and says how to see more.
_SUGGESTION = "set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL"


def _torchs_part(message):
    """`message` up to minddp's own account, which follows torch's lines."""
    return message.split("\nminddp (rank")[0]


def _which(message):
    """The lines of torch's part of `message` that say which parameters got no gradient."""
    return [line for line in _torchs_part(message).split("\n")
            if "did not receive grad" in line or line.startswith(" In addition")]


@pytest.mark.parametrize("debug", ["OFF", "INFO"])
def test_unfinished_and_twice_marked_errors_carry_torchs_lines(debug):
    """What torch's tests (and users' scripts) look for in these errors: which
    parameters, by index, by name where debugging is on, torch's first sentences."""
    for rank, told in enumerate(run_world(_torchs_lines, 2, debug)):
        indices = f"Parameter indices which did not receive grad for rank {rank}: 2"
        names = f"Parameters which did not receive grad for rank {rank}: fc3.weight"
        for case, words in [("unused", _UNUSED), ("graph changed", _GRAPH_CHANGED)]:
            for told_by in ("torch", "minddp"):
                message = told[case, told_by]
                assert all(w in message for w in words), message
                assert indices in message.split("\n"), message
                torchs = _torchs_part(message)
                assert (_SUGGESTION in torchs) == (debug == "OFF"), message
                assert (names in torchs.split("\n")) == (debug != "OFF"), message
        for case in ("unused", "graph changed", "two unused"):  # torch's lines, in its order
            theirs, ours = (_which(told[case, kind]) for kind in ("torch", "minddp"))
            assert ours == theirs and theirs, (theirs, ours)
        theirs, ours = told["marked twice", "torch"], told["marked twice", "minddp"]
        assert "Parameter at index 2 with name fc3.weight has been marked" in theirs, theirs
        assert ours.startswith("Expected to mark a variable ready only once. Parameter at "
                               "index 2 with name fc3.weight has been marked"), ours
