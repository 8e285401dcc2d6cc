"""bucket_cap_mb="auto": bucket boundaries planned from when gradients are ready.

With a fixed cap the buckets are whatever the cap makes of the model: with
torch's 25 MiB a transformer's gradients mostly sit in one bucket that is
ready only when backward ends, and all of its communication is exposed. A
plan does better by looking at the run itself:

  1. Until the plan, buckets follow PROBE_CAPS_MB: small first buckets, so
     the first steps already overlap somewhat.
  2. In the synced backwards MEASURED the reducer notes when each
     parameter's gradient became ready (microseconds after backward began).
  3. After the backward of synced forward PLAN_AT, every rank (a joined one
     too) measures the link as the wrapper uses it (`measure_link`: one
     bucket reduction's alpha + beta * bytes, and the slowdown a reduction
     causes to computation beside it), and the ranks agree on the slowest
     rank's figures with one all-reduce MAX.
  4. `plan` puts the parameters in that ready order and chooses where buckets
     end. Every rank computes the same plan from the same numbers, and the
     reducer rebuilds its buckets once, as torch rebuilds its buckets after
     the first iteration.

The model: a bucket of b bytes takes alpha + beta * b on the link, and
starts when its last gradient is ready and the bucket before it is done.
With F(j) the earliest moment the first j parameters' buckets can all be
done,

    F(i) = min over j < i of  max(ready(i), F(j)) + alpha + beta * bytes(j..i)

which is exact for this model because F only grows with its predecessor's
finish. Large buckets pay alpha less often; small ones start sooner; the
last bucket comes out small, so little is left to send after backward. The
model leaves out that a reduction can slow backward down (on a CPU whose
cores backward needs); `plan` weighs that with `simulate`.
"""
import dataclasses
import functools
import logging
import time

import torch
import torch.distributed as dist

from minddp.algorithms.cost_model import fit, interleaved
from minddp import buckets
from minddp.algorithms import native
from minddp.buckets import FIRST_BUCKET_BYTES
from minddp.reduction import bucket_storage, setup_collective
from minddp.devices import barrier

log = logging.getLogger("minddp.overlap")

PROBE_CAPS_MB = (0.25, 1, 4, 16)
MEASURED = (2, 3)  # synced forwards whose backward is measured (the first warms up)
PLAN_AT = MEASURED[-1]
# Boundaries the plan considers: parameters are grouped into at most this many
# runs of consecutive ready order (planning is quadratic in their number).
MAX_ATOMS = 400
MIN_ALPHA_US = 20.0  # a launch costs at least this much, whatever the fit says
LINK_BYTES = (64 << 10, 4 << 20)  # the sizes measure_link times
LINK_REPEATS = 5
ALPHA_SCALES = (1, 4, 16, 64, 256)
TIE_SHARE = 0.01  # ends closer than this share apart: the plan with fewer buckets wins


def probe_limits():
    return [int(mb * 1024 * 1024) for mb in PROBE_CAPS_MB]


class Recorder:
    """When each parameter's gradient became ready in the measured backwards (this rank)."""

    def __init__(self, count):
        # summed over measured passes; on the host (agree() moves it to the group's device)
        self.ready = torch.zeros(count, dtype=torch.float64, device="cpu")
        self.passes = 0
        self._marks = None

    def measuring(self, forwards):
        return forwards in MEASURED

    def begin(self):
        self._marks = {}

    def ready_at(self, index, us):
        self._marks[index] = us

    def end(self, start_us):
        """The backward is over: keep its notes."""
        for index, us in self._marks.items():
            self.ready[index] += us - start_us
        self._marks = None
        self.passes += 1

    def times(self):
        """Mean microseconds from the start of backward to each gradient."""
        return self.ready / max(1, self.passes)


