"""The benchmark scripts run end to end on a tiny budget and write what they promise.

No timing is asserted here: performance figures come from the benchmarks
themselves, run on a quiet machine.
"""
import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import compare  # noqa: E402
from dist_harness import run_world  # noqa: E402


def _compare(rank, world_size, out):
    import torch
    args = compare.parse_args(["--workloads", "mlp,convnet", "--steps", "2", "--warmup", "1",
                               "--batch-size", "4", "--out", out])
    return compare.run(args, rank, world_size, torch.device("cpu"))


def test_compare_writes_every_row(tmp_path):
    rows = run_world(_compare, 2, str(tmp_path), timeout=240)[0]
    with open(tmp_path / "compare.json") as f:
        written = json.load(f)["rows"]
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert [r["name"] for r in written] == [r["name"] for r in rows]
    for workload in ("mlp", "convnet"):
        names = [r["name"] for r in written if r["workload"] == workload]
        assert names == compare.CONFIG_NAMES, f"{workload}: rows {names}"
    for row in written:
        assert row["world_size"] == 2
        if row["absent"] is not None:
            assert "not implemented" in row["absent"], row
            continue
        for key in ("step_ms", "samples_per_s", "peak_mem_mb", "ratio_to_torch_ddp"):
            assert isinstance(row[key], float) and row[key] > 0, (row["name"], key, row[key])
        assert len(row["steps_ms"]) == 2
        if row["name"] != "no_comm":
            assert row["comm_ms"] > 0 and 0.0 <= row["hidden_share"] <= 1.0
    present = {r["name"] for r in written if r["absent"] is None}
    assert {"no_comm", "torch_ddp", "torch_ddp_fp16", "minddp_native"} <= present
