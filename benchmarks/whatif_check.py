"""How far `python -m minddp.diagnose --what-if` holds: its predictions next to measurements.

    torchrun --nproc_per_node=2 benchmarks/compare.py --workloads transformer \\
        --configs minddp_native@1 --timeline --steps 20 --out run       # one loopback run
    OUT=mn1 benchmarks/multinode.sh 2 1gbit --workloads transformer \\
        --configs minddp_ring@1,minddp_ring@4,minddp_ring@25,minddp_ring@auto,... --steps 20
    python benchmarks/whatif_check.py run/trace.transformer.minddp_native@1.rank*.json \\
        --measured 1gbit=mn1/compare.json --measured 10gbit=mn10/compare.json \\
        [--reference run/compare.json] [--out check.json]

Every minddp row of each measured compare.json (minddp_<algorithm>@<cap>, @auto is the
planned layout) is predicted from the trace alone for that link rate and the row's world
size; the table gives predicted and measured median step times, the error of each
(predicted / measured - 1) and the median of the absolute errors. This machine's speed
changes with its load between runs; with no_comm rows in the runs (--reference: the
measured run's), the error is also given with that change added to the prediction.
"""
import argparse
import json
import os
import statistics
import sys

from benchmarks.configs import how_to_build, split_name, wire_ratio
from minddp import whatif


def floor(rows):
    """The no_comm row's step (local compute only), or None."""
    bare = [r["step_ms"] for r in rows if how_to_build(split_name(r["name"])[0])[0] == "bare"]
    return bare[0] if bare else None


def compare(run, measured, latency_us=0.0, reference_floor=None):
    """Rows of predicted against measured, for {rate: compare.json rows}. With the
    measured run's no_comm step (`reference_floor`) and a no_comm row measured beside
    each, also the error once the machine's change of speed between the runs (the
    difference of the no_comm steps) is added to the prediction."""
    out = []
    for rate, rows in measured.items():
        link = whatif.Link(whatif.parse_rate(rate), latency_us * 1e-6)
        here = floor(rows)
        drift = None if here is None or reference_floor is None else here - reference_floor
        for row in rows:
            base, cap = split_name(row["name"])
            built = how_to_build(base)
            if built[0] != "minddp" or row.get("step_ms") is None:
                continue
            cap = "planned" if cap == "auto" else cap or 25
            got = whatif.predict(run, f"{float(cap):g}" if cap != "planned" else cap, built[1],
                                 link, row["world_size"], wire_ratio(built[2]))
            if got is None:
                continue
            out.append({"rate": rate, "name": row["name"], "algorithm": built[1],
                        "cap": got and str(cap), "buckets": got["buckets"],
                        "predicted_ms": got["step_ms"], "measured_ms": row["step_ms"],
                        "error": got["step_ms"] / row["step_ms"] - 1,
                        # as compare.py measures it: step - no_comm (the measured run's)
                        "predicted_exposed_ms": got["step_ms"] - reference_floor
                        if reference_floor is not None else got["exposed_ms"],
                        "measured_exposed_ms": row.get("exposed_comm_ms"),
                        "drift_ms": drift,
                        "drift_error": None if drift is None else
                        (got["step_ms"] + drift) / row["step_ms"] - 1})
    return out


def describe(rows):
    lines = [f"{'rate':<8}{'row':<20}{'buckets':>8}{'predicted ms':>14}{'measured ms':>13}"
             f"{'error':>8}{'drift ms':>10}{'then':>8}{'pred. exposed':>15}{'meas. exposed':>15}"]
    for r in rows:
        exposed = r["measured_exposed_ms"]  # step - no_comm of the measured run
        lines.append(f"{r['rate']:<8}{r['name']:<20}{r['buckets']:>8}{r['predicted_ms']:>14.1f}"
                     f"{r['measured_ms']:>13.1f}{r['error']:>+8.1%}"
                     f"{_maybe(r['drift_ms'], '+.0f'):>10}{_maybe(r['drift_error'], '+.1%'):>8}"
                     f"{r['predicted_exposed_ms']:>15.1f}"
                     f"{_maybe(exposed, '.1f'):>15}")
    for key, what in (("error", "error"), ("drift_error", "with the machine's drift taken out")):
        errors = [abs(r[key]) for r in rows if r.get(key) is not None]
        if errors:
            over = [f"{r['rate']} {r['name']}" for r in rows if abs(r[key]) > 0.2]
            lines.append(f"median |{what}| {statistics.median(errors):.1%} over {len(errors)} "
                         f"configurations; over 20%: {', '.join(over) or 'none'}")
    return "\n".join(lines)


def markdown(rows):
    """The table for docs/performance.md."""
    lines = ["| link | row | buckets | predicted ms | measured ms | error | drift ms | error "
             "less drift | predicted exposed ms | measured exposed ms |", "|---" * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['rate']} | {r['name']} | {r['buckets']} | {r['predicted_ms']:.1f} | "
                     f"{r['measured_ms']:.1f} | {r['error']:+.1%} | "
                     f"{_maybe(r['drift_ms'], '+.0f')} | {_maybe(r['drift_error'], '+.1%')} | "
                     f"{r['predicted_exposed_ms']:.1f} | "
                     f"{_maybe(r['measured_exposed_ms'], '.1f')} |")
    return "\n".join(lines)


def _maybe(value, spec):
    return "-" if value is None else format(value, spec)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="the measured run's per-rank trace files")
    p.add_argument("--measured", action="append", default=[], metavar="RATE=COMPARE_JSON",
                   help="a multinode.sh result and its link rate, e.g. 1gbit=mn1/compare.json")
    p.add_argument("--latency-us", type=float, default=0.0)
    p.add_argument("--reference", metavar="COMPARE_JSON",
                   help="the measured run's compare.json: its no_comm row gives the machine's "
                        "speed then, for the drift-corrected error")
    p.add_argument("--measured-algorithm", metavar="NAME",
                   help="the algorithm the traced run used, where annotate did not record it")
    p.add_argument("--out", help="also write the rows as JSON")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table instead")
    args = p.parse_args(argv)
    traces = []
    for path in args.traces:
        with open(path) as f:
            traces.append(json.load(f))
    measured = {}
    for item in args.measured:
        rate, _, path = item.partition("=")
        with open(path) as f:
            measured[rate] = json.load(f)["rows"]
    reference = None
    if args.reference:
        with open(args.reference) as f:
            reference = floor(json.load(f)["rows"])
    run = whatif.from_traces(traces)
    run.algorithm = args.measured_algorithm or run.algorithm
    rows = compare(run, measured, args.latency_us, reference)
    print(markdown(rows) if args.markdown else describe(rows))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"traces": [os.path.basename(t) for t in args.traces],
                       "measured": dict(m.partition("=")[::2] for m in args.measured),
                       "latency_us": args.latency_us, "reference_no_comm_ms": reference,
                       "rows": rows,
                       "median_abs_error": statistics.median(abs(r["error"]) for r in rows)
                       if rows else None}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
