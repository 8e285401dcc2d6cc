"""Who made the others wait: the ranks' timelines on one clock, bucket by bucket.

    torchrun ... train.py        # with DDP(..., timeline="run/trace") or MINDDP_TIMELINE
    python -m minddp.diagnose run/trace.rank*.json [--json] [--merged all.json]

Inside DDP a bucket's all-reduce cannot finish before its last rank is ready,
so backward's wall time is the same everywhere and step times name nobody.
The ready times do: each rank's trace records when each bucket became ready
in each iteration, and the clock offset to rank 0 measured at start-up
(timeline.align). On one clock, per iteration and bucket, the last rank to
be ready is the one the others waited for, by how much later it was than the
next latest. Per iteration the delay attributed to a rank is the most it held
any bucket back, counted only above the noise (--noise-ms, default 2 ms, plus
the clocks' alignment error). A rank is blamed where that happened in at
least 3/4 of the iterations and more often than chance would make one of p
ranks the last (binomial, p < 0.05): a busy machine delays ranks at random.

Then the links (links.py), where minddp's own algorithms ran on gloo: per
directed link, its rate against the others', its messages' time on the wire
against their receiver's wait for the sender to post (a slow link, not a
late rank), and the link that ran below half the others' rate in most calls.
"""
import argparse
import collections
import json
import math
import statistics
import sys

from minddp import links, whatif
from minddp.timeline import ready_bucket



def load(paths):
    """{rank: (offset_us, offset_error_us, events)} from the per-rank trace files."""
    ranks = {}
    for path in paths:
        with open(path) as f:
            trace = json.load(f)
        meta = trace.get("otherData", {})
        events = trace["traceEvents"]
        rank = meta.get("rank", events[0]["pid"] if events else len(ranks))
        ranks[rank] = (meta.get("clock_offset_us") or 0.0, meta.get("clock_offset_error_us"),
                       events)
    return ranks


def ready_times(ranks):
    """{(iteration, bucket): {rank: time on rank 0's clock, us}}, where every rank has it."""
    table = collections.defaultdict(dict)
    for rank, (offset, _, events) in ranks.items():
        for e in events:
            bucket = ready_bucket(e)
            if bucket is not None and "iteration" in e.get("args", {}):
                table[e["args"]["iteration"], bucket][rank] = e["ts"] + offset
    return {key: times for key, times in table.items() if len(times) == len(ranks)}


def attribute(ranks, noise_ms=2.0):
    """The analysis as a dict (what --json prints)."""
    table = ready_times(ranks)
    errors = [err for _, err, _ in ranks.values() if err is not None]
    noise_us = noise_ms * 1e3 + 2 * max(errors, default=0.0)
    per_iteration = collections.defaultdict(dict)  # iteration -> {rank: most held back, us}
    last_counts = collections.Counter()
    # rank -> us the others waited for it: per iteration the most over buckets (they wait
    # for its buckets one after another, so the waits overlap), each the mean over them
    waited = collections.defaultdict(float)
    waited_now = collections.defaultdict(dict)  # iteration -> {rank: us}
    for (iteration, _), times in sorted(table.items()):
        order = sorted(times, key=times.get)
        last = order[-1]
        margin = times[last] - times[order[-2]] if len(order) > 1 else 0.0
        last_counts[last] += 1
        held = per_iteration[iteration]
        held[last] = max(held.get(last, 0.0), margin)
        if len(order) > 1:
            lag = statistics.mean(times[last] - times[r] for r in order[:-1])
            waited_now[iteration][last] = max(waited_now[iteration].get(last, 0.0), lag)
    iterations = sorted(per_iteration)
    for by_rank in waited_now.values():
        for rank, lag in by_rank.items():
            waited[rank] += lag
    culprits = {}  # iteration -> (rank, delay us) where above the noise
    for it in iterations:
        rank, delay = max(per_iteration[it].items(), key=lambda kv: kv[1])
        if delay > noise_us:
            culprits[it] = (rank, delay)
    report = {"ranks": sorted(ranks), "iterations": len(iterations), "buckets": len(table),
              "noise_ms": noise_us / 1e3,
              "clock_error_ms": max(errors, default=0.0) / 1e3, "per_rank": {}, "blamed": []}
    for rank in sorted(ranks):
        delays = [d for r, d in culprits.values() if r == rank]
        row = {"last_ready_share": last_counts[rank] / max(1, len(table)),
               "iterations_blamed": len(delays),
               "delay_ms": statistics.median(delays) / 1e3 if delays else 0.0,
               "others_waited_ms_per_iteration": waited[rank] / 1e3 / max(1, len(iterations))}
        report["per_rank"][rank] = row
        # Blamed: held the others back in most iterations, more often than chance
        # would make one of p ranks the last (a busy machine delays ranks at random).
        row["chance_p"] = _tail(len(delays), len(iterations), 1 / len(ranks))
        if iterations and len(delays) >= 0.75 * len(iterations) and row["chance_p"] < 0.05:
            report["blamed"].append(rank)
    report["per_iteration"] = {it: {"rank": r, "delay_ms": d / 1e3}
                               for it, (r, d) in culprits.items()}
    return report


