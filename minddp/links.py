"""Which link was slow: each message's wait for its sender against its time on the wire.

    python -m minddp.diagnose run/trace.rank*.json      # prints this report after the ranks'

Input: the ranks' timelines (diagnose.load), with the "hops" spans hops.py
records for minddp's own algorithms on gloo. Each receive is paired with the
send it got (same call, sender, receiver, tag and order) and, on rank 0's
clock:
    waited = max(0, send posted - receive posted)   the sender had not posted yet:
                                                    a late rank (compute, or its own upstream)
    wire   = receive done - max(both posts)         the bytes were late: the link
A link's rate in one call is its bytes over its busy time, the union of its
messages' wire intervals (queued messages overlap; a sum would count the
link's time twice), and its ratio is that rate over the median of the call's
other links. A link is blamed where it ran below SLOW of the others' rate in
at least 3/4 of the recorded calls and lost more than the noise in them
(its busy time minus what its bytes would take at the others' rate, median
over those calls): a busy machine slows links at random, one call at a time.
When every outgoing link of one rank is blamed (it has two or more), the
report names its outgoing links, as a slow network card would; incoming alike.
Where two or more links are blamed and all touch one rank, it names that rank:
a node whose outgoing link is slow also slows the TCP stream into it (its
acknowledgements queue behind its data), so in a ring the link into it reads
slow too, though less so than its own.
"""
import collections
import statistics

SLOW = 0.5  # a link below this share of the others' rate is slow in that call
CONSISTENT = 0.75  # share of calls in which it must be slow to be blamed


def hops(ranks):
    """Every received message paired with its send: a list of dicts with call, src, dst,
    bytes, sent (send posted), posted (receive posted), done, on rank 0's clock (us)."""
    sends, recvs = {}, []
    for rank, (offset, _, events) in ranks.items():
        for e in events:
            args = e.get("args", {})
            if e.get("tid") != "hops" or "call" not in args:
                continue
            if args["op"] == "send":
                key = (args["call"], rank, args["peer"], args["tag"], args["seq"])
                sends[key] = e["ts"] + offset
            else:
                key = (args["call"], args["peer"], rank, args["tag"], args["seq"])
                recvs.append((key, args["bytes"], e["ts"] + offset, e["ts"] + e["dur"] + offset))
    paired = []
    for key, nbytes, posted, done in recvs:
        if key in sends:  # the sender recorded too (a timeline on every rank)
            paired.append({"call": key[0], "src": key[1], "dst": key[2], "bytes": nbytes,
                           "sent": sends[key], "posted": posted, "done": done})
    return paired


def timing(hop):
    """(waited, wire) of one paired message, us: waiting for the sender to post, then
    the bytes' time from the later post to the receive's end."""
    start = max(hop["sent"], hop["posted"])
    return max(0.0, hop["sent"] - hop["posted"]), max(0.0, hop["done"] - start)


