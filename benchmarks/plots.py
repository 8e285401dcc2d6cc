"""PNG plots of benchmark results (matplotlib, no display needed)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_compare(rows, path):
    """One panel per workload: a bar of median step time per configuration,
    with the no_comm floor (local compute only) as a dashed line."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == workload and r.get("step_ms") is not None]
        names = [r["name"] for r in mine]
        ax.bar(names, [r["step_ms"] for r in mine],
               color=["#999999" if n == "no_comm" else "#d62728" if n.startswith("torch")
                      else "#1f77b4" for n in names])
        floor = [r["step_ms"] for r in mine if r["name"] == "no_comm"]
        if floor:
            ax.axhline(floor[0], linestyle="--", color="black", linewidth=1,
                       label="no_comm floor")
            ax.legend(loc="lower right")
        world = mine[0]["world_size"] if mine else "?"
        ax.set_title(f"{workload} ({world} ranks)")
        ax.set_ylabel("median step time (ms)")
        ax.tick_params(axis="x", rotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_collectives(rows, path, world):
    """Left: all-reduce time against message size per algorithm (log-log); right: each
    algorithm's time relative to the backend's own all-reduce."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == name]
        sizes = [r["bytes"] for r in mine]
        left.plot(sizes, [r["time_us"] for r in mine], marker="o", label=name)
        if name != "native" and mine[0]["ratio_to_native"] is not None:
            right.plot(sizes, [r["ratio_to_native"] for r in mine], marker="o", label=name)
    left.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="median time (us)",
             title=f"all-reduce time, {world} ranks")
    right.axhline(1.0, color="black", linewidth=1, linestyle="--")
    right.set(xscale="log", xlabel="message bytes", ylabel="time / native (median of pairs)",
              title="relative to the backend's all-reduce")
    left.legend()
    if right.get_legend_handles_labels()[0]:  # nothing but native: no ratios to plot
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(rows, path):
    """Throughput (samples/s over all ranks) against the number of ranks."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in dict.fromkeys((r["workload"], r["name"]) for r in rows):
        mine = [r for r in rows if (r["workload"], r["name"]) == key]
        ax.plot([r["world_size"] for r in mine], [r["samples_per_s"] for r in mine], marker="o",
                label=" ".join(key))
    ax.set_xlabel("ranks")
    ax.set_ylabel("samples/s (all ranks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(events, path):
    """One training step of one rank from a minddp Chrome trace (minddp.timeline): the
    backward span and each bucket's ready mark on the training thread, each bucket's
    all-reduce on the communication thread, and the finalize that writes .grad."""
    steps = [e for e in events if e["name"] == "backward"]
    if not steps:
        raise ValueError("the trace holds no backward span: was it recorded with a timeline?")
    backward = steps[-1]
    start = backward["ts"]
    finalize = next(e for e in events if e["name"] == "finalize" and e["ts"] >= start)
    end = finalize["ts"] + finalize["dur"]
    comm = [e for e in events if e["name"].startswith("comm b") and start <= e["ts"] <= end]
    ready = [e for e in events if e["name"].startswith("ready b") and start <= e["ts"] <= end]

    def ms(t):
        return (t - start) / 1e3
    fig, ax = plt.subplots(figsize=(9, 2.6))
    ax.broken_barh([(0, backward["dur"] / 1e3)], (1.6, 0.8), color="#bbbbbb")
    ax.text(backward["dur"] / 2e3, 2.0, "backward", ha="center", va="center")
    ax.broken_barh([(ms(finalize["ts"]), max(finalize["dur"] / 1e3, 0.05))], (1.6, 0.8),
                   color="#2ca02c")
    for e in ready:
        ax.plot([ms(e["ts"])] * 2, [1.5, 2.5], color="#d62728", linewidth=1.5)
        ax.text(ms(e["ts"]), 2.55, e["name"].split()[1], ha="center", va="bottom", fontsize=8)
    for e in comm:
        ax.broken_barh([(ms(e["ts"]), e["dur"] / 1e3)], (0.2, 0.8), color="#1f77b4",
                       edgecolor="white")
        ax.text(ms(e["ts"]) + e["dur"] / 2e3, 0.6, e["name"].split()[1], ha="center",
                va="center", color="white", fontsize=8)
    ax.set_yticks([0.6, 2.0], ["comm thread", "training thread"])
    ax.set_ylim(0, 3.0)
    ax.set_xlabel("ms since the first gradient hook (red: bucket ready, green: finalize)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss_against_time(rows, path):
    """Validation loss against training wall time, one line per configuration, with the
    target loss dashed (time_to_loss.py)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        curve = row["curve"]
        ax.plot([seconds for _, seconds, _ in curve], [loss for _, _, loss in curve],
                marker=".", label=row["name"])
    if rows:
        ax.axhline(rows[0]["target"], linestyle="--", color="black", linewidth=1,
                   label="target")
    ax.set_xlabel("training wall time (s, validation excluded)")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
