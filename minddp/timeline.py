"""A per-rank timeline of one wrapper's work, written as a Chrome trace.

    MINDDP_TIMELINE=trace.json torchrun ... train.py   # or DDP(..., timeline="trace.json")

Each rank writes `trace.json.rank<R>.json` (open it in https://ui.perfetto.dev or
chrome://tracing; `merge` joins the ranks into one file). What is recorded, per
iteration:

    backward      first gradient hook -> end of backward (the autograd callback)
    ready b<i>    the moment bucket i's last gradient arrived (an instant; args:
                  the iteration)
    comm b<i>     bucket i's all-reduce, from when the communication thread
                  starts it to when its result is there (thread "comm")
    finalize      waiting for the buckets and writing .grad
    send to <r>,  each message of minddp's own algorithms on gloo, from its
    recv from <r> posting to its wait's end (thread "hops"; hops.py)

`hidden_share` reads the overlap back: how much of the communication ran
while backward was still computing. The same spans are labelled for
torch.profiler (record_function), so a torch profile shows them too.

Each rank's clock counts from its own start. `align(timeline, group)` measures how far
it is from rank 0's (a few round trips, the shortest kept, as NTP does), and
the file records that offset, so `python -m minddp.diagnose` can put every
rank's events on one clock and say who waited for whom (diagnose.py).
"""
import atexit
import json
import os
import re
import threading
import time

import torch
import torch.distributed as dist

_T0 = time.perf_counter()
_READY = re.compile(r"ready b(\d+)$")
ALIGN_ROUNDS = 16  # round trips per rank when aligning clocks (a few ms in all)


def ready_bucket(event):
    """The bucket index of a "ready b<i>" instant, or None for any other event."""
    match = _READY.match(event["name"])
    return int(match.group(1)) if match else None


def now_us():
    return (time.perf_counter() - _T0) * 1e6


class Timeline:
    """Collects trace events in memory; `save()` writes them (also at interpreter exit)."""

    def __init__(self, path, rank):
        self.path = f"{path}.rank{rank}.json" if path else None
        self.rank = rank
        self.events = []
        self.offset_us = 0.0  # rank 0's clock minus this rank's (align())
        self.offset_error_us = None  # half the shortest round trip: the offset's bound
        self.meta = {}  # more "otherData" for readers of the file (whatif.annotate)
        self._lock = threading.Lock()  # spans arrive from the training and comm threads
        self.calls = 0  # point-to-point all-reduces run for it so far (hops.py numbers them)
        self._later = []  # add_later's functions, not yet called
        if self.path:
            atexit.register(self.save)

    def span(self, name, start_us, end_us, thread="train", **args):
        with self._lock:
            self.events.append({"name": name, "ph": "X", "ts": start_us,
                                "dur": max(0.0, end_us - start_us), "pid": self.rank,
                                "tid": thread, "args": args})

    def instant(self, name, thread="train", **args):
        with self._lock:
            self.events.append({"name": name, "ph": "i", "s": "t", "ts": now_us(),
                                "pid": self.rank, "tid": thread, "args": args})

    def add_later(self, make_events):
        """Have `make_events()` (a list of trace events) added at save: hops.py's records
        are formatted then, off the communication thread's path."""
        with self._lock:
            self._later.append(make_events)

    def save(self):
        if self.path is None:
            return None
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with self._lock:
            for make_events in self._later:
                self.events.extend(make_events())
            self._later.clear()
        with self._lock, open(self.path, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms",
                       "otherData": {"rank": self.rank, "clock_offset_us": self.offset_us,
                                     "clock_offset_error_us": self.offset_error_us,
                                     **self.meta}}, f)
        return self.path


def profiled(label):
    """A torch.profiler label, or nothing when no profiler runs (it costs a little)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(label)
    return _NoLabel()


class _NoLabel:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def align(timeline, group, rounds=ALIGN_ROUNDS):
    """Put `timeline` (or None) on the clock of `group`'s first rank: a collective, every
    rank of `group` calls it, whether or not it records (`timeline=` may be given on some
    ranks only). `group` must take CPU tensors (gloo). One all-reduce says whether any rank
    records; if one does, each other rank in turn pings the first `rounds` times, and the
    round trip with the shortest time bounds the offset best."""
    anyone = torch.tensor([float(timeline is not None)], dtype=torch.float64, device="cpu")
    dist.all_reduce(anyone, op=dist.ReduceOp.MAX, group=group)
    if not anyone.item():
        return
    ranks = dist.get_process_group_ranks(group)
    me, first = dist.get_rank(), ranks[0]
    buf = torch.zeros(1, dtype=torch.float64, device="cpu")
    offset, error = 0.0, 0.0 if me == first else None
    for peer in ranks[1:]:
        for _ in range(rounds):
            if me == peer:
                sent = now_us()
                dist.send(buf, first, group=group)
                dist.recv(buf, first, group=group)
                back = now_us()
                if error is None or (back - sent) / 2 < error:
                    error, offset = (back - sent) / 2, buf.item() - (sent + back) / 2
            elif me == first:
                dist.recv(buf, peer, group=group)
                buf.fill_(now_us())
                dist.send(buf, peer, group=group)
    if timeline is not None:
        timeline.offset_us, timeline.offset_error_us = offset, error


def from_environment(rank, path=None):
    """The Timeline the wrapper should keep: `path`, else $MINDDP_TIMELINE, else none."""
    path = path or os.environ.get("MINDDP_TIMELINE")
    return Timeline(path, rank) if path else None


def hidden_share(events):
    """Share of communication time that overlapped a backward span, over a list of
    trace events from one rank (1.0: all hidden, 0.0: all exposed)."""
    backward = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "backward"]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("comm ")]
    total = sum(end - start for start, end in comm)
    if total <= 0:
        return None
    overlap = sum(max(0.0, min(end, b_end) - max(start, b_start))
                  for start, end in comm for b_start, b_end in backward)
    return overlap / total


def merge(paths, out):
    """Join per-rank trace files into one (each rank is its own process row)."""
    events = []
    for path in paths:
        with open(path) as f:
            events += json.load(f)["traceEvents"]
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return out
