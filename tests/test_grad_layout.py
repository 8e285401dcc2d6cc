"""Bucket views keep each parameter's layout (torch's Gradient Layout Contract).

A channels_last convolution's weight has strides (27, 1, 9, 3) for 3 input
channels and a 3x3 kernel; autograd gives its gradient the same strides, and
torch's DDP makes the bucket view, so .grad under gradient_as_bucket_view, with
them too. Values must equal torch's DDP's; ranks must end bitwise identical.
"""
import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp import buckets
from dist_harness import run_world


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.conv2 = nn.Conv2d(6, 4, 1)
        self.head = nn.Linear(4 * 4 * 4, 1)

    def forward(self, x):
        return self.head(self.conv2(torch.relu(self.conv(x))).flatten(1))


def _model():
    torch.manual_seed(0)
    return ConvNet().to(memory_format=torch.channels_last)


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)


def _run(ddp, rank, steps=3, hook=None):
    if hook is not None:
        ddp.register_comm_hook(*hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        ddp(_batch(rank, step)).square().mean().backward()
        grads.append({n: (p.grad.stride(), p.grad.clone())
                      for n, p in ddp.module.named_parameters()})
        opt.step()
    return grads


def _layout(rank, world_size, as_view):
    model = _model()
    assert model.conv.weight.stride() == (27, 1, 9, 3)
    ours_ddp = minddp.DDP(copy.deepcopy(model), gradient_as_bucket_view=as_view)
    ours = _run(ours_ddp, rank)
    theirs = _run(TorchDDP(copy.deepcopy(model), gradient_as_bucket_view=as_view), rank)
    params = dict(ours_ddp.module.named_parameters())
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for name, (stride, grad) in a.items():
            assert stride == params[name].stride() == b[name][0], \
                f"step {step} {name}: .grad strides {stride}, torch's {b[name][0]}"
            assert torch.equal(grad, b[name][1]), f"step {step} {name}: values differ"
    if as_view:  # .grad is the bucket view itself
        spans = [(bk.buffer.data_ptr(), bk.buffer.data_ptr() + bk.nbytes)
                 for bk in ours_ddp.reducer.buckets]
        for name, p in params.items():
            assert any(lo <= p.grad.data_ptr() < hi for lo, hi in spans), name
    return torch.cat([p.detach().reshape(-1) for p in params.values()])


@pytest.mark.parametrize("as_view", [True, False])
def test_grads_keep_the_parameters_strides(as_view):
    a, b = run_world(_layout, 2, as_view, timeout=90)
    assert torch.equal(a, b), "ranks differ"


def _powersgd(rank, world_size):
    """torch's PowerSGD hook reshapes bucket.gradients() to matrices: they must
    stay row-major slices of the buffer as torch's are, channels_last or not.
    Only conv.weight is worth compressing at this rate, so the order of the
    parameters in the bucket (torch rebuilds it after the first step) cannot
    change the random matrices the hook draws."""
    model = _model()
    results = []
    for wrap in (TorchDDP, minddp.DDP):
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=3,
                                       random_seed=7)
        grads = _run(wrap(copy.deepcopy(model)), rank, steps=4,
                     hook=(state, powersgd.powerSGD_hook))
        results.append(grads[-1])
    theirs, ours = results
    for name, (stride, grad) in ours.items():
        assert stride == theirs[name][0], name
        torch.testing.assert_close(grad, theirs[name][1], rtol=1e-5, atol=1e-6)
    return torch.cat([g.reshape(-1) for _, g in ours.values()])


def test_powersgd_hook_sees_row_major_gradients():
    a, b = run_world(_powersgd, 2, timeout=90)
    assert torch.equal(a, b), "ranks differ"


def test_views_follow_the_gradient_layout_contract():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    odd = nn.Parameter(torch.zeros(4, 6)[:, ::2])  # overlapping-free but not dense
    params = [conv.weight, conv.bias, odd]
    (bucket,) = buckets.build(params, [1 << 20])
    views = [bucket.view(i) for i in range(len(bucket.params))]
    by_param = {id(p): v for p, v in zip(bucket.params, views)}
    assert by_param[id(conv.weight)].stride() == (27, 1, 9, 3)
    assert by_param[id(odd)].stride() == (3, 1)  # row-major: not dense
    for o, v in zip(bucket.offsets, views):
        assert v.data_ptr() == bucket.buffer[o:].data_ptr()
    result = torch.arange(bucket.buffer.numel(), dtype=torch.float32)
    for p, o, v in zip(bucket.params, bucket.offsets, bucket.views_of(result)):
        assert v.stride() == by_param[id(p)].stride()
        assert sorted(v.reshape(-1).tolist()) == list(range(o, o + p.numel()))


def _layouts_differ(rank, world_size):
    model = ConvNet()
    if rank == 1:
        model = model.to(memory_format=torch.channels_last)
    try:
        minddp.DDP(model)
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return None


def test_ranks_whose_parameters_differ_in_layout_are_refused():
    """torch's test_param_layout_mismatch_error: buckets are summed in memory order,
    so one parameter laid out two ways would be summed with its elements mixed."""
    for told in run_world(_layouts_differ, 2, timeout=90):
        assert told is not None and told[0] == "ModelMismatch", told
        assert "'conv.weight' with strides (27, 1, 9, 3) appears not to match strides of the " \
               "same param in process 0 ((27, 9, 3, 1))" in told[1], told
