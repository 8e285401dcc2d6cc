"""ddp._get_ddp_logging_data(): torch's keys with minddp's values (logging_data.py).

torch's DDP on the same steps is the oracle wherever the value does not depend
on how the wrapper works inside: the facts logged at construction, which
iterations are sampled, the gradients' ready order, when the graph is found
not static, the errors for bad sample rates. torch's own tests that read the
logging data run in tests/torch_suite (test_ddp_logging_data_cpu and others).
"""
import copy
import pickle
import time

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from dist_harness import run_world

IMPLS = {"torch": TorchDDP, "minddp": minddp.DDP}
TIMINGS = ("forward_compute_time", "backward_compute_time", "backward_comm_time")


class Mixed(nn.Module):
    """Three layers, the middle one in float64: buckets of two dtypes, and with
    a small cap more than one per dtype."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 512)
        self.b = nn.Linear(512, 256).double()
        self.c = nn.Linear(256, 8)

    def forward(self, x):
        return self.c(self.b(self.a(x).double()).float())


def _x(rank, step):
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(100 * step + rank))


def _construction(data):
    """The keys logged at construction (torch's set_construction_data_and_log)
    but the bucket sizes: torch's first layout is a bucket per dtype whenever
    it will re-lay them after the first iteration; minddp's is the one it keeps."""
    return {k: v for k, v in data.items() if k != "bucket_sizes"}


def _parity(rank, world_size):
    out = {}
    for name, wrap in IMPLS.items():
        torch.manual_seed(0)
        ddp = wrap(Mixed(), bucket_cap_mb=0.005)
        built = _construction(ddp._get_ddp_logging_data())
        ddp._set_ddp_runtime_logging_sample_rate(3)
        seen = []
        for step in range(26):
            sync = step % 4 != 3  # every 4th step accumulates under no_sync
            with (ddp.no_sync() if not sync else torch.enable_grad()):
                ddp(_x(rank, step)).sum().backward()
            data = ddp._get_ddp_logging_data()
            seen.append((data["iteration"], all(data.get(k, 0) > 0 for k in TIMINGS)))
        errors = []
        for rate in (0, -2, 2.5):
            try:
                ddp._set_ddp_runtime_logging_sample_rate(rate)
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - the type is compared
                errors.append((type(e).__name__, "sample rate" in str(e)))
        logged = ddp._get_ddp_logging_data()
        copy = pickle.loads(pickle.dumps(ddp))
        out[name] = {"built": built, "seen": seen, "errors": errors,
                     "sizes": (ddp._get_ddp_logging_data()["bucket_sizes"],
                               logged.get("rebuilt_bucket_sizes")),
                     "logged_error": "equal or greater than 1" in logged.get("error", ""),
                     "order": logged.get("prev_iteration_grad_ready_order_indices"),
                     "unpickled": _construction(copy._get_ddp_logging_data())}
    return out


def test_logged_like_torch_ddp():
    """Construction facts, the sampled iterations (first 10 synced ones, then
    every 3rd; no_sync steps not counted), ready order, bad sample rates and
    a copy made by pickling: as torch's DDP logs them, on 2 ranks."""
    for result in run_world(_parity, 2, timeout=120):
        want, got = result["torch"], result["minddp"]
        assert got["built"] == want["built"]
        assert got["built"]["dtypes"] == "double, float"
        # minddp's buckets are those torch re-lays its own into: several per dtype.
        assert got["sizes"] == (want["sizes"][1], want["sizes"][1])
        assert want["sizes"][1] == "8224, 1050624, 133120"
        assert got["seen"] == want["seen"]
        assert [i for i, _ in got["seen"]][-1] == 18  # 20 synced forwards, sampled at 18
        assert got["errors"] == want["errors"] == [("ValueError", True), ("ValueError", True),
                                                   ("TypeError", False)]
        assert got["logged_error"] and want["logged_error"]
        assert got["order"] == want["order"] == "5, 4, 3, 2, 1, 0"
        assert got["unpickled"] == want["unpickled"] == want["built"]


class Sometimes(nn.Module):
    """b takes part only when `use_b(step)`."""

    def __init__(self, use_b):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.use_b = use_b
        self.step = 0

    def forward(self, x):
        self.step += 1
        return self.b(self.a(x)) if self.use_b(self.step) else self.a(x)


def _graph(rank, world_size):
    out = {}
    # torch logs can_set_static_graph once per process: its changing run goes first.
    for name, wrap in IMPLS.items():
        for label, use_b in (("changes", lambda step: step % 2 == 0),
                             ("never", lambda step: False)):
            ddp = wrap(Sometimes(use_b), find_unused_parameters=True)
            for _ in range(4):
                ddp(torch.ones(2, 4)).sum().backward()
            data = ddp._get_ddp_logging_data()
            out[name, label] = (data.get("can_set_static_graph"), data.get("iteration"))
            if label == "never" and name == "minddp":
                out["unused"] = data["unused_parameter_size"]
    return out


def test_can_set_static_graph_like_torch_ddp():
    """find_unused_parameters with b used every other step: can_set_static_graph
    is logged 0 (at the second synced forward), as torch's DDP logs it; with b
    never used nothing is logged while the wrapper lives; unused_parameter_size
    counts b's bytes."""
    for result in run_world(_graph, 2, timeout=90):
        assert result["minddp", "changes"] == result["torch", "changes"] == (0, 3)
        assert result["minddp", "never"][0] is None
        assert result["torch", "never"][0] is None
        assert result["unused"] == (16 + 4) * 4


class Slow(nn.Module):
    """A forward that takes at least SLEEP seconds."""

    SLEEP = 0.03

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(self.SLEEP)
        return self.lin(x)


def my_hook(state, bucket):
    return allreduce_hook(state, bucket)


def _timings(rank, world_size):
    ddp = minddp.DDP(Slow())
    for _ in range(3):
        ddp(torch.ones(2, 8)).sum().backward()
    hooked = minddp.DDP(nn.Linear(2, 2))
    hooked.register_comm_hook(None, my_hook)
    static = minddp.DDP(nn.Linear(2, 2), static_graph=True)
    return (ddp._get_ddp_logging_data(), hooked._get_ddp_logging_data()["comm_hook"],
            static._get_ddp_logging_data().get("static_graph"))


def test_runtime_stats_measure_minddps_iteration():
    """forward_compute_time covers the module's forward (a 30 ms sleep in it),
    the host time stamps come in iteration order, the overlap lies within both
    spans it overlaps; a hook's name is its __qualname__; static_graph is logged."""
    for data, hook_name, static in run_world(_timings, 2, timeout=60):
        assert data["iteration"] == 2
        # No upper bound: a loaded machine may stretch the forward arbitrarily.
        assert Slow.SLEEP * 1e9 <= data["forward_compute_time"]
        assert data["avg_forward_compute_time"] >= Slow.SLEEP * 1e9
        assert (data["forward_compute_time_start"] <= data["backward_compute_time_start"]
                <= data["backward_comm_time_start"] <= data["backward_compute_time_end"]
                <= data["backward_comm_time_end"])
        for key in ("backward_compute_time", "backward_comm_time"):
            assert data[key] >= data["backward_compute_comm_overlap_time"] > 0
        assert data["num_buckets_reduced"] == 1
        assert data["has_rebuilt_buckets"] == 1
        assert data["rebuilt_per_bucket_param_indices"] == "1 0"
        assert hook_name == "my_hook"
        assert static == 1


def _when_rebuilt(rank, world_size):
    """(where, _has_rebuilt_buckets, the logged has_rebuilt_buckets) after each forward
    and backward of 4 steps, with a forward under no_grad before the second, then of a
    deepcopy's first step (torch's flag is an attribute: the copy takes it along)."""
    seen = {}
    for kwargs in ({}, {"static_graph": True}, {"find_unused_parameters": True}):
        for kind, wrapper in [("torch", TorchDDP), ("minddp", minddp.DDP)]:
            torch.manual_seed(0)
            ddp = wrapper(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), **kwargs)
            steps = []

            def note(where, ddp):
                steps.append((where, int(ddp._has_rebuilt_buckets),
                              ddp._get_ddp_logging_data().get("has_rebuilt_buckets")))
            for step in range(4):
                if step == 1:
                    with torch.no_grad():
                        ddp(torch.ones(2, 4))
                    note("no_grad forward", ddp)
                out = ddp(torch.ones(2, 4))
                note("forward", ddp)
                out.sum().backward()
                note("backward", ddp)
            copied = copy.deepcopy(ddp)
            note("copied", copied)
            copied(torch.ones(2, 4)).sum().backward()
            note("copy's backward", copied)
            seen[str(kwargs), kind] = steps
    return seen


def test_buckets_count_as_rebuilt_when_torchs_are():
    """torch rebuilds its buckets at the first forward with gradients after the backward
    it learns their order from; its logging says so from the forward after."""
    seen = run_world(_when_rebuilt, 1)[0]
    for kwargs in ({}, {"static_graph": True}, {"find_unused_parameters": True}):
        assert seen[str(kwargs), "minddp"] == seen[str(kwargs), "torch"], (kwargs, seen)
    assert any(rebuilt for _, rebuilt, _ in seen["{}", "torch"])  # the oracle did rebuild
