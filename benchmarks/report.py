"""Writes docs/results.md, its pictures, README.md's results table and the tables of
docs/performance.md from the result files the benchmarks wrote.

    python benchmarks/report.py                 # = make docs
    python benchmarks/report.py --check         # fail if a page is out of date

Reads, from --results (default docs/results): compare.json (compare.py) and
<setting>/compare.json (the same elsewhere, e.g. multinode.sh over slow links),
trace.transformer.minddp_auto.rank0.json (compare.py --timeline: that row's trace),
<setting>/time_to_loss.json (time_to_loss.py), collectives_p*.json (collectives.py) and
kernels*.json, <setting>/kernels*.json (kernels.py --json);
a file that is absent leaves its section out. Every file carries the command
that made it, the commit and the machine (benchmarks.measure.provenance), and
the page repeats them, so every figure in the docs can be made again.
"""
import argparse
import glob
import json
import os
import sys

from benchmarks.measure import format_interval, human_bytes
from benchmarks.plots import (plot_collectives, plot_compare, plot_loss_against_time,
                              plot_timeline)
from benchmarks.time_to_loss import startup_seconds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = "trace.transformer.minddp_auto.rank0.json"  # the step the docs show
README = os.path.join(REPO, "README.md")
PERFORMANCE = os.path.join(REPO, "docs", "performance.md")


def _load(path):
    with open(path) as f:
        return json.load(f)


def _made_by(meta):
    return (f"Made by `{meta['command']}` at commit `{meta['commit']}` on {meta['machine']}, "
            f"torch {meta['torch']}, {meta['date']}.")


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _num(value, fmt):
    return "-" if value is None else fmt.format(value)


def compare_section(path, img):
    data = _load(path)
    meta, rows = data["meta"], data["rows"]
    folder = os.path.basename(os.path.dirname(path))
    nested = folder != "results"  # docs/results/<setting>/compare.json: another setting
    picture = f"compare-{folder}.png" if nested else "compare.png"
    plot_compare(rows, os.path.join(img, picture))
    body = [_table(
        ["workload", "config", "step ms", "vs torch_ddp", "95% interval", "exposed comm ms",
         "hidden", "MB sent / step"],
        [[r["workload"], r["name"], _num(r.get("step_ms"), "{:.1f}"),
          _num(r.get("ratio_to_torch_ddp"), "{:.3f}"),
          format_interval(r.get("ratio_to_torch_ddp_ci"), digits=3) or "-",
          _num(r.get("exposed_comm_ms"), "{:.1f}"), _num(r.get("hidden_share"), "{:.0%}"),
          _num(r.get("bytes_sent_mb"), "{:.1f}")] for r in rows])]
    title = "## compare.py: minddp next to torch DDP" + (f" ({folder})" if nested else "")
    return ([title, "", _made_by(meta),
             f"{meta['world_size']} ranks, {meta['backend']} on {meta['device']}, "
             f"{meta['warmup']} warm-up + {meta['steps']} measured steps per configuration, "
             "interleaved. A ratio under 1 is faster than torch DDP; an interval that holds 1 "
             "means this run could not tell the two apart.", "", *body, "",
             f"![step time per configuration](img/{picture})", ""])


def readme_table(path, picture=None):
    """A README table: each workload's step time relative to torch DDP."""
    data = _load(path)
    meta, rows = data["meta"], data["rows"]
    names = [n for n in dict.fromkeys(r["name"] for r in rows) if n not in ("torch_ddp",)]
    table = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = {r["name"]: r for r in rows if r["workload"] == workload}
        cells = [workload, _num(mine.get("torch_ddp", {}).get("step_ms"), "{:.1f}")]
        for name in names:
            r = mine.get(name, {})
            ci = format_interval(r.get("ratio_to_torch_ddp_ci"))
            cells.append(_num(r.get("ratio_to_torch_ddp"), "{:.2f}") + (f" ({ci})" if ci else ""))
        table.append(cells)
    return "\n".join([
        f"Step time relative to torch DDP on {meta['world_size']} {meta['device']} ranks "
        f"({meta['backend']}), median of per-step ratios over {meta['steps']} interleaved steps "
        "with its 95% interval (under 1: faster; an interval that holds 1: not told apart). "
        + _made_by(meta), "",
        _table(["workload", "torch_ddp ms", *names], table)]
        + (["", f"![step time per configuration]({picture})"] if picture else []))


