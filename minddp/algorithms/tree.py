"""Tree all-reduce: reduce up a binary tree to rank 0, then broadcast back down.

Ranks form a binary heap: the parent of r is (r - 1) // 2, its children are
2r + 1 and 2r + 2. Going up, each rank adds its children's data into its own
and passes the sum to its parent; going down, each rank takes the total from
its parent and passes it to its children; rank 0 turns each segment around
as soon as it has summed it. Large tensors are cut into segments
that flow through the tree one behind the other (a pipeline): a rank passes
segment j on as soon as it has it, while segment j + 1 is still arriving.

Cost for n bytes on p ranks, tree depth d = floor(log2 p), k segments of n/k,
fan-out f = min(2, p - 1) (a parent's link carries f segments per step); the
way down overlaps the way up (other direction of each link):
    T = (2d + k - 1) (alpha + f n/k beta) + (d + k - 1) f n/k gamma
With k = 1 that is 2d steps: the fewest of the algorithms for small messages
(without a codec, posted straight to the process group: `_one_segment`).
For large ones each rank moves about f n bytes each way, up to f times the ring's.
Two ranks, no codec, up to EXCHANGE_BYTES: the tree is a single edge, and going
up then down is two hops in turn. Instead both ranks act as the root (`_exchange`):
each sends its tensor to the other at once and adds, in one hop:
    T = alpha + n beta + n gamma                          (`hops(p)` is 1)

Under NCCL's rules (p2p.py) neither shortcut is taken: the whole tensor goes
up and down the tree in rounds, one group of messages per tree level.

Every rank ends bitwise identical: only rank 0 holds the final sum, and the
broadcast copies it (with a codec, rank 0's encoding, decoded by all). In the
two-rank exchange both ranks add, in the same order: rank 0's tensor + rank 1's.
"""
import math

import torch

from minddp import registry
from minddp.algorithms import p2p

# One p2p tag: up and down messages travel in opposite directions, so between
# two ranks each direction carries one phase only, in order.
TAG = 20

# Smaller than the ring's segments: the pipeline takes d extra steps to fill,
# each the time of one segment.
SEGMENT_BYTES = 256 << 10
# Two ranks exchange messages up to this size (both send and add everything);
# above it the up-and-down path, which sends each byte once each way, wins.
EXCHANGE_BYTES = 64 << 10


def all_reduce(tensor, group=None, codec=None, error=None):
    """In-place sum of `tensor` over `group` (every rank calls it); returns the tensor."""
    return p2p.run("tree", _tree, tensor, group, codec, segment_bytes=SEGMENT_BYTES,
                   error=error)


def cost(nbytes, p, c):
    """Predicted seconds (the formulas above, pipelined in segments; c: cost_model.Costs)."""
    depth, fan = int(math.log2(p)), min(2, p - 1)
    k = math.ceil(nbytes / SEGMENT_BYTES)
    if p == 2 and nbytes <= EXCHANGE_BYTES:  # the exchange (assumes no codec)
        return hops(p) * (c.hop + nbytes * c.beta) + nbytes * c.gamma
    segment = fan * nbytes / k
    return ((2 * depth + k - 1) * (c.hop + segment * c.beta) +
            (depth + k - 1) * segment * c.gamma)


registry.register_algorithm("tree", all_reduce, cost=cost, per_hop=True, runs_on=p2p.runs_on)


def hops(p):
    """One-way hops, one after another, of a one-segment all-reduce on p ranks."""
    return 1 if p == 2 else 2 * int(math.log2(p))  # 0 for one rank


def _tree(link):
    r = link.rank
    parent = (r - 1) // 2 if r > 0 else None
    children = [c for c in (2 * r + 1, 2 * r + 2) if c < link.size]
    # Whether a rank records its hops (hops.py) must not change which path it takes:
    # the shortcuts' messages differ from the pipeline's (one exchange on 2 ranks).
    if not link.grouped and link.codec is None and link.numel <= link.segment:
        if link.size == 2 and link.numel * link.itemsize <= EXCHANGE_BYTES:
            return _exchange(link, 1 - r)
        return _one_segment(link, parent, children)
    # Rounds under NCCL's rules (p2p.py), by depth t in a tree of depth d:
    # going up, a rank at depth t sends in round d - t; going down, rank 0
    # sends in round d and a rank at depth t receives in round d + t - 1.
    d, t = link.size.bit_length() - 1, (r + 1).bit_length() - 1
    segments = link.segments(0, link.numel)

    def pass_on(i, _):  # segment i // len(children) now holds its subtree's sum
        if i % len(children) != len(children) - 1:
            return []
        view = segments[i // len(children)]
        if parent is not None:
            return [(parent, link.wire(view))]
        final = link.wire(view, final=True)  # rank 0: the total, straight back down
        return [(c, final) for c in children]

    if not children:
        # A leaf sends everything up and takes each total as it comes back
        # down. Receiving into the segments being sent is safe: the parent
        # returns segment j only after all of ours has arrived.
        link.exchange([(parent, view) for view in segments],
                      [(parent, view) for view in segments], "set", TAG,
                      send_round=d - t, recv_rounds=[d + t - 1] * len(segments))
        return
    ups = [(c, view) for view in segments for c in children]
    link.exchange([], ups, "add", TAG, forward=pass_on, recv_rounds=[d - t - 1] * len(ups))
    if parent is not None:
        link.exchange([], [(parent, view) for view in segments], "set", TAG,
                      forward=lambda _, wire: [(c, wire) for c in children],
                      recv_rounds=[d + t - 1] * len(segments))


def _one_segment(link, parent, children):
    """The whole tensor as one message, no codec: the common small bucket.

    The messages of the pipeline with k = 1, posted straight to the process
    group (a leaf posts its receive once its send is done, not before). At a
    few bytes a call is all per-message overhead, and every line of Python
    before or between messages lies on the critical path, so this path skips
    Link.exchange's bookkeeping (windows, rounds, forwarding).
    """
    flat = link.flat
    bufs = [link.scratch(flat, k) for k in range(len(children))]
    # Link._post/_wait: a failed message is reported as the peer's, and noted as a hop
    # while a timeline records.
    received = [link._post("recv", c, [buf], TAG) for c, buf in zip(children, bufs)]
    for posted in received:
        link._wait(posted)
    for buf in bufs:  # in child order, as the pipeline adds them
        flat.add_(buf)
    if parent is not None:
        link._wait(link._post("send", parent, [flat], TAG))
        link._wait(link._post("recv", parent, [flat], TAG))
    sent = [link._post("send", c, [flat], TAG) for c in children]
    for posted in sent:
        link._wait(posted)


def _exchange(link, peer):
    """Two ranks: each is a root, receiving the other's tensor while sending its own.

    One hop where the tree takes two (up, then down): at a few bytes a hop is
    the whole cost, and gloo's own all-reduce takes at least two. Both ranks
    compute rank 0's tensor + rank 1's, so they agree to the bit (the order
    fixes even which NaN payload survives).
    """
    flat = link.flat
    buf = link.scratch(flat, 0)
    received = link._post("recv", peer, [buf], TAG)  # first: the peer's send can go at once
    sent = link._post("send", peer, [flat], TAG)
    link._wait(received)  # bounded by the group's timeout, as in exchange
    link._wait(sent)  # our tensor is read until then: only now may it change
    if link.rank == 0:
        flat.add_(buf)
    else:
        torch.add(buf, flat, out=flat)