def _tail(k, n, p):
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


def describe(report):
    """The report in sentences."""
    lines = [f"{len(report['ranks'])} ranks, {report['iterations']} iterations, "
             f"{report['buckets']} bucket readies on one clock (alignment error "
             f"{report['clock_error_ms']:.3f} ms; noise taken as {report['noise_ms']:.1f} ms)"]
    for rank, row in report["per_rank"].items():
        lines.append(f"rank {rank}: last ready for {row['last_ready_share']:.0%} of buckets; "
                     f"held the others back in {row['iterations_blamed']} of "
                     f"{report['iterations']} iterations, by {row['delay_ms']:.1f} ms "
                     f"(median); the others waited {row['others_waited_ms_per_iteration']:.1f} "
                     f"ms per iteration for it")
    if report["blamed"]:
        lines += [f"=> rank {r} made the others wait: {report['per_rank'][r]['delay_ms']:.1f} ms "
                  f"per iteration" for r in report["blamed"]]
    else:
        lines.append("=> no rank held the others back above the noise")
    if "links" in report:
        lines += links.describe(report["links"])
    return "\n".join(lines)


def merged_trace(ranks, report, out):
    """One Chrome trace, every rank on rank 0's clock, with a "waited for rank R" mark on
    each rank where an iteration's culprit held it back, and each hop's wait and wire
    time on its receiver (links.trace_events)."""
    events = []
    for offset, _, evs in ranks.values():  # hop spans overlap: links.py redraws them
        events += [dict(e, ts=e["ts"] + offset) for e in evs if e.get("tid") != "hops"]
    table = ready_times(ranks)
    for (it, bucket), times in table.items():
        culprit = report["per_iteration"].get(it)
        if culprit is None or times.get(culprit["rank"]) != max(times.values()):
            continue
        for rank, t in times.items():
            if rank != culprit["rank"]:
                events.append({"name": f"waited for rank {culprit['rank']}", "ph": "X",
                               "ts": t, "dur": times[culprit["rank"]] - t, "pid": rank,
                               "tid": "waits", "args": {"iteration": it, "bucket": bucket}})
    events += links.trace_events(ranks)  # who waited for whom, per hop
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minddp.diagnose",
                                description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="the per-rank files timeline= writes")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.add_argument("--noise-ms", type=float, default=2.0,
                   help="a rank holding a bucket back by less is not blamed (default 2)")
    p.add_argument("--merged", metavar="OUT", help="also write one Chrome trace of all ranks")
    whatif.add_arguments(p)
    args = p.parse_args(argv)
    if args.what_if:
        return whatif.main(args)
    ranks = load(args.traces)
    report = attribute(ranks, args.noise_ms)
    report["links"] = links.analyse(ranks, report["noise_ms"] * 1e3)
    if args.merged:
        merged_trace(ranks, report, args.merged)
    print(json.dumps(report, indent=1) if args.json else describe(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
