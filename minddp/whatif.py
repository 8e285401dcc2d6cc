"""What if: step time and exposed communication under other settings, from one run's trace.

    ddp = minddp.DDP(model, timeline="run/trace")   # train a few dozen steps, then, on every rank:
    from minddp import whatif; whatif.annotate(ddp) # measures the link; saves the trace
    python -m minddp.diagnose run/trace.rank*.json --what-if --bandwidth 1gbit [--latency-us 50]
        [--caps 1,4,25,planned] [--algorithms ring,native] [--world-size 4] [--ratio 0.5]
        [--json] [--plot whatif.png]

What the trace holds (timeline.py), per rank and iteration: when backward began
and ended, when each bucket became ready, each bucket's reduction (span "comm
b<i>") and finalize. `annotate` adds to its "otherData": the parameters
(registration order, bytes), the buckets as lists of their indices, the
backend's cost figures (cost_model.measure: alpha, beta, ... per algorithm
formula), the slowdown a reduction causes to computation beside it
(overlap.measure_link) and, where the caller knows it, the measured step time.

The model, per rank, medians over the iterations after the first WARMUP:
  1. Ready times and backward as measured. Within a bucket, its parameters
     are taken as ready in proportion to their bytes since the bucket ready
     before it (a run with small buckets, 1 MiB, gives the finest picture).
  2. A layout: torch's rule (buckets.assign) at a cap, or the plan
     bucket_cap_mb="auto" would make (overlap.plan) for the predicted link.
  3. Each bucket's reduction on the target link: the algorithm's registered
     cost formula (cost_model.predict) with the link's latency added to each
     step and its time per byte added to each byte sent (`over_link`). Only the
     part the measured run's link costs takes cores: the slowdown of a
     reduction is s times that share (waiting on a wire takes none).
  4. overlap.simulate_each: buckets one at a time, in order, each once it is
     ready and the one before is done; backward slowed while they run. Its
     end is when backward and the last reduction are over.
  5. Step = measured step + end(target) - end(the measured layout on the
     measured link): forward, optimizer, the wrapper's copies and whatever
     else the step held stay as measured, and the model's errors for the
     measured run itself cancel (predicting it gives the measured step).
A compression's wire ratio scales the bytes each bucket sends; its encoding
time is not modelled, and the measured run is taken to be uncompressed. How
far the predictions hold: docs/performance.md.
"""
import dataclasses
import functools
import re
import statistics

import torch

from minddp import buckets, overlap, registry
from minddp.algorithms import cost_model, native
from minddp.timeline import ready_bucket

WARMUP = 3  # iterations left out: the first ones warm caches and the plan's probes
LAYOUTS = ("1", "4", "25", "planned")  # "25" is torch's layout (a 1 MiB first bucket)


def native_wire(p):
    """Bytes a backend's own all-reduce sends per byte reduced over p ranks: gloo and
    NCCL run a ring on large messages (the other algorithms' formulas say it themselves)."""
    return 2 * (p - 1) / p


def annotate(ddp, step_ms=None):
    """Measure the link as `ddp` reduces over it and record it, with the layout, in
    `ddp.timeline` (then saved). A collective: every rank of the wrapper's group calls
    it, after training, with no backward running. `step_ms`: the measured median step."""
    engine, reducer = ddp.engine, ddp.reducer
    if not cost_model.can_measure(engine.group):
        raise ValueError("minddp.whatif.annotate: the cost model calibrates on send/recv, "
                         "which this process group's backend cannot run (use gloo or NCCL)")
    costs = engine.run(cost_model.measure, engine.group, label="link")
    run = getattr(reducer.reduction, "collective", None)
    run = run if run is not None else functools.partial(native.all_reduce, group=engine.group)
    _, _, slowdown = overlap.measure_link(lambda t: engine.run(run, t, label="link"),
                                          lambda t: engine.submit(run, t, label="link"),
                                          engine.side_group, engine.device,
                                          reducer.params[0].dtype)
    meta = {"params": [[p.numel() * p.element_size(), str(p.dtype)] for p in reducer.params],
            "buckets": [list(b.indices) for b in reducer.buckets],
            "costs": dataclasses.asdict(costs), "slowdown": slowdown,
            "world_size": engine.group.size(), "algorithm": ddp.algorithm}
    if step_ms is not None:
        meta["step_ms"] = step_ms
    if ddp.timeline is not None:
        ddp.timeline.meta["whatif"] = meta
        ddp.timeline.save()
    return meta