def measure_link(reduce, submit, group, device, dtype=torch.float32, announce=None):
    """(alpha, beta, slowdown) of one whole bucket reduction as the wrapper runs it.

    `reduce(tensor)` reduces and waits, `submit(tensor)` starts one and returns
    its Future; `announce(tensors)`, if given, is told the tensors first (auto
    then picks for their sizes without timing them: they are probes). alpha and
    beta (microseconds, and per byte): a line through the time of LINK_BYTES
    sizes, each the lower quartile of a few runs after a barrier
    (cost_model.interleaved). slowdown: how much of a reduction's time
    the computation running beside it loses (0: none, the link is waiting on the
    wire or another device computes; 1: the reduction takes the cores backward
    needs, as over loopback on a busy host). A collective on `group`.
    """
    small, large = (torch.zeros(n * 8 // torch.finfo(dtype).bits, dtype=dtype, device=device)
                    for n in LINK_BYTES)
    if announce is not None:
        announce([small, large])
    seconds = interleaved([lambda: reduce(small), lambda: reduce(large)], LINK_REPEATS,
                          group, device)
    alpha, beta = fit([small.nbytes, large.nbytes], seconds)
    return alpha * 1e6, beta * 1e6, _slowdown(lambda: submit(large), seconds[1], group, device)


def _slowdown(start_reduction, busy_s, group, device):
    """Share of a reduction's `busy_s` seconds that a computation beside it loses."""
    a = torch.ones(128, 128, device=device)
    work = [1]

    def compute():
        for _ in range(work[0]):
            torch.mm(a, a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    alone = interleaved([compute], 1, device=device)[0]
    work[0] = max(1, int(busy_s / max(alone, 1e-7)))  # as long as the reduction
    alone = interleaved([compute], 3, device=device)[0]
    lost = []
    for _ in range(3):
        barrier(group)
        future = start_reduction()
        began = time.perf_counter()
        compute()
        lost.append(time.perf_counter() - began - alone)
        future.wait()
    return min(1.0, max(0.0, sorted(lost)[1] / busy_s))


@dataclasses.dataclass
class Plan:
    buckets: list     # lists of parameter indices, in launch order
    ready_us: list    # per bucket: when its last gradient is ready (agreed)
    done_us: list     # per bucket: when its reduction should be done (simulate)
    end_us: float     # when backward and every reduction should be over
    link: tuple       # (alpha, beta, slowdown) it was planned for

    def describe(self):
        alpha, beta, slowdown = self.link
        return {"buckets": len(self.buckets), "alpha_us": round(alpha, 1),
                "beta_us_per_mb": round(beta * 2**20, 1), "slowdown": round(slowdown, 2),
                "ready_ms": [round(t / 1e3, 2) for t in self.ready_us],
                "done_ms": [round(t / 1e3, 2) for t in self.done_us],
                "end_ms": round(self.end_us / 1e3, 2)}


def agree(times, link, group, device):
    """The slowest rank's ready times and link figures: an all-reduce MAX, a
    collective on `group` (a joined rank takes part with zeros)."""
    agreed = torch.cat([times, torch.tensor(link, dtype=torch.float64, device="cpu")]).to(device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    agreed = agreed.cpu().tolist()
    return agreed[:-len(link)], tuple(agreed[-len(link):])


def plan(params, times, link, sparse=None):
    """The plan for `params` (registration order) from the agreed ready times
    (microseconds) and link figures (measure_link); `sparse[i]`, where given,
    whether parameter i expects a sparse gradient: it is planned as a group of
    its own, so it stays alone in its bucket (buckets.py).

    The dynamic programme above knows nothing of slowdown: a reduction that
    takes cores from backward delays every gradient after it. So it plans for
    several per-bucket costs (ALPHA_SCALES times alpha: larger ones give fewer,
    larger buckets), torch's fixed layout is added, and `simulate`, which does
    count the slowdown, picks the one that ends soonest.
    """
    alpha, beta, slowdown = link
    alpha = max(alpha, MIN_ALPHA_US)
    groups = {}
    for i in sorted(range(len(params)), key=lambda i: (times[i], -i)):
        p = params[i]
        key = ("sparse", i) if sparse is not None and sparse[i] else (p.dtype, p.device)
        groups.setdefault(key, []).append(i)
    size = [p.numel() * p.element_size() for p in params]
    layouts = [_fixed(groups.values(), size)]
    for scale in ALPHA_SCALES:
        layouts.append([b for order in groups.values() for b in _split(
            order, [times[i] for i in order], [size[i] for i in order], alpha * scale, beta)])
    best = None
    for layout in layouts:
        layout.sort(key=lambda b: max(times[i] for i in b))
        ready = [max(times[i] for i in b) for b in layout]
        done, end = simulate(ready, [sum(size[i] for i in b) for b in layout], max(times),
                             alpha, beta, slowdown)
        tie = best is not None and abs(end - best.end_us) <= TIE_SHARE * best.end_us
        if best is None or (end < best.end_us if not tie else len(layout) < len(best.buckets)):
            best = Plan(layout, ready, done, end, (alpha, beta, slowdown))
    return best


def simulate(ready, nbytes, backward_end, alpha, beta, slowdown):
    """When each bucket's reduction is done, and when the step's backward and
    reductions are all over: one bucket at a time on the link, each starting
    once it is ready and the one before is done. While a reduction runs beside
    backward, backward goes at (1 - slowdown) of its speed, which delays it and
    every gradient after it."""
    return simulate_each(ready, [alpha + beta * b for b in nbytes], backward_end,
                         [slowdown] * len(ready))


def simulate_each(ready, took, backward_end, slowdowns):
    """`simulate` with each bucket's own reduction time and slowdown (whatif.py:
    a reduction that waits on a slow wire takes fewer cores than one over loopback)."""
    delay, free, done = 0.0, 0.0, []
    for r, t, slowdown in zip(ready, took, slowdowns):
        start = max(r + delay, free)
        left = backward_end + delay - start  # backward still to run, undisturbed
        if left > 0 and slowdown > 0:
            if slowdown >= 1 or (1 - slowdown) * t < left:
                delay += slowdown * t  # beside backward all along
            else:
                delay += left * slowdown / (1 - slowdown)  # backward ends first
        free = start + t
        done.append(free)
    return done, max(free, backward_end + delay)


def _fixed(groups, size):
    """torch's layout (a 1 MiB first bucket, then 25 MiB) over the ready order."""
    layout = []
    for order in groups:
        bucket, nbytes = [], 0
        for i in order:
            bucket.append(i)
            nbytes += size[i]
            if nbytes >= (FIRST_BUCKET_BYTES if not layout else 25 << 20):
                layout.append(bucket)
                bucket, nbytes = [], 0
        if bucket:
            layout.append(bucket)
    return layout


def _split(order, times, sizes, alpha, beta):
    """Buckets (lists of indices) for parameters in ready order, per the model above."""
    atoms = _atoms(order, times, sizes)
    n = len(atoms)
    total = [0]
    for _, _, nbytes in atoms:
        total.append(total[-1] + nbytes)
    finish, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for i in range(1, n + 1):
        ready = atoms[i - 1][1]
        for j in range(i):
            done = max(ready, finish[j]) + alpha + beta * (total[i] - total[j])
            if done < finish[i]:
                finish[i], cut[i] = done, j
    ends, i = [], n
    while i > 0:
        ends.append(i)
        i = cut[i]
    buckets, start = [], 0
    for end in reversed(ends):
        buckets.append([index for atom in atoms[start:end] for index in atom[0]])
        start = end
    return buckets


def _atoms(order, times, sizes):
    """Consecutive parameters merged into runs of at least total / MAX_ATOMS bytes:
    (indices, ready time of the last, bytes)."""
    least = sum(sizes) / MAX_ATOMS
    atoms, indices, nbytes = [], [], 0
    for index, t, size in zip(order, times, sizes):
        indices.append(index)
        nbytes += size
        if nbytes >= least:
            atoms.append((indices, t, nbytes))
            indices, nbytes = [], 0
    if indices:
        atoms.append((indices, times[-1], nbytes))
    return atoms


def planned_buckets(engine, reducer, device, rank, timeline, ready_times):
    """bucket_cap_mb="auto", once, on every rank together: measure the link as
    buckets use it, agree on ready times and link costs, plan, and build the
    planned buckets (buckets.Bucket, already set up on the reducer's reduction)."""
    # the reduction's own collective; a comm hook is timed as the backend's sum
    run = getattr(reducer.reduction, "collective", None)
    run = run if run is not None else functools.partial(native.all_reduce, group=engine.group)
    link = measure_link(lambda t: engine.run(run, t, label="link"),
                        lambda t: engine.submit(run, t, label="link"),
                        engine.side_group, device, reducer.params[0].dtype,
                        lambda probes: setup_collective(engine, run, probes, True))
    sparse = reducer.expect_sparse  # each alone in its bucket, planned or not
    chosen = plan(reducer.params, *agree(ready_times, link, engine.side_group, engine.device),
                  sparse=sparse)
    planned = buckets.allocate(reducer.params, chosen.buckets, stamp=True, sparse=sparse,
                               zeros=bucket_storage(reducer.reduction, reducer.as_view))
    reducer.reduction.setup(planned)
    log.debug("minddp (rank %d): buckets planned: %s", rank, chosen.describe())
    if timeline is not None:
        timeline.instant("bucket plan", **chosen.describe())
    return planned
