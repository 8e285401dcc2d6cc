"""The reducer's pieces: bucket layout, gradients as bucket views, torch's PowerSGD hook."""
import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp import buckets
from dist_harness import run_world
from models import DeepNet, batch

MiB = 1024 * 1024


def _params(*specs):
    return [torch.zeros(n, dtype=dtype) for n, dtype in specs]


def test_buckets_fill_in_reverse_with_small_first_bucket():
    # 6 parameters of 0.5 MiB: the 1 MiB first bucket takes the last two,
    # then 2 MiB buckets take the rest, newest first.
    params = _params(*[(MiB // 8, torch.float32)] * 6)
    assert buckets.assign(params, buckets.caps(2 * MiB)) == [[5, 4], [3, 2, 1, 0]]


@pytest.mark.skipif(buckets._gradients_in_cpp is None, reason="needs minddp._C (its reader)")
def test_reading_a_buckets_grads_in_cpp_as_in_python():
    """The extension's reader and its Python twin: every kind of .grad the reducer meets."""
    params = [nn.Parameter(torch.zeros(3)) for _ in range(4)]
    cases = {"plain": [torch.ones(3)] * 4,
             "none": [None] * 4,
             "one missing": [torch.ones(3), None, torch.ones(3), torch.ones(3)],
             "create_graph": [torch.ones(3).requires_grad_()] + [torch.ones(3)] * 3,
             "sparse": [torch.ones(3).to_sparse()] + [torch.ones(3)] * 3}
    for case, grads in cases.items():
        for param, grad in zip(params, grads):
            param.grad = grad
        ours, theirs = buckets._gradients_in_cpp(params), buckets.read_grads(params)
        assert ours[1:] == theirs[1:], f"{case}: {ours[1:]} where Python reads {theirs[1:]}"
        assert all(a is b for a, b in zip(ours[0], theirs[0])), f"{case}: other tensors"
    assert buckets.read_grads(params)[1:] == (4, False)  # the last case: sparse


def test_a_list_of_caps_gives_each_bucket_its_own():
    # torch's bucket_cap_mb_list: bucket k closes at the k-th cap, later ones at the last.
    params = _params(*[(MiB // 8, torch.float32)] * 8)
    assert buckets.assign(params, [MiB // 2, MiB, 2 * MiB]) == \
        [[7], [6, 5], [4, 3, 2, 1], [0]]


def test_buckets_never_mix_dtypes_and_big_params_stand_alone():
    params = _params((10, torch.float32), (10, torch.float64), (MiB, torch.float32),
                     (10, torch.float64))
    layout = buckets.assign(params, [MiB])
    assert sorted(map(sorted, layout)) == [[0], [1, 3], [2]]
    built = buckets.build(params, [MiB])
    for bucket in built:
        assert len({p.dtype for p in bucket.params}) == 1
        assert bucket.buffer.dtype == bucket.params[0].dtype
        assert bucket.buffer.numel() == sum(p.numel() for p in bucket.params)


def _grads_are_views(rank, world_size):
    ddp = minddp.DDP(DeepNet(), bucket_cap_mb=0.002, gradient_as_bucket_view=True)
    for step in range(2):
        ddp(*batch("deep", rank, step)).sum().backward()
    spans = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.nbytes) for b in ddp.reducer.buckets]
    assert len(spans) > 3, "the tiny cap should give several buckets"
    for name, p in ddp.module.named_parameters():
        ptr = p.grad.data_ptr()
        assert any(lo <= ptr < hi for lo, hi in spans), f"{name}.grad is not in a bucket"
    return True


def test_gradient_as_bucket_view_aliases_the_buckets():
    assert run_world(_grads_are_views, 2) == [True, True]


def _powersgd_both(rank, world_size):
    torch.manual_seed(0)
    model = DeepNet()
    results = []
    for wrap in (TorchDDP, minddp.DDP):
        ddp = wrap(copy.deepcopy(model))
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, random_seed=7)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(4):  # two plain all-reduce steps, then compressed ones
            opt.zero_grad()
            ddp(*batch("deep", rank, step)).square().mean().backward()
            opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]))
    return results


def test_torch_powersgd_hook_unchanged():
    (ref0, ours0), (ref1, ours1) = run_world(_powersgd_both, 2)
    assert torch.equal(ours0, ours1), "ranks differ"
    torch.testing.assert_close(ours0, ref0, rtol=1e-5, atol=1e-6)


def _never_used(rank, world_size):
    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    ddp = minddp.DDP(WithSpare(), find_unused_parameters=True)
    for _ in range(2):
        ddp(torch.randn(3, 4)).sum().backward()
    return ddp.module.spare.weight.grad is None, ddp.module.used.weight.grad is not None


def test_parameter_no_rank_used_keeps_no_grad():
    # torch leaves .grad of a parameter no rank used untouched (None here).
    assert run_world(_never_used, 2) == [(True, True), (True, True)]


def _write_back_order(rank, world_size):
    import torch.distributed as dist
    ddp = minddp.DDP(DeepNet(), bucket_cap_mb=0.002)
    seen, collect = [], ddp.reducer._collect

    def hook(state, bucket):
        work = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    def probe(b):  # finalize is about to wait for bucket b
        first = ddp.reducer.buckets[0]
        if b > 0:
            seen.append(all(torch.equal(p.grad, first.view(i))
                            for i, p in enumerate(first.params)))
        return collect(b)

    ddp.register_comm_hook(None, hook)
    ddp.reducer._collect = probe
    for step in range(2):
        ddp(*batch("deep", rank, step)).sum().backward()
    return len(ddp.reducer.buckets), seen


def test_each_bucket_is_written_back_before_the_next_is_waited_for():
    # As torch's finalize does: copying bucket 0 to .grad overlaps the later
    # buckets' communication instead of following all of it.
    for count, seen in run_world(_write_back_order, 2):
        assert count > 2 and len(seen) == 2 * (count - 1)
        assert all(seen), "bucket 0 was still unwritten when a later bucket was waited for"



def _stamped(n, world_size):
    """A step check and bucket 0 of a fresh layout, holding the stamp of synced forward n."""
    from minddp.step_check import StepCheck

    class Exact:  # a reduction that sums bucket 0's slots with it, exactly
        carries_stamp = True

    built = buckets.build(_params((4, torch.float32)), [MiB], stamp=True)
    check = StepCheck(sum_step=lambda tensor: None, rank=0, world_size=world_size)
    check.stamp(n, built, Exact())
    return check, built[0]


def test_step_check_passes_equal_stamps_and_names_a_rank_out_of_step():
    # The all-reduce of bucket 0 done by hand: three ranks at forward n, then
    # two at n and one at n - 1. n lies above float32's exact integers (2^24),
    # so the stamp takes it modulo a bound and still sums exactly.
    n = (1 << 30) + 5
    check, bucket = _stamped(n, 3)
    m = n % check.modulus(torch.float32)
    assert bucket.carrier[-3:].tolist() == [1, m, m * m]
    summed = check.take(bucket, bucket.carrier * 3)
    assert summed.numel() == bucket.buffer.numel()  # the stamp's slots are cut off
    check.verify(n, [bucket], wait=None)  # agreed: no error
    _, behind = _stamped(n - 1, 3)
    check.take(bucket, bucket.carrier * 2 + behind.carrier)
    with pytest.raises(RuntimeError, match=f"rank 0.*out of step.*forward #{n}"):
        check.verify(n, [bucket], wait=None)


def test_step_check_asserts_a_carried_stamp_comes_back():
    check, bucket = _stamped(7, 2)
    with pytest.raises(RuntimeError, match="minddp internal error.*stamp back"):
        check.verify(7, [bucket], wait=None)  # bucket 0's sum never handed to take()


def _broken_order(rank, world_size):
    ddp = minddp.DDP(DeepNet(), bucket_cap_mb=0.002)
    ddp(*batch("deep", rank, 0)).sum().backward()
    errors = []
    for call in (lambda: ddp.reducer._bucket_full(0),  # full again after its launch
                 lambda: ddp.reducer._collect(0),      # its Future was collected already
                 lambda: ddp.reducer.use_buckets(ddp.reducer.buckets[1:])):  # one left out
        try:
            call()
            errors.append("no error")
        except RuntimeError as e:
            errors.append(str(e))
    return errors


def test_reducer_asserts_its_ordering_invariants():
    refill, recollect, relayout = run_world(_broken_order, 1)[0]
    assert refill.startswith("minddp internal error") and "fill once" in refill, refill
    assert recollect.startswith("minddp internal error") and "waited once" in recollect
    assert relayout.startswith("minddp internal error") and "layout" in relayout, relayout


def _one_rank_collective_calls(rank, world_size, compression):
    """How many times a one-rank wrapper called its algorithm in a step, and whether its
    gradients are the module's own (a sum over one rank is the bucket itself)."""
    from minddp import registry
    calls = []
    ring = registry.algorithm("ring")
    minddp.register_algorithm(
        "counted_one_rank", lambda t, group=None, codec=None, error=None:
        calls.append(t.numel()) or ring.all_reduce(t, group, codec=codec, error=error),
        per_hop=True, auto=False)
    try:  # the worker lives on: the name must not leak into other tests' registry
        torch.manual_seed(0)
        model = DeepNet()
        ours = minddp.DDP(copy.deepcopy(model), algorithm="counted_one_rank",
                          compression=compression)
    finally:
        del registry._algorithms["counted_one_rank"]
    (x,) = batch("deep", rank, 0)
    ours(x).square().sum().backward()
    model(x).square().sum().backward()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), model.parameters()))
    return len(calls), same


def test_one_rank_launches_no_collective_without_a_codec():
    assert run_world(_one_rank_collective_calls, 1, None) == [(0, True)]
    calls, _ = run_world(_one_rank_collective_calls, 1, "fp16")[0]
    assert calls > 0, "with a codec the collective runs as on more ranks"