def readme_rows(path):
    """A README table with a row per configuration: step time, ratio, exposed
    communication and the share hidden."""
    data = _load(path)
    meta, rows = data["meta"], data["rows"]
    return "\n".join([
        f"{meta['world_size']} {meta['device']} ranks ({meta['backend']}), medians over "
        f"{meta['steps']} interleaved steps; exposed = step - no_comm, what backward did not "
        "hide. " + _made_by(meta), "",
        _table(["workload", "config", "step ms", "vs torch_ddp (95%)", "exposed ms", "hidden"],
               [[r["workload"], r["name"], _num(r.get("step_ms"), "{:.1f}"),
                 _num(r.get("ratio_to_torch_ddp"), "{:.3f}") +
                 (f" ({format_interval(r.get('ratio_to_torch_ddp_ci'), digits=3)})"
                  if r.get("ratio_to_torch_ddp_ci") else ""),
                 _num(r.get("exposed_comm_ms"), "{:.1f}"), _num(r.get("hidden_share"), "{:.0%}")]
                for r in rows if r["name"] != "no_comm"])])


def with_readme_block(readme, name, text):
    """README text with the block between `name`'s markers replaced by `text`."""
    begin = readme.index(f"<!-- {name}:begin")
    begin = readme.index("\n", begin) + 1
    end = readme.index(f"<!-- {name}:end -->")
    return readme[:begin] + text + "\n" + readme[end:]


def readme_time_to_loss(paths):
    """A README table with a row per time_to_loss.py run (setting) and a column per
    configuration: time to the target relative to torch DDP's, and final loss relative to
    torch DDP's."""
    runs = [(os.path.basename(os.path.dirname(p)), _load(p)) for p in paths]
    names = list(dict.fromkeys(r["name"] for _, d in runs for r in d["rows"]
                               if r["name"] != "torch_ddp"))
    table = []
    for folder, data in runs:
        mine = {r["name"]: r for r in data["rows"]}
        cells = [folder, _model_of(data["meta"]).split(",")[0],
                 _num(mine.get("torch_ddp", {}).get("time_to_target_s"), "{:.1f}")]
        for name in names:
            r = mine.get(name)
            if r is None:
                cells.append("-")
                continue
            time = _num(r.get("time_vs_torch"), "{:.2f}") if r.get("time_to_target_s") \
                else "not reached"
            cells.append(f"{time} ({_num(r.get('loss_vs_torch'), '{:.3f}')})")
        table.append(cells)
    meta = runs[0][1]["meta"]
    return "\n".join([
        "Wall time to the target loss relative to torch DDP's (under 1: sooner), and in brackets "
        "final validation loss relative to torch DDP's (over 1: trained worse). Target: "
        f"{_target_rule(meta)}. Each row is one run of "
        "time_to_loss.py, every configuration interleaved step by step; commands, commits and "
        "curves in [results.md](results.md).", "",
        _table(["run", "model", "torch_ddp s", *names], table)])


# Generated blocks: block -> (file(s) in docs/results, table). "results" is README's; the
# others, from runs over a simulated link, are docs/performance.md's.
BLOCKS = {"results": ("compare.json", lambda path: readme_table(path, "docs/img/compare.png")),
          "slow-link": ("compression-1gbit-2ranks/compare.json", readme_table),
          "bucket-plan": ("cap-1gbit-2ranks/compare.json", readme_rows),
          "time-to-loss": ("ttl-*/time_to_loss.json", readme_time_to_loss)}


