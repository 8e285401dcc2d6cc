"""What every benchmark script needs: start-up, timing statistics, progress, tables.

Statistics follow one rule: configurations are measured interleaved, step by
step, and a ratio is the median of per-step ratios, so a slow patch of the
machine (another process, a frequency drop) slows both sides of a ratio.
"""
import datetime
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist


def init_distributed(device="cpu"):
    """Join the torchrun world; return (rank, world_size, device).

    On CPU the cores are split between the local ranks, so N ranks on N cores
    do not fight over threads. On CUDA a rank gets its own GPU and NCCL when
    there are enough GPUs, and otherwise shares GPU 0 through gloo (NCCL
    cannot put two ranks on one GPU).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # MINDDP_BENCH_THREADS: set by multinode.sh, whose "nodes" share this machine.
    threads = os.environ.get("MINDDP_BENCH_THREADS")
    torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // local_world))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch has no CUDA device here")
        own_gpu = torch.cuda.device_count() >= local_world
        dev = torch.device("cuda", local_rank if own_gpu else 0)
        torch.cuda.set_device(dev)
        backend = "nccl" if own_gpu and dist.is_nccl_available() else "gloo"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    return dist.get_rank(), dist.get_world_size(), dev


def run_distributed(run, args):
    """A benchmark's main under torchrun: join the world on args.device, call
    run(args, rank, world_size, device) on every rank, leave the world."""
    rank, world_size, device = init_distributed(args.device)
    try:
        return run(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


def timed(fn, device):
    """Milliseconds `fn()` takes, started on every rank together (a barrier first)."""
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def rotated(items, step):
    """`items` starting at position step % len: interleaved configurations take turns going
    first, so none always runs right after the same other one."""
    k = step % len(items)
    return items[k:] + items[:k]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values):
    return statistics.median(values) if values else float("nan")


def step_ratios(a, b):
    """a[i] / b[i] for each step (b[i] > 0): pairs timed side by side."""
    return [x / y for x, y in zip(a, b) if y > 0]


def pairwise_ratio(a, b):
    """Median over steps of a[i] / b[i]: fair when a and b were timed interleaved."""
    return median(step_ratios(a, b))


def median_interval(values, confidence=0.95):
    """A distribution-free interval for the median of `values`: (low, high).

    The k-th smallest and k-th largest values, with k the largest rank at
    which the chance that the true median lies outside is at most
    1 - confidence (each value falls below the median with probability 1/2,
    so the count below it is binomial(n, 1/2)). No resampling, and no
    assumption about the shape of the noise. (nan, nan) when too few values
    (n < 6 at 95%).
    """
    xs, n = sorted(values), len(values)
    k, below = 0, 0.0  # below: P(fewer than k + 1 of n values under the median)
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n
        if 2 * below > 1 - confidence:
            break
        k += 1
    if k == 0:
        return float("nan"), float("nan")
    return xs[k - 1], xs[n - k]


def interval_or_none(values, confidence=0.95):
    """median_interval as [low, high] (JSON-ready); None when there are too few values."""
    low, high = median_interval(values, confidence)
    return None if low != low else [low, high]


def pairwise_ratio_interval(a, b, confidence=0.95):
    """The interval of the per-step ratios a[i] / b[i] that pairwise_ratio takes the median of."""
    return interval_or_none(step_ratios(a, b), confidence)


def format_interval(bounds, digits=2):
    """[low, high] as "0.97-1.02" for a table cell; None (too few pairs) as a blank "-"."""
    return None if bounds is None else f"{bounds[0]:.{digits}f}-{bounds[1]:.{digits}f}"


def step_differences(a, b):
    """a[i] - b[i] for each step: pairs timed side by side."""
    return [x - y for x, y in zip(a, b)]


def pairwise_difference(a, b):
    return median(step_differences(a, b))


def slowest_rank(times):
    """Per-step times as the slowest rank saw them (a step ends when every rank is done).

    The tensor goes where the default group's backend takes it: NCCL reduces
    CUDA tensors only (a CPU one raises "No backend type associated with
    device type cpu"), gloo CPU ones.
    """
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def thread_cpu_ns():
    """{thread name: nanoseconds on a CPU so far}, summed over this process's other threads.

    Not the calling thread: reading /proc takes it about 0.1 ms, so time it
    with time.thread_time_ns() around what it does. The others come from
    /proc/self/task/*/schedstat (exact, unlike the tick-sampled utime/stime);
    gloo names its event loop "gloo_tcp_loop" and its collective workers
    "pt_gloo_runloop". Empty where /proc lacks them.
    """
    me = threading.get_native_id()
    totals = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended while we read
        totals[name] = totals.get(name, 0) + ns
    return totals


def peak_rss_mb():
    """This process's peak resident memory (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Progress:
    """Progress on stderr, from rank 0 only: a redrawn bar on a terminal, and a
    line per tenth of the work when stderr is a file or a pipe (CI logs)."""

    def __init__(self, total, label, enabled=True, width=30):
        self.total, self.label, self.enabled, self.width = total, label, enabled, width
        self.done, self.start = 0, time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, note=""):
        self.done += 1
        tenth = self.done * 10 // max(1, self.total) != (self.done - 1) * 10 // max(1, self.total)
        if not self.enabled or not (self.tty or tenth):
            return
        filled = self.width * self.done // max(1, self.total)
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{self.done}/{self.total} {elapsed:5.0f}s eta {eta:4.0f}s {note:<24}")
        end = "\n" if (self.done == self.total or not self.tty) else ""
        sys.stderr.write(("\r" if self.tty else "") + line + end)
        sys.stderr.flush()


def provenance():
    """Where and how a result file was made, stored in it so that a figure in the docs
    names the command that reproduces it, the commit and the machine."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), _REPO)
    launcher = (f"torchrun --nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}"
                if "LOCAL_WORLD_SIZE" in os.environ else "python")
    # MINDDP_BENCH_COMMAND: set by multinode.sh, whose own command line is the one to rerun.
    command = os.environ.get("MINDDP_BENCH_COMMAND") or " ".join([launcher, script,
                                                                   *sys.argv[1:]])
    return {"command": command, "commit": _commit(),
            "machine": _machine(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat()}


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _commit():
    """The checkout's commit, "+changes" when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", "-C", _REPO, *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short=7", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+changes" if dirty else "")) or "unknown"


def _machine():
    cpu = platform.processor() or platform.machine()
    memory_gib = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            memory_gib = round(int(f.readline().split()[1]) / 2**20)
    except OSError:
        pass
    text = f"{os.cpu_count()} x {cpu}" + (f", {memory_gib} GiB" if memory_gib else "")
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


def human_bytes(n):
    """A message size for a table: "4 B", "64 KiB", "25 MiB"."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def format_table(rows, columns):
    """Render dict rows as an aligned text table; `columns` is [(key, header, format)]."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(key) is None else fmt.format(row[key]))
                      for key, _, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
