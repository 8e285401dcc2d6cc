"""torch.compile with minddp's wrapper, against torch's DDP compiled the same way.

As with torch's DDP, dynamo compiles the module's forward only: the wrapper's
own bookkeeping (the finished-backward check, buffer broadcast, the sink of
static_graph and find_unused_parameters) runs eagerly, and while the module
runs dynamo's DDPOptimizer cuts its graph where the wrapper's buckets end.
Both ways of compiling are covered: the wrapper (`torch.compile(ddp)`) and
the module inside it (`DDP(torch.compile(model))`).

Compiling is slow on a shared 2-core machine: tiny models, several cases per
world, and the aot_eager backend (AOT autograd compiles the backward into one
autograd node per graph, as inductor does, without generating C++), except for
one test on the default backend, inductor.
"""
import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from dist_harness import run_world

STEPS = 3


class Net(nn.Module):
    """Defined here, not a bare torch.nn module: dynamo compiles no graph for those."""

    def __init__(self, spare=False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.spare = nn.Linear(3, 3) if spare else None  # never used

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Deep(nn.Module):
    """Four layers of 1 MiB of parameters each: one bucket each at bucket_cap_mb=1."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


CASES = {  # name: (DDP keywords, comm hook, first step under no_sync)
    "default": ({}, None, False),
    "static_graph": ({"static_graph": True}, None, False),
    "find_unused_parameters": ({"find_unused_parameters": True}, None, False),
    "gradient_as_bucket_view+no_sync": ({"gradient_as_bucket_view": True}, None, True),
    "comm_hook": ({}, default_hooks.allreduce_hook, False),
}


def _batch(rank, step, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * step + rank))


def _recompiles():
    return sum(len(failures) for failures in torch._dynamo.utils.guard_failures.values())


def _train(rank, wrap, model, compiled, kwargs, hook, first_no_sync, backend):
    """STEPS of SGD on the compiled model; (parameters, gradients, recompiles)."""
    torch._dynamo.reset()
    if compiled == "module":
        model = torch.compile(model, backend=backend)
    ddp = wrap(model, **kwargs)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    run = torch.compile(ddp, backend=backend) if compiled == "wrapper" else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        if first_no_sync and step == 0:
            with ddp.no_sync():
                run(_batch(rank, step, 4, 6)).square().sum().backward()
            continue  # accumulated: the next step's synced backward adds to it
        if not (first_no_sync and step == 1):
            opt.zero_grad()
        run(_batch(rank, step, 4, 6)).square().sum().backward()
        grads = [None if p.grad is None else p.grad.clone() for p in ddp.parameters()]
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()], grads, _recompiles()


def _parity(rank, world_size, compiled):
    results = {}
    for name, (kwargs, hook, first_no_sync) in CASES.items():
        torch.manual_seed(0)
        model = Net(spare=kwargs.get("find_unused_parameters", False))
        results[name] = [_train(rank, wrap, copy.deepcopy(model), compiled, kwargs, hook,
                                first_no_sync, "aot_eager") for wrap in (TorchDDP, minddp.DDP)]
    return results


def _assert_same(ours, torchs, what):
    assert len(ours) == len(torchs)
    for i, (a, b) in enumerate(zip(ours, torchs)):
        if a is None or b is None:
            assert a is None and b is None, f"{what} {i}: minddp {a}, torch {b}"
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what} {i}: {m}")


@pytest.mark.parametrize("compiled", ["wrapper", "module"])
def test_compiled_training_equals_torch_ddp(compiled):
    """Every case trains to bitwise the parameters and gradients of torch's DDP
    compiled the same way, and neither recompiles after the first step."""
    for rank, results in enumerate(run_world(_parity, 2, compiled, timeout=300)):
        for name, (torchs, ours) in results.items():
            _assert_same(ours[0], torchs[0], f"rank {rank}, {name}: parameter")
            _assert_same(ours[1], torchs[1], f"rank {rank}, {name}: gradient")
            assert torchs[2] == 0, f"{name}: torch's DDP recompiled {torchs[2]} times"
            assert ours[2] == 0, f"rank {rank}, {name}: minddp recompiled {ours[2]} times"


def _cut_at_buckets(rank, world_size):
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    out = {}
    for name, wrap in (("torch", TorchDDP), ("minddp", minddp.DDP)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        graphs, events = [], []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return aot_eager(gm, example_inputs)

        def hook(state, bucket):
            events.append(f"bucket {bucket.index()}")
            return default_hooks.allreduce_hook(state, bucket)

        ddp = wrap(Deep(), bucket_cap_mb=1)
        ddp.register_comm_hook(None, hook)
        x = _batch(rank, 0, 2, 512).requires_grad_()
        x.register_hook(lambda grad: events.append("input's gradient"))
        torch.compile(ddp, backend=backend)(x).sum().backward()
        out[name] = len(graphs), events, [p.grad.clone() for p in ddp.parameters()]

    # Below DDPOptimizer's first bucket (1 MiB) the graph stays whole
    # (torch's DDP raises there); the gradients are those of torch's DDP, run eagerly.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Deep()
    grads = []
    for wrap, compiled in ((TorchDDP, False), (minddp.DDP, True)):
        ddp = wrap(copy.deepcopy(model), bucket_cap_mb=0.5)
        run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
        run(_batch(rank, 1, 2, 512)).sum().backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
    out["small_cap"] = grads
    return out


def test_compiled_graph_is_cut_at_bucket_boundaries():
    """With torch.compile(ddp), dynamo's DDPOptimizer cuts the module's graph
    where a bucket ends, into as many pieces as for torch's DDP: each piece's
    backward is its own autograd node, so the last layers' bucket is reduced
    while the first layers' backward still runs (one graph would hand over
    every gradient at its end). Measured once on 2 CPU cores (4 such layers,
    batch 4096, aot_eager; tests assert no timings): the first bucket launched
    82 ms into a 251 ms backward with the cut, 276 ms into 293 ms without."""
    for rank, out in enumerate(run_world(_cut_at_buckets, 2, timeout=240)):
        torch_graphs, _, torch_grads = out["torch"]
        graphs, events, grads = out["minddp"]
        assert graphs == torch_graphs > 1, (graphs, torch_graphs)
        assert events.index("bucket 0") < events.index("input's gradient"), events
        _assert_same(grads, torch_grads, f"rank {rank}: gradient")
        eager, compiled = out["small_cap"]
        _assert_same(compiled, eager, f"rank {rank}, bucket_cap_mb=0.5: gradient")


def _inductor(rank, world_size):
    torch.manual_seed(0)
    model = Net()
    return [_train(rank, wrap, copy.deepcopy(model), "wrapper", {"static_graph": True}, None,
                   False, "inductor") for wrap in (TorchDDP, minddp.DDP)]


def test_inductor_static_graph_equals_torch_ddp():
    """The issue's case on the default backend: torch.compile(DDP(model,
    static_graph=True)) trains (its backward once raised in the sink) to
    torch's DDP's parameters."""
    for rank, (torchs, ours) in enumerate(run_world(_inductor, 2, timeout=300)):
        _assert_same(ours[0], torchs[0], f"rank {rank}: parameter")
        _assert_same(ours[1], torchs[1], f"rank {rank}: gradient")
        assert ours[2] == 0, f"rank {rank}: minddp recompiled {ours[2]} times"


def _whole_step_compiled(rank, world_size):
    """Forward and backward in one compiled function: backward is a graph break, and
    the gradient hooks run inside the compiled frame's context."""
    seen = {}
    for wrap in (TorchDDP, minddp.DDP):
        torch._dynamo.reset()
        before = len(torch._dynamo.utils.get_compilation_metrics())
        torch.manual_seed(0)
        ddp = wrap(Net())

        @torch.compile(backend="eager")
        def step(x):
            loss = ddp(x).square().sum()
            loss.backward()
            return loss

        for i in range(4):
            step(_batch(rank, i, 4, 6))
        seen[wrap.__module__] = (len(torch._dynamo.utils.get_compilation_metrics()) - before,
                                 _recompiles(), [p.grad.clone() for p in ddp.parameters()])
    return seen


