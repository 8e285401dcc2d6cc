"""Alpha-beta cost model: predicts each algorithm's all-reduce time from measured link costs.

    alpha  seconds per step (latency + our per-step overhead), from send/recv exchanges
    beta   seconds per byte on the wire, from the same exchanges at a larger size
    gamma  seconds per byte to add two buffers locally
    native_alpha, native_beta   a line fitted to the backend's own all-reduce
The formulas are the ones in each algorithm's docstring. `measure(group)` is
a collective: every rank of the group calls it, and all get the same Costs
(each value is the maximum over ranks, which is exact), so every rank
predicts, and picks, the same algorithm for the same bucket.
"""
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minddp.algorithms import p2p, tree

SMALL, LARGE = 4, 4 << 20  # message sizes (bytes) of the measurements
TAG = 40  # p2p tag of the measurement exchanges


@dataclass(frozen=True)
class Costs:
    alpha: float
    beta: float
    gamma: float
    native_alpha: float
    native_beta: float


def predict(algorithm, nbytes, p, c):
    """Predicted seconds for an all-reduce of `nbytes` over `p` ranks."""
    if p == 1 or nbytes == 0:
        return 0.0
    if algorithm == "native":
        return c.native_alpha + c.native_beta * nbytes
    if algorithm == "ring":
        return 2 * (p - 1) * c.alpha + (p - 1) / p * nbytes * (2 * c.beta + c.gamma)
    if algorithm == "tree":
        depth, fan = int(math.log2(p)), min(2, p - 1)
        k = math.ceil(nbytes / tree.SEGMENT_BYTES)
        step = c.alpha + fan * nbytes / k * c.beta
        return (depth + k - 1) * (2 * step + fan * nbytes / k * c.gamma)
    if algorithm == "halving_doubling":
        q = 1 << (p.bit_length() - 1)
        fold = 0.0 if q == p else 2 * c.alpha + nbytes * (2 * c.beta + c.gamma)
        return fold + 2 * math.log2(q) * c.alpha + (q - 1) / q * nbytes * (2 * c.beta + c.gamma)
    raise ValueError(f"minddp cost model: no formula for algorithm {algorithm!r}")


def fit(sizes, seconds):
    """Least-squares line seconds = alpha + beta * size; both clipped at 0."""
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    var = sum((x - mean_x) ** 2 for x in sizes)
    beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds)) / var if var else 0.0
    beta = max(beta, 0.0)
    return max(mean_y - beta * mean_x, 0.0), beta


def measure(group, repeats=(15, 5)):
    """Measure Costs on `group`; a collective (every rank calls it), about 0.1 s.

    alpha and beta come from pairwise exchanges through the p2p helper (both
    directions at once, as in a ring step, our Python overhead included), at a
    small and a large size; the backend's all-reduce is timed at the same two
    sizes, interleaved with them, so a busy moment slows both alike.
    """
    rank, p = group.rank(), group.size()
    partner = rank ^ 1  # ranks exchange in pairs (0, 1), (2, 3), ...; an odd one out waits
    exchange, native = [], []
    for nbytes, reps in zip((SMALL, LARGE), repeats):
        send, recv = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
        link = p2p.Link("cost model", recv, group, None, p2p.SEGMENT_BYTES, rank, p)
        times = _interleaved([lambda: partner < p and link.exchange(
                                  [(partner, [send])], [(partner, recv)], "set", TAG),
                              lambda: dist.all_reduce(send, group=group)], reps)
        exchange.append(times[0] if partner < p else 0.0)
        native.append(times[1])
    alpha, beta = fit((SMALL, LARGE), exchange)
    a, b = torch.rand(LARGE // 4), torch.rand(LARGE // 4)
    gamma = _interleaved([lambda: a.add_(b)], repeats[1])[0] / LARGE
    native_alpha, native_beta = fit((SMALL, LARGE), native)
    agreed = torch.tensor([alpha, beta, gamma, native_alpha, native_beta], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return Costs(*agreed.tolist())


def _interleaved(fns, repeats):
    """Median seconds of each fn, run in turns after one untimed warm-up round."""
    times = [[] for _ in fns]
    for rep in range(repeats + 1):
        for fn, mine in zip(fns, times):
            start = time.perf_counter()
            fn()
            if rep:
                mine.append(time.perf_counter() - start)
    return [sorted(t)[len(t) // 2] for t in times]