@dataclasses.dataclass
class Run:
    """What one measured run says, all ranks combined (microseconds from backward start)."""
    sizes: list        # bytes per parameter, registration order
    dtypes: list
    ready: list        # ready time per parameter (the latest rank's)
    backward: float    # backward duration (the longest rank's)
    step: float        # measured step
    costs: cost_model.Costs
    slowdown: float
    world_size: int
    layout: list       # the measured buckets (lists of indices)
    algorithm: str = None  # what the run reduced with; None: each prediction's own


def from_traces(traces):
    """A Run from the per-rank trace files' contents ({"traceEvents", "otherData"})."""
    metas = [trace.get("otherData", {}).get("whatif") for trace in traces]
    if not metas or None in metas:
        raise ValueError("a trace has no link figures: call minddp.whatif.annotate(ddp) on "
                         "every rank after training (compare.py --timeline does)")
    slowdown = max(m["slowdown"] for m in metas)  # the ranks plan with the slowest (overlap)
    per_rank = [_rank_figures(trace["traceEvents"], meta) for trace, meta in zip(traces, metas)]
    meta = metas[0]
    sizes = [n for n, _ in meta["params"]]
    ready = [max(r["ready"][i] for r in per_rank) for i in range(len(sizes))]
    step = meta.get("step_ms")
    step = step * 1e3 if step is not None else max(r["period"] for r in per_rank)
    return Run(sizes, [d for _, d in meta["params"]], ready,
               max(r["backward"] for r in per_rank), step,
               cost_model.Costs(**meta["costs"]), slowdown, meta["world_size"],
               meta["buckets"], meta.get("algorithm"))


def _rank_figures(events, meta):
    """One rank's medians: per-parameter ready times and backward, and the period
    between backwards (the step, where the trace does not say)."""
    backwards = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "backward")
    readies = [(e["ts"], ready_bucket(e)) for e in events if ready_bucket(e) is not None]
    nb = len(meta["buckets"])
    per_bucket, backward = [[] for _ in range(nb)], []
    for k, (start, end) in enumerate(backwards):
        if k < WARMUP or k + 1 >= len(backwards) and len(backwards) > WARMUP + 1:
            continue  # the last one may have been cut short by the run's end
        backward.append(end - start)
        until = backwards[k + 1][0] if k + 1 < len(backwards) else float("inf")
        for ts, b in readies:
            if start <= ts < until and b < nb:
                per_bucket[b].append(ts - start)
    if not backward:
        raise ValueError(f"the trace holds {len(backwards)} backwards: record more than "
                         f"{WARMUP + 1}")
    bucket_ready = [statistics.median(t) if t else 0.0 for t in per_bucket]
    ready, before = [0.0] * len(meta["params"]), 0.0
    for b in sorted(range(nb), key=lambda b: bucket_ready[b]):
        indices = meta["buckets"][b]
        total = sum(meta["params"][i][0] for i in indices) or 1
        seen = 0
        for i in indices:  # in proportion to bytes since the bucket before
            seen += meta["params"][i][0]
            ready[i] = before + (bucket_ready[b] - before) * seen / total
        before = bucket_ready[b]
    starts = [a for a, _ in backwards]
    periods = [b - a for a, b in zip(starts[WARMUP:], starts[WARMUP + 1:])]
    return {"ready": ready, "backward": statistics.median(backward),
            "period": statistics.median(periods) if periods else statistics.median(backward)}


def parse_rate(text):
    """'1gbit' / '10Gbit' / '100mbit' / '800kbit' / '1e9' (bits per second) -> bytes per
    second; None for 'inf' or None (no link: loopback as measured)."""
    if text is None or str(text).lower() in ("inf", "loopback", "none"):
        return None
    match = re.fullmatch(r"([0-9.e+]+)\s*([kmg]?)(bit|bps)?", str(text).strip().lower())
    if not match:
        raise ValueError(f"bandwidth {text!r}: give bits per second like 1gbit, 100mbit, 1e9")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return float(match.group(1)) * scale / 8


