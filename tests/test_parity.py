"""Parity with torch's own DDP: same gradients, parameters, buffers and state_dict.

Each rank wraps two copies of one model, one in torch DDP and one in minddp,
and feeds both the same rank-dependent batches. With two ranks the all-reduce
sums are exact in any order, so gradients must match torch bit for bit; with
more ranks the summation order follows the bucket layout, so they match to
float rounding. In every case all ranks must end bitwise identical.
"""
import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp import registry
from minddp.algorithms import lanes
from dist_harness import run_world
from models import MODELS, batch


def _assert_match(a, b, exact, what, loose=False):
    assert a.dtype == b.dtype, f"{what}: {a.dtype}, torch's {b.dtype}"
    if loose:  # bf16 keeps 8 mantissa bits: relative error up to 2**-8 per value
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3, msg=what)
    elif exact:
        assert torch.equal(a, b), f"{what}: max diff {(a - b).abs().max().item()}"
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


def _train_both(rank, world_size, name, steps=3, torch_kwargs=None, ours_kwargs=None,
                hook=None, accumulate=1, ref_hook="same"):
    torch.manual_seed(0)
    model = MODELS[name]()
    torch_kwargs = dict(torch_kwargs or {})
    ours_kwargs = dict(ours_kwargs or {})
    ref = TorchDDP(copy.deepcopy(model), **torch_kwargs)
    ours = minddp.DDP(copy.deepcopy(model), **{"algorithm": "native", **ours_kwargs})
    # Opened by the constructor: never created later by the communication thread.
    assert lanes.is_open(ours.engine.group), "the wrapper left its reverse lane unopened"
    ref_hook = hook if ref_hook == "same" else ref_hook
    if ref_hook is not None:
        ref.register_comm_hook(None, ref_hook)
    if hook is not None:
        ours.register_comm_hook(None, hook)
    loose = ref_hook is not hook
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    exact = world_size <= 2
    for step in range(steps):
        for ddp, opt in zip((ref, ours), opts):
            opt.zero_grad()
            for micro in range(accumulate):
                inputs = batch(name, rank, step * accumulate + micro)
                last = micro == accumulate - 1
                ctx = ddp.no_sync() if not last else _nullcontext()
                with ctx:
                    ddp(*inputs).square().mean().backward()
        for (n, p_ref), p_ours in zip(ref.module.named_parameters(), ours.module.parameters()):
            if p_ref.grad is None:
                assert p_ours.grad is None, f"step {step}: {n} has a grad only in minddp"
            else:
                _assert_match(p_ours.grad, p_ref.grad, exact, f"step {step} grad of {n}", loose)
        for opt in opts:
            opt.step()
    for (n, p_ref), p_ours in zip(ref.module.named_parameters(), ours.module.parameters()):
        _assert_match(p_ours.detach(), p_ref.detach(), exact, f"parameter {n}", loose)
    for (n, b_ref), b_ours in zip(ref.module.named_buffers(), ours.module.buffers()):
        _assert_match(b_ours, b_ref, exact, f"buffer {n}", loose)
    assert list(ours.state_dict()) == list(ref.state_dict())
    return torch.cat([p.detach().reshape(-1) for p in ours.parameters()])


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _assert_ranks_equal(flat_params):
    for rank, params in enumerate(flat_params[1:], start=1):
        assert torch.equal(params, flat_params[0]), f"rank {rank} parameters differ from rank 0"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_deep_model_every_world_size(world_size):
    _assert_ranks_equal(run_world(_train_both, world_size, "deep"))


# Every registered algorithm but native (covered above); auto picks per bucket
# size, and tiny buckets on 3 ranks give many sizes and the non-power-of-two paths.
@pytest.mark.parametrize("algorithm", [n for n in registry.algorithm_names() if n != "native"])
@pytest.mark.parametrize("world_size, kwargs", [
    (3, {"bucket_cap_mb": 0.002}),
    (2, {"find_unused_parameters": True, "gradient_as_bucket_view": True})],
    ids=["3-ranks-tiny-buckets", "2-ranks-unused-bucket-view"])
def test_each_algorithm(algorithm, world_size, kwargs):
    name = "branch" if kwargs.get("find_unused_parameters") else "deep"
    ours = dict(kwargs, algorithm=algorithm)
    _assert_ranks_equal(run_world(_train_both, world_size, name, 3, kwargs, ours))


