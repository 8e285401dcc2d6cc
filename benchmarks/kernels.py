"""Throughput of minddp's compression kernels against torch's unfused equivalents and a copy.

    python benchmarks/kernels.py                  # CPU: 1 thread, then all threads
    python benchmarks/kernels.py --device cuda    # the CUDA kernels
    python benchmarks/kernels.py --mib 256 --reps 21 --json results/kernels.json

For a float32 tensor of --mib MiB (default 64: past every cache), each op runs
as the fused kernel (torch.ops.minddp.*) and as the torch ops a user would write
instead; a plain float32 copy (dst.copy_(src)) gives the machine's bandwidth:

    compress         x.abs().max() -> scale; (x * scale).half()
    decompress       packed.float() / scale
    decompress_add_  dst.add_(packed.float(), alpha=1 / scale)

(--dtype int8, a scale per 1024 values: minddp/compression/reference.py's torch ops.)
GB/s counts the bytes an op must move at least (read inputs once, write
outputs once: compress 6 bytes/element, decompress 6, decompress_add_ 10, copy
8; int8 one less), so the fused/copy column is the fraction of copy bandwidth
reached.
Repetitions are interleaved across all variants (a noisy shared machine slows
them alike) and the median is reported. On CUDA each time is the GPU's alone (see
timed()): host dispatch is a per-call cost the step times of compare.py include.

On CPU the script re-runs itself with glibc told to keep freed memory
(GLIBC_TUNABLES below): glibc otherwise returns every block over 32 MiB to the
OS on free, so each op's fresh 32-64 MiB output would be page-faulted in again
and the table would time the kernel's page faults, which real use (1 MiB ring
segments, reused buckets) never pays. --fresh-pages measures that case instead.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

from benchmarks.measure import provenance
from minddp import compression  # loads minddp._C
from minddp.compression import reference
from minddp.compression.reference import scale_from_amax

KEEP_HEAP = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"


def variants(x, dtype):
    """name -> (bytes moved, {impl: callable}) for one float32 tensor x."""
    n, ops = x.numel(), torch.ops.minddp
    packed, scale = ops.compress(x, dtype)
    dst, copy_dst = torch.empty_like(x), torch.empty_like(x)
    wide = 4 + dtype.itemsize  # bytes per element of fp32 in + packed out (or back)
    if dtype == torch.int8:  # a scale per block: the reference's torch ops are the unfused way
        unfused = {"compress": lambda: reference.compress(x, dtype),
                   "decompress": lambda: reference.decompress(packed, scale),
                   "decompress_add_": lambda: reference.decompress_add_(dst, packed, scale)}
    else:
        alpha = 1.0 / scale.item()
        unfused = {"compress": lambda: (x * scale_from_amax(x.abs().max())).to(dtype),
                   "decompress": lambda: packed.float() / scale,
                   "decompress_add_": lambda: dst.add_(packed.float(), alpha=alpha)}
    return {
        "copy": (8 * n, {"torch": lambda: copy_dst.copy_(x)}),
        "compress": (wide * n, {"fused": lambda: ops.compress(x, dtype),
                                "unfused": unfused["compress"]}),
        "decompress": (wide * n, {"fused": lambda: ops.decompress(packed, scale),
                                  "unfused": unfused["decompress"]}),
        "decompress_add_": ((wide + 4) * n, {
            "fused": lambda: ops.decompress_add_(dst, packed, scale),
            "unfused": unfused["decompress_add_"]}),
    }


# Cycles the GPU spins (torch.cuda._sleep) before a timed call, about a millisecond.
HOLD_CYCLES = 2_000_000


def timed(fn, device):
    """Seconds one call of fn takes (CUDA: the GPU's time between events, host dispatch hidden).

    On CUDA a sleep kernel holds the stream while the host enqueues the start event, fn's
    kernels and the end event, so the interval is the kernels' own time: without it, an op's
    host dispatch (the op call, allocations, launches, 10-20 us) sits inside the interval while
    the GPU idles, and a 64 MiB kernel on an H200 takes only 20-40 us. Where the GPU reached the
    start event before the host finished (a longer dispatch, or fn synchronises), the sample
    is retaken with a longer hold, twice at most.
    """
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    hidden = False
    for attempt in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOLD_CYCLES << (2 * attempt))
        start.record()
        fn()
        end.record()
        hidden = not start.query()  # the GPU is still sleeping: fn was enqueued in time
        end.synchronize()
        if hidden:
            break
    if not hidden:
        UNHIDDEN.add(fn)
    return start.elapsed_time(end) / 1e3


UNHIDDEN = set()  # callables a sample of which timed host dispatch too (measure() says which)


def measure(table, device, reps):
    """Median seconds of every callable, repetitions interleaved."""
    times = {(op, impl): [] for op, (_, impls) in table.items() for impl in impls}
    for rep in range(reps + 2):  # two warm-up rounds
        for (op, impl), samples in times.items():
            seconds = timed(table[op][1][impl], device)
            if rep >= 2:
                samples.append(seconds)
    for op, impl in times:
        if table[op][1][impl] in UNHIDDEN:
            print(f"note: {op} ({impl}): some samples include host dispatch (the GPU reached "
                  f"the start event before the host had enqueued the op)")
    return {key: statistics.median(samples) for key, samples in times.items()}


def report(table, seconds, label):
    copy_gbs = table["copy"][0] / seconds[("copy", "torch")] / 1e9
    print(f"\n{label}: plain copy {copy_gbs:.1f} GB/s")
    print(f"{'op':<16} {'fused ms':>9} {'GB/s':>7} {'unfused ms':>11} {'GB/s':>7} "
          f"{'fused/unfused time':>19} {'fused/copy GB/s':>16}")
    rows = []
    for op, (nbytes, _) in table.items():
        if op == "copy":
            continue
        fused, unfused = seconds[(op, "fused")], seconds[(op, "unfused")]
        row = {"setting": label, "op": op, "fused_ms": fused * 1e3, "unfused_ms": unfused * 1e3,
               "fused_gbs": nbytes / fused / 1e9, "unfused_gbs": nbytes / unfused / 1e9,
               "time_ratio": fused / unfused, "copy_fraction": nbytes / fused / 1e9 / copy_gbs}
        rows.append(row)
        print(f"{op:<16} {row['fused_ms']:>9.2f} {row['fused_gbs']:>7.1f} "
              f"{row['unfused_ms']:>11.2f} {row['unfused_gbs']:>7.1f} "
              f"{row['time_ratio']:>19.2f} {row['copy_fraction']:>16.2f}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--mib", type=int, default=64, help="float32 input size in MiB")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per variant")
    p.add_argument("--dtype", default="fp16", choices=sorted(compression.DTYPES))
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--fresh-pages", action="store_true",
                   help="CPU: leave glibc's allocator as it is (outputs page-faulted per call)")
    args = p.parse_args()
    if args.device == "cpu" and not args.fresh_pages and "GLIBC_TUNABLES" not in os.environ:
        os.execve(sys.executable, [sys.executable] + sys.argv,
                  {**os.environ, "GLIBC_TUNABLES": KEEP_HEAP})
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("kernels.py: --device cuda: torch has no CUDA device here")
    if (not compression.HAVE_EXTENSION
            or compression.kernels_for(args.device) is not torch.ops.minddp):
        sys.exit(f"kernels.py: minddp._C has no {args.device} kernels; build it with `make setup`")
    x = torch.randn(args.mib << 18, generator=torch.Generator().manual_seed(0)).to(args.device)
    table = variants(x, compression.DTYPES[args.dtype])
    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"{os.cpu_count()} CPUs, minddp's {sys.modules['minddp._C'].cpu_isa} kernels")
    print(f"minddp kernels: {args.mib} MiB float32 -> {args.dtype} on {where}, torch "
          f"{torch.__version__}, median of {args.reps} interleaved repetitions")
    if args.device == "cpu":
        print(f"allocator: GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(default)')}")
    rows = []
    settings = [("cuda", None)] if args.device == "cuda" else [
        ("cpu, 1 thread", 1), (f"cpu, {os.cpu_count()} threads", os.cpu_count())]
    for label, threads in settings:
        if threads:
            torch.set_num_threads(threads)
        rows += report(table, measure(table, args.device, args.reps), label)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": provenance(), "mib": args.mib, "dtype": args.dtype, "where": where,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
