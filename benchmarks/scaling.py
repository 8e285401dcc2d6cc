"""Scaling: throughput and efficiency of torch DDP and minddp at 1, 2 and 4 ranks.

    python benchmarks/scaling.py                      # or: python benchmarks/compare.py --scaling
    python benchmarks/scaling.py --worlds 1,2 --workloads mlp --steps 8

Runs `torchrun --nproc_per_node=N benchmarks/compare.py` once per world size
(plain python here, not under torchrun) and reads back its JSON. Throughput is
samples per second over all ranks; scaling efficiency is
throughput_N / (N x throughput_1), the course's DP-vs-DDP table. More ranks
than CPU cores share the cores (the output says so): efficiency then measures
the machine as much as the library. Writes results/scaling.json and .png.
"""
import argparse
import json
import os
import subprocess
import sys

from benchmarks.measure import format_table, provenance
from benchmarks.plots import plot_scaling

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIGS = "no_comm,torch_ddp,minddp_native,minddp_auto"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--workloads", default="transformer")
    p.add_argument("--configs", default=CONFIGS)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="results")
    return p.parse_args(argv)


def run_world(n, args):
    out = os.path.join(args.out, "scaling", f"world{n}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={n}", os.path.join(HERE, "compare.py"),
           "--workloads", args.workloads, "--configs", args.configs, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--out", out]
    print(f"scaling: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "compare.json")) as f:
        return json.load(f)["rows"]


def efficiency_rows(by_world):
    base = {(r["workload"], r["name"]): r for r in by_world[min(by_world)]}
    rows = []
    for n, measured in sorted(by_world.items()):
        for r in measured:
            if r.get("samples_per_s") is None or r["name"] == "no_comm":
                continue
            one = base[(r["workload"], r["name"])]["samples_per_s"]
            rows.append({"workload": r["workload"], "name": r["name"], "world_size": n,
                         "step_ms": r["step_ms"], "samples_per_s": r["samples_per_s"],
                         "efficiency": r["samples_per_s"] / (n / min(by_world) * one)})
    return rows


def main(argv=None):
    args = parse_args(argv)
    worlds = [int(n) for n in args.worlds.split(",")]
    cores = os.cpu_count() or 1
    by_world = {n: run_world(n, args) for n in worlds}
    rows = efficiency_rows(by_world)
    print(f"\nscaling on {cores} CPU cores"
          + (f"; worlds above {cores} ranks are oversubscribed (ranks share cores)"
             if max(worlds) > cores else ""))
    print(format_table(rows, [("workload", "workload", "{}"), ("name", "config", "{}"),
                              ("world_size", "ranks", "{}"), ("step_ms", "step ms", "{:.1f}"),
                              ("samples_per_s", "samples/s", "{:.1f}"),
                              ("efficiency", "efficiency", "{:.0%}")]))
    with open(os.path.join(args.out, "scaling.json"), "w") as f:
        json.dump({"meta": provenance(), "cores": cores, "rows": rows}, f, indent=1)
    plot_scaling(rows, os.path.join(args.out, "scaling.png"))
    print(f"wrote {args.out}/scaling.json and {args.out}/scaling.png")


if __name__ == "__main__":
    main()
