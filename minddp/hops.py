"""Per-hop records of minddp's own all-reduces, taken only while a timeline records.

comm.py marks the thread that runs a job with the job's timeline
(`recording`); p2p.Link asks `start(group)` once per all-reduce call and gets
a `Hops` to note each message on, or None (no timeline: one thread-local
read is all it costs). Per message: the peer (global rank), the bytes, the
tag, when this rank posted it and when its wait returned. links.py pairs
the ranks' records and tells waiting for a peer from time on the wire.

Which send a receive got: gloo matches a message to the first receive
posted for its peer and tag, so the k-th send from a to b with tag t within
one call is the k-th such receive on b; calls are numbered per timeline in
the order the comm thread runs them, the same on every rank.

Limits, and why:
- a receive's completion is seen when this rank waits for it, which on a
  pipeline is after combining the one before: on a fast link that bounds the
  wire time from above by the receiver's own pace; a slow link reads as slow
  either way (gloo's send/recv works have no future to timestamp the landing);
- NCCL's rules are not recorded: a wait there only orders streams, the host
  never sees a message land;
- MINDDP_HOPS_EVERY=N records one call in N (default 1: every call; N bounds
  the trace's size on long runs, and the cost), and at most MAX_CALLS calls are
  recorded per timeline. Noting a message takes about
  1.2 us of CPU (it is formatted only when the timeline saves); end to end a
  recorded ring call of 4 KB on 2 loopback ranks took 30 us longer (280 ->
  315 us, median of 1450 interleaved calls), and steps of compare.py's narrow
  workload on 2 ranks 1.3% (one bucket) to 2.3% (12 buckets) longer: the
  worst case, tiny calls; the 4-node run's 50-110 ms steps pay under 0.1%.
"""
import collections
import os
import threading

import torch.distributed as dist

from minddp.timeline import now_us

def _every():
    value = os.environ.get("MINDDP_HOPS_EVERY", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"minddp: MINDDP_HOPS_EVERY={value!r} is not a whole number; set it "
                         f"to N to record one all-reduce call in N (1: every call)") from None


EVERY = _every()
# At most this many calls are recorded per timeline (about 200 bytes a message kept until
# the trace is saved): enough for thousands of steps, bounded on a run of any length.
MAX_CALLS = 10_000
_local = threading.local()


def recording(timeline, label):
    """Mark this thread as running job `label` for `timeline`; returns what to `restore`."""
    previous = getattr(_local, "job", None)
    _local.job = (timeline, label)
    return previous


def restore(previous):
    _local.job = previous


def start(group):
    """A Hops for one all-reduce call on `group` from this thread, or None when no
    timeline records here or this call is sampled out."""
    job = getattr(_local, "job", None)
    if job is None:
        return None
    timeline, label = job
    call = timeline.calls
    timeline.calls += 1
    if EVERY <= 0 or call % EVERY or call // EVERY >= MAX_CALLS:
        return None
    return Hops(timeline, call, label, dist.get_process_group_ranks(group))


class Hops:
    """The messages of one call on one rank, in posting order, a flat list per field
    (a list per message would be one more object for the garbage collector to walk)."""

    def __init__(self, timeline, call, label, ranks):
        self.timeline, self.call, self.label, self.ranks = timeline, call, label, ranks
        self.ops, self.peers, self.nbytes, self.tags = [], [], [], []
        self.posts, self.dones = [], []

    def posted(self, op, peer, tensors, tag):
        """Note a send or receive of `tensors` to/from group rank `peer`, posted now;
        returns its index for `done`."""
        self.ops.append(op)
        self.peers.append(self.ranks[peer])
        self.nbytes.append(sum(t.nbytes for t in tensors))
        self.tags.append(tag)
        self.dones.append(None)
        self.posts.append(now_us())
        return len(self.posts) - 1

    def done(self, index):
        self.dones[index] = now_us()

    def flush(self):
        """Hand the call's messages to the timeline, formatted when it saves."""
        self.timeline.add_later(self.events)

    def events(self):
        """The call's messages as trace spans on thread "hops"."""
        seq = collections.Counter()
        events = []
        for op, peer, nbytes, tag, posted, done in zip(self.ops, self.peers, self.nbytes,
                                                        self.tags, self.posts, self.dones):
            k = seq[op, peer, tag]
            seq[op, peer, tag] += 1
            events.append({"name": f"{op} {'to' if op == 'send' else 'from'} {peer}", "ph": "X",
                           "ts": posted, "dur": max(0.0, (done or posted) - posted),
                           "pid": self.timeline.rank, "tid": "hops",
                           "args": {"op": op, "peer": peer, "bytes": nbytes, "tag": tag,
                                    "call": self.call, "seq": k, "job": self.label}})
        return events
