"""Per-hop timing (hops.py) and the link report (links.py): a link whose bytes are late is
named; a rank that posts late is not taken for a slow link; a uniform run blames none.

The slow link is injected without namespaces: on the sender, each message to one peer
is noted as posted (hops.py) and handed to gloo DELAY_S later, as a slow wire would
deliver it. The late rank sleeps before it posts anything, as late compute would.
"""
import glob
import json
import queue
import threading
import time

import pytest
import torch
from torch import nn

import minddp
from dist_harness import run_world
from minddp import diagnose, links
from minddp.algorithms import p2p

DELAY_S = 0.02
STEPS = 10
NOISE_US = 10e3  # half the injected DELAY_S: a loaded CI machine made a late rank cost 5.3 ms


class _Wire:
    """Sends handed to gloo DELAY_S after they are posted, in order, by a thread of their
    own: the sender goes on at once, as it does with a real slow link."""

    def __init__(self):
        self.queue = queue.Queue()
        threading.Thread(target=self._deliver, daemon=True).start()

    def _deliver(self):
        while True:
            due, lane, tensors, peer, tag, work = self.queue.get()
            time.sleep(max(0.0, due - time.monotonic()))
            work.put(lane.send(tensors, peer, tag))

    def send(self, lane, tensors, peer, tag):
        work = queue.Queue(maxsize=1)
        self.queue.put((time.monotonic() + DELAY_S, lane, tensors, peer, tag, work))
        return _Later(work)


class _Later:
    def __init__(self, work):
        self.work = work

    def wait(self):
        return self.work.get(timeout=60).wait()


class _SlowLane:
    def __init__(self, lane, wire):
        self.lane, self.wire = lane, wire

    def send(self, tensors, peer, tag):
        return self.wire.send(self.lane, tensors, peer, tag)


def _slow_link(dst):
    lane, wire = p2p.Link.lane, _Wire()

    def slow(self, op, peer):
        got = lane(self, op, peer)
        return _SlowLane(got, wire) if op == "send" and peer == dst else got
    p2p.Link.lane = slow


def _late_rank():
    exchange = p2p.Link.exchange

    def late(self, *args, **kwargs):
        time.sleep(DELAY_S)
        return exchange(self, *args, **kwargs)
    p2p.Link.exchange = late


def _train(rank, world_size, prefix, fault):
    if fault is not None and rank == 1:
        _slow_link(2) if fault == "link" else _late_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    ddp = minddp.DDP(model, algorithm="ring", timeline=prefix)
    for _ in range(STEPS):
        ddp(torch.randn(8, 64)).square().mean().backward()
    ddp.timeline.save()


@pytest.mark.parametrize("fault", ["link", "rank", None], ids=["slow-link", "late-rank", "none"])
def test_link_report_names_the_slow_link_only(tmp_path, fault):
    prefix = str(tmp_path / "trace")
    run_world(_train, 3, prefix, fault, timeout=120)
    ranks = diagnose.load(sorted(glob.glob(prefix + ".rank*.json")))
    # 10 ms, not diagnose's 2: three ranks on a shared 2-core machine wake up late now
    # and then (a late rank, descheduled after its sleep, once lost 5.3 ms a call on a
    # link of its); the injected link loses about DELAY_S (20 ms) per call.
    report = links.analyse(ranks, noise_us=NOISE_US)
    text = "\n".join(links.describe(report))
    assert report["calls"] == STEPS and len(report["per_link"]) == 3, text
    if fault == "link":
        assert report["blamed"] == [[1, 2]], text
        assert report["per_link"]["1->2"]["ratio"] < 0.2, text
        assert "=> the link 1 -> 2 ran at" in text
    else:
        assert report["blamed"] == [], text
    if fault == "rank":  # the wait shows where it belongs: rank 2 waited for rank 1 to post
        assert report["per_link"]["1->2"]["waited_ms"] > 0.5 * DELAY_S * 1e3, text
    merged = json.loads(open(diagnose.merged_trace(ranks, diagnose.attribute(ranks),
                                                   str(tmp_path / "all.json"))).read())
    shown = {e["name"] for e in merged["traceEvents"] if e["pid"] == 2 and e.get("dur", 0) > 0}
    assert "wire from 1" in shown
    if fault is not None:  # where rank 2's time went, per hop
        assert {"link": "wire from 1", "rank": "waited for rank 1"}[fault] in shown, shown


def _pairs(rank, world_size, prefix, algorithm):
    ddp = minddp.DDP(nn.Linear(64, 64), algorithm=algorithm, timeline=prefix)
    for _ in range(2):
        ddp(torch.randn(8, 64)).sum().backward()
    ddp.timeline.save()


@pytest.mark.parametrize("algorithm", ["tree", "halving_doubling"])
def test_every_receive_pairs_with_its_send(tmp_path, algorithm):
    prefix = str(tmp_path / "trace")
    run_world(_pairs, 3, prefix, algorithm, timeout=60)
    ranks = diagnose.load(sorted(glob.glob(prefix + ".rank*.json")))
    received = [e for _, _, events in ranks.values() for e in events
                if e.get("tid") == "hops" and e["args"]["op"] == "recv"]
    paired = links.hops(ranks)
    assert received and len(paired) == len(received), (len(paired), len(received))
    assert {hop["call"] for hop in paired} == {0, 1}