@dataclasses.dataclass(frozen=True)
class Link:
    """A network between the ranks: bytes per second each rank can send (None: no
    limit beyond what the measured run had) and one-way latency in seconds."""
    bandwidth: float = None
    latency: float = 0.0


def over_link(costs, link, p):
    """The Costs of the measured run with `link` added: its latency on every step,
    its time per byte on every byte sent (the backend's own all-reduce: native_wire
    bytes per byte reduced, 2 (p - 1) latencies)."""
    wire = 0.0 if link.bandwidth is None else 1.0 / link.bandwidth
    return dataclasses.replace(
        costs, alpha=costs.alpha + link.latency, hop=costs.hop + link.latency,
        beta=costs.beta + wire,
        native_alpha=costs.native_alpha + 2 * (p - 1) * link.latency,
        native_beta=costs.native_beta + native_wire(p) * wire)


def layout(run, cap, link_costs=None):
    """Buckets (lists of indices) for `cap`: MiB as torch lays them out, or "planned"
    (then `link_costs(nbytes) -> (seconds, slowdown)` is the link the plan sees)."""
    params = [torch.empty(n // torch.empty(0, dtype=_dtype(d)).element_size(),
                          dtype=_dtype(d), device="meta") for n, d in zip(run.sizes, run.dtypes)]
    if cap != "planned":
        return buckets.assign(params, buckets.caps(int(float(cap) * 2**20)))
    small, large = overlap.LINK_BYTES
    (t_small, _), (t_large, slowdown) = link_costs(small), link_costs(large)
    beta = (t_large - t_small) / (large - small)
    link = ((t_small - beta * small) * 1e6, beta * 1e6, slowdown)
    return overlap.plan(params, run.ready, link).buckets


def _dtype(name):
    return getattr(torch, name.split(".")[-1])


def predict(run, cap, algorithm, link=Link(), world_size=None, ratio=1.0):
    """{"step_ms", "exposed_ms", "comm_ms", "buckets"} for one setting; None where
    `algorithm` has no cost formula. exposed: the model's time from the end of an
    undisturbed backward to the end of the last reduction, slowdown included."""
    p = world_size or run.world_size
    target = over_link(run.costs, link, p)

    def costs(nbytes):  # (microseconds, slowdown) of one bucket's reduction
        total = cost_model.predict(algorithm, nbytes * ratio, p, target)
        cpu = cost_model.predict(algorithm, nbytes * ratio, p, run.costs)
        return total * 1e6, run.slowdown * min(1.0, cpu / total) if total > 0 else 0.0
    if cost_model.predict(algorithm, 1 << 20, p, target) is None:
        return None
    chosen = layout(run, cap, lambda n: (costs(n)[0] / 1e6, costs(n)[1]))
    end, comm = _end(run, chosen, costs)
    # The measured run as the model sees it, with the algorithm it ran (auto, or an
    # algorithm without a formula: the predicted one's, so only the layout and link differ).
    ran = run.algorithm
    if ran is None or cost_model.predict(ran, 1 << 20, run.world_size, run.costs) is None:
        ran = algorithm
    measured, _ = _end(run, run.layout, lambda n: (
        cost_model.predict(ran, n, run.world_size, run.costs) * 1e6, run.slowdown))
    return {"step_ms": (run.step + end - measured) / 1e3,
            "exposed_ms": (end - run.backward) / 1e3, "comm_ms": comm / 1e3,
            "buckets": len(chosen)}


def _end(run, chosen, costs):
    """(when backward and the reductions of layout `chosen` are over, their summed
    time), microseconds, with `costs(nbytes) -> (microseconds, slowdown)`."""
    ready = [max(run.ready[i] for i in b) for b in chosen]
    each = [costs(sum(run.sizes[i] for i in b)) for b in chosen]
    _, end = overlap.simulate_each(ready, [t for t, _ in each], run.backward,
                                   [s for _, s in each])
    return end, sum(t for t, _ in each)


def table(run, caps=LAYOUTS, algorithms=None, link=Link(), world_size=None, ratio=1.0):
    """One row per (cap, algorithm) with a cost formula: its prediction."""
    algorithms = algorithms or [a for a in registry.algorithm_names()
                                if registry.algorithm(a).cost is not None]
    rows = []
    for algorithm in algorithms:
        for cap in caps:
            got = predict(run, cap, algorithm, link, world_size, ratio)
            if got is not None:
                rows.append(dict(algorithm=algorithm, cap=str(cap), **got))
    return rows


