"""Alpha-beta cost model: predicts each algorithm's all-reduce time from measured link costs.

    alpha  seconds per step in which every rank sends and receives (ring and
           halving-doubling steps), latency and our overhead included
    hop    seconds per one-way hop (a tree's steps)
    beta   seconds per byte on the wire
    gamma  seconds per byte to add two buffers locally
    native_alpha, native_beta   a line fitted to the backend's own all-reduce
Each registered algorithm's `cost(nbytes, p, costs)` holds its formula (see its
docstring); `predict` looks it up. `measure(group)` is
a collective: every rank of the group calls it, and all get the same Costs
(each value is the maximum over ranks, which is exact), so every rank
predicts, and picks, the same algorithm for the same bucket.
"""
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minddp import devices, registry
from minddp.algorithms import p2p, ring, tree

log = logging.getLogger("minddp.algorithms")

# Message sizes (bytes) of the measurements; SMALL gives each of up to 16
# ranks a non-empty chunk, so a small ring takes all its 2(p-1) steps.
SMALL, LARGE = 64, 4 << 20


@dataclass(frozen=True)
class Costs:
    alpha: float
    hop: float
    beta: float
    gamma: float
    native_alpha: float
    native_beta: float


def predict(algorithm, nbytes, p, c):
    """Predicted seconds for an all-reduce of `nbytes` over `p` ranks with the registered
    `algorithm` (its cost formula), or None where it has none."""
    if p == 1 or nbytes == 0:
        return 0.0
    cost = registry.algorithm(algorithm).cost
    return None if cost is None else cost(nbytes, p, c)


def fit(sizes, seconds):
    """Least-squares line seconds = alpha + beta * size; both clipped at 0."""
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    var = sum((x - mean_x) ** 2 for x in sizes)
    beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds)) / var if var else 0.0
    beta = max(beta, 0.0)
    return max(mean_y - beta * mean_x, 0.0), beta


# Measurements taken again when they are impossible (see measure).
ATTEMPTS = 3


def can_measure(group):
    """Whether measure() can run on `group`: it calibrates on the ring and the tree."""
    return p2p.runs_on(group)


def measure(group, repeats=(15, 7)):
    """Measure Costs on `group`; a collective (every rank calls it).

    An attempt is a few dozen all-reduces. A large message can never take
    less time per byte than nothing: when beta or the backend's per-byte cost
    comes out as zero, the small messages were timed in a busy spell (on a
    loaded machine a small all-reduce can take many times its usual time),
    and the whole measurement runs again, up to ATTEMPTS times. Every rank
    tests the agreed values, so all retry together.
    """
    for attempt in range(1, ATTEMPTS + 1):
        costs = _measure_once(group, repeats)
        if costs.beta > 0 and costs.native_beta > 0:
            break
        log.debug("minddp cost model: attempt %d gave %s, which cannot be right%s", attempt,
                  costs, "; measuring again" if attempt < ATTEMPTS else "; keeping it")
    return costs


def _measure_once(group, repeats):
    """One measurement of every cost, agreed across the group.

    Each latency is calibrated on the algorithm whose step count it sets, run
    through send/recv as it really runs (Python overhead, scheduling of the
    ranks on their cores included): alpha = a small ring all-reduce / its
    2(p-1) steps, hop = a small tree all-reduce / its `tree.hops(p)`, beta =
    a ring all-reduce of LARGE bytes less its alpha and gamma terms, per byte
    sent. The backend's all-reduce is timed at both sizes, interleaved with
    ours, so a busy moment slows both alike.
    """
    p = group.size()
    # Every tensor on the group's device: that is where the buckets will be.
    device = devices.group_device(group)
    small = torch.zeros(SMALL // 4, device=device)
    large = torch.zeros(LARGE // 4, device=device)
    ring_small, tree_small, native_small = interleaved(
        [lambda: ring.all_reduce(small, group), lambda: tree.all_reduce(small, group),
         lambda: dist.all_reduce(small, group=group)], repeats[0], group, device)
    alpha = ring_small / (2 * (p - 1))
    hop = tree_small / max(1, tree.hops(p))
    # A private generator: measuring must not move the user's RNG (dropout masks).
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.rand(LARGE // 4, generator=g, device=device)
    b = torch.rand(LARGE // 4, generator=g, device=device)
    gamma = interleaved([lambda: a.add_(b)], repeats[1], device=device)[0] / LARGE
    ring_large, native_large = interleaved([lambda: ring.all_reduce(large, group),
                                             lambda: dist.all_reduce(large, group=group)],
                                            repeats[1], group, device)
    share = (p - 1) / p * LARGE
    beta = max(0.0, (ring_large - 2 * (p - 1) * alpha - share * gamma) / (2 * share))
    native_alpha, native_beta = fit((SMALL, LARGE), (native_small, native_large))
    agreed = torch.tensor([alpha, hop, beta, gamma, native_alpha, native_beta],
                          dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return Costs(*agreed.tolist())


def interleaved(fns, repeats, group=None, device=None):
    """Lower-quartile seconds of each fn, run in turns after one untimed warm-up round.

    The lower quartile, not the median: busy spells only ever slow calls down,
    and on a loaded machine they come and go every few tens of milliseconds,
    long enough to cover half of a measurement. With a group, every call
    starts after a barrier: otherwise a rank that left the previous call early
    would time its wait for the others. On a CUDA `device` each call is timed
    to the end of the work it queued.
    """
    times = [[] for _ in fns]
    synchronize = device is not None and device.type == "cuda"
    for rep in range(repeats + 1):
        for fn, mine in zip(fns, times):
            if group is not None:
                devices.barrier(group)
            start = time.perf_counter()
            fn()
            if synchronize:
                torch.cuda.synchronize(device)
            if rep:
                mine.append(time.perf_counter() - start)
    return [sorted(t)[len(t) // 4] for t in times]
