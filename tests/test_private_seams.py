"""torch DDP's private seams that its own tests and tools drive, against torch's DDP.

`_register_buffer_comm_hook` (buffers synced by a hook before or after each forward,
its futures waited for at the end of backward; torch's own tests of it are ported in
torch_suite/ported.py) and `_register_fused_optim` (an optimizer stepped in each
bucket's comm-hook callback: torch's `_hook_then_optimizer`). The models are torch's
test models (distributed_test.py's NetWithBuffers, its optimizer-parity setup).
"""
import copy
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _BufferCommHookLocation as Where

import minddp
from dist_harness import run_world
from torch_suite.ported import NetWithBuffers


def _wrap(kind, model, **kwargs):
    if kind == "torch":
        return TorchDDP(model, **kwargs)
    return minddp.DDP(model, **kwargs)


def _counts(rank, world_size, kind):
    """The buffer, which each forward counts up, after two steps, each rank starting at
    10 * rank, for a hook that sums it and one that keeps it local, before and after the
    forward. The hook replaces the broadcast from rank 0 wherever it runs, so none of it
    is rank 0's copy."""
    def summed(state, named):
        dist.all_reduce(named["buffer"])

    def kept(state, named):
        return None

    counts = {}
    for hook in (summed, kept):
        for where in (Where.PRE_FORWARD, Where.POST_FORWARD):
            torch.manual_seed(0)
            ddp = _wrap(kind, NetWithBuffers())
            ddp._register_buffer_comm_hook(None, hook, where)
            ddp.module.buffer.fill_(10 * rank)
            for _ in range(2):
                ddp(torch.randn(2, 10)).sum().backward()
            counts[hook.__name__, where.name] = ddp.module.buffer.tolist()
    return counts


def test_a_buffer_hook_replaces_the_broadcast_wherever_it_runs_as_torchs():
    torch_counts = run_world(_counts, 2, "torch")
    assert run_world(_counts, 2, "minddp") == torch_counts
    assert torch_counts[1]["kept", "POST_FORWARD"] == [[12.0, 12.0]]  # no broadcast from 0
    assert torch_counts[1]["summed", "POST_FORWARD"] == [[26.0, 26.0]]


