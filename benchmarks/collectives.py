"""All-reduce time vs message size: minddp's ring / tree / halving-doubling / auto vs the backend.

    torchrun --standalone --nproc_per_node=2 benchmarks/collectives.py [--model] \
        [--compression fp16] [--plugin examples/algorithm_direct.py]
    (or: python -m torch.distributed.run ... with the same arguments)

For each size (4 B .. 64 MiB of float32) every algorithm runs interleaved,
repetition by repetition (in a fresh random order each time), after a barrier; a
repetition's time is the slowest rank's. Reported: median time, algbw =
bytes / time and busbw = algbw * 2(p-1)/p (nccl-tests' definitions), and the
median over repetitions of time / native time (fair on a noisy machine) with a
95% interval for it (distribution-free; if repetitions were independent, the
true median would lie outside it in at most 5% of runs: an interval that
excludes 1 is a difference, not noise; busy spells make it optimistic), and
likewise (with its interval) time / the time of the fastest algorithm (by
median) at that size.
`--algorithms ... native_again` adds the backend's all-reduce a second time:
its /native ratio is the machine's noise floor for these ratios.
`--model` adds the alpha-beta cost model's prediction (costs measured at
start-up, as `algorithm="auto"` does) and its relative error. `--cpu` adds the
CPU time one call costs each rank, per thread (our Python thread, gloo's event
loop, gloo's workers; median over repetitions, mean over ranks): on a machine
with fewer cores than the ranks' busy threads, that is what a call competes
for. Writes
results/collectives_p{N}.json and .png; progress goes to stderr.
"""
import argparse
import functools
import json
import os
import random
import time

import torch
import torch.distributed as dist

from benchmarks.measure import (Progress, format_interval, format_table, human_bytes,
                                init_distributed, median, pairwise_ratio,
                                pairwise_ratio_interval, provenance, slowest_rank, sync,
                                thread_cpu_ns)
from benchmarks.plots import plot_collectives
from minddp import compression, registry
from minddp.algorithms import auto, cost_model

SIZES = [4, 64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20,
         16 << 20, 25 << 20, 64 << 20]
# The baseline first, then every registered algorithm (plugins' too: --plugin).
BASELINE = "native"
# Not run by default: the backend's all-reduce once more, as if another
# algorithm. Its /native ratio is how far two identical operations drift apart
# on this machine at that size: the noise floor the other ratios sit on.
NOISE_FLOOR = "native_again"
# --cpu groups threads by name into these kinds (the rest: "other").
THREAD_KINDS = {"main": "main", "gloo_tcp_loop": "gloo loop", "pt_gloo_runloop": "gloo workers"}


def parse_args(argv=None):
    # --plugin first: what it registers becomes a choice of --algorithms and --compression.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugin", action="append", default=[])
    for path in pre.parse_known_args(argv)[0].plugin:
        registry.load(path)
    names = algorithm_names()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE",
                        help="a Python file registering algorithms or codecs, loaded on every "
                             "rank (repeatable)")
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message bytes")
    parser.add_argument("--algorithms", nargs="+", default=names,
                        choices=names + [NOISE_FLOOR])
    parser.add_argument("--budget", type=float, default=1.0,
                        help="scales the repetitions (1.0: about a minute on 2 idle ranks)")
    parser.add_argument("--model", action="store_true",
                        help="print the alpha-beta prediction and its relative error")
    parser.add_argument("--cpu", action="store_true",
                        help="print the CPU time per call of each thread kind (Linux)")
    parser.add_argument("--compression", nargs="+", default=[], choices=registry.codec_names(),
                        help="also run each algorithm (but auto) with these codecs, as "
                             "'ring+fp16' etc.")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default="results")
    return parser.parse_args(argv)


def algorithm_names():
    """The rows' algorithms: the baseline first, then every other registered one."""
    return [BASELINE] + [n for n in registry.algorithm_names() if n != BASELINE]


def repetitions(nbytes, budget):
    # Many for small messages (cheap, noisy), at least 20 for the largest.
    return max(20, int(budget * 200 * (1 << 20) / max(nbytes, 1 << 20)))


def variants(args):
    """Every name to run: the algorithms, then each with each codec ("ring+fp16")."""
    # Where the algorithm can carry the codec (int8 needs fp32 sums at every hop: the
    # backend's all-reduce cannot take it); not auto's kind, which picks among these.
    return args.algorithms + [f"{a}+{c}" for c in args.compression for a in args.algorithms
                              if a != NOISE_FLOOR and registry.algorithm(a).bind is None and
                              registry.algorithm(a).carries(registry.codec(c)) is None]


