"""What frameworks reach through torch's DDP class, against torch's DDP itself.

Lightning, Accelerate and the HF Trainer test `isinstance(model,
DistributedDataParallel)` and then call torch-private parts of the wrapper and
its reducer. Each case runs the same script on torch's DDP and on minddp's and
compares the weights; both ranks must also end bitwise equal.
"""
import contextlib
import itertools
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp.replicas import ReplicasDiverged
from dist_harness import run_world
from models import BatchNormNet


def _wrap(kind, model, **kwargs):
    if kind == "torch":
        return TorchDDP(model, **kwargs)
    return minddp.DDP(model, algorithm="native", **kwargs)


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _gathered(tensor):
    out = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


def _weights(model):
    """Parameters first, then buffers (which torch does not keep equal when a
    forward switches sync off: the next forward broadcasts none)."""
    return ([p.detach().clone() for p in model.parameters()],
            [b.detach().clone() for b in model.buffers()])


def _manual_lightning_style(rank, world_size, kind):
    """Lightning's manual optimisation: the backward runs inside the wrapper's
    forward, after Lightning's own prepare_for_backward(model, loss), and sync
    is switched off at the end of the inner forward and on after the outer one
    (lightning.pytorch.strategies.ddp); its calls are copied here."""
    class Step(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net
            self.ddp = None

        def forward(self, x, y):
            loss = nn.functional.mse_loss(self.net(x), y)
            ddp = self.ddp[0]
            if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
                ddp.require_forward_param_sync = True
                ddp.reducer._rebuild_buckets()
                ddp.reducer.prepare_for_backward([])
            loss.backward()
            ddp.require_backward_grad_sync = False  # Lightning: the reducer's work is done
            return loss.detach()

    torch.manual_seed(0)
    step = Step(BatchNormNet())
    ddp = _wrap(kind, step)
    step.ddp = [ddp]  # a list: not registered as a submodule
    assert isinstance(ddp, TorchDDP)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for i in range(4):
        opt.zero_grad()
        ddp(*_batch(rank, i))
        ddp.require_backward_grad_sync = True  # Lightning, after the outer forward
        opt.step()
    return _weights(step.net)


def _closure_inside_forward(rank, world_size):
    """A backward inside the forward with nothing arming the reducer: local on the
    first step, as under torch's DDP, so the ranks' weights part; the replica
    check (at synced step 1, the second step's backward) must say so on every rank."""
    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = BatchNormNet()

        def forward(self, x, y):
            loss = nn.functional.mse_loss(self.net(x), y)
            loss.backward()
            return loss.detach()

    torch.manual_seed(0)
    ddp = minddp.DDP(Step(), algorithm="native")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        for i in range(3):
            opt.zero_grad()
            ddp(*_batch(rank, i))
            opt.step()
    except ReplicasDiverged as e:
        return i, str(e)
    return None


def _trigger_sync_in_backward(rank, world_size, kind):
    """Accelerate's trigger_sync_in_backward: the forward runs under no_sync, then
    the flags are set and reducer.prepare_for_backward([]) arms the backward."""
    torch.manual_seed(0)
    ddp = _wrap(kind, BatchNormNet())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for i in range(3):
        opt.zero_grad()
        x, y = _batch(rank, i)
        with ddp.no_sync():
            loss = nn.functional.mse_loss(ddp(x), y)
        ddp.require_backward_grad_sync = True
        ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward([])
        loss.backward()
        opt.step()
    return _weights(ddp.module)


def _sync_switched_off_in_forward(rank, world_size, kind):
    """torch reads require_backward_grad_sync after the module's forward."""
    class Off(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ddp = nn.Linear(2, 2), None

        def forward(self, x):
            self.ddp[0].require_backward_grad_sync = False
            return self.fc(x)

    module = Off()
    ddp = _wrap(kind, module)
    module.ddp = [ddp]
    ddp(torch.ones(1, 2))
    return ddp.require_forward_param_sync


@pytest.mark.parametrize("case", [_manual_lightning_style, _trigger_sync_in_backward])
def test_framework_calls_into_the_reducer_train_as_torch(case):
    theirs = run_world(case, 2, "torch")
    ours = run_world(case, 2, "minddp")
    for rank in range(2):
        for a, b in zip(sum(theirs[rank], []), sum(ours[rank], []), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for a, b in zip(ours[0][0], ours[1][0], strict=True):
        assert torch.equal(a, b), "ranks ended with different parameters"


def test_unarmed_backward_inside_forward_is_caught_on_every_rank():
    results = run_world(_closure_inside_forward, 2)
    assert all(r is not None for r in results), f"a rank trained on apart: {results}"
    assert [step for step, _ in results] == [1, 1], results
    same = [message.split(": ", 1)[1] for _, message in results]  # past "minddp (rank r)"
    assert same[0] == same[1] and "inside the wrapper's forward" in same[0]


def test_sync_flag_is_read_after_the_forward_as_torch():
    assert run_world(_sync_switched_off_in_forward, 1, "torch") == [False]
    assert run_world(_sync_switched_off_in_forward, 1, "minddp") == [False]


def _replaced(rank, world_size):
    torchs = TorchDDP(nn.Linear(3, 3))
    with minddp.replace_torch_ddp(algorithm="ring") as _:
        name = torch.nn.parallel.DistributedDataParallel
        built = name(nn.Linear(3, 3))
        direct = minddp.DDP(nn.Linear(3, 3))
        # as against torch's class, which the name stands for
        answers = [isinstance(m, name) for m in (built, direct, torchs, nn.Linear(3, 3))] + [
            isinstance(torchs, minddp.DDP), issubclass(TorchDDP, minddp.DDP)]  # not widened
    after = torch.nn.parallel.DistributedDataParallel(nn.Linear(3, 3))
    return (type(built).__module__, built.algorithm, isinstance(built, TorchDDP),
            type(after).__module__, answers)


def test_replace_torch_ddp_builds_minddp_and_restores_torch():
    built_in, algorithm, is_torch_ddp, after, answers = run_world(_replaced, 2)[0]
    assert built_in.startswith("minddp") and algorithm == "ring" and is_torch_ddp
    assert after == "torch.nn.parallel.distributed"
    assert answers == [True, True, True, False, False, False], answers


def _built_through_other_names(rank, world_size):
    import warnings
    # Ray Train's prepare_model takes the name at import, in its workers, before the
    # user's code can call replace_torch_ddp(); Lightning takes it after, from
    # torch.nn.parallel.distributed, where it stays torch's class.
    framework = types.ModuleType("a_framework_imported_first")
    framework.DDP = TorchDDP

    class Foreign(TorchDDP):  # a framework's own subclass: its reducer is torch's
        pass

    with minddp.replace_torch_ddp(algorithm="ring"):
        from torch.nn.parallel.distributed import DistributedDataParallel as late
        first, second = framework.DDP(nn.Linear(3, 3)), late(nn.Linear(3, 3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            foreign = Foreign(nn.Linear(3, 3))
        unpickled = TorchDDP.__new__(TorchDDP)  # as pickle and deepcopy make one
    after = framework.DDP(nn.Linear(3, 3))
    kinds = [type(m).__module__ for m in (first, second, foreign, unpickled, after)]
    return kinds, first.algorithm, second.algorithm, [str(w.message) for w in caught]


def test_replace_torch_ddp_reaches_every_name_of_torchs_class():
    kinds, first, second, warned = run_world(_built_through_other_names, 1)[0]
    assert kinds[:2] == ["minddp.swap"] * 2 and first == second == "ring", kinds
    assert kinds[2] == "test_torch_surface" and len(warned) == 1, (kinds, warned)
    assert "Foreign subclasses torch's DistributedDataParallel" in warned[0], warned
    assert kinds[3:] == ["torch.nn.parallel.distributed"] * 2, kinds


def _marked_active_through_the_name(rank, world_size):
    """Code that marks the running DDP through the public name, as torch's FakeDDP test
    helper does: dynamo's DDPOptimizer, which reads torch's class, must see the mark."""
    class Halves(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(512, 512), nn.Linear(512, 512)  # 1 MiB each

        def forward(self, x):
            return self.b(self.a(x))

    class Marker(nn.Module):
        bucket_bytes_cap = 1024 * 1024

    graphs = []
    with minddp.replace_torch_ddp():
        compiled = torch.compile(Halves(), backend=lambda gm, inputs: graphs.append(gm) or gm)
        torch._dynamo.config.optimize_ddp = True
        torch.nn.parallel.DistributedDataParallel._active_ddp_module = Marker()
        try:
            compiled(torch.randn(4, 512))
        finally:
            torch.nn.parallel.DistributedDataParallel._active_ddp_module = None
    return len(graphs)


def test_the_active_ddp_marked_through_the_swapped_name_reaches_dynamo():
    assert run_world(_marked_active_through_the_name, 1) == [2]  # cut at the bucket's end


class _LoadsOnAnyAttribute(types.ModuleType):
    """A lazily loaded module: any attribute read would import it (here: fail)."""

    def __getattribute__(self, name):
        raise ImportError("a lazy module loaded by replace_torch_ddp")


def test_replace_torch_ddp_leaves_lazy_modules_unloaded():
    lazy = _LoadsOnAnyAttribute("a_lazy_module")
    sys.modules["a_lazy_module"] = lazy
    try:
        with minddp.replace_torch_ddp():
            assert torch.nn.parallel.DistributedDataParallel is minddp.swap.DistributedDataParallel
    finally:
        del sys.modules["a_lazy_module"]
    assert torch.nn.parallel.DistributedDataParallel is TorchDDP


def test_replace_torch_ddp_refuses_unknown_keywords():
    with pytest.raises(TypeError, match="unknown keyword"):
        minddp.replace_torch_ddp(find_unused_parameters=True)
    assert torch.nn.parallel.DistributedDataParallel is TorchDDP


def _private_surface(rank, world_size):
    ddp = minddp.DDP(nn.Linear(3, 3))
    errors = {}
    for call in (lambda: ddp._sync_final_model(True),):
        try:
            call()
        except NotImplementedError as e:
            errors[len(errors)] = str(e)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    ddp(torch.ones(2, 3)).sum().backward()
    return errors, ddp._get_ddp_logging_data().get("comm_hook"), ddp.module.weight.grad


def test_torch_private_methods_minddp_lacks_raise_clearly():
    errors, hook, grad = run_world(_private_surface, 1)[0]
    assert hook == str(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert torch.equal(grad, torch.full((3, 3), 2.0)), grad  # the built-in hook reduced it
    assert len(errors) == 1, errors
    assert "_sync_final_model" in errors[0] and "minddp" in errors[0]


def _double_wrap(rank, world_size):
    errors = []
    try:
        TorchDDP(minddp.DDP(nn.Linear(3, 3), algorithm="native"))(torch.ones(2, 3))
    except RuntimeError as e:
        errors.append(str(e))
    try:
        minddp.DDP(TorchDDP(nn.Linear(3, 3)))
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_a_ddp_wrapped_in_a_ddp_is_refused_on_every_rank():
    for errors in run_world(_double_wrap, 2):
        assert len(errors) == 2, errors
        assert "reduced twice" in errors[0] and "replace_torch_ddp" in errors[0]
        assert "already a DistributedDataParallel" in errors[1]


# torch's methods that read only what minddp's wrapper also has: inherited as they are.
HARMLESS = {"scatter", "gather", "to_kwargs", "train", "_check_comm_hook", "_check_default_group",
            "_get_data_parallel_params", "join_device", "join_process_group",
            "_distributed_rank", "_get_active_ddp_module", "_inside_ddp_forward",
            # the buffer hook's and fused optimizer's parts (test_private_seams.py)
            "_register_fused_optim", "_check_sync_bufs_pre_fwd", "_check_sync_bufs_post_fwd",
            "_sync_buffers", "_sync_module_buffers", "_find_common_rank",
            "_default_broadcast_coalesced", "_distributed_broadcast_coalesced",
            # pure functions of the module that torch's tests call
            "_build_params_for_reducer", "_build_debug_param_to_name_mapping"}


def test_every_torch_method_is_minddps_refused_or_harmless():
    """A torch release that adds a method to its DDP fails here until it is sorted."""
    from minddp.ddp import _TORCH_PRIVATE_NOT_PROVIDED
    ours = vars(minddp.DistributedDataParallel)
    unsorted = [name for name, value in vars(TorchDDP).items()
                if callable(value) or isinstance(value, (property, classmethod, staticmethod))
                if not name.startswith("__") and name not in ours and name not in HARMLESS]
    assert not unsorted, f"torch DDP methods neither minddp's, refused nor harmless: {unsorted}"
    assert set(_TORCH_PRIVATE_NOT_PROVIDED) <= set(ours)
    ddp = object.__new__(minddp.DistributedDataParallel)
    with pytest.raises(NotImplementedError, match="_sync_final_model"):
        ddp._sync_final_model(True)


def _clones_in_a_step(rank, world_size):
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountClones(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.clones = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.clones += func._overloadpacket == torch.ops.aten.clone
            return func(*args, **(kwargs or {}))

    seen = {}
    for kind, sink_clone in itertools.product(("torch", "minddp"), (True, False)):
        torch.manual_seed(0)
        ddp = _wrap(kind, nn.Linear(10, 10), find_unused_parameters=True)
        if not sink_clone:
            ddp._set_ddp_sink_clone(False)
        with CountClones() as counted:
            ddp(torch.ones(4, 10)).sum().backward()
        seen[kind, sink_clone] = counted.clones, ddp.module.weight.grad
    return seen


def test_the_sink_copies_outputs_unless_told_not_to_as_torch():
    """torch's test_ddp_sink_noclone: no aten.clone in a step after
    _set_ddp_sink_clone(False); one per output before."""
    seen = run_world(_clones_in_a_step, 1)[0]
    for sink_clone in (True, False):
        (torch_clones, torch_grad), (ours, grad) = (seen["torch", sink_clone],
                                                    seen["minddp", sink_clone])
        assert ours == torch_clones == (1 if sink_clone else 0), seen
        assert torch.equal(grad, torch_grad)


def _warnings_and_hook_errors(rank, world_size):
    import warnings

    def misnamed(state, b):  # torch's DDP looks its hook's parameter up as `bucket`
        raise AssertionError("never called")

    seen = {}
    for kind in ("torch", "minddp"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = _wrap(kind, nn.Linear(3, 3), broadcast_buffers=False)
        seen[kind] = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        try:
            ddp.register_comm_hook(None, misnamed)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            seen[kind].append(type(e).__name__)
    return seen


def test_broadcast_buffers_warning_and_hook_checks_as_torch():
    seen = run_world(_warnings_and_hook_errors, 1)[0]
    assert seen["torch"][-1] == "KeyError", seen  # what torch 2.13 does: the oracle
    assert seen["minddp"] == seen["torch"], seen


def _zero_overlap(rank, world_size, kind, static_graph):
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    ddp = _wrap(kind, model, bucket_cap_mb=1e-4, static_graph=static_graph)  # several buckets
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                   overlap_with_ddp=True, lr=0.05)
    # torch refuses gloo here (pytorch#62300: it may hang with NCCL's semantics assumed);
    # it runs on 2 CPU ranks, and this test needs only what the hook reads of the wrapper.
    real, dist.get_backend = dist.get_backend, (lambda *a, **k: "nccl")
    try:
        hook = ddp_zero_hook.hook_with_zero_step(default_hooks.allreduce_hook, ddp, zero)
    finally:
        dist.get_backend = real
    ddp.register_comm_hook(None, hook)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(5):  # ZeRO steps once the buckets are final (step 2 on, 3 static)
        x, y = _batch(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        zero.step()
    moved = not all(torch.equal(a, p) for a, p in zip(start, model.parameters()))
    return moved, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("static_graph", [False, True])
def test_zero_overlapped_with_ddp_as_torch(static_graph):
    for (moved, theirs), (_, ours) in zip(run_world(_zero_overlap, 2, "torch", static_graph),
                                          run_world(_zero_overlap, 2, "minddp", static_graph)):
        assert moved  # ZeRO stepped at all
        assert all(torch.equal(a, b) for a, b in zip(theirs, ours))


def _sync_batchnorm_on_cpu(rank, world_size):
    model = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4))
    errors = []
    for kind in ("torch", "minddp"):
        try:
            _wrap(kind, model)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_sync_batchnorm_on_cpu_refused_at_construction_as_torch():
    for errors in run_world(_sync_batchnorm_on_cpu, 2):
        assert len(errors) == 2 and errors[1].startswith(errors[0]), errors


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x, both):
        return self.a(x) + self.b(x) if both else self.a(x)


def _reducer_warnings(rank, world_size):
    """How many times each step printed torch's reducer hints on stderr, and whether a
    Python warning came too (under "error" it would have raised)."""
    import contextlib
    import io
    import warnings

    from minddp import reducer
    reducer._warned_nothing_unused = False  # once a process, and this one may have run others
    ddp = minddp.DDP(_TwoHeads(), find_unused_parameters=True, algorithm="native")
    counts = []
    for both, create_graph in ((False, False), (True, False), (True, True), (True, True)):
        printed = io.StringIO()  # b unused; then nothing unused, thrice; create_graph twice
        with warnings.catch_warnings(), contextlib.redirect_stderr(printed):
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", "Using backward.. with create_graph")  # autograd's
            ddp(torch.ones(2, 3), both).square().sum().backward(create_graph=create_graph)
        counts.append([printed.getvalue().count(hint) for hint in (
            "did not find any unused parameters in the forward pass",
            "with create_graph=True is not well-supported")])
    return counts


def test_reducer_hints_on_stderr_once_as_torch():
    # torch's reducer.cpp gives these once a process (TORCH_WARN_ONCE) on stderr, out of
    # reach of Python's warning filters: "-W error" must not make a backward raise
    assert run_world(_reducer_warnings, 1) == [[[0, 0], [1, 0], [0, 1], [0, 0]]]


def _bucket_caps(rank, world_size):
    caps = []
    for kwargs in ({}, {"bucket_cap_mb": 5}, {"bucket_cap_mb_list": [1, 3, 2]}):
        theirs = TorchDDP(nn.Linear(3, 3), **kwargs)
        ours = minddp.DDP(nn.Linear(3, 3), algorithm="native", **kwargs)
        caps.append((theirs.bucket_bytes_cap, ours.bucket_bytes_cap))
    return caps


def test_bucket_bytes_cap_as_torch():
    # dynamo's DDPOptimizer cuts a compiled module's graph where this cap ends a bucket
    caps = run_world(_bucket_caps, 1)[0]
    assert caps[2][0] == 3 * 1024 * 1024, caps  # torch: the largest of the list
    assert all(theirs == ours for theirs, ours in caps), caps


def _tensor_parallel_on_a_mesh_slice(rank, world_size):
    """DDP + tensor parallel as torch's tutorial writes it: DDP over the "dp" slice of a
    2-D mesh, whose parameters are DTensors until the wrapper (as torch's) makes them local.
    One step through each wrapper, the same data; the gradients and the mesh it keeps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    grads, meshes = [], []
    for wrap in (TorchDDP, minddp.DDP):
        torch.manual_seed(0)
        model = parallelize_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                                   mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        ddp = wrap(model, device_mesh=mesh["dp"])
        params = list(ddp.parameters())  # the local shards: the forward swaps DTensors in
        x, y = _batch(rank, 0)
        nn.functional.mse_loss(ddp(x), y).backward()
        grads.append([p.grad.clone() for p in params])
        meshes.append(ddp.device_mesh == mesh["dp"])
    return grads, meshes


def test_ddp_over_the_data_parallel_slice_of_a_mesh_as_torch():
    for rank, ((theirs, ours), meshes) in enumerate(run_world(
            _tensor_parallel_on_a_mesh_slice, 2)):
        assert meshes == [True, True], f"rank {rank}: ddp.device_mesh {meshes}"
        assert len(ours) == len(theirs) == 4
        for a, b in zip(theirs, ours):
            assert type(a) is type(b) and torch.equal(a, b), f"rank {rank}"


def _small_surface(rank, world_size):
    """What a script reads or gets from each wrapper: torch's attributes, the errors of a
    second hook (in each order), of a built-in hook's wrong argument and of set_buffer."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def builtin(d):
        d._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)

    def hook(d):
        d.register_comm_hook(None, default_hooks.allreduce_hook)

    def wrong_size(state, bucket):
        bucket.set_buffer(torch.zeros(bucket.buffer().numel() + 1))

    seen = []
    for wrap in (TorchDDP, minddp.DDP):
        d = wrap(nn.Linear(2, 2))
        out = {name: getattr(d, name) for name in (
            "mixed_precision", "is_multi_device_module", "broadcast_bucket_size",
            "bucket_bytes_cap_default", "skip_all_reduce_unused_params", "batched_grad_copy")}
        for first, second in ((hook, hook), (hook, builtin), (builtin, hook), (builtin, builtin)):
            d = wrap(nn.Linear(2, 2))
            first(d)
            try:
                second(d)
            except RuntimeError as e:
                out[(first.__name__, second.__name__)] = str(e).splitlines()[0]
        try:
            wrap(nn.Linear(2, 2))._register_builtin_comm_hook("ALLREDUCE")
        except TypeError:
            out["builtin by name"] = "TypeError"
        out["sink"] = type(wrap(nn.Linear(2, 2), static_graph=True)(torch.ones(1, 2)).grad_fn)
        out["sink"] = out["sink"].__name__
        seen.append(out)
    d = minddp.DDP(nn.Linear(2, 2))  # torch's raises RuntimeError or crashes, by the size
    d.register_comm_hook(None, wrong_size)
    try:
        d(torch.ones(1, 2)).sum().backward()
    except RuntimeError as e:
        seen.append(str(e))
    return seen


def test_small_surface_as_torch():
    theirs, ours, wrong_size = run_world(_small_surface, 1)[0]
    assert ours == theirs
    assert "set_buffer got 7 elements for bucket 0 of 6" in wrong_size, wrong_size


class _WithSpareHead(nn.Module):
    """Three layers; with `spare`, no rank ever uses the last (find_unused_parameters')."""

    def __init__(self, spare):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 6), nn.Linear(6, 4), nn.Linear(4, 4)
        self.spare = spare

    def forward(self, x):
        x = self.b(torch.tanh(self.a(x)))
        return x if self.spare else self.head(x)


def _optimizers(params):
    """Per parameter, as _apply_optimizer_in_backward makes them: SGD with momentum for
    the first layer, AdamW with weight decay for the rest."""
    return [(p, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}) if i < 2 else
            (p, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})
            for i, p in enumerate(params)]


def _optimizer_in_backward(rank, world_size, kwargs, after_wrapping):
    """minddp with torch's optimizers in backward, against what torch's DDP does with
    them on a GPU (its hook needs an accelerator): each parameter's optimizers step
    on the averaged gradient (zeros where no rank used it), then .grad is None.
    Step 1 accumulates under no_sync: nothing steps there."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    weights, grads_left = [], []
    for kind in ("reference", "minddp"):
        torch.manual_seed(0)
        model = _WithSpareHead(spare=kwargs.get("find_unused_parameters", False))
        if kind == "reference":
            ddp = TorchDDP(model, find_unused_parameters=kwargs.get("find_unused_parameters",
                                                                     False))
            stepped = [(p, cls(([p]), **kw)) for p, cls, kw in _optimizers(model.parameters())]
        else:
            if not after_wrapping:
                for p, cls, kw in _optimizers(model.parameters()):
                    _apply_optimizer_in_backward(cls, [p], kw)
            ddp = minddp.DDP(model, **kwargs)
            if after_wrapping:  # before the first forward: torch's DDP takes them over then
                for p, cls, kw in _optimizers(model.parameters()):
                    _apply_optimizer_in_backward(cls, [p], kw)
        for step in range(4):
            x, y = _batch(rank, step)
            with ddp.no_sync() if step == 1 else contextlib.nullcontext():
                (ddp(x) - y).square().mean().backward()
            if kind == "reference" and step != 1:
                for p, optimizer in stepped:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    optimizer.step()
                    p.grad = None
            if kind == "minddp" and step != 1:
                grads_left.append([p.grad is not None for p in model.parameters()])
        weights.append(_weights(model)[0])
    theirs, ours = weights
    return [torch.equal(a, b) for a, b in zip(theirs, ours)], grads_left, \
        torch.equal(*_gathered(torch.cat([w.flatten() for w in ours])))


@pytest.mark.parametrize("kwargs, after_wrapping", [
    ({}, False), ({"gradient_as_bucket_view": True}, True),
    ({"find_unused_parameters": True, "algorithm": "ring"}, False)])
def test_optimizers_in_backward_step_on_the_average_as_torch(kwargs, after_wrapping):
    for same, grads_left, ranks_equal in run_world(_optimizer_in_backward, 2, kwargs,
                                                   after_wrapping):
        assert all(same), f"parameters that differ from torch's: {same}"
        assert not any(any(step) for step in grads_left), grads_left  # .grad None, as torch
        assert ranks_equal


def _python_process_group(rank, world_size):
    """A world of one built directly from torch's ProcessGroup class, never registered with
    torch.distributed (torch's test_c10d_pypg.py passes such a group to its DDP)."""
    from torch._C._distributed_c10d import _create_work_from_future

    class Lonely(dist.ProcessGroup):
        def __init__(self):
            super().__init__(0, 1)

        def allreduce(self, tensors, opts):
            future = torch.futures.Future()
            future.set_result(tensors)
            return _create_work_from_future(future)

        def getBackendName(self):
            return "lonely"

    try:
        minddp.DDP(nn.Linear(2, 2), process_group=Lonely())
    except ValueError as e:
        return str(e)
    return "no error"


def test_an_unregistered_process_group_is_refused_naming_the_fix():
    message = run_world(_python_process_group, 1)[0]
    for words in ("minddp (rank 0 of process_group)", "not registered with torch.distributed",
                  "dist.new_group(ranks)"):
        assert words in message, (words, message)


def _trained_under_detail(rank, world_size):
    """Two steps each with the backend's all-reduce, ring and auto, every collective on
    minddp's own groups checked by torch's debug wrapper (as TORCH_DISTRIBUTED_DEBUG=DETAIL
    makes it, here set before minddp makes its groups): ranks must issue the same."""
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    grads, wrapped = [], []
    for algorithm in ("native", "ring", "auto"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
        ddp = minddp.DDP(model, algorithm=algorithm, bucket_cap_mb=0.0001)
        for step in range(2):
            x, y = _batch(rank, step)
            (ddp(x) - y).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        wrapped.append(type(ddp.engine.group._get_backend(torch.device("cpu"))).__name__)
    return wrapped, [torch.equal(*_gathered(g)) for g in grads]


def test_every_collective_passes_torchs_debug_checks():
    # torch 2.13's own DDP segfaults in its constructor here on CPU (docs/differences.md).
    for wrapped, same in run_world(_trained_under_detail, 2, timeout=120):
        assert wrapped == ["_ProcessGroupWrapper"] * 3, wrapped  # checked by torch
        assert all(same), same


def _optimizer_in_backward_through_a_join(rank, world_size):
    """Rank 0 has 3 batches, rank 1 one: the joined rank steps its optimizers on the
    peers' averages too (torch's joined rank runs the same hook), so the weights and the
    momentum buffers stay equal and the steps after the join train without a mismatch."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(),
                                 {"lr": 0.1, "momentum": 0.9})
    ddp = minddp.DDP(model, check_replicas=1)
    with ddp.join():
        for step in range(3 if rank == 0 else 1):
            ddp(torch.full((2, 4), rank + 1.0 + step)).sum().backward()
    for _ in range(2):
        ddp(torch.full((2, 4), rank + 1.0)).sum().backward()
    momenta = [o.state[p]["momentum_buffer"] for p in model.parameters()
               for o in p._in_backward_optimizers]
    return [torch.equal(*_gathered(t)) for t in list(model.parameters()) + momenta]


def test_optimizers_in_backward_step_on_a_joined_rank_too():
    for same in run_world(_optimizer_in_backward_through_a_join, 2):
        assert all(same), same