def merged(intervals):
    """The union of (start, end) intervals, as sorted disjoint intervals."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def busy(intervals):
    """Length of the union of (start, end) intervals."""
    return sum(end - start for start, end in merged(intervals))


def per_call(paired):
    """{call: {(src, dst): {"bytes", "busy_us", "waited_us"}}}."""
    calls = collections.defaultdict(lambda: collections.defaultdict(list))
    for hop in paired:
        calls[hop["call"]][hop["src"], hop["dst"]].append(hop)
    table = {}
    for call, links in calls.items():
        table[call] = {}
        for link, messages in links.items():
            spans = [(max(h["sent"], h["posted"]), h["done"]) for h in messages]
            table[call][link] = {"bytes": sum(h["bytes"] for h in messages),
                                 "busy_us": busy(spans),
                                 "waited_us": sum(timing(h)[0] for h in messages)}
    return table


def analyse(ranks, noise_us):
    """The link report as a dict (diagnose's --json "links"); None without hop records."""
    paired = hops(ranks)
    if not paired:
        return None
    table = per_call(paired)
    ratios, lost = collections.defaultdict(list), collections.defaultdict(list)
    for links in table.values():
        rates = {link: row["bytes"] / max(row["busy_us"], 1e-3) for link, row in links.items()}
        for link, row in links.items():
            others = [r for other, r in rates.items() if other != link]
            if not others:
                continue
            usual = statistics.median(others)
            ratios[link].append(rates[link] / usual)
            lost[link].append(row["busy_us"] - row["bytes"] / usual)
    report = {"calls": len(table), "slow_below": SLOW, "per_link": {}, "blamed": []}
    for link in sorted(table[next(iter(table))].keys() | ratios.keys()):
        rows = [links[link] for links in table.values() if link in links]
        slow = [i for i, ratio in enumerate(ratios[link]) if ratio < SLOW]
        row = {"src": link[0], "dst": link[1], "calls": len(rows),
               "mb_per_call": statistics.median(r["bytes"] for r in rows) / 2**20,
               "rate_mb_s": sum(r["bytes"] for r in rows) / 2**20
               / max(1e-9, sum(r["busy_us"] for r in rows) / 1e6),
               "ratio": statistics.median(ratios[link]) if ratios[link] else None,
               "calls_slow": len(slow),
               "lost_ms": statistics.median(lost[link][i] for i in slow) / 1e3 if slow else 0.0,
               "wire_ms": statistics.median(r["busy_us"] for r in rows) / 1e3,
               "waited_ms": statistics.median(r["waited_us"] for r in rows) / 1e3}
        report["per_link"][f"{link[0]}->{link[1]}"] = row
        if (ratios[link] and len(slow) >= CONSISTENT * len(ratios[link])
                and row["lost_ms"] * 1e3 > noise_us):
            report["blamed"].append([link[0], link[1]])
    report["nodes"] = _nodes(report)
    return report


def _nodes(report):
    """[(rank, side)]: "outgoing" ("incoming") where every link from (to) a rank, two or
    more, is blamed; else "every" where two or more links are blamed and all touch one
    rank (a slow node in a ring: its own link, and the one into it, whose TCP
    acknowledgements queue behind its outgoing data)."""
    blamed = {tuple(link) for link in report["blamed"]}
    found = []
    for side, end in (("outgoing", "src"), ("incoming", "dst")):
        ends = collections.defaultdict(list)
        for row in report["per_link"].values():
            ends[row[end]].append((row["src"], row["dst"]) in blamed)
        found += [[rank, side] for rank, flags in sorted(ends.items())
                  if len(flags) >= 2 and all(flags)]
    if not found and len(blamed) >= 2:
        found += [[rank, "every"] for rank in sorted(set.intersection(*map(set, blamed)))]
    return found


def describe(report):
    """The link report in sentences (a list of lines)."""
    if report is None:
        return ["links: no hop records (minddp's own algorithms on gloo record them; "
                "algorithm='native' and NCCL do not)"]
    lines = [f"links: {len(report['per_link'])} directed links over {report['calls']} timed "
             f"all-reduce calls (rate: bytes over wire time; waited: the receiver for the "
             f"sender to post)"]
    for row in report["per_link"].values():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(f"link {row['src']} -> {row['dst']}: {row['mb_per_call']:.2f} MB per call "
                     f"at {row['rate_mb_s']:.1f} MB/s, {ratio} of the others' rate (median); "
                     f"below {report['slow_below']:.1f} in {row['calls_slow']} of "
                     f"{row['calls']} calls; wire {row['wire_ms']:.1f} ms, waited "
                     f"{row['waited_ms']:.1f} ms per call")
    by_node = {(rank, side) for rank, side in report["nodes"]}
    for rank, side in report["nodes"]:
        if side == "every":
            lines.append(f"=> every slow link touches rank {rank}: look at rank {rank}'s node "
                         f"and its network link")
            continue
        rows = [r for r in report["per_link"].values() if r["src" if side == "outgoing"
                                                           else "dst"] == rank]
        ratio = statistics.median(r["ratio"] for r in rows)
        lines.append(f"=> rank {rank}'s {side} links ran at {ratio:.2f} of the others' rate")
    rows = sorted((report["per_link"][f"{src}->{dst}"] for src, dst in report["blamed"]),
                  key=lambda row: row["ratio"])
    for row in rows:  # the slowest first
        if (row["src"], "outgoing") in by_node or (row["dst"], "incoming") in by_node:
            continue
        lines.append(f"=> the link {row['src']} -> {row['dst']} ran at {row['ratio']:.2f} of "
                     f"the others' rate: {row['lost_ms']:.1f} ms lost per call")
    if not report["blamed"]:
        lines.append("=> no link ran below the others' rate consistently")
    return lines


def trace_events(ranks):
    """For diagnose's merged trace, in place of the raw hop spans (which overlap): per call
    and link, on the sender "send to D" while its messages were out, on the receiver
    "waited for rank S" while the sender had not posted and "wire from S" while bytes were
    due (each the union over the call's messages, so spans never overlap on a track),
    and a flow arrow per message from the send's post to the receive's end."""
    events, groups = [], collections.defaultdict(list)
    for n, hop in enumerate(hops(ranks)):
        src, dst = hop["src"], hop["dst"]
        groups[hop["call"], src, dst].append(hop)
        events.append({"name": f"hop {src}->{dst}", "cat": "hop", "ph": "s", "id": n,
                       "ts": hop["sent"], "pid": src, "tid": f"send {dst}"})
        events.append({"name": f"hop {src}->{dst}", "cat": "hop", "ph": "f", "bp": "e",
                       "id": n, "ts": hop["done"], "pid": dst, "tid": f"wire {src}"})
    for (call, src, dst), messages in groups.items():
        sends = [(h["sent"], h["done"]) for h in messages]
        waits = [(h["posted"], h["sent"]) for h in messages if h["sent"] > h["posted"]]
        wires = [(max(h["sent"], h["posted"]), h["done"]) for h in messages]
        for pid, tid, name, spans in ((src, f"send {dst}", f"send to {dst}", sends),
                                      (dst, f"waited {src}", f"waited for rank {src}", waits),
                                      (dst, f"wire {src}", f"wire from {src}", wires)):
            events += [{"name": name, "ph": "X", "ts": start, "dur": end - start, "pid": pid,
                        "tid": tid, "args": {"call": call}} for start, end in merged(spans)]
    return events
