"""PNG plots of benchmark results (matplotlib, no display needed)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


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