def describe(rows, run, link, world_size=None, ratio=1.0):
    """The table as text, with what it assumed."""
    where = ("the measured link" if link.bandwidth is None
             else f"{link.bandwidth * 8 / 1e9:g} Gbit/s") + f", {link.latency * 1e6:g} us latency"
    lines = [f"what if: {world_size or run.world_size} ranks, {where}, wire ratio {ratio:g} "
             f"(measured: {run.world_size} ranks, step {run.step / 1e3:.1f} ms, backward "
             f"{run.backward / 1e3:.1f} ms, slowdown {run.slowdown:.2f})",
             f"{'algorithm':<18}{'cap MiB':>9}{'buckets':>9}{'step ms':>10}{'exposed ms':>12}"
             f"{'comm ms':>10}"]
    for r in rows:
        lines.append(f"{r['algorithm']:<18}{r['cap']:>9}{r['buckets']:>9}{r['step_ms']:>10.1f}"
                     f"{r['exposed_ms']:>12.1f}{r['comm_ms']:>10.1f}")
    return "\n".join(lines)


def plot(rows, path):
    """Predicted step time per cap, a bar per algorithm, exposed part hatched."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    caps = list(dict.fromkeys(r["cap"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(algorithms))
    for k, algorithm in enumerate(algorithms):
        mine = {r["cap"]: r for r in rows if r["algorithm"] == algorithm}
        xs = [c + k * width for c in range(len(caps)) if caps[c] in mine]
        got = [mine[c] for c in caps if c in mine]
        ax.bar(xs, [r["step_ms"] - r["exposed_ms"] for r in got], width, label=algorithm)
        ax.bar(xs, [r["exposed_ms"] for r in got], width,
               bottom=[r["step_ms"] - r["exposed_ms"] for r in got], color="none",
               edgecolor="black", hatch="//")
    ax.set_xticks([c + width * (len(algorithms) - 1) / 2 for c in range(len(caps))], caps)
    ax.set_xlabel("bucket cap (MiB)")
    ax.set_ylabel("predicted step ms (hatched: exposed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(parser):
    """diagnose.py's --what-if and its settings."""
    g = parser.add_argument_group("what if (needs traces annotated by minddp.whatif.annotate)")
    g.add_argument("--what-if", action="store_true",
                   help="predict step time and exposed communication for other settings")
    g.add_argument("--bandwidth", help="per-rank link rate, e.g. 1gbit, 10gbit (default: the "
                   "measured run's link)")
    g.add_argument("--latency-us", type=float, default=0.0, help="one-way link latency")
    g.add_argument("--caps", default=",".join(LAYOUTS),
                   help="bucket caps in MiB and/or 'planned' (25 is torch's layout)")
    g.add_argument("--algorithms", default=None,
                   help="comma-separated (default: every registered one with a cost formula)")
    g.add_argument("--world-size", type=int, default=None)
    g.add_argument("--ratio", type=float, default=1.0,
                   help="wire bytes per byte reduced (fp16 compression: 0.5)")
    g.add_argument("--plot", metavar="PNG", help="also draw the predictions")
    g.add_argument("--measured-algorithm", metavar="NAME",
                   help="the algorithm the traced run used (default: what annotate recorded)")


def main(args):
    """Print the predictions for diagnose's parsed `args` (text, or JSON with --json)."""
    import json
    traces = []
    for path in args.traces:
        with open(path) as f:
            traces.append(json.load(f))
    run = from_traces(traces)
    if args.measured_algorithm:
        run.algorithm = args.measured_algorithm
    link = Link(parse_rate(args.bandwidth), args.latency_us * 1e-6)
    rows = table(run, args.caps.split(","),
                 args.algorithms.split(",") if args.algorithms else None, link,
                 args.world_size, args.ratio)
    if args.plot:
        plot(rows, args.plot)
    print(json.dumps({"rows": rows, "measured_step_ms": run.step / 1e3}, indent=1) if args.json
          else describe(rows, run, link, args.world_size, args.ratio))
    return 0
