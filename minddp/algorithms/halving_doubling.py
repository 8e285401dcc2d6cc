"""Halving-doubling all-reduce (Rabenseifner): recursive halving, then recursive doubling.

With q = p a power of two: in reduce-scatter step d = q/2, q/4, ..., 1 each
rank swaps half of its current range with the partner rank ^ d and adds the
half it keeps; after log2 q steps rank v holds the full sum of chunk v. The
all-gather retraces the steps (d = 1, 2, ..., q/2), doubling the range held.
Other p: the first 2(p - q) ranks pair up, each even one folds its tensor into
the odd one above it before, and gets the result back after.

Cost for n bytes, q = 2^floor(log2 p) (the fold adds 2 alpha + 2 n beta + n gamma):
    T = 2 log2(q) alpha + 2(q-1)/q n beta + (q-1)/q n gamma
The ring's bandwidth with log p instead of p steps: it wins at medium sizes
on 4+ ranks; on 2 ranks it is the ring.

Every rank ends bitwise identical: each chunk is summed on one rank only, then
copied (codec wires are forwarded as received; the unfold sends raw bits).
"""
import math

from minddp import registry
from minddp.algorithms import p2p

FOLD, HALVING, DOUBLING, UNFOLD = 30, 31, 32, 33  # p2p tags, one per phase


def all_reduce(tensor, group=None, codec=None, error=None):
    """In-place sum of `tensor` over `group` (every rank calls it); returns the tensor."""
    return p2p.run("halving_doubling", _halving_doubling, tensor, group, codec, error=error)


def cost(nbytes, p, c):
    """Predicted seconds (the formula above; c: cost_model.Costs)."""
    q = 1 << (p.bit_length() - 1)
    fold = 0.0 if q == p else 2 * c.alpha + nbytes * (2 * c.beta + c.gamma)
    return fold + 2 * math.log2(q) * c.alpha + (q - 1) / q * nbytes * (2 * c.beta + c.gamma)


registry.register_algorithm("halving_doubling", all_reduce, cost=cost, per_hop=True,
                            runs_on=p2p.runs_on)


def _halving_doubling(link):
    p, r = link.size, link.rank
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    everything = link.segments(0, link.numel)
    if r < 2 * extra and r % 2 == 0:  # folded: hand over the data, wait for the sum
        link.exchange([(r + 1, view) for view in everything], [], "add", FOLD)
        link.exchange([], [(r + 1, view) for view in everything], "set", UNFOLD, plain=True)
        return
    if r < 2 * extra:
        link.exchange([], [(r - 1, view) for view in everything], "add", FOLD)
    v = r // 2 if r < 2 * extra else r - extra  # rank among the q that take part

    def real(w):
        return 2 * w + 1 if w < extra else w + extra

    chunks = [link.segments(start, end) for start, end in p2p.chunk_bounds(link.numel, q)]
    lo, hi = 0, q
    d = q // 2
    while d >= 1:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
        sends = [(real(v ^ d), view) for c in range(*give) for view in chunks[c]]
        recvs = [(real(v ^ d), view) for c in range(*keep) for view in chunks[c]]
        link.exchange(sends, recvs, "add", HALVING)
        lo, hi = keep
        d //= 2
    wires = {v: [link.wire(view, final=True) for view in chunks[v]]}
    d = 1
    while d < q:
        mine = range(v - v % d, v - v % d + d)
        theirs = range((v ^ d) - (v ^ d) % d, (v ^ d) - (v ^ d) % d + d)
        sends = [(real(v ^ d), wire) for c in mine for wire in wires[c]]
        recvs = [(real(v ^ d), view) for c in theirs for view in chunks[c]]
        got = iter(link.exchange(sends, recvs, "set", DOUBLING))
        wires.update({c: [next(got) for _ in chunks[c]] for c in theirs})
        d *= 2
    if r < 2 * extra:
        link.exchange([(r - 1, [view]) for view in everything], [], "set", UNFOLD)