def _failed_future_run(rank, world_size, kind):
    def hook(state, named):
        future = torch.futures.Future()
        future.set_exception(ValueError("the buffer sync broke"))
        return [future]

    ddp = _wrap(kind, NetWithBuffers())
    ddp._register_buffer_comm_hook(None, hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ddp(torch.randn(2, 10)).sum().backward()
    return [str(w.message) for w in caught if "buffer comm hook" in str(w.message)]


def test_a_failed_future_of_a_buffer_hook_does_not_stop_training_as_in_torch():
    assert run_world(_failed_future_run, 2, "torch") == [[], []]
    for rank, messages in enumerate(run_world(_failed_future_run, 2, "minddp")):
        assert len(messages) == 3, messages  # minddp warns where torch is silent
        assert f"rank {rank}" in messages[0] and "the buffer sync broke" in messages[0]


def _slow_future_run(rank, world_size, kind):
    """A buffer hook returning a future some other thread completes 0.3 s later:
    backward must not return before it is done."""
    done = []

    def hook(ddp, named_buffers):
        future = torch.futures.Future()

        def finish():
            time.sleep(0.3)
            done.append(time.monotonic())
            future.set_result(None)
        threading.Thread(target=finish, daemon=True).start()
        return [future]

    torch.manual_seed(0)
    ddp = _wrap(kind, NetWithBuffers())
    ddp._register_buffer_comm_hook(None, hook)
    ddp(torch.randn(2, 10)).sum().backward()
    returned = time.monotonic()
    return bool(done) and done[0] <= returned


@pytest.mark.parametrize("kind", ["torch", "minddp"])
def test_backward_waits_for_the_futures_a_buffer_hook_returns(kind):
    assert run_world(_slow_future_run, 2, kind) == [True, True]


def _single_future_hook(rank, world_size, kind):
    ddp = _wrap(kind, NetWithBuffers())
    ddp._register_buffer_comm_hook(
        ddp, lambda ddp, named: dist.all_reduce(named["buffer"], async_op=True).get_future())
    try:
        ddp(torch.randn(2, 10))
    except TypeError:
        return "TypeError"
    return "accepted"


@pytest.mark.parametrize("kind", ["torch", "minddp"])
def test_a_buffer_hook_returning_one_future_is_a_type_error_as_in_torch(kind):
    assert run_world(_single_future_hook, 2, kind) == ["TypeError"] * 2


def _join_with_buffer_hook(rank, world_size):
    ddp = minddp.DDP(NetWithBuffers())
    ddp._register_buffer_comm_hook(None, lambda state, named: None)
    with pytest.raises(NotImplementedError, match=f"rank {rank}.*join"):
        ddp.join()
    with pytest.raises(NotImplementedError, match=f"rank {rank}.*join"):
        Join([ddp])  # torch's generic join asks the wrapper for its hook
    return True


def test_join_with_a_buffer_hook_is_refused_naming_it():
    assert run_world(_join_with_buffer_hook, 2) == [True, True]


class Layers(nn.Module):
    """Several buckets at a small cap: the optimizer steps in several callbacks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])

    def forward(self, x):
        return self.layers(x)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, (1e-2,), {"betas": (0.9, 0.99), "eps": 1e-6}),
    "adam": (torch.optim.Adam, (1e-2,), {"betas": (0.9, 0.99), "eps": 1e-6}),
    "sgd": (torch.optim.SGD, (1e-2,), {"momentum": 0.9, "weight_decay": 0.01}),
}


def _fused_optim_run(rank, world_size, name, as_view, static_graph, subset):
    """torch's _test_ddp_hook_with_optimizer_parity on the CPU: six steps with the
    optimizer fused into the comm hook, against six with it stepped after backward;
    for torch's DDP and minddp's (which also checks its replicas every step)."""
    cls, args, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = Layers()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    out = {}
    for kind in ("torch", "minddp"):
        extra = {} if kind == "torch" else {"check_replicas": 1}
        fused = _wrap(kind, copy.deepcopy(model), gradient_as_bucket_view=as_view,
                      static_graph=static_graph, bucket_cap_mb=0.002, **extra)
        plain = _wrap(kind, copy.deepcopy(model), gradient_as_bucket_view=as_view,
                      static_graph=static_graph, bucket_cap_mb=0.002)
        chosen = [next(iter(fused.parameters()))] if subset else None
        fused._register_fused_optim(cls, *args, optim_params=chosen, **kwargs)
        optimizer = cls([next(iter(plain.parameters()))] if subset else plain.parameters(),
                        *args, **kwargs)
        for _ in range(6):
            fused.zero_grad()
            fused(x).sum().backward()
        for _ in range(6):
            plain.zero_grad()
            plain(x).sum().backward()
            optimizer.step()
        out[kind] = ([p.detach().clone() for p in fused.parameters()],
                     [p.detach().clone() for p in plain.parameters()])
    return out, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name,as_view,static_graph,subset", [
    ("adamw", True, False, False), ("adamw", False, True, False), ("adamw", False, False, True),
    ("adam", True, False, True), ("sgd", True, False, False), ("sgd", False, False, True)])
def test_fused_optimizer_steps_as_after_backward_and_as_torch(name, as_view, static_graph,
                                                              subset):
    results = run_world(_fused_optim_run, 2, name, as_view, static_graph, subset)
    for out, initial in results:
        fused, plain = out["minddp"]
        torch.testing.assert_close(fused, plain)  # the fused optimizer took the steps
        assert [torch.equal(a, b) for a, b in zip(fused, out["torch"][0])] == [True] * 12
        changed = [not torch.equal(a, b) for a, b in zip(fused, initial)]
        assert changed == ([True] + [False] * 11 if subset else [True] * 12)
    assert all(torch.equal(a, b) for a, b in zip(results[0][0]["minddp"][0],
                                                 results[1][0]["minddp"][0]))
