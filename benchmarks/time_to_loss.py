"""Time to a target loss: torch DDP and minddp configurations training a real task.

    torchrun --nproc_per_node=2 benchmarks/time_to_loss.py                     # a few minutes
    torchrun --nproc_per_node=2 benchmarks/time_to_loss.py --workload charlm --steps 400
    sudo SCRIPT=benchmarks/time_to_loss.py benchmarks/multinode.sh 2 1gbit --steps 200

Every configuration trains its own copy of the same model (charlm.py: next-byte prediction
on the standard library's sources; --workload charmlp, an MLP whose step over a slow link is
mostly communication, or charlm, a transformer whose step is mostly compute) on the same
batches with AdamW. They run interleaved, one
step of each in rotating order, so a slow moment of the machine hits all of them; a
configuration's wall time is the sum of its own steps (the slowest rank's time of each),
validation excluded. Before the first step and every --eval-every steps each model is scored
on the same held-out windows.

Reported per configuration: validation loss after the last step and its ratio to torch DDP's,
wall time until validation loss first reached the target (interpolated linearly between
evaluations) and its ratio to torch DDP's, start-up (what the steps before the first
evaluation took beyond as many median steps: auto's timings and the bucket plan, paid once, so
a longer run dilutes them), median step time and bytes each rank sends per step
(once compression runs, after any warm-up). The target defaults to torch DDP's final loss plus
1%: "as good as torch DDP", which a configuration that loses accuracy may never reach. Writes
results/time_to_loss.json and results/time_to_loss.png (loss against wall time).
"""
import argparse
import json
import math
import os

import torch
import torch.distributed as dist

from benchmarks import charlm
from benchmarks.configs import CONFIGS, build_configs, check_names
from benchmarks.measure import (Progress, format_table, median, provenance, rotated,
                                run_distributed, slowest_rank, timed)
from benchmarks.plots import plot_loss_against_time
from benchmarks.workloads import WORKLOADS

VALIDATION = {"charlm": charlm.validation, "charmlp": charlm.mlp_validation}

# The default target: torch DDP's final validation loss, plus this much. A configuration that
# trains as well as torch DDP reaches it just before the end; one that trains worse may not.
TARGET_SLACK = 0.01
DEFAULT_CONFIGS = ("torch_ddp,torch_ddp_fp16,minddp_auto@auto,minddp_ring_int8@auto,"
                   "minddp_auto_int8@auto,minddp_compression_auto@auto,minddp_auto_powersgd@auto")
COLUMNS = [("name", "config", "{}"), ("final_loss", "final loss", "{:.4f}"),
           ("loss_vs_torch", "loss / torch", "{:.4f}"),
           ("time_to_target_s", "to target s", "{:.1f}"),
           ("time_vs_torch", "time / torch", "{:.3f}"),
           ("startup_s", "start-up s", "{:.1f}"), ("step_ms", "step ms", "{:.1f}"),
           ("bytes_sent_mb", "sent MB/step", "{:.2f}")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=sorted(VALIDATION), default="charmlp",
                   help="charmlp: little compute per gradient byte; charlm: a transformer")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated, from {list(CONFIGS)} (no_comm has no gradient sync)")
    p.add_argument("--steps", type=int, default=120, help="training steps per configuration")
    p.add_argument("--eval-every", type=int, default=10, help="steps between validations")
    p.add_argument("--val-batches", type=int, default=8,
                   help="held-out batches each validation scores (the same on every rank)")
    p.add_argument("--target", type=float, default=None,
                   help="validation loss to reach (default: torch DDP's final loss plus "
                        f"{TARGET_SLACK * 100:g}%%; without a torch_ddp row, the highest of the "
                        "configurations' best, which all of them reach)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW, linear warm-up of 20 steps")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per rank (default: the workload's, charmlp 128, charlm 16)")
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default="results")
    return p.parse_args(argv)


def _adamw(lr):
    def make(params):
        # fused: one kernel for all parameters; the default per-parameter loop costs
        # CharMLP 48 ms a step on one CPU thread (fused: 7 ms), the same for every row.
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True)
        optimizer.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / 20))
        return optimizer
    return make


@torch.no_grad()
def _evaluate(model, held_out, device):
    model = getattr(model, "module", model)  # the bare model: no wrapper work in evaluation
    model.eval()
    losses = [charlm.loss(model(*(t.to(device) for t in inputs)), labels.to(device)).item()
              for inputs, labels in held_out]
    model.train()
    return sum(losses) / len(losses)


def _train_step(config, workload, inputs, target):
    config.optimizer.zero_grad(set_to_none=True)
    workload.loss(config.model(*inputs), target).backward()
    config.optimizer.step()
    config.optimizer.scheduler.step()