def _hop(call, src, dst, sent, posted, done, nbytes=1000, tag=10, seq=0):
    """The two trace events of one message (clock offsets zero)."""
    args = {"call": call, "tag": tag, "seq": seq, "bytes": nbytes}
    return [(src, {"name": "send", "ts": sent, "dur": 1.0, "tid": "hops",
                   "args": dict(args, op="send", peer=dst)}),
            (dst, {"name": "recv", "ts": posted, "dur": done - posted, "tid": "hops",
                   "args": dict(args, op="recv", peer=src)})]


def _ranks(events, offsets=None):
    ranks = {}
    for rank, e in events:
        ranks.setdefault(rank, ((offsets or {}).get(rank, 0.0), 0.0, []))[2].append(e)
    return ranks


def test_wait_and_wire_arithmetic():
    # Sender posts at 50 (its clock 40 + offset 10), receiver at 20, bytes in at 80:
    # 30 us waiting for the sender, then 30 us on the wire.
    ranks = _ranks(_hop(0, 0, 1, sent=40.0, posted=20.0, done=80.0), offsets={0: 10.0})
    (hop,) = links.hops(ranks)
    assert links.timing(hop) == (30.0, 30.0)
    # Receive posted after the send: no wait, the wire counts from the receive.
    ranks = _ranks(_hop(0, 0, 1, sent=10.0, posted=20.0, done=35.0))
    assert links.timing(links.hops(ranks)[0]) == (0.0, 15.0)


def test_queued_messages_count_the_link_time_once():
    events = (_hop(0, 0, 1, sent=0.0, posted=0.0, done=10.0, seq=0)
              + _hop(0, 0, 1, sent=0.0, posted=0.0, done=20.0, seq=1)
              + _hop(0, 0, 1, sent=30.0, posted=0.0, done=35.0, seq=2))
    row = links.per_call(links.hops(_ranks(events)))[0][0, 1]
    assert row == {"bytes": 3000, "busy_us": 25.0, "waited_us": 30.0}


def _uniform_call(call, slow=None, base_us=1e3, factors=None):
    """A ring of 4, each link 1 MB in `base_us`; `slow` takes ten times as long, or
    the link from rank r `factors[r]` times."""
    factors = factors or {slow: 10.0}
    events = []
    for src in range(4):
        wire = base_us * factors.get(src, 1.0)
        events += _hop(call, src, (src + 1) % 4, sent=0.0, posted=0.0, done=wire, nbytes=2**20)
    return events


def test_blame_needs_most_calls_not_one():
    once = _uniform_call(0, slow=2) + sum((_uniform_call(c) for c in range(1, 4)), [])
    report = links.analyse(_ranks(once), noise_us=2e3)
    assert report["blamed"] == [] and report["per_link"]["2->3"]["calls_slow"] == 1
    always = sum((_uniform_call(c, slow=2) for c in range(4)), [])
    report = links.analyse(_ranks(always), noise_us=2e3)
    assert report["blamed"] == [[2, 3]], report
    assert report["per_link"]["2->3"]["ratio"] == pytest.approx(0.1)
    assert report["per_link"]["2->3"]["lost_ms"] == pytest.approx(9.0)
    # Below the noise: ten times slower, but only 90 us lost per call.
    tiny = sum((_uniform_call(c, slow=2, base_us=10.0) for c in range(4)), [])
    assert links.analyse(_ranks(tiny), noise_us=2e3)["blamed"] == []


def test_a_node_with_every_outgoing_link_slow_is_named():
    events = []
    for call in range(4):
        for src in range(3):
            for dst in range(3):
                if src != dst:
                    wire = 1e4 if src == 0 else 1e3
                    events += _hop(call, src, dst, 0.0, 0.0, wire, nbytes=2**20)
    report = links.analyse(_ranks(events), noise_us=2e3)
    assert sorted(report["blamed"]) == [[0, 1], [0, 2]]
    assert report["nodes"] == [[0, "outgoing"]]
    assert "=> rank 0's outgoing links ran at 0.10" in "\n".join(links.describe(report))


def test_slow_links_around_one_rank_name_the_rank():
    # A node with a slow link in a ring: its own link, and the one into it (its TCP
    # acknowledgements queue behind its data) less so.
    calls = sum((_uniform_call(c, factors={2: 30.0, 1: 8.0}) for c in range(4)), [])
    report = links.analyse(_ranks(calls), noise_us=2e3)
    assert sorted(report["blamed"]) == [[1, 2], [2, 3]] and report["nodes"] == [[2, "every"]]
    text = "\n".join(links.describe(report))
    assert "=> every slow link touches rank 2" in text
    assert text.index("the link 2 -> 3") < text.index("the link 1 -> 2"), text  # slowest first


def _sums_with_one_rank_recording(rank, world_size, prefix):
    """A 2-rank tree of small integer buckets, the timeline (so the hop records) on
    rank 0 only: both ranks must take the same path and hold the exact sum."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape))
    ddp = minddp.DDP(model, algorithm="tree", timeline=prefix if rank == 0 else None)
    x = torch.randint(-3, 4, (4, 8)).float() * (rank + 1)
    ddp(x).sum().backward()
    return [p.grad.clone() for p in ddp.parameters()]


def test_recording_on_one_rank_does_not_change_what_the_tree_sends(tmp_path):
    grads = run_world(_sums_with_one_rank_recording, 2, str(tmp_path / "trace"), timeout=60)
    for mine, theirs in zip(*grads):
        assert torch.equal(mine, theirs), "rank 1's gradients differ from rank 0's"