def readme_blocks(page, results):
    """A page (README, docs/performance.md) with the generated blocks it holds rewritten
    from the result files that exist."""
    for block, (pattern, table) in BLOCKS.items():
        paths = sorted(glob.glob(os.path.join(results, pattern)))
        if paths and f"<!-- {block}:begin" in page:
            page = with_readme_block(page, block, table(*paths) if "*" not in pattern
                                     else table(paths))
    return page


def timeline_section(path, img):
    with open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    plot_timeline(events, os.path.join(img, "timeline.png"))
    name = os.path.basename(path)
    return ["## One step on the timeline", "",
            f"The last measured step of `{name}` (rank 0), written by the compare.py run above "
            "with `--timeline`: backward on the training thread with the moment each bucket "
            "became ready, each bucket's all-reduce on the communication thread, and the "
            "finalize that writes `.grad`. Open the file in https://ui.perfetto.dev for all "
            "steps.", "", "![one step](img/timeline.png)", ""]


def _model_of(meta):
    """Which model time_to_loss.py trained, with its batch (files before --workload: CharLM)."""
    name = {"charmlp": "CharMLP", "charlm": "CharLM"}[meta.get("workload", "charlm")]
    batch = meta.get("batch_size")
    return f"{name}, {batch} windows per rank per step," if batch else name


def _target_rule(meta):
    """How the target was chosen (files from before the rule was recorded: the old default)."""
    return meta.get("target_rule", "the highest of the configurations' best")


def time_to_loss_section(path, img):
    data = _load(path)
    meta, rows = data["meta"], data["rows"]
    folder = os.path.basename(os.path.dirname(path))
    picture = f"time_to_loss-{folder}.png"
    plot_loss_against_time(rows, os.path.join(img, picture))
    table = [[r["name"], f"{r['final_loss']:.4f}", _num(r.get("loss_vs_torch"), "{:.4f}"),
              _num(r.get("time_to_target_s"), "{:.1f}"), _num(r.get("time_vs_torch"), "{:.3f}"),
              _num(startup_seconds(r["curve"], r["step_ms"]), "{:.1f}"),
              _num(r.get("step_ms"), "{:.1f}"),
              _num(r.get("bytes_sent_mb"), "{:.2f}")]
             for r in rows]
    return [f"## time_to_loss.py: training to a target loss ({folder})", "", _made_by(meta),
            f"{meta['world_size']} ranks, {meta['backend']} on {meta['device']}, {meta['steps']} "
            f"steps of each configuration, interleaved, {_model_of(meta)} on {meta['text']}. "
            f"Target: validation loss {meta['target']:.4f}, {_target_rule(meta)}.", "",
            _table(["config", "final loss", "loss / torch", "to target s", "time / torch",
                    "start-up s", "step ms", "sent MB/step"], table), "",
            f"![validation loss against wall time](img/{picture})", ""]


def collectives_section(path, img):
    data = _load(path)
    meta, rows, world = data["meta"], data["rows"], data["world_size"]
    stem = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.basename(os.path.dirname(path))
    nested = folder != "results"  # docs/results/<setting>/collectives_p*.json
    stem = f"{stem}-{folder}" if nested else stem
    plot_collectives(rows, os.path.join(img, stem + ".png"), world)
    algorithms = [a for a in dict.fromkeys(r["algorithm"] for r in rows) if a != "native"]
    by_size = {}
    for r in rows:
        by_size.setdefault(r["bytes"], {})[r["algorithm"]] = r
    table = []
    for size, mine in sorted(by_size.items()):
        cells = [human_bytes(size), _num(mine.get("native", {}).get("time_us"), "{:.0f}")]
        for a in algorithms:
            r = mine.get(a, {})
            ratio = _num(r.get("ratio_to_native"), "{:.2f}")
            cells.append(ratio + (f" ({r['picked']})" if r.get("picked") else ""))
        table.append(cells)
    title = f"## collectives.py: all-reduce on {world} ranks" + (f" ({folder})" if nested else "")
    return [title, "", _made_by(meta),
            "Cells: median over interleaved repetitions of each algorithm's time / the backend's "
            "own all-reduce (native) at that size, the slowest rank's time; `native_again` is "
            "native timed a second time, the run's noise floor; auto's pick in brackets.", "",
            _table(["size", "native us", *[f"{a} / native" for a in algorithms]], table), "",
            f"![all-reduce time against size](img/{stem}.png)", ""]


