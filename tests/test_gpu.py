"""minddp on CUDA tensors, in the two worlds one GPU allows, against torch's DDP.

- 2 ranks over gloo, both on cuda:0: NCCL cannot put two ranks on one GPU, so
  gloo carries the traffic and minddp stages CUDA tensors through pinned CPU
  memory for its own algorithms (p2p.py); the backend's all-reduce takes them
  as they are.
- 1 rank over NCCL, on cuda:0: the only NCCL world one GPU allows. There is
  nothing to sum, but the wrapper still agrees on the model over NCCL, opens
  its NCCL group and runs torch's comm hooks on NCCL futures.

Every parity test feeds both wrappers the same integer-valued batches on a
model with integer weights: every product and sum in forward, backward and
the all-reduce is an integer below 2^24, exact in float32 whatever the
order, so gradients must equal torch DDP's bit for bit. Only minddp's fp16
compression gets a tolerance. All ranks must end bitwise identical.

Skipped without CUDA; `make gpu-check` runs this file on a GPU machine.
"""
import copy
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp import comm, registry
from minddp.algorithms import p2p, ring
from dist_harness import run_world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (world size, backend): what one GPU can host.
WORLDS = [pytest.param(2, "gloo", id="2-ranks-gloo-one-gpu"),
          pytest.param(1, "nccl", id="1-rank-nccl")]

# minddp (algorithm, compression, comm hook); the hook is registered on both wrappers.
CONFIGS = [pytest.param("native", None, None, id="native"),
           pytest.param("ring", None, None, id="ring"),
           pytest.param("tree", None, None, id="tree"),
           pytest.param("auto", None, None, id="auto"),
           pytest.param("ring", "fp16", None, id="ring-fp16"),
           pytest.param("native", "fp16", None, id="native-fp16"),
           pytest.param("ring", "int8", None, id="ring-int8"),
           pytest.param("native", None, "fp16_compress_hook", id="torch-fp16-hook")]

# Compressing a chunk loses at most 2^-10 of its largest magnitude (fp16), and a
# gradient passes through two or three encodings (reduce-scatter, all-gather;
# native's common scale): 2^-7 of the model's largest gradient bounds it. int8 loses
# up to 0.5/127 of its block's largest magnitude per encoding (2^-8), and error
# feedback adds back what the last step's encodings lost: 2^-5 bounds both.
# bf16 keeps 8 bits where fp16 keeps 11: 2^-5 as for int8. A codec registered elsewhere (a
# plugin) has no known bound: its results are checked for device, finiteness and equal ranks.
TOLERANCE = {"fp16": 2.0 ** -7, "bf16": 2.0 ** -5, "int8": 2.0 ** -5}


class IntegerNet(nn.Module):
    """16 -> 512 -> 512 -> 8 with ReLUs, integer weights in {-1, 0, 1}. The 512x512
    weight is 1 MiB, past the first bucket's cap: the model fills two buckets."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 512), nn.Linear(512, 512), nn.Linear(512, 8)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=g))

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _batch(rank, step, device):
    """Inputs in {-1, 0, 1} and loss weights in [-50, 50], different on every rank
    and step. At most: activations 4.5e6 (output), gradients 1.8e6 (fc3.weight),
    all below 2^24; typical gradients have more bits than fp16 keeps, so the
    compressed configurations really round."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(-1, 2, (4, 16), generator=g).float()
    weights = torch.randint(-50, 51, (4, 8), generator=g).float()
    return x.to(device), weights.to(device)


def _device():
    # Every rank uses cuda:0: gloo ranks share the one GPU, the NCCL world has one rank.
    torch.cuda.set_device(0)
    # TF32 keeps 10 mantissa bits: it would round integer activations (up to 23 bits).
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch.device("cuda", 0)


def _check_world(world_size, backend):
    assert dist.get_backend() == backend, f"default group runs {dist.get_backend()}"
    assert torch.cuda.current_device() == 0


