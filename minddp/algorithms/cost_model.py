"""Alpha-beta cost model: predicts each algorithm's all-reduce time from measured link costs.

    alpha  seconds per step in which every rank sends and receives (ring and
           halving-doubling steps), latency and our overhead included, from
           pairwise send/recv exchanges
    hop    seconds per one-way hop (a tree's steps), from send/recv round trips
    beta   seconds per byte on the wire, from a ring all-reduce of a known volume
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

from minddp.algorithms import p2p, ring, tree

SMALL, LARGE = 4, 4 << 20  # message sizes (bytes) of the measurements
TAG = 40  # p2p tag of the measurement exchanges


@dataclass(frozen=True)
class Costs:
    alpha: float
    hop: float
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
        segment = fan * nbytes / k
        return ((2 * depth + k - 1) * (c.hop + segment * c.beta) +
                (depth + k - 1) * segment * c.gamma)
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


def measure(group, repeats=(15, 7)):
    """Measure Costs on `group`; a collective (every rank calls it), about 0.1 s.

    alpha: small pairwise exchanges through the p2p helper (both directions at
    once, as in a ring step, our Python overhead included); hop: small round
    trips; beta: a ring all-reduce of LARGE bytes (send/recv of a known volume,
    segmented and added as the algorithms do), less its alpha and gamma terms.
    The backend's all-reduce is timed at both sizes, interleaved with ours, so
    a busy moment slows both alike.
    """
    rank, p = group.rank(), group.size()
    partner = rank ^ 1  # ranks exchange in pairs (0, 1), (2, 3), ...; an odd one out waits
    small, large = torch.zeros(SMALL // 4), torch.zeros(LARGE // 4)
    link = p2p.Link("cost model", small, group, None, p2p.SEGMENT_BYTES, rank, p)
    exchange, native_small = _interleaved(
        [lambda: partner < p and link.exchange([(partner, [small])], [(partner, small)], "set",
                                               TAG),
         lambda: dist.all_reduce(small, group=group)], repeats[0])
    alpha = exchange if partner < p else 0.0
    hop = _round_trip(group, rank, partner, repeats[0]) / 2 if partner < p else 0.0
    # A private generator: measuring must not move the user's RNG (dropout masks).
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(LARGE // 4, generator=g), torch.rand(LARGE // 4, generator=g)
    gamma = _interleaved([lambda: a.add_(b)], repeats[1])[0] / LARGE
    ring_large, native_large = _interleaved([lambda: ring.all_reduce(large, group),
                                             lambda: dist.all_reduce(large, group=group)],
                                            repeats[1])
    share = (p - 1) / p * LARGE
    beta = max(0.0, (ring_large - 2 * (p - 1) * alpha - share * gamma) / (2 * share))
    native_alpha, native_beta = fit((SMALL, LARGE), (native_small, native_large))
    agreed = torch.tensor([alpha, hop, beta, gamma, native_alpha, native_beta],
                          dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return Costs(*agreed.tolist())


def _round_trip(group, rank, partner, repeats):
    """Seconds for a small message there and back, as the first of the pair sees it
    (the second reports 0; the maximum over ranks keeps the first's)."""
    buf = torch.zeros(1)
    link = p2p.Link("cost model", buf, group, None, p2p.SEGMENT_BYTES, rank, group.size())
    if rank < partner:  # like a tree's leaf: send, and wait for the answer
        return _interleaved([lambda: link.exchange([(partner, [buf])], [(partner, buf)], "set",
                                                   TAG)], repeats)[0]
    _interleaved([lambda: (link.exchange([], [(partner, buf)], "set", TAG),
                           link.exchange([(partner, [buf])], [], "set", TAG))], repeats)
    return 0.0


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