def kernels_section(path):
    data = _load(path)
    meta = data["meta"]
    table = [[r["setting"], r["op"], f"{r['fused_gbs']:.1f}", f"{r['unfused_gbs']:.1f}",
              f"{r['time_ratio']:.2f}", f"{r['copy_fraction']:.2f}"] for r in data["rows"]]
    return [f"## kernels.py: compression kernels to {data['dtype']} on {data['where']}", "",
            _made_by(meta),
            f"{data['mib']} MiB of float32 to {data['dtype']} on {data['where']}. GB/s counts "
            "the bytes an op must move at least; the last column is the fraction of a plain "
            "copy's bandwidth the fused kernel reaches.", "",
            _table(["setting", "op", "fused GB/s", "torch ops GB/s", "fused / torch time",
                    "fused / copy"], table), ""]


def render(results, img):
    """The page's text; writes the pictures into `img` as it goes."""
    os.makedirs(img, exist_ok=True)
    lines = ["# Results", "",
             "Generated by `python benchmarks/report.py` (`make docs`) from the files in "
             "[`docs/results/`](results/); do not edit it by hand. To refresh a section, run "
             "the command it names with `--out docs/results` (kernels.py: `--json "
             "docs/results/kernels.json`), then `make docs`. "
             "[benchmarks.md](benchmarks.md) explains the columns.", ""]
    if os.path.exists(os.path.join(results, "compare.json")):
        lines += compare_section(os.path.join(results, "compare.json"), img)
    if os.path.exists(os.path.join(results, TRACE)):
        lines += timeline_section(os.path.join(results, TRACE), img)
    for path in sorted(glob.glob(os.path.join(results, "*", "compare.json"))):
        lines += compare_section(path, img)
    for path in sorted(glob.glob(os.path.join(results, "*", "time_to_loss.json"))):
        lines += time_to_loss_section(path, img)
    for path in sorted(glob.glob(os.path.join(results, "collectives_p*.json")) +
                       glob.glob(os.path.join(results, "*", "collectives_p*.json"))):
        lines += collectives_section(path, img)
    for path in sorted(glob.glob(os.path.join(results, "kernels*.json")) +
                       glob.glob(os.path.join(results, "*", "kernels*.json"))):
        lines += kernels_section(path)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=os.path.join(REPO, "docs", "results"))
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results.md"))
    p.add_argument("--pages", nargs="+", default=[README, PERFORMANCE],
                   help="the pages whose generated blocks to update")
    p.add_argument("--check", action="store_true",
                   help="compare with the existing pages instead of writing them (pictures are "
                        "drawn into a scratch folder)")
    args = p.parse_args(argv)
    pages = {}
    for page in args.pages:
        with open(page) as f:
            old = f.read()
        pages[page] = (old, readme_blocks(old, args.results))
    if args.check:
        import tempfile
        with tempfile.TemporaryDirectory() as scratch:
            text = render(args.results, scratch)
        with open(args.out) as f:
            pages[args.out] = (f.read(), text)
        stale = [page for page, (old, new) in pages.items() if old != new]
        if stale:
            sys.exit(f"{', '.join(stale)}: out of date with {args.results}; run `make docs`")
        print(f"{', '.join(pages)}: up to date")
        return
    pages[args.out] = (None, render(args.results, os.path.join(os.path.dirname(args.out), "img")))
    for page, (_, text) in pages.items():
        with open(page, "w") as f:
            f.write(text)
    print(f"wrote {', '.join(pages)}")


if __name__ == "__main__":
    main()
