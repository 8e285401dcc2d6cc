"""The timeline: a Chrome trace whose spans follow the reducer's contract."""
import json


import minddp
from minddp.timeline import hidden_share, merge
from dist_harness import run_world
from models import DeepNet, batch


def _traced(rank, world_size, prefix):
    ddp = minddp.DDP(DeepNet(), bucket_cap_mb=0.002, timeline=prefix)
    for step in range(3):
        ddp(*batch("deep", rank, step)).square().mean().backward()
    return ddp.timeline.save(), len(ddp.reducer.buckets)


def _by_step(events, name):
    return sorted((e for e in events if e["name"] == name), key=lambda e: e["ts"])


def test_trace_structure_and_order(tmp_path):
    results = run_world(_traced, 2, str(tmp_path / "trace"))
    paths = [path for path, _ in results]
    n_buckets = results[0][1]
    assert n_buckets > 3
    for rank, path in enumerate(paths):
        events = json.load(open(path))["traceEvents"]
        assert {e["pid"] for e in events} == {rank}
        backward, finalize = _by_step(events, "backward"), _by_step(events, "finalize")
        assert len(backward) == len(finalize) == 3
        for step in range(3):
            b, f = backward[step], finalize[step]
            assert b["ts"] + b["dur"] <= f["ts"] + 1e-3, "finalize starts when backward ends"
            lo, hi = b["ts"], f["ts"] + f["dur"]
            comm = sorted((e for e in events if e["name"].startswith("comm b") and
                           lo <= e["ts"] <= hi), key=lambda e: e["ts"])
            ready = [e for e in events if e["name"].startswith("ready b") and lo <= e["ts"] <= hi]
            assert [e["name"] for e in comm] == [f"comm b{i}" for i in range(n_buckets)], \
                "every bucket starts communicating once, in index order"
            assert len(ready) == n_buckets
            ready_at = {e["name"][len("ready "):]: e["ts"] for e in ready}
            for e in comm:
                assert e["tid"] == "comm"
                assert e["ts"] >= ready_at[e["name"][len("comm "):]], "sent before it was full"
                assert e["ts"] + e["dur"] <= hi + 1e-3, "finalize waits for every bucket"
        share = hidden_share(events)
        assert share is not None and 0.0 <= share <= 1.0
    merged = json.load(open(merge(paths, str(tmp_path / "merged.json"))))["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}


def test_hidden_share_on_synthetic_spans():
    events = [{"name": "backward", "ts": 0, "dur": 100},
              {"name": "comm b0", "ts": 50, "dur": 100},   # half inside backward
              {"name": "comm b1", "ts": 150, "dur": 100}]  # all after it
    assert hidden_share(events) == 0.25
    assert hidden_share([{"name": "backward", "ts": 0, "dur": 1}]) is None