def _parity(rank, world_size, backend, algorithm, compression, hook, steps=3):
    """Three iterations of torch DDP and minddp on the same batches; returns minddp's
    gradients of every iteration, flattened, on the CPU."""
    device = _device()
    _check_world(world_size, backend)
    model = IntegerNet().to(device)
    ref = TorchDDP(copy.deepcopy(model), device_ids=[device])
    ours = minddp.DDP(copy.deepcopy(model), device_ids=[device], algorithm=algorithm,
                      compression=compression)
    if hook is not None:
        for ddp in (ref, ours):
            ddp.register_comm_hook(None, getattr(default_hooks, hook))
    seen = []
    for step in range(steps):
        x, weights = _batch(rank, step, device)
        for ddp in (ref, ours):
            ddp.zero_grad()
            (ddp(x) * weights).sum().backward()
        largest = max(p.grad.abs().max().item() for p in ref.parameters())
        for (name, p_ref), p_ours in zip(ref.module.named_parameters(), ours.module.parameters()):
            assert p_ours.grad is not None and p_ours.grad.device == device, name
            where = f"step {step}, rank {rank}: grad of {name}"
            if compression is None:
                diff = (p_ours.grad - p_ref.grad).abs().max().item()
                assert torch.equal(p_ours.grad, p_ref.grad), f"{where}: max diff {diff}"
            else:
                torch.testing.assert_close(p_ours.grad, p_ref.grad, rtol=0,
                                           atol=TOLERANCE[compression] * largest, msg=where)
        seen += [p.grad.reshape(-1).cpu() for p in ours.module.parameters()]
    if compression == "int8" and world_size > 1:
        # error feedback's records are made on the pinned CPU copy gloo sends (staging)
        # and must come back to the bucket's device
        records = list(ours.reducer.reduction.collective.errors.values())
        assert records and all(r.device == device for r in records)
        assert any(r.abs().max() > 0 for r in records), "no rounding was recorded"
    return torch.cat(seen)


@pytest.mark.parametrize("algorithm, compression, hook", CONFIGS)
@pytest.mark.parametrize("world_size, backend", WORLDS)
def test_gradients_match_torch_ddp(world_size, backend, algorithm, compression, hook):
    grads = run_world(_parity, world_size, backend, algorithm, compression, hook,
                      timeout=180, backend=backend)
    for rank, mine in enumerate(grads[1:], start=1):
        assert torch.equal(mine, grads[0]), f"rank {rank}'s gradients differ from rank 0's"


# (algorithm, compression) for minddp.all_reduce on CUDA tensors.
# Every registered algorithm plain; every codec on the first of minddp's send/recv
# algorithms (they all stage through p2p.py) and on every other algorithm that can carry
# it, but auto (it runs one of the others).
_P2P = [a for a in registry.algorithm_names() if registry.algorithm(a).runs_on is p2p.runs_on]
ALL_REDUCES = ([(a, None) for a in registry.algorithm_names()] +
               [(a, c) for c in registry.codec_names() for a in registry.algorithm_names()
                if a == _P2P[0] or (a not in _P2P and registry.algorithm(a).bind is None and
                                    registry.algorithm(a).carries(registry.codec(c)) is None)])


def _all_reduces(rank, world_size, backend):
    """minddp.all_reduce of CUDA tensors: one of several segments, a small one
    and a strided view. Returns every result, on the CPU."""
    device = _device()
    _check_world(world_size, backend)
    sizes = [3 << 20, 7]  # 12 MiB: several 2 MiB segments per chunk

    def data(r, n, salt):
        g = torch.Generator().manual_seed(1000 * salt + r)
        return torch.randint(-100, 101, (n,), generator=g).float()

    results = []
    for salt, (algorithm, compression) in enumerate(ALL_REDUCES):
        what = f"rank {rank}: {algorithm}/{compression or 'fp32'}"
        for n in sizes:
            t = data(rank, n, salt).to(device)
            want = sum(data(r, n, salt) for r in range(world_size)).to(device)
            assert minddp.all_reduce(t, algorithm, compression=compression) is t
            _assert_sum(t, want, compression, f"{what}, {n} elements")
            results.append(t.cpu())
        if compression is None:
            base = data(rank, 64, salt).to(device).view(8, 8)
            strided = base.t()  # not contiguous: reduced through a copy
            want = sum(data(r, 64, salt) for r in range(world_size)).view(8, 8).t().to(device)
            minddp.all_reduce(strided, algorithm)
            _assert_sum(strided, want, None, f"{what}, strided view")
            results.append(strided.cpu())
    return results


