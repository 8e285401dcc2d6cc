"""Ring all-reduce: reduce-scatter, then all-gather, around the ring r -> r+1.

The tensor is cut into p chunks. In reduce-scatter step s (s = 0..p-2) rank r
sends chunk (r - s) to its right neighbour and adds chunk (r - s - 1) arriving
from its left one; afterwards rank r holds the full sum of chunk (r + 1). The
all-gather passes those finished chunks around the ring in p - 1 more steps.
On gloo each chunk is segmented (p2p.SEGMENT_BYTES) and the ring is one
pipeline: a segment moves on to the right as soon as it has been added (or,
in the all-gather, received), so adding one segment overlaps receiving the
next and no rank waits for a whole step to end before starting the next one.
Under NCCL's rules (p2p.py) each step is one group: a whole chunk each way.

Cost for n bytes on p ranks: 2(p-1) steps, each rank sends 2(p-1)/p * n bytes:
    T = 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma   (gamma: add time per byte)
Bandwidth-optimal; latency grows linearly with p, so small messages prefer a tree.

Every rank ends bitwise identical: each chunk is summed on one rank only and
then copied (with a codec, its owner's encoding is decoded on every rank,
the owner included, and forwarded as received, never re-encoded).
"""
from minddp import registry
from minddp.algorithms import p2p

REDUCE_SCATTER, ALL_GATHER = 10, 11  # p2p tags, one per phase


def all_reduce(tensor, group=None, codec=None, error=None):
    """In-place sum of `tensor` over `group` (every rank calls it); returns the tensor."""
    return p2p.run("ring", _ring, tensor, group, codec, error=error)


def cost(nbytes, p, c):
    """Predicted seconds (the formula above; c: cost_model.Costs)."""
    return 2 * (p - 1) * c.alpha + (p - 1) / p * nbytes * (2 * c.beta + c.gamma)


registry.register_algorithm("ring", all_reduce, cost=cost, per_hop=True, runs_on=p2p.runs_on)


def _ring(link):
    p, r = link.size, link.rank
    right, left = (r + 1) % p, (r - 1) % p
    chunks = [link.segments(start, end) for start, end in p2p.chunk_bounds(link.numel, p)]
    # Every receive of both phases, in the order the left neighbour sends them.
    steps = ([(chunks[(r - s - 1) % p], "add", REDUCE_SCATTER) for s in range(p - 1)] +
             [(chunks[(r - s) % p], "set", ALL_GATHER) for s in range(p - 1)])
    recvs = [(left, view, how, tag) for views, how, tag in steps for view in views]
    owner = [(s, j) for s, (views, _, _) in enumerate(steps) for j in range(len(views))]

    def move_on(i, wire):
        # Pipelined: each segment goes on to the right as soon as it is
        # combined, not once its whole step is: the reduce-scatter's last step
        # finishes a segment of our own chunk, which starts the all-gather.
        s, j = owner[i]
        view = steps[s][0][j]
        if s < p - 2:
            return [(right, view, REDUCE_SCATTER)]
        if s == p - 2:
            return [(right, link.wire(view, final=True), ALL_GATHER)]
        if s < 2 * p - 3:
            return [(right, wire, ALL_GATHER)]  # forwarded as received: never re-encoded
        return []

    if p == 1 or not recvs:
        return
    sends = [(right, view, REDUCE_SCATTER) for view in chunks[r]]
    # Under NCCL's rules (p2p.py) step s is round s: all of it at once.
    rounds = [s for s, _ in owner] if link.grouped else None
    link.exchange(sends, recvs, forward=move_on, recv_rounds=rounds)
