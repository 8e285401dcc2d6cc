"""Lanes: on gloo, one connection per direction between two ranks.

gloo joins two ranks by one TCP connection, guarded by one lock. A send whose
receive the peer has already posted is written by the thread that posts it,
holding that lock for the whole write (up to p2p.SEGMENT_BYTES). Data
arriving from the peer meanwhile finds the lock taken; gloo's event loop then
goes back to epoll_wait, which at once reports the same unread data again: it
spins, on the CPU the writer needs. Any algorithm that sends both ways between the same
two ranks at once meets this: the ring on two ranks, halving-doubling's
exchanges, the tree's two-rank exchange, a tree's pipelined up and down.

So each gloo group gets a second process group over the same ranks (its
reverse lane): messages from a lower to a higher rank travel on the group
itself, from higher to lower on the lane. Each connection then carries data
one way only: the writer and the reader of one rank never want the same
lock, so no event loop spins while a segment is written.

NCCL keeps one lane: its point-to-point has no such lock, and a second
communicator would cost GPU memory.
"""
import datetime

import torch
import torch.distributed as dist

from minddp.errors import first_line
from minddp.groups import new_group

_reverse = {}  # group -> the group carrying its messages from higher to lower ranks


def is_open(group):
    """Whether `open_lanes` has run for `group` in this process."""
    return group in _reverse


def open_lanes(group):
    """Open `group`'s reverse lane, once; a no-op where it has one or needs none.

    A collective over the group's ranks, like `dist.new_group`: every member
    calls it at the same point of its program, from the thread that creates
    its other groups. p2p.run calls it after a group's first all-reduce (a
    peer that is gone by then fails that call, which names it; a group's
    creation cannot); the wrapper calls it when it opens its gradient group,
    so its communication thread never creates one.
    """
    if group in _reverse:
        return
    if group.size() < 2 or dist.get_backend(group) != "gloo":
        _reverse[group] = group
        return
    ranks = dist.get_process_group_ranks(group)
    try:
        lane = new_group(ranks, "gloo", timeout_of(group))
    except Exception as e:
        raise RuntimeError(
            f"minddp (rank {group.rank()} of {group.size()}): opening the reverse lane of a "
            f"gloo group (a second group over its ranks {ranks}, see minddp/algorithms/lanes.py) "
            f"failed: a peer died, or did not make the same call, within the group's timeout. "
            f"Fix the peer's failure first. Cause: {first_line(e)}") from e
    # Both number their members in the same order (new_group sorts the ranks),
    # so a peer's rank in one is its rank in the other.
    assert dist.get_process_group_ranks(lane) == ranks, (ranks, lane)
    _reverse[group] = lane


def reverse(group):
    """The group that carries `group`'s messages from higher to lower ranks (the
    group itself where it has no lane of its own)."""
    return _reverse.get(group, group)


def timeout_of(group):
    """The process group's own timeout (gloo and NCCL keep it in their options);
    torch's default (30 minutes) for a backend that keeps none there."""
    for device in ("cpu", "cuda"):  # an NCCL-only group has no CPU backend
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return datetime.timedelta(minutes=30)
