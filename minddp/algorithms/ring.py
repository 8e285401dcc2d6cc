"""Ring all-reduce: reduce-scatter, then all-gather, around the ring r -> r+1.

The tensor is cut into p chunks. In reduce-scatter step s (s = 0..p-2) rank r
sends chunk (r - s) to its right neighbour and adds chunk (r - s - 1) arriving
from its left one; afterwards rank r holds the full sum of chunk (r + 1). The
all-gather passes those finished chunks around the ring in p - 1 more steps.
Each chunk is segmented (p2p.SEGMENT_BYTES) so adding one segment overlaps
receiving the next.

Cost for n bytes on p ranks: 2(p-1) steps, each rank sends 2(p-1)/p * n bytes:
    T = 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma   (gamma: add time per byte)
Bandwidth-optimal; latency grows linearly with p, so small messages prefer a tree.

Every rank ends bitwise identical: each chunk is summed on one rank only and
then copied (with a codec, its owner's encoding is decoded on every rank,
the owner included, and forwarded as received, never re-encoded).
"""
from minddp.algorithms import p2p

REDUCE_SCATTER, ALL_GATHER = 10, 11  # p2p tags, one per phase


def all_reduce(tensor, group=None, codec=None):
    """In-place sum of `tensor` over `group` (every rank calls it); returns the tensor."""
    return p2p.run("ring", _ring, tensor, group, codec)


def _ring(link):
    p, r = link.size, link.rank
    right, left = (r + 1) % p, (r - 1) % p
    chunks = [link.segments(start, end) for start, end in p2p.chunk_bounds(link.numel, p)]
    for s in range(p - 1):
        sends = [(right, link.wire(view)) for view in chunks[(r - s) % p]]
        recvs = [(left, view) for view in chunks[(r - s - 1) % p]]
        link.exchange(sends, recvs, "add", REDUCE_SCATTER)
    wires = [link.wire(view, final=True) for view in chunks[(r + 1) % p]]
    for s in range(p - 1):
        recvs = [(left, view) for view in chunks[(r - s) % p]]
        wires = link.exchange([(right, wire) for wire in wires], recvs, "set", ALL_GATHER)