def _time_to(curve, target):
    """Wall seconds when validation loss first reached `target`, interpolated between the
    evaluations around it; None if it never did."""
    for (_, t0, l0), (_, t1, l1) in zip(curve, curve[1:]):
        if l0 <= target:  # reached already (a target above the first evaluation's loss)
            return t0
        if l1 <= target:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)  # l0 > target >= l1
    return None


def run(args, rank, world_size, device):
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    check_names(names)
    workload = WORKLOADS[args.workload]
    batch_size = args.batch_size or workload.batch_size
    _, where = charlm.stdlib_text()
    if rank == 0:
        print(f"time_to_loss.py: {world_size} ranks, {device}, {dist.get_backend()}; "
              f"{args.workload} on {where}; {args.steps} steps of {batch_size} windows per "
              f"rank, interleaved; torch {torch.__version__}", flush=True)
    configs = [c for c in build_configs(workload, names, device, args.bucket_cap_mb,
                                        optimizer=_adamw(args.lr)) if c.absent is None]
    held_out = VALIDATION[args.workload](args.val_batches)
    times = {c.name: [] for c in configs}  # ms per step
    curves = {c.name: [] for c in configs}  # (step, wall seconds so far, validation loss)
    for config in configs:
        curves[config.name].append((0, 0.0, _evaluate(config.model, held_out, device)))
    bar = Progress(args.steps * len(configs), args.workload, rank == 0)
    for step in range(args.steps):
        inputs, target = workload.batch(rank, step, batch_size)
        inputs, target = tuple(t.to(device) for t in inputs), target.to(device)
        for config in rotated(configs, step):
            times[config.name].append(timed(lambda: _train_step(config, workload, inputs,
                                                                target), device))
            bar.step(config.name)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            for config in configs:
                elapsed = sum(slowest_rank(times[config.name])) / 1e3
                curves[config.name].append((step + 1, elapsed,
                                            _evaluate(config.model, held_out, device)))
    times = {name: slowest_rank(t) for name, t in times.items()}
    if rank != 0:
        return None
    rows = summarise(configs, times, curves, args.target, world_size)
    print(format_table(rows, COLUMNS))
    os.makedirs(args.out, exist_ok=True)
    meta = dict(provenance(), world_size=world_size, device=str(device),
                backend=dist.get_backend(), steps=args.steps, text=where,
                workload=args.workload, batch_size=batch_size,
                target=rows[0]["target"] if rows else None,
                target_rule=rows[0]["target_rule"] if rows else None)
    with open(os.path.join(args.out, "time_to_loss.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    png = plot_loss_against_time(rows, os.path.join(args.out, "time_to_loss.png"))
    print(f"target loss {meta['target']:.4f}; wrote {args.out}/time_to_loss.json and {png}")
    return rows


def startup_seconds(curve, step_ms):
    """One-time costs (auto's timings, the bucket plan) land in the first steps: what the
    steps up to the first evaluation took beyond as many median steps."""
    if len(curve) < 2:
        return None
    steps, seconds, _ = curve[1]
    return seconds - steps * step_ms / 1e3


def _target(curves, given):
    """(the loss to reach, how it was chosen)."""
    if given is not None:
        return given, "given with --target"
    if "torch_ddp" in curves:
        return (curves["torch_ddp"][-1][2] * (1 + TARGET_SLACK),
                f"torch DDP's final loss + {TARGET_SLACK:.0%}")
    return (max(min(loss for _, _, loss in curve) for curve in curves.values()),
            "the highest of the configurations' best")


def summarise(configs, times, curves, target, world_size):
    baseline = curves.get("torch_ddp")
    target, rule = _target(curves, target)
    torch_time = _time_to(baseline, target) if baseline else None
    rows = []
    for config in configs:
        curve = curves[config.name]
        reached = _time_to(curve, target)
        final = curve[-1][2]
        row = {"name": config.name, "target": target, "target_rule": rule, "curve": curve,
               "startup_s": startup_seconds(curve, median(times[config.name])),
               "final_loss": final,
               "time_to_target_s": reached, "step_ms": median(times[config.name]),
               "wall_s": sum(times[config.name]) / 1e3,
               "bytes_sent_mb": config.sent_mb(), "world_size": world_size}
        if baseline:
            row["loss_vs_torch"] = final / baseline[-1][2]
            if reached is not None and torch_time:
                row["time_vs_torch"] = reached / torch_time
        if not math.isfinite(final):
            row["note"] = "diverged"
        rows.append(row)
    return rows


def main(argv=None):
    run_distributed(run, parse_args(argv))


if __name__ == "__main__":
    main()