def make_runners(names, group, chooser):
    """name -> fn(tensor): a blocking in-place all-reduce."""
    runners = {}
    for name in names:
        if "+" in name:
            algorithm, codec = name.split("+")
            runners[name] = functools.partial(compression.all_reduce, algorithm=algorithm,
                                              group=group, compression=codec)
        elif name == NOISE_FLOOR:
            runners[name] = lambda t: dist.all_reduce(t, group=group)
        elif registry.algorithm(name).bind is auto.bind:  # this run's chooser: rows show picks
            runners[name] = lambda t: registry.algorithm(chooser.pick(t)).all_reduce(t, group)
        else:
            entry = registry.algorithm(name)
            runners[name] = lambda t, entry=entry: entry.all_reduce(t, group)
    return runners


def measure_size(nbytes, runners, reps, device, cpu=False):
    """Per algorithm, the slowest rank's seconds per repetition (interleaved), and
    with `cpu` {thread kind: this rank's CPU seconds} per repetition (else None)."""
    tensor = torch.zeros(max(1, nbytes // 4), device=device)  # zeros: sums never overflow
    names = list(runners)
    for _ in range(3):  # warm-up: connections, scratch buffers, caches
        for name in names:
            runners[name](tensor)
    times = {name: [] for name in names}
    cpu_used = {name: [] for name in names} if cpu else None
    for rep in range(reps):
        # A fresh order each repetition (the same on every rank): no algorithm
        # always runs right after the same other one.
        for name in random.Random(rep).sample(names, len(names)):
            dist.barrier()
            sync(device)
            before = thread_cpu_ns() if cpu else None
            mine = time.thread_time_ns()
            start = time.perf_counter()
            runners[name](tensor)
            sync(device)
            times[name].append(time.perf_counter() - start)
            if cpu:
                mine = time.thread_time_ns() - mine
                after = thread_cpu_ns()
                used = {kind: (ns - before.get(kind, 0)) * 1e-9 for kind, ns in after.items()}
                cpu_used[name].append(dict(used, main=mine * 1e-9))
    return {name: slowest_rank(t) for name, t in times.items()}, cpu_used


def relative_error(runner, nbytes, device):
    """|result - exact sum| / |exact sum| for one call on random data (a collective): what a
    codec costs in accuracy; float32 rounding alone for the uncompressed algorithms."""
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(max(1, nbytes // 4), generator=g).to(device)
    every = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(every, x)
    exact = torch.stack(every).double().sum(0)
    runner(x)  # in place
    return float((x.double() - exact).norm() / exact.norm().clamp_min(1e-300))


def cpu_per_call(samples):
    """{thread kind: seconds}, the median per kind over repetitions, then the mean
    over ranks (a collective); "all" is the median of the per-repetition sums."""
    kinds = {THREAD_KINDS.get(name, "other") for sample in samples for name in sample}
    mine = {kind: median([sum(s for name, s in sample.items()
                              if THREAD_KINDS.get(name, "other") == kind) for sample in samples])
            for kind in kinds}
    mine["all"] = median([sum(sample.values()) for sample in samples])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {kind: sum(r.get(kind, 0.0) for r in every) / len(every)
            for kind in dict.fromkeys(k for r in every for k in r)}


def run(args, rank, world, device):
    group = dist.group.WORLD
    costs = cost_model.measure(group)
    chooser = auto.Chooser(group, costs=costs)
    names = variants(args)
    runners = make_runners(names, group, chooser)
    progress = Progress(len(args.sizes), f"collectives p={world}", enabled=rank == 0)
    rows = []
    for nbytes in args.sizes:
        reps = repetitions(nbytes, args.budget)
        times, cpu_used = measure_size(nbytes, runners, reps, device, args.cpu)
        for name in names:
            seconds = median(times[name])
            row = {"algorithm": name, "bytes": nbytes, "world_size": world, "reps": reps,
                   "time_us": seconds * 1e6, "algbw_gbs": nbytes / seconds / 1e9,
                   "busbw_gbs": nbytes / seconds / 1e9 * 2 * (world - 1) / world,
                   "ratio_to_native": (pairwise_ratio(times[name], times["native"])
                                       if "native" in times else None),
                   "ratio_to_native_ci": (pairwise_ratio_interval(times[name], times["native"])
                                          if "native" in times else None),
                   "picked": (chooser.pick(torch.empty(nbytes // 4)) if name != NOISE_FLOOR and
                              registry.algorithm(name.split("+")[0]).bind is auto.bind
                              else None)}
            # bytes on the wire / float32 bytes (the per-chunk scales aside)
            row["wire"] = (registry.codec(name.split("+")[1]).wire_itemsize(torch.float32)
                           / 4 if "+" in name else 1.0)
            row["rel_error"] = relative_error(runners[name], nbytes, device)
            if "+" not in name:  # the model knows no codec's encode/decode time
                model_name = row["picked"] or (BASELINE if name == NOISE_FLOOR else name)
                predicted = cost_model.predict(model_name, nbytes, world, costs)
                if predicted is not None:  # an algorithm registered without a formula
                    row["model_us"] = predicted * 1e6
                    row["model_error"] = (row["model_us"] - row["time_us"]) / row["time_us"]
            if args.cpu:
                row["cpu_us"] = {kind: seconds * 1e6
                                 for kind, seconds in cpu_per_call(cpu_used[name]).items()}
            rows.append(row)
        to_best, best = relative_to_best(times), fastest(times)
        for row in rows[-len(names):]:
            row["ratio_to_best"] = to_best[row["algorithm"]]
            row["ratio_to_best_ci"] = pairwise_ratio_interval(times[row["algorithm"]],
                                                              times[best])
        progress.step(f"{human_bytes(nbytes)}: {reps} reps")
    return rows, costs


def relative_to_best(times):
    """name -> median over repetitions of its time / the fastest algorithm's time.

    The fastest is the one with the lowest median; pairing repetition by
    repetition (as /native does) cancels slow spells that hit a whole
    repetition, where a ratio of two medians would set each algorithm against
    the luckiest of several noisy medians.
    """
    best = fastest(times)
    return {name: pairwise_ratio(t, times[best]) for name, t in times.items()}


def fastest(times):
    """The algorithm with the lowest median time; never the noise-floor row (native again)."""
    return min((name for name in times if name != NOISE_FLOOR),
               key=lambda name: median(times[name]))


def report(rows, costs, args, world):
    columns = [("size", "size", "{}"), ("algorithm", "algorithm", "{}"),
               ("time_us", "median us", "{:.1f}"), ("algbw_gbs", "algbw GB/s", "{:.3f}"),
               ("busbw_gbs", "busbw GB/s", "{:.3f}"),
               ("ratio_to_native", "/native (pairwise)", "{:.2f}"),
               ("native_ci", "/native 95%", "{}"),
               ("ratio_to_best", "/best (pairwise)", "{:.2f}"), ("best_ci", "/best 95%", "{}"),
               ("picked", "auto picked", "{}"), ("wire", "wire/fp32", "{:.2f}"),
               ("rel_error", "rel error", "{:.1e}")]
    if args.model:
        columns += [("model_us", "model us", "{:.1f}"), ("model_error", "model err", "{:+.0%}")]
    shown = [dict(r, size=human_bytes(r["bytes"]),
                  native_ci=format_interval(r["ratio_to_native_ci"]),
                  best_ci=format_interval(r["ratio_to_best_ci"])) for r in rows]
    if args.cpu:
        for row in shown:
            row.update({f"cpu_{kind}": us for kind, us in row["cpu_us"].items()})
        present = {k for r in rows for k in r["cpu_us"]}
        kinds = [k for k in (*THREAD_KINDS.values(), "other", "all") if k in present]
        columns += [(f"cpu_{kind}", f"cpu us {kind}", "{:.0f}") for kind in kinds]
    print(f"\nall-reduce of float32 on {world} ranks ({dist.get_backend()}, "
          f"{torch.get_num_threads()} thread(s) per rank, {os.cpu_count()} cores); median over "
          f"interleaved repetitions of the slowest rank's time.")
    print(f"cost model: alpha {costs.alpha * 1e6:.1f} us, beta {costs.beta * 1e9:.3f} ns/B "
          f"({1e-9 / max(costs.beta, 1e-30):.2f} GB/s), gamma {costs.gamma * 1e9:.3f} ns/B, "
          f"native {costs.native_alpha * 1e6:.1f} us + {costs.native_beta * 1e9:.3f} ns/B")
    print(format_table(shown, columns))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"collectives_p{world}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": dict(provenance(), backend=dist.get_backend()), "rows": rows,
                   "costs": costs.__dict__, "world_size": world}, f, indent=1)
    plot_collectives(rows, stem + ".png", world)
    print(f"wrote {stem}.json and {stem}.png")


def main():
    args = parse_args()
    rank, world, device = init_distributed(args.device)
    rows, costs = run(args, rank, world, device)
    if rank == 0:
        report(rows, costs, args, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
