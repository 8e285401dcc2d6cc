"""Where a short step's wrapper time goes: minddp's pieces next to torch DDP's step.

    torchrun --nproc_per_node=1 benchmarks/overhead.py                # narrow, 300 steps
    torchrun --nproc_per_node=2 benchmarks/overhead.py --out results/overhead-2

Rows, run interleaved step by step (a step: zero_grad, forward, loss,
backward; no optimizer, so the wrapper's share shows), each on its own copy of
the model:

    bare               the module alone: the floor
    torch_ddp          torch's DDP; torch_ddp_batched with batched_grad_copy=True
                       (where this torch has it)
    torch_ddp_no_sync  torch's DDP under no_sync(): its forward and hooks, nothing reduced
    minddp_no_sync     the same for minddp
    minddp             minddp, --algorithm (default native)
    minddp_timed       minddp again, its reducer's methods wrapped in timers

From minddp_timed, the microseconds per step spent inside each piece that
this version of the reducer has (a piece includes the ones it calls; the
timers add about a microsecond per call, and Python hooks are called once per
parameter, so read these as shares, the untimed rows as the step):

    on_gradient   the Python gradient hook (every gradient with Python hooks,
                  the first of a backward with the C++ ones)
    _bucket_full  a full bucket, called from the C++ hooks: copy in and launch
    _fill         copying a bucket's gradients in and dividing them
    launch        handing a bucket to its reduction
    _finalize     the end of backward: waiting for every bucket, the checks,
                  writing .grad
    _write_back   inside it: waiting and writing .grad

Prints the step of every row (median, ratio to torch_ddp with a 95%
interval) and the pieces; writes OUT/overhead.json.
"""
import argparse
import contextlib
import copy
import inspect
import json
import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from benchmarks.measure import (format_interval, format_table, median, pairwise_ratio,
                                pairwise_ratio_interval, provenance, run_distributed, slowest_rank,
                                timed)
from benchmarks.workloads import WORKLOADS

PIECES = ["on_gradient", "_bucket_full", "_fill", "launch", "_finalize", "_write_back"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="narrow", choices=sorted(WORKLOADS))
    p.add_argument("--algorithm", default="native")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default="results")
    return p.parse_args(argv)


def _timers(ddp, spent):
    """Wrap the reducer's (and its reduction's) pieces that exist in this version."""
    reducer = ddp.reducer
    for owner in (reducer, reducer.reduction):
        for name in PIECES:
            method = getattr(owner, name, None)
            if method is None or name in spent:
                continue
            spent[name] = 0.0

            def timed(*args, _method=method, _name=name, **kwargs):
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    spent[_name] += time.perf_counter() - start
            setattr(owner, name, timed)


def run(args, rank, world_size, device):
    workload = WORKLOADS[args.workload]
    torch.manual_seed(0)
    base = workload.build().to(device)
    ids = [device] if device.type == "cuda" else None
    rows = {"bare": copy.deepcopy(base),
            "torch_ddp": TorchDDP(copy.deepcopy(base), device_ids=ids),
            "torch_ddp_no_sync": TorchDDP(copy.deepcopy(base), device_ids=ids),
            "minddp_no_sync": minddp.DDP(copy.deepcopy(base), device_ids=ids,
                                         algorithm=args.algorithm),
            "minddp": minddp.DDP(copy.deepcopy(base), device_ids=ids, algorithm=args.algorithm),
            "minddp_timed": minddp.DDP(copy.deepcopy(base), device_ids=ids,
                                       algorithm=args.algorithm)}
    if "batched_grad_copy" in inspect.signature(TorchDDP).parameters:  # newer torch only
        rows["torch_ddp_batched"] = TorchDDP(copy.deepcopy(base), device_ids=ids,
                                             batched_grad_copy=True)
    spent, per_step = {}, []
    _timers(rows["minddp_timed"], spent)
    times = {name: [] for name in rows}

    def step(name, model, s):
        inputs, target = workload.batch(rank, s, workload.batch_size)
        inputs = [t.to(device) for t in inputs]
        model.zero_grad()
        quiet = model.no_sync() if name.endswith("no_sync") else contextlib.nullcontext()
        with quiet:
            workload.loss(model(*inputs), target.to(device)).backward()

    names = list(rows)
    for s in range(args.warmup + args.steps):
        for k in range(len(names)):  # a rotating order, so no row always follows another
            name = names[(s + k) % len(names)]
            before = dict(spent)
            # Every rank starts together: a rank that ran ahead in the row before
            # (no_sync rows do not meet) would otherwise wait inside this row's step.
            elapsed = timed(lambda: step(name, rows[name], s), device)
            if s >= args.warmup:
                times[name].append(elapsed)
                if name == "minddp_timed":
                    per_step.append({p: (spent[p] - before[p]) * 1e6 for p in spent})
    times = {name: slowest_rank(t) for name, t in times.items()}
    if rank != 0:
        return
    table = []
    for name in names:
        table.append({"name": name, "step_ms": median(times[name]),
                      "ratio": pairwise_ratio(times[name], times["torch_ddp"]),
                      "ci": format_interval(pairwise_ratio_interval(times[name],
                                                                    times["torch_ddp"]), 3)})
    pieces = {p: median([step[p] for step in per_step]) for p in spent}
    hooks = type(getattr(rows["minddp"].reducer, "readiness", None)).__name__
    print(f"{args.workload}, {world_size} rank(s), {args.steps} steps, minddp "
          f"algorithm={args.algorithm}, gradient hooks: {hooks}")
    print(format_table(table, [("name", "row", "{}"), ("step_ms", "step ms", "{:.3f}"),
                               ("ratio", "vs torch_ddp", "{:.3f}"),
                               ("ci", "95%", "{}")]))
    print("\nminddp_timed, microseconds per step (median) inside:")
    for p, us in pieces.items():
        print(f"  {p:13s} {us:9.1f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "overhead.json")
    with open(path, "w") as f:
        json.dump({"rows": table, "pieces_us": pieces, "world_size": world_size, "hooks": hooks,
                   "workload": args.workload, "algorithm": args.algorithm,
                   "steps": args.steps, "provenance": provenance()}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    run_distributed(run, parse_args())
