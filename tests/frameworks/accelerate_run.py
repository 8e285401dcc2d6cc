"""One rank of the Accelerate parity run (tests/test_frameworks.py launches it).

    accelerate launch --num_processes 2 --cpu tests/frameworks/accelerate_run.py OUT_DIR

Trains the same model twice in one launched world, same seeds and data: first
as stock Accelerate does (torch's DDP), then after the documented one line,
`minddp.replace_torch_ddp(...)`, with minddp's wrapper. Each run goes through
`accumulate` (no_sync) with the fp16 comm hook from DistributedDataParallelKwargs,
`clip_grad_norm_`, `unwrap_model`, `save_state` / `load_state`, and
`no_sync` + `trigger_sync_in_backward`. Saves OUT_DIR/rank<r>.pt for the test.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, set_seed

import minddp

OUT = sys.argv[1]


def make_model():
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def loader():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    return DataLoader(data, batch_size=4)  # per rank after prepare: 8 batches


def fresh_accelerator(**kwargs):
    # Accelerate keeps its state in process-wide singletons; a second Accelerator in one
    # process (the minddp run after the stock one) starts from a clean slate.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(label):
    out = {}
    set_seed(0)
    bare = make_model()
    hook = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    acc = fresh_accelerator(gradient_accumulation_steps=2, kwargs_handlers=[hook])
    model, opt, data = acc.prepare(bare, torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9),
                                   loader())
    out["wrapper"] = f"{type(model).__module__}.{type(model).__name__}"
    out["unwrapped_is_bare"] = acc.unwrap_model(model) is bare
    losses, norms = [], []
    for x, y in data:  # accumulate: every other backward runs under no_sync
        with acc.accumulate(model):
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), 0.5).detach().clone())
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach().clone())
    out["accumulate"] = {"params": params(bare), "losses": torch.stack(losses),
                         "norms": torch.stack(norms),
                         "buffers": {n: b.clone() for n, b in bare.named_buffers()}}

    state_dir = os.path.join(OUT, f"{label}_state")
    acc.save_state(state_dir)
    saved = params(bare)
    for x, y in data:  # train on, then come back to the saved state
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    acc.load_state(state_dir)
    out["load_state_restores"] = all(torch.equal(saved[n], p) for n, p in bare.named_parameters())
    for x, y in data:  # resumed training: the optimizer's momentum came back too
        acc.backward(F.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    out["resumed"] = {"params": params(bare)}

    # Two forwards under no_sync, the second backward forced to synchronise.
    batches = iter(data)
    for _ in range(3):
        (xa, ya), (xb, yb) = next(batches), next(batches)
        with acc.no_sync(model):
            loss_a = F.mse_loss(model(xa), ya)
            loss_b = F.mse_loss(model(xb), yb)
        acc.backward(loss_a)
        with acc.trigger_sync_in_backward(model):
            acc.backward(loss_b)
        opt.step()
        opt.zero_grad()
    out["trigger_sync"] = {"params": params(bare)}
    acc.wait_for_everyone()
    return out


def prewrapped():
    """Without the one line, a model the user wrapped in minddp's DDP first: Accelerate
    wraps it again in torch's (it would do the same to torch's DDP), and minddp must refuse
    with an error naming the fix."""
    set_seed(0)
    bare = make_model()
    acc = fresh_accelerator(gradient_accumulation_steps=2)
    try:
        model = acc.prepare(minddp.DDP(bare, algorithm="ring"))
        opt = acc.prepare(torch.optim.SGD(bare.parameters(), lr=0.1))
        for x, y in acc.prepare(loader()):
            with acc.accumulate(model):
                acc.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


results = {"stock": run("stock"), "prewrapped": prewrapped()}
minddp.replace_torch_ddp(algorithm="ring")  # the one line (ring: no start-up timing in tests)
results["minddp"] = run("minddp")
torch.save(results, os.path.join(OUT, f"rank{torch.distributed.get_rank()}.pt"))
