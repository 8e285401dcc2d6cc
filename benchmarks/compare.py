"""minddp next to torch DDP, step by step on the same workloads: the main benchmark.

    torchrun --nproc_per_node=2 benchmarks/compare.py                  # quick default mix
    torchrun --nproc_per_node=2 benchmarks/compare.py --workloads mlp --steps 30
    torchrun --nproc_per_node=1 benchmarks/compare.py --workloads transformer   # wrapper overhead
    python benchmarks/compare.py --scaling      # 1, 2 and 4 ranks (see scaling.py)

Every configuration (rows below) wraps its own copy of the same model, and
they all run interleaved: step s of every configuration, in an order that
rotates, before step s+1 of any. A step is zero_grad, forward, loss, backward,
SGD step; its time is the slowest rank's. Figures are medians over the measured
steps; ratios and differences are medians of per-step pairs.

Columns: step ms, samples/s (all ranks), ratio to torch_ddp with a 95% interval
for it (distribution-free, from the per-step ratios, as benchmarks/collectives.py
explains: an interval that holds 1 means "not told apart from torch DDP in this
run"; blank with under 6 steps), ratio to no_comm
(with one rank: what the wrapper itself costs), exposed
communication (step - no_comm: what backward failed to hide), comm ms (the
same bucket reductions run alone), hidden share (1 - exposed / comm), with
--timeline the traced share (communication time inside backward spans), peak
memory (CPU: process peak RSS, shared by all rows; CUDA: max allocated during
the row's steps), bytes each rank sends per step (alpha-beta estimate).

Writes results/compare.json ({"rows": [...]}) and results/compare.png.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import minddp
from benchmarks.configs import (CONFIG_NAMES, CONFIGS, POWERSGD, build_configs, check_names,
                                how_to_build, load_plugins, split_name)
from benchmarks.measure import (Progress, format_interval, format_table, median,
                                pairwise_difference, pairwise_ratio, pairwise_ratio_interval,
                                peak_rss_mb, provenance, rotated, run_distributed,
                                slowest_rank, timed)
from benchmarks.plots import plot_compare
from benchmarks.workloads import WORKLOADS
from minddp import whatif
from minddp.timeline import hidden_share

COLUMNS = [("workload", "workload", "{}"), ("name", "config", "{}"),
           ("step_ms", "step ms", "{:.1f}"), ("samples_per_s", "samples/s", "{:.1f}"),
           ("ratio_to_torch_ddp", "vs torch_ddp", "{:.3f}"),
           ("torch_ddp_ci", "vs torch_ddp 95%", "{}"),
           ("ratio_to_no_comm", "vs no_comm", "{:.3f}"),
           ("exposed_comm_ms", "exposed ms", "{:.1f}"), ("comm_ms", "comm ms", "{:.1f}"),
           ("hidden_share", "hidden", "{:.0%}"), ("trace_hidden_share", "traced", "{:.0%}"),
           ("peak_mem_mb", "peak MB", "{:.0f}"),
           ("bytes_sent_mb", "sent MB/step", "{:.1f}"), ("absent", "absent", "{}")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="transformer,mlp,convnet",
                   help=f"comma-separated, from {sorted(WORKLOADS)}")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated rows to run (default: {','.join(CONFIG_NAMES)}, and "
                        f"a row for each algorithm or codec a --plugin registers; also: "
                        f"{','.join(n for n in CONFIGS if n not in CONFIG_NAMES)}, and "
                        f"minddp_<algorithm>[_<compression>] of any registered ones); "
                        f"NAME@CAP gives a row its own bucket_cap_mb (e.g. torch_ddp@4, "
                        f"minddp_auto@auto)")
    p.add_argument("--plugin", action="append", default=[], metavar="FILE",
                   help="a Python file that registers algorithms or codecs "
                        "(minddp.register_algorithm / register_codec), loaded on every rank; "
                        "repeatable, e.g. examples/algorithm_direct.py")
    p.add_argument("--steps", type=int, default=12, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default: workload's)")
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="gradient_as_bucket_view=True for torch's rows and minddp's: .grad is "
                        "the bucket slot, no copy into the bucket and back")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default="results", help="folder for compare.json and compare.png")
    p.add_argument("--scaling", action="store_true",
                   help="run with plain python: world sizes 1, 2, 4 via scaling.py")
    p.add_argument("--timeline", action="store_true",
                   help="record Chrome traces of the minddp rows (results/trace.*.json), with "
                        "the link figures python -m minddp.diagnose --what-if needs (a few "
                        "seconds per row, after its steps), and report the overlap they show")
    return p.parse_args(argv)


def train_step(config, workload, inputs, target):
    config.optimizer.zero_grad(set_to_none=False)
    workload.loss(config.model(*inputs), target).backward()
    config.optimizer.step()


def run_workload(workload, args, rank, world_size, device, names):
    batch_size = args.batch_size or workload.batch_size
    trace = os.path.join(args.out, "trace") if args.timeline else None
    configs = build_configs(workload, names, device, args.bucket_cap_mb, trace,
                            args.gradient_as_bucket_view)
    live = [c for c in configs if c.absent is None]
    steps, comm = {c.name: [] for c in live}, {c.name: [] for c in live}
    mem = {c.name: 0.0 for c in live}
    bar = Progress((args.warmup + args.steps) * len(live), f"{workload.name:<11}", rank == 0)
    for step in range(args.warmup + args.steps):
        inputs, target = workload.batch(rank, step, batch_size)
        inputs = tuple(t.to(device) for t in inputs)
        target = target.to(device)
        for config in rotated(live, step):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ms = timed(lambda: train_step(config, workload, inputs, target), device)
            comm_ms = timed(config.communicate, device) if config.communicate else None
            if step >= args.warmup:
                steps[config.name].append(ms)
                if comm_ms is not None:
                    comm[config.name].append(comm_ms)
                if device.type == "cuda":
                    mem[config.name] = max(mem[config.name],
                                           torch.cuda.max_memory_allocated(device) / 2**20)
            bar.step(config.name)
    steps = {name: slowest_rank(times) for name, times in steps.items()}
    comm = {name: slowest_rank(times) if times else [] for name, times in comm.items()}
    rows = []
    for config in configs:
        row = {"workload": workload.name, "name": config.name, "world_size": world_size,
               "batch_size": batch_size, "device": device.type, "absent": config.absent}
        if config.absent is None:
            row.update(summarise(config, steps, comm, world_size * batch_size, device))
            row["peak_mem_mb"] = mem[config.name] if device.type == "cuda" else peak_rss_mb()
            row.update(trace_figures(config, args.warmup, row["step_ms"]))
        rows.append(row)
    return rows


def trace_figures(config, warmup, step_ms):
    """Write the row's trace (if recording), with the link figures and step time
    `python -m minddp.diagnose --what-if` predicts from (whatif.annotate, a
    collective: every rank comes here for the same rows), and read the overlap
    back from it, skipping the warm-up steps."""
    timeline = getattr(config.model, "timeline", None)
    if timeline is None:
        return {}
    whatif.annotate(config.model, step_ms)
    backward = sorted(e["ts"] for e in timeline.events if e["name"] == "backward")
    since = backward[warmup] if len(backward) > warmup else 0.0
    measured = [e for e in timeline.events if e["ts"] >= since]
    return {"trace": timeline.save(), "trace_hidden_share": hidden_share(measured)}


def summarise(config, steps, comm, samples, device):
    mine = steps[config.name]
    row = {"step_ms": median(mine), "samples_per_s": samples / median(mine) * 1e3,
           "steps_ms": mine,
           "bytes_sent_mb": config.sent_mb()}
    if "torch_ddp" in steps:
        row["ratio_to_torch_ddp"] = pairwise_ratio(mine, steps["torch_ddp"])
        row["ratio_to_torch_ddp_ci"] = pairwise_ratio_interval(mine, steps["torch_ddp"])
    if "no_comm" in steps and config.name != "no_comm":
        row["ratio_to_no_comm"] = pairwise_ratio(mine, steps["no_comm"])
        exposed = pairwise_difference(mine, steps["no_comm"])
        row["exposed_comm_ms"] = exposed
        if comm.get(config.name):
            row["comm_ms"] = median(comm[config.name])
            row["hidden_share"] = min(1.0, max(0.0, 1 - exposed / row["comm_ms"]))
    return row


def run(args, rank, world_size, device):
    """Run the selected workloads in the current process group; rank 0 writes the
    results and returns the rows (the other ranks return them too, unwritten)."""
    added = load_plugins(args.plugin)
    configs = args.configs if args.configs is not None else ",".join(CONFIG_NAMES + added)
    names = [n.strip() for n in configs.split(",") if n.strip()]
    check_names(names)
    lossy = [n for n in names if isinstance(how_to_build(split_name(n)[0])[-1], minddp.PowerSGD)]
    if lossy and args.warmup < POWERSGD.warmup_steps:
        args.warmup = POWERSGD.warmup_steps  # measure PowerSGD compressing, not warming up
        if rank == 0:
            print(f"compare.py: --warmup raised to {args.warmup}: {', '.join(lossy)} run "
                  f"full precision for their first {POWERSGD.warmup_steps} steps", flush=True)
    workloads = args.workloads.split(",")
    for name in workloads:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    if rank == 0:
        print(f"compare.py: world size {world_size}, device {device}, backend "
              f"{dist.get_backend()}, {torch.get_num_threads()} threads per rank, "
              f"{args.warmup} warm-up + {args.steps} measured steps, interleaved; "
              f"torch {torch.__version__}", flush=True)
    rows = []
    for name in workloads:
        rows += run_workload(WORKLOADS[name], args, rank, world_size, device, names)
    if rank == 0:
        shown = [dict(r, torch_ddp_ci=format_interval(r.get("ratio_to_torch_ddp_ci")))
                 for r in rows]
        print(format_table(shown, COLUMNS))
        os.makedirs(args.out, exist_ok=True)
        meta = dict(provenance(), world_size=world_size, device=str(device),
                    backend=dist.get_backend(), steps=args.steps, warmup=args.warmup)
        with open(os.path.join(args.out, "compare.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        png = plot_compare(rows, os.path.join(args.out, "compare.png"))
        print(f"wrote {args.out}/compare.json and {png}")
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--scaling" in argv:  # several worlds: scaling.py starts torchrun for each
        from benchmarks import scaling
        return scaling.main([a for a in argv if a != "--scaling"])
    run_distributed(run, parse_args(argv))


if __name__ == "__main__":
    main()