def _assert_sum(got, want, compression, what):
    assert got.device == want.device, f"{what}: result on {got.device}"
    if compression is None:
        assert torch.equal(got, want), f"{what}: max diff {(got - want).abs().max().item()}"
    elif compression not in TOLERANCE:
        assert torch.isfinite(got).all(), f"{what}: not finite"
    else:
        largest = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE[compression] * largest,
                                   msg=what)


@pytest.mark.parametrize("world_size, backend", WORLDS)
def test_all_reduce_of_cuda_tensors(world_size, backend):
    results = run_world(_all_reduces, world_size, backend, timeout=180, backend=backend)
    for rank, mine in enumerate(results[1:], start=1):
        for k, (a, b) in enumerate(zip(mine, results[0])):
            assert torch.equal(a, b), f"rank {rank}'s result {k} differs from rank 0's"


def _steps_without_host_sync(rank, world_size, backend):
    """Default keywords, one NCCL rank: after two warm-up steps (the first one
    agrees on the model, picks algorithms, may plan), every step runs with
    torch's sync debug mode set to raise on anything that makes the host wait
    for the GPU. Returns how many steps ran so."""
    device = _device()
    ddp = minddp.DDP(IntegerNet().to(device), device_ids=[device])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    batches = [_batch(rank, step, device) for step in range(12)]
    steps = 0
    for step, (x, weights) in enumerate(batches):
        replicas = ddp.reducer.replicas  # None where there is nothing to compare
        checked = step >= 2 and not (replicas and replicas.due(ddp.reducer.forwards + 1))
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.zero_grad()
            (ddp(x) * weights).sum().backward()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        steps += checked
    return steps


def test_steady_state_steps_never_wait_for_the_gpu():
    # The replica check's step reads checksums back (1 in 100 steps by default),
    # which the loop above leaves unchecked.
    assert run_world(_steps_without_host_sync, 1, "nccl", timeout=180, backend="nccl") == [10]


def _engine_follows_the_submitter(rank, world_size, backend):
    """A ring sum of a CUDA tensor queued on the communication engine, between two long
    kernels on the submitting stream: it must read what the first one delayed, and be
    done while the second one still runs. Returns (sum right, done before the GPU)."""
    device = _device()
    engine = comm.engine_for(dist.group.WORLD, device=device)
    t = torch.zeros(1 << 20, device=device)
    # Once untimed: the first sum connects the ranks and pins its host buffers (an
    # allocation of pinned memory may wait for the whole device).
    engine.submit(ring.all_reduce, t, engine.group, label="test", device=device).wait()
    torch.cuda.synchronize()
    cycles = int(2e9)  # about a second at an H100's or H200's clock
    # The thread holds at a gate until the second kernel is queued, so that the sum's
    # copies are issued after it, as a bucket's are after later backward kernels.
    gate = threading.Event()
    engine.submit(gate.wait, 60, label="gate")
    torch.cuda._sleep(cycles // 4)
    t.fill_(rank + 1.0)  # a job that ran before this would sum zeros
    fut = engine.submit(ring.all_reduce, t, engine.group, label="test", device=device)
    torch.cuda._sleep(cycles)  # queued after the job: nothing it must wait for
    gate.set()
    deadline = time.monotonic() + 60
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert fut.done(), f"rank {rank}: the sum did not finish in 60 s"
    before_the_gpu = not torch.cuda.current_stream().query()
    fut.wait()
    right = bool((t == sum(r + 1.0 for r in range(world_size))).all().item())
    return right, before_the_gpu


def test_queued_jobs_wait_for_their_submission_only():
    # On the thread's default stream the staging copies would wait for the second
    # kernel (and everything backward queues after a bucket): no overlap at all.
    results = run_world(_engine_follows_the_submitter, 2, "gloo", timeout=120)
    assert results == [(True, True)] * 2, results