@pytest.mark.parametrize("name", ["batchnorm", "tied", "frozen", "odd"])
def test_models_two_ranks(name):
    _assert_ranks_equal(run_world(_train_both, 2, name))


@pytest.mark.parametrize("ours, hook", [({"algorithm": "auto"}, None),
                                        ({}, default_hooks.fp16_compress_hook)])
def test_complex_and_strided_parameters_as_torch(ours, hook):
    # auto times its candidates on the buckets, complex ones too; torch's fp16 hook
    # compresses the bucket it is given, where a complex bucket's imaginary parts must be.
    _assert_ranks_equal(run_world(_train_both, 2, "odd", 3, None, ours, hook))


def test_rank_dependent_unused_branch():
    kw = {"find_unused_parameters": True}
    _assert_ranks_equal(run_world(_train_both, 2, "branch", 4, kw, kw))


def test_tiny_buckets_many_of_them():
    kw = {"bucket_cap_mb": 0.001}
    _assert_ranks_equal(run_world(_train_both, 3, "deep", 3, kw, kw))


@pytest.mark.parametrize("cap", [0, -1])
def test_a_cap_of_zero_or_less_trains_as_torch(cap):
    """torch takes it: every bucket closes at its first parameter."""
    kw = {"bucket_cap_mb": cap}
    _assert_ranks_equal(run_world(_train_both, 2, "deep", 3, kw, kw))


def test_gradient_as_bucket_view():
    kw = {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.002}
    _assert_ranks_equal(run_world(_train_both, 2, "deep", 3, kw, kw))


def test_no_sync_accumulation():
    _assert_ranks_equal(run_world(_train_both, 2, "batchnorm", 3, None, None, None, 3))


@pytest.mark.parametrize("hook", [default_hooks.allreduce_hook, default_hooks.fp16_compress_hook])
def test_torch_comm_hooks_unchanged(hook):
    _assert_ranks_equal(run_world(_train_both, 2, "deep", 3, None, None, hook))


def test_torch_hook_wrapper_unchanged():
    # fp16_compress_wrapper replaces the bucket's buffer with an fp16 copy (set_buffer):
    # the wrapped hook reduces in fp16, and .grad comes back float32.
    _assert_ranks_equal(run_world(_train_wrapped, 2, "allreduce_hook"))


def _train_wrapped(rank, world_size, inner):
    hook = default_hooks.fp16_compress_wrapper(getattr(default_hooks, inner))
    return _train_both(rank, world_size, "deep", 3, None, None, hook)


def test_torch_bf16_hook_unchanged():
    # torch DDP refuses bf16_compress_hook on gloo (it wants NCCL), so the
    # oracle is torch DDP without a hook, compared at bf16 precision.
    _assert_ranks_equal(run_world(_train_both, 2, "deep", 3, None, None,
                                  default_hooks.bf16_compress_hook, 1, None))


