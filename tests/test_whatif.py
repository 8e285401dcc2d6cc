"""minddp.whatif: the predictor on synthetic traces whose answer is known, and one real
2-rank run's trace through `python -m minddp.diagnose --what-if`."""
import dataclasses
import glob

import pytest
import torch
from torch import nn

import minddp
from dist_harness import run_world
from minddp import diagnose, whatif
from minddp.algorithms import cost_model

KIB = 1024
STEP_US, BACKWARD_US = 100_000.0, 40_000.0
ZERO = cost_model.Costs(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
LOOPBACK = cost_model.Costs(alpha=50e-6, hop=50e-6, beta=0.5e-9, gamma=0.1e-9,
                            native_alpha=100e-6, native_beta=0.6e-9)


def _trace(rank, sizes, costs, slowdown=0.0, iterations=8, comm_us=0.0):
    """A rank's trace: one bucket per parameter, the last parameter's gradient first,
    evenly over a BACKWARD_US backward; each bucket's reduction `comm_us` long."""
    count = len(sizes)
    events = []
    for k in range(iterations):
        start = k * STEP_US
        for b, i in enumerate(reversed(range(count))):
            ready = start + BACKWARD_US * (b + 1) / count
            events.append({"name": f"ready b{b}", "ph": "i", "ts": ready,
                           "args": {"iteration": k, "bytes": sizes[i]}})
            events.append({"name": f"comm b{b}", "ph": "X", "ts": ready, "dur": comm_us})
        events.append({"name": "backward", "ph": "X", "ts": start, "dur": BACKWARD_US})
        events.append({"name": "finalize", "ph": "X", "ts": start + BACKWARD_US,
                       "dur": comm_us})
    meta = {"params": [[n, "torch.float32"] for n in sizes],
            "buckets": [[i] for i in reversed(range(count))],
            "costs": dataclasses.asdict(costs), "slowdown": slowdown, "world_size": 2,
            "step_ms": STEP_US / 1e3}
    return {"traceEvents": events, "otherData": {"rank": rank, "whatif": meta}}


def _run(sizes=(64 * KIB,) * 8, costs=LOOPBACK, **kw):
    return whatif.from_traces([_trace(r, list(sizes), costs, **kw) for r in range(2)])


def test_an_infinitely_fast_link_exposes_nothing():
    run = _run(costs=ZERO)
    for cap in ("0.0625", "25", "planned"):
        got = whatif.predict(run, cap, "ring")
        assert got["exposed_ms"] == pytest.approx(0.0, abs=1e-9), cap
        assert got["step_ms"] == pytest.approx(STEP_US / 1e3)


def test_exposed_communication_grows_as_bandwidth_drops():
    run = _run()
    exposed = [whatif.predict(run, "0.0625", "ring", whatif.Link(whatif.parse_rate(rate)))
               ["exposed_ms"] for rate in ("100gbit", "10gbit", "1gbit", "100mbit")]
    assert exposed == sorted(exposed) and exposed[-1] > 10 * exposed[0] > 0, exposed


def test_one_bucket_exposes_its_whole_reduction():
    """512 KiB in all: at 25 MiB one bucket, ready when backward ends, so all of its
    reduction is exposed; one bucket per parameter hides all but the last."""
    run = _run()
    link = whatif.Link(whatif.parse_rate("1gbit"))
    whole = whatif.predict(run, "25", "ring", link)
    assert whole["buckets"] == 1
    assert whole["exposed_ms"] == pytest.approx(whole["comm_ms"])
    small = whatif.predict(run, "0.0625", "ring", link)
    assert small["buckets"] == 8
    assert small["exposed_ms"] == pytest.approx(small["comm_ms"] / 8, rel=0.01)


@pytest.mark.parametrize("algorithm", ["ring", "native", "tree"])
def test_world_size_follows_the_cost_formula(algorithm):
    run = _run()
    link = whatif.Link(whatif.parse_rate("10gbit"), latency=20e-6)
    for p in (2, 4, 8):
        got = whatif.predict(run, "25", algorithm, link, world_size=p)
        formula = cost_model.predict(algorithm, 512 * KIB, p, whatif.over_link(LOOPBACK, link, p))
        assert got["exposed_ms"] == pytest.approx(formula * 1e3), p


def test_wire_ratio_and_latency():
    run = _run()
    slow = whatif.Link(whatif.parse_rate("1gbit"))
    full = whatif.predict(run, "25", "ring", slow)["comm_ms"]
    half = whatif.predict(run, "25", "ring", slow, ratio=0.5)["comm_ms"]
    assert half == pytest.approx(full / 2, rel=0.05)  # all but the 2 alphas halve
    far = whatif.predict(run, "25", "ring", whatif.Link(slow.bandwidth, latency=1e-3))
    assert far["comm_ms"] == pytest.approx(full + 2.0, rel=0.01)  # 2 (p - 1) steps of 1 ms


def test_the_measured_setting_gives_the_measured_step():
    run = _run(slowdown=0.5, comm_us=2000.0)
    assert run.backward == BACKWARD_US and run.ready[-1] == BACKWARD_US / 8
    same = whatif.predict(run, "0.0625", "ring")  # one bucket per parameter, as measured
    assert same["buckets"] == 8 and same["step_ms"] == pytest.approx(STEP_US / 1e3)
    slower = whatif.predict(run, "0.0625", "ring", whatif.Link(whatif.parse_rate("1gbit")))
    assert slower["step_ms"] > same["step_ms"]


def test_only_the_measured_share_of_a_reduction_slows_backward():
    """Over a 1 Gbit/s link a reduction waits on the wire; with slowdown 1 backward
    loses just what the same reduction took over the measured link, for each of the 7
    buckets reduced beside it."""
    link = whatif.Link(whatif.parse_rate("1gbit"))
    exposed = [whatif.predict(_run(slowdown=s), "0.0625", "ring", link)["exposed_ms"]
               for s in (0.0, 1.0)]
    cpu = cost_model.predict("ring", 64 * KIB, 2, LOOPBACK)
    assert exposed[1] - exposed[0] == pytest.approx(7 * cpu * 1e3)
    assert whatif.parse_rate("inf") is None and whatif.parse_rate("8mbit") == 1e6
    with pytest.raises(ValueError, match="bits per second"):
        whatif.parse_rate("fast")


def test_planned_buckets_do_no_worse_than_torchs():
    run = _run(sizes=[256 * KIB] * 16)
    link = whatif.Link(whatif.parse_rate("1gbit"))
    planned = whatif.predict(run, "planned", "ring", link)
    assert planned["step_ms"] <= 1.01 * whatif.predict(run, "25", "ring", link)["step_ms"]
    assert planned["buckets"] > 1


def _train(rank, world_size, prefix, steps=6):
    torch.manual_seed(0)
    ddp = minddp.DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), algorithm="ring",
                     bucket_cap_mb=0.02, timeline=prefix)
    for _ in range(steps):
        ddp(torch.randn(8, 64)).square().mean().backward()
    whatif.annotate(ddp)


