"""Several compare.py runs read as one sample: each row's ratio to torch_ddp, pooled.

    python benchmarks/pool.py results/a/compare.json results/b/compare.json ...
    python benchmarks/pool.py --baseline minddp_auto a.json b.json   # ratios to another row

One run of compare.py pins a ratio down to about 1% (its 95% interval), and
from run to run the median itself moves by about as much: the machine's state
(which core a rank lands on, what else runs) changes between runs more than
between steps. Where two configurations are within 1% of each other, no single
run can tell which is faster. Pooling runs taken at different times samples
that too. A step is still compared only with torch_ddp's step of the same run
and the same index (they were timed side by side); the per-step ratios of all
runs then give one median and one distribution-free 95% interval
(measure.median_interval). That interval takes the steps as independent
draws; where the runs disagree with one another by more than their own
intervals allow, it is too narrow, and the column of per-run ratios shows it.
The runs under 1 are counted too: runs are independent of one another, so
that count is a sign test that needs no assumption about steps (all of 5 runs
on one side of 1 happens by chance 1 time in 16 when neither side is faster).

Where every run has a no_comm row, exposed communication is pooled the same
way: a step's exposed time is its time minus no_comm's at the same index of the
same run, the pooled figure the median over every run's steps, and it is
divided by the baseline's pooled exposed time. Time on a simulated link is set
by the link more than by the CPU, so exposed milliseconds of different runs are
comparable even when the machine's speed is not; each run's own quotient is
shown next to the pooled one.

Prints, per workload and configuration: each run's ratio, the pooled ratio, its
interval, how many runs are under 1, the number of steps pooled and, with
no_comm, the exposed quotients.
"""
import argparse
import json

from benchmarks.measure import (format_interval, format_table, interval_or_none, median,
                                step_differences, step_ratios)

def columns(baseline, exposed):
    shown = [("workload", "workload", "{}"), ("name", "config", "{}"),
             ("runs", "each run", "{}"), ("ratio", f"pooled vs {baseline}", "{:.3f}"),
             ("interval", "pooled 95%", "{}"), ("under_1", "runs under 1", "{}"),
             ("steps", "steps", "{}")]
    if exposed:
        shown += [("exposed_ms", "exposed ms", "{:.1f}"),
                  ("exposed_runs", f"exposed / {baseline}'s, each run", "{}"),
                  ("exposed_ratio", "pooled", "{:.2f}")]
    return shown


def exposed_steps(steps, workload, name):
    """Per-step exposed ms (step - no_comm of the same index) of one run's row."""
    return step_differences(steps[workload, name], steps[workload, "no_comm"])


def steps_by_row(rows):
    """{(workload, configuration): per-step ms} of one run's rows, absent ones left out."""
    return {(r["workload"], r["name"]): r["steps_ms"] for r in rows if not r.get("absent")}


def pool(runs, baseline="torch_ddp"):
    """runs: [(source, rows)], rows as compare.json holds them. Returns one row per
    (workload, configuration) present in every run, the baseline itself left out."""
    indexed = [(source, steps_by_row(rows)) for source, rows in runs]
    keys = set.intersection(*(set(steps) for _, steps in indexed))
    order = [(r["workload"], r["name"]) for r in runs[0][1]]
    pooled = []
    for workload, name in (k for k in order if k in keys and k[1] != baseline):
        each = []
        for source, steps in indexed:
            if (workload, baseline) not in steps:
                raise SystemExit(f"pool.py: {source} has no {baseline} row for {workload}: run "
                                 f"compare.py with {baseline} among --configs, the rows are "
                                 f"ratios to it")
            each.append(step_ratios(steps[workload, name], steps[workload, baseline]))
        ratios = [x for run in each for x in run]
        medians = [median(run) for run in each]
        row = {"workload": workload, "name": name,
               "runs": " ".join(f"{m:.3f}" for m in medians),
               "under_1": f"{sum(m < 1 for m in medians)} of {len(medians)}",
               "ratio": median(ratios), "interval": interval_or_none(ratios),
               "steps": len(ratios)}
        with_no_comm = all((workload, "no_comm") in s for _, s in indexed)
        if with_no_comm and "no_comm" not in (name, baseline):
            row.update(_exposed(indexed, workload, name, baseline))
        pooled.append(row)
    return pooled


def _exposed(indexed, workload, name, baseline):
    mine = [exposed_steps(s, workload, name) for _, s in indexed]
    theirs = [exposed_steps(s, workload, baseline) for _, s in indexed]
    each = [median(m) / median(t) for m, t in zip(mine, theirs)]
    exposed = median([x for run in mine for x in run])
    return {"exposed_ms": exposed, "exposed_runs": " ".join(f"{q:.2f}" for q in each),
            "exposed_ratio": exposed / median([x for run in theirs for x in run])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="compare.json files, one per run")
    p.add_argument("--baseline", default="torch_ddp",
                   help="the configuration every row is divided by, step by step")
    args = p.parse_args(argv)
    runs = []
    for path in args.files:
        with open(path) as f:
            runs.append((path, json.load(f)["rows"]))
    rows = pool(runs, args.baseline)
    # Three digits: pooling is for ratios too close to 1 for a single run.
    shown = [dict(r, interval=format_interval(r["interval"], digits=3)) for r in rows]
    print(format_table(shown, columns(args.baseline, any("exposed_ms" in r for r in rows))))
    return rows


if __name__ == "__main__":
    main()