class _ReassignsBuffer(torch.nn.Module):
    """Replaces its buffer with a new tensor every forward (torch issue 63916)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        self.seen = self.seen + x.mean(0).detach()
        return self.lin(x) + self.seen


def _buffers_after_training(rank, world_size):
    """Both wrappers: one module that reassigns its buffer, one given a buffer only
    after it was wrapped, and BatchNorm run on two batches before one backward; the
    buffers each rank ends with."""
    found = {}
    for kind, wrap in (("torch", TorchDDP), ("minddp", minddp.DDP)):
        torch.manual_seed(0)
        reassigns, late = wrap(_ReassignsBuffer()), wrap(torch.nn.Linear(4, 4))
        twice = wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
        late.module.register_buffer("late", torch.full((2,), float(rank)))
        for step in range(3):
            x = torch.full((2, 4), float(rank + step))
            (reassigns(x).sum() + late(x).sum()).backward()
            # the second forward's broadcast must leave the saved running stats valid
            (twice(x).square().mean() + twice(x * 2).square().mean()).backward()
        found[kind] = (reassigns.module.seen.clone(), late.module.late.clone(),
                       *[t.detach().clone() for t in twice.module.state_dict().values()])
    return found


def test_buffers_synced_where_torchs_are():
    """torch reads the buffers again before each forward's broadcast, but only where the
    module had buffers when wrapped: a reassigned buffer is synced, a buffer added later
    is not; the broadcast keeps the buffers' version counters (a BatchNorm module run
    twice before one backward failed in backward with minddp)."""
    for rank, found in enumerate(run_world(_buffers_after_training, 2)):
        names = ("reassigned", "added later", *[f"two forwards: {k}" for k in range(7)])
        for name, ours, torchs in zip(names, found["minddp"], found["torch"]):
            assert torch.equal(ours, torchs), f"rank {rank}, {name}: {ours}, torch {torchs}"


def _forward_without_backward(rank, world_size):
    """A synced forward with no backward (validation with gradients on) makes the next
    forward look for parameters whose dtype changed since wrapping: a complex one has not."""
    ddp = minddp.DDP(MODELS["odd"]())
    ddp(*batch("odd", rank, 0))
    ddp(*batch("odd", rank, 1)).abs().sum().backward()
    return [p.grad for p in ddp.parameters()]


def test_a_complex_parameter_is_not_taken_for_a_converted_one():
    grads = run_world(_forward_without_backward, 2)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _WithLogVariance(nn.Module):
    """A forward that returns one of its parameters as it is (a learned log-variance)."""

    def __init__(self):
        super().__init__()
        self.fc, self.log_var = nn.Linear(4, 4), nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.fc(x), self.log_var


def _parameter_as_output(rank, world_size, kwargs, from_step):
    """Each step's gradients (or the error's opening) under torch's DDP and minddp; the
    returned parameter enters the loss from step `from_step` on."""
    seen = []
    for wrap in (TorchDDP, minddp.DDP):
        torch.manual_seed(0)
        ddp, steps = wrap(_WithLogVariance(), **kwargs), []
        try:
            for step in range(3):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
                y, log_var = ddp(x)
                loss = (y.square() * torch.exp(-log_var) + log_var).sum() if step >= from_step \
                    else y.square().sum()
                loss.backward()
                steps.append([None if p.grad is None else p.grad.clone()
                              for p in ddp.parameters()])
                ddp.zero_grad()
        except RuntimeError as e:
            steps.append(str(e).split(".")[0])
        seen.append(steps)
    return seen


_RETURNED = [({"find_unused_parameters": True}, 0),  # torch: marked unused, its hook fires: error
             ({"find_unused_parameters": True}, 1),
             ({"static_graph": True}, 1)]            # torch: the sink's backward counts it used


def _parameter_as_output_each_way(rank, world_size):
    return [_parameter_as_output(rank, world_size, *case) for case in _RETURNED]


def test_a_parameter_returned_by_forward_as_torch():
    for rank, cases in enumerate(run_world(_parameter_as_output_each_way, 2)):
        for (kwargs, from_step), (theirs, ours) in zip(_RETURNED, cases):
            where = f"rank {rank}, {kwargs}, from step {from_step}"
            assert len(ours) == len(theirs), f"{where}: torch {theirs}, minddp {ours}"
            for step, (a, b) in enumerate(zip(theirs, ours)):
                if isinstance(a, str) or isinstance(b, str):
                    assert a == b, f"{where}, step {step}: torch {a!r}, minddp {b!r}"
                    continue
                for g, h in zip(a, b):
                    assert (g is None) == (h is None) and (g is None or torch.equal(g, h)), \
                        f"{where}, step {step}"


def _overlapping_subgroups(rank, world_size):
    """Rank 1 belongs to two data-parallel groups, [0, 1] and [1, 2], and wraps a model
    in each; the others wrap one. Rank 1 then holds more process groups than its peers,
    which must not change the names of the groups minddp makes for each wrapper."""
    import torch.distributed as dist

    pairs = {(0, 1): dist.new_group([0, 1]), (1, 2): dist.new_group([1, 2])}
    seen = {}
    for wrap in (TorchDDP, minddp.DDP):
        for ranks, group in pairs.items():
            if rank not in ranks:
                continue
            torch.manual_seed(0)
            model = nn.Linear(4, 2)
            ddp = wrap(model, process_group=group, **({} if wrap is TorchDDP else
                                                       {"algorithm": "ring"}))
            ddp(torch.full((3, 4), rank + 1.0)).square().sum().backward()
            seen.setdefault(ranks, []).append([p.grad for p in model.parameters()])
    return seen


def test_wrappers_over_overlapping_subgroups_train_as_torch():
    for rank, seen in enumerate(run_world(_overlapping_subgroups, 3)):
        for ranks, (theirs, ours) in seen.items():
            assert all(torch.equal(a, b) for a, b in zip(theirs, ours)), (rank, ranks)
