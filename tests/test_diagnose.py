"""python -m minddp.diagnose: an injected straggler is named, with its delay; none is blamed
without one."""
import glob
import json
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import minddp
from dist_harness import run_world
from minddp import diagnose

# Long against what 4 ranks sharing 2 busy cores lose to scheduling (a few ms an iteration):
# at 30 ms the 4-rank case failed now and then when the machine was loaded.
SLEEP_S = 0.08
SLEPT_S = []  # what the straggler's sleeps took: the OS may wake it late on a busy machine


def _sleep(grad):
    start = time.perf_counter()
    time.sleep(SLEEP_S)
    SLEPT_S.append(time.perf_counter() - start)
    return grad


class Net(nn.Module):
    """Six layers; on the straggler, backward sleeps before the first layer's gradients."""

    def __init__(self, straggler):
        super().__init__()
        self.first = nn.Linear(32, 32)
        self.rest = nn.Sequential(*[nn.Linear(32, 32) for _ in range(5)])
        self.straggler = straggler

    def forward(self, x):
        h = self.first(x)
        if self.straggler:
            h.register_hook(_sleep)
        return self.rest(h)


def _train(rank, world_size, prefix, victim, steps=10):
    torch.manual_seed(0)
    SLEPT_S.clear()
    ddp = minddp.DDP(Net(rank == victim), algorithm="native", bucket_cap_mb=0.005,
                     timeline=prefix)
    for _ in range(steps):
        ddp(torch.randn(8, 32)).square().mean().backward()
    ddp.timeline.save()
    return sorted(SLEPT_S)[len(SLEPT_S) // 2] if SLEPT_S else None


@pytest.mark.parametrize("world_size, victim", [(2, 1), (4, 2), (2, None)],
                         ids=["one-of-2", "one-of-4", "none"])
def test_diagnose_names_the_straggler(tmp_path, world_size, victim):
    prefix = str(tmp_path / "trace")
    slept = run_world(_train, world_size, prefix, victim, timeout=120)
    files = sorted(glob.glob(prefix + ".rank*.json"))
    assert len(files) == world_size
    report = diagnose.attribute(diagnose.load(files))
    assert report["iterations"] == 10 and report["buckets"] >= 20, report
    if victim is None:
        # Nobody is made a straggler of the size injected above. On a busy 2-core machine
        # one rank may still trail by a few ms in most iterations (a core shared with other
        # tests' processes), and diagnose rightly says so: that much is not a failure.
        delays = {rank: report["per_rank"][rank]["delay_ms"] for rank in report["blamed"]}
        assert all(d < SLEEP_S * 1e3 / 3 for d in delays.values()), diagnose.describe(report)
        return
    named = [it for it, c in report["per_iteration"].items() if c["rank"] == victim]
    assert len(named) >= 9, diagnose.describe(report)  # at least 90% of the iterations
    assert report["blamed"] == [victim], diagnose.describe(report)
    delay, injected = report["per_rank"][victim]["delay_ms"], slept[victim] * 1e3
    assert injected >= SLEEP_S * 1e3
    # Under: with 4 ranks on 2 cores busy with other tests the others are late too, and wait
    # for the straggler less than it slept (a CI run: 23.9 ms for 31.0 slept).
    assert 0.7 * injected <= delay <= 1.2 * injected, (injected, diagnose.describe(report))
    out = subprocess.run([sys.executable, "-m", "minddp.diagnose", *files, "--merged",
                          str(tmp_path / "all.json")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"=> rank {victim} made the others wait" in out.stdout, out.stdout
    merged = json.loads((tmp_path / "all.json").read_text())["traceEvents"]
    assert any(e["name"] == f"waited for rank {victim}" for e in merged)


def _timeline_on_rank_0_only(rank, world_size, prefix):
    ddp = minddp.DDP(Net(False), algorithm="native", timeline=prefix if rank == 0 else None)
    ddp(torch.randn(8, 32)).sum().backward()
    return ddp.timeline is not None and ddp.timeline.offset_error_us == 0.0


def test_a_timeline_on_some_ranks_only_does_not_hang(tmp_path):
    assert run_world(_timeline_on_rank_0_only, 2, str(tmp_path / "trace"), timeout=60) == [
        True, False]


def test_the_others_wait_once_per_iteration_not_once_per_bucket_and_rank():
    # 4 ranks, 3 buckets; rank 3 is 30 ms late with every bucket in every iteration
    def events(rank):
        return [{"name": f"ready b{b}", "ph": "i", "ts": 1e6 * it + 1e3 * b + (3e4 if rank == 3
                                                                             else 0.0),
                 "pid": rank, "args": {"iteration": it}}
                for it in range(8) for b in range(3)]
    ranks = {r: (0.0, 10.0, events(r)) for r in range(4)}
    report = diagnose.attribute(ranks)
    assert report["blamed"] == [3]
    row = report["per_rank"][3]
    assert abs(row["others_waited_ms_per_iteration"] - 30.0) < 1e-6, row
    assert abs(row["delay_ms"] - 30.0) < 1e-6, row