def test_backward_inside_a_compiled_step_leaves_minddp_uncompiled():
    # dynamo once compiled minddp's reducer from its hooks: 35 frames and 6 recompiles
    # in 12 steps where torch's DDP compiled 9 frames once
    for seen in run_world(_whole_step_compiled, 2, timeout=300):
        (frames, recompiles, grads), (our_frames, ours, our_grads) = seen.values()
        assert (our_frames, ours) == (frames, recompiles) and recompiles == 0, seen
        _assert_same(our_grads, grads, "gradient")


def _compiled_autograd(rank, world_size):
    from torch._dynamo import compiled_autograd
    errors = []
    for wrap in (TorchDDP, minddp.DDP):
        torch._dynamo.reset()
        loss = torch.compile(wrap(Net()), backend="eager")(_batch(rank, 0, 4, 6)).sum()
        try:
            with compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
            errors.append("no error")
        except Exception as e:  # noqa: BLE001 - the error is what is compared
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    return errors


def test_compiled_autograd_is_refused_in_torchs_words():
    theirs, ours = run_world(_compiled_autograd, 1)[0]
    assert "optimize_ddp=\"python_reducer\"" in theirs, theirs
    assert ours == theirs


def _python_reducer(rank, world_size):
    from torch._dynamo import compiled_autograd
    torch._dynamo.config.optimize_ddp = "python_reducer"
    seen = {}
    for wrap in (minddp.DDP, TorchDDP):  # torch's inlines its own module for the process after
        torch._dynamo.reset()
        torch.manual_seed(0)
        torch._inductor.config._fuse_ddp_bucket_size = None  # what each wrapper sets it to
        for cap in (2.7, None):  # torch hands inductor whole MiB
            wrap(Net(), bucket_cap_mb=cap)
            seen[f"inductor's bucket size, {cap}, {wrap.__module__}"] = \
                torch._inductor.config._fuse_ddp_bucket_size
        ddp = wrap(Net())
        compiled = torch.compile(ddp, backend="aot_eager", fullgraph=True)
        grads = []
        for step in range(3):
            ddp.zero_grad()
            if step < 2:  # compiled autograd, as the mode is meant for; then eager
                with compiled_autograd._enable(torch.compile(backend="aot_eager",
                                                             fullgraph=True)):
                    compiled(_batch(rank, step, 4, 6)).square().sum().backward()
            else:
                ddp(_batch(rank, step, 4, 6)).square().sum().backward()
            grads += [p.grad.clone() for p in ddp.parameters()]
        try:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            hook = "accepted"
        except NotImplementedError as e:
            hook = str(e)
        seen[wrap.__module__] = grads, hook
    try:
        minddp.DDP(Net(), bucket_cap_mb_list=[1, 2])
    except AssertionError as e:  # torch's type and words
        seen["list"] = str(e)
    # torch's replicate() builds DDP and calls its _pre_forward and _post_forward itself
    from torch.distributed._composable.replicate import replicate
    for swapped in (False, True):
        torch.manual_seed(0)
        model = Net()
        with minddp.replace_torch_ddp(algorithm="native") if swapped else contextlib.nullcontext():
            replicate(model)
            model(_batch(rank, 0, 4, 6)).sum().backward()
        seen[f"replicate, swapped {swapped}"] = [p.grad.clone() for p in model.parameters()]
    return seen


def test_python_reducer_mode_reduces_as_torchs():
    """optimize_ddp="python_reducer": each gradient all-reduced by a functional
    collective the compiled backward holds, as torch's DDP does in this mode."""
    for rank, seen in enumerate(run_world(_python_reducer, 2, timeout=300)):
        (ours, our_hook), (theirs, _) = seen["minddp.ddp"], seen["torch.nn.parallel.distributed"]
        _assert_same(ours, theirs, f"rank {rank}: gradient")
        assert "optimize_ddp='python_reducer'" in our_hook, our_hook  # torch's fails later
        assert seen["list"] == "when using bucket_cap_mb_list, python reducer is not supported"
        for cap in (2.7, None):
            assert seen[f"inductor's bucket size, {cap}, minddp.ddp"] == \
                seen[f"inductor's bucket size, {cap}, torch.nn.parallel.distributed"], seen
        _assert_same(seen["replicate, swapped True"], seen["replicate, swapped False"],
                     f"rank {rank}: replicate() gradient")