def test_a_real_trace_gives_a_table(tmp_path, capsys):
    prefix = str(tmp_path / "trace")
    run_world(_train, 2, prefix, timeout=120)
    files = sorted(glob.glob(prefix + ".rank*.json"))
    assert len(files) == 2
    png = tmp_path / "whatif.png"
    assert diagnose.main(files + ["--what-if", "--bandwidth", "1gbit",
                                  "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "1 Gbit/s" in out and png.stat().st_size > 0
    rows = [line.split() for line in out.splitlines()[2:]]
    assert {r[0] for r in rows} >= {"ring", "native"}
    assert {r[1] for r in rows} == {"1", "4", "25", "planned"}
    assert all(float(r[3]) > 0 for r in rows)


def test_algorithms_differ_by_their_costs_against_the_one_the_run_used():
    """The measured run used ring: predicting ring on its own link gives its step back,
    and an algorithm whose formula costs more there predicts a longer step."""
    run = _run(slowdown=0.0)
    run.algorithm = "ring"
    ring = whatif.predict(run, "0.0625", "ring")  # one bucket per parameter, as measured
    assert ring["step_ms"] == pytest.approx(STEP_US / 1e3)
    others = {a: whatif.predict(run, "0.0625", a)
              for a in ("tree", "halving_doubling", "native")}
    costlier = [a for a, got in others.items() if got["comm_ms"] > ring["comm_ms"] + 1e-6]
    assert costlier, others
    for a in costlier:
        assert others[a]["step_ms"] > ring["step_ms"], (a, others[a], ring)
