"""The benchmark scripts run end to end on a tiny budget and write what they promise.

No timing is asserted here: performance figures come from the benchmarks
themselves, run on a quiet machine.
"""
import json

import pytest

from benchmarks import compare
from dist_harness import run_world
from minddp import registry


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
        assert row["ratio_to_torch_ddp_ci"] is None  # 2 steps are too few for a 95% interval
        if row["name"] != "no_comm":
            assert row["comm_ms"] > 0 and 0.0 <= row["hidden_share"] <= 1.0
    present = {r["name"] for r in written if r["absent"] is None}
    assert {"no_comm", "torch_ddp", "torch_ddp_fp16", "minddp_native"} <= present


def _time_to_loss(rank, world_size, out):
    import torch
    from benchmarks import time_to_loss
    args = time_to_loss.parse_args(["--steps", "3", "--eval-every", "1", "--batch-size", "2",
                                    "--val-batches", "1",
                                    "--configs", "torch_ddp,minddp_ring_powersgd",
                                    "--out", out])
    return time_to_loss.run(args, rank, world_size, torch.device("cpu"))


def test_time_to_loss_writes_curves_and_ratios(tmp_path):
    rows = run_world(_time_to_loss, 2, str(tmp_path), timeout=240)[0]
    with open(tmp_path / "time_to_loss.json") as f:
        data = json.load(f)
    assert (tmp_path / "time_to_loss.png").stat().st_size > 0
    assert [r["name"] for r in data["rows"]] == ["torch_ddp", "minddp_ring_powersgd"]
    assert {"command", "commit", "machine", "torch", "target"} <= set(data["meta"])
    torch_row, minddp_row = rows
    assert [step for step, _, _ in torch_row["curve"]] == [0, 1, 2, 3]
    # the default target: torch DDP's final loss + 1%, which torch DDP itself reaches
    assert torch_row["target"] == pytest.approx(torch_row["final_loss"] * 1.01)
    assert data["meta"]["target_rule"] == "torch DDP's final loss + 1%"
    assert all(row["time_to_target_s"] is not None for row in rows)
    assert torch_row["time_vs_torch"] == 1.0 and torch_row["loss_vs_torch"] == 1.0
    # 3 steps are inside PowerSGD's full-precision warm-up: the same losses as torch DDP
    assert abs(minddp_row["final_loss"] - torch_row["final_loss"]) < 1e-4
    assert 0 < minddp_row["bytes_sent_mb"] < torch_row["bytes_sent_mb"] / 10


def _collectives(rank, world_size, out):
    import torch
    from benchmarks import collectives
    args = collectives.parse_args(["--sizes", "4", "4096", "--budget", "0.05", "--model", "--cpu",
                                   "--algorithms", *collectives.algorithm_names(),
                                   collectives.NOISE_FLOOR, "--compression", "fp16",
                                   "--out", out])
    rows, costs = collectives.run(args, rank, world_size, torch.device("cpu"))
    if rank == 0:
        collectives.report(rows, costs, args, world_size)
    return rows


def test_collectives_writes_a_row_per_algorithm_and_size(tmp_path):
    from benchmarks import collectives
    rows = run_world(_collectives, 2, str(tmp_path), timeout=240)[0]
    with open(tmp_path / "collectives_p2.json") as f:
        written = json.load(f)["rows"]
    assert (tmp_path / "collectives_p2.png").stat().st_size > 0
    names = collectives.algorithm_names()  # every registered one, plugins' too
    codecs = [f"{a}+fp16" for a in names if registry.algorithm(a).bind is None]
    assert [(r["bytes"], r["algorithm"]) for r in written] == [
        (size, name) for size in (4, 4096) for name in names + [collectives.NOISE_FLOOR] + codecs]
    for size in (4, 4096):
        mine = [r for r in rows if r["bytes"] == size]
        for row in mine:
            for key in ("time_us", "ratio_to_native", "ratio_to_best"):
                assert row[key] > 0, (size, row["algorithm"], key, row[key])
            if row["algorithm"] in codecs:  # half the bytes, fp16's rounding in the result
                assert row["wire"] == 0.5 and 1e-6 < row["rel_error"] < 2e-3, row
            else:  # float32 sums: rounding only; a prediction where there is a formula
                modelled = row["algorithm"] == collectives.NOISE_FLOOR or registry.algorithm(
                    row["picked"] or row["algorithm"]).cost is not None
                assert row.get("model_us", 0) > 0 or not modelled, row
                assert row["wire"] == 1.0 and row["rel_error"] < 1e-6, row
        # /best is paired against the algorithm with the lowest median: that
        # row is exactly 1. The others are medians of per-repetition ratios,
        # so they are not bounded below by 1 and are not checked against it.
        # The noise-floor row is never the reference, even when it is fastest.
        fastest = min((r for r in mine if r["algorithm"] != collectives.NOISE_FLOOR),
                      key=lambda r: r["time_us"])
        assert fastest["ratio_to_best"] == 1.0
        assert [r["picked"] for r in mine if r["algorithm"] == "auto"][0] in names
        for row in mine:
            for key in ("ratio_to_native", "ratio_to_best"):
                low, high = row[key + "_ci"]
                assert low <= row[key] <= high, (size, row["algorithm"], key, low, high)
        for row in mine:  # --cpu: our thread always works; gloo's own threads only for native
            cpu = row["cpu_us"]
            assert cpu["main"] > 0 and cpu["all"] >= cpu["main"], (size, row["algorithm"], cpu)
            if row["algorithm"] == "native":
                assert cpu["gloo workers"] > 0, (size, cpu)


def test_relative_to_best_pairs_each_repetition_with_the_fastest():
    from benchmarks import collectives
    # Slow spells hit whole repetitions: b (the lowest median) ran slow in
    # repetitions 3-4, a in 2-4. a is 1.1x b in all but one repetition; its
    # median over b's would say 5.5.
    times = {"b": [1.0, 1.0, 1.0, 5.0, 5.0],
             "a": [1.1, 1.1, 5.5, 5.5, 5.5],
             "c": [9.0, 9.0, 9.0, 9.0, 9.0]}
    ratios = collectives.relative_to_best(times)
    assert ratios["b"] == 1.0
    assert abs(ratios["a"] - 1.1) < 1e-9
    assert abs(ratios["c"] - 9.0) < 1e-9  # median of 9, 9, 9, 1.8, 1.8
    # The noise-floor row (native timed again) is never the reference, even
    # when it is the lucky one.
    lucky = collectives.relative_to_best({"native": [2.0] * 3, "ring": [3.0] * 3,
                                          collectives.NOISE_FLOOR: [1.0] * 3})
    assert lucky["native"] == 1.0 and lucky[collectives.NOISE_FLOOR] == 0.5


def test_median_interval_takes_the_binomial_order_statistics():
    import math

    from benchmarks import measure
    # 20 values: the 6th smallest and 6th largest (P(outside) = 2 * P(Bin(20, 1/2) <= 5) = 4.1%).
    assert measure.median_interval(list(range(20, 0, -1))) == (6, 15)
    assert measure.median_interval(range(1, 7)) == (1, 6)  # 2 / 64 = 3.1% outside
    low, high = measure.median_interval(range(1, 6))  # 5 values: even (1, 5) misses 6.2%
    assert math.isnan(low) and math.isnan(high)
    assert measure.pairwise_ratio_interval([2.0] * 10, [1.0] * 10) == [2.0, 2.0]
    assert measure.pairwise_ratio_interval([2.0] * 5, [1.0] * 5) is None  # too few for 95%
    assert measure.format_interval([0.9712, 1.0049]) == "0.97-1.00"
    assert measure.format_interval([0.9712, 1.0049], digits=3) == "0.971-1.005"


def _compare_json(path, steps):
    """A compare.json with one workload; steps: {config: [ms per step]}."""
    rows = [{"workload": "transformer", "name": name, "absent": None, "steps_ms": ms}
            for name, ms in steps.items()]
    rows.append({"workload": "transformer", "name": "minddp_tree", "absent": "not implemented"})
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def test_pool_pairs_steps_within_each_run(tmp_path):
    from benchmarks import pool
    # Run a is slow throughout. Within each run the ring is 0.9x torch DDP on
    # every step; pairing across runs (a's ring with b's torch) would give 1.8
    # or 0.45, and a ratio of medians of the pooled times gives auto 0.95, not 1.
    a = _compare_json(tmp_path / "a.json", {"torch_ddp": [200.0] * 4, "minddp_ring": [180.0] * 4,
                                            "minddp_auto": [210.0, 220.0, 190.0, 200.0]})
    b = _compare_json(tmp_path / "b.json", {"torch_ddp": [100.0] * 3, "minddp_ring": [90.0] * 3,
                                            "minddp_auto": [95.0, 105.0, 100.0]})
    rows = {r["name"]: r for r in pool.main([a, b])}
    assert set(rows) == {"minddp_ring", "minddp_auto"}  # not torch_ddp, not the absent row
    ring = rows["minddp_ring"]
    assert ring["steps"] == 7 and abs(ring["ratio"] - 0.9) < 1e-12
    assert ring["runs"] == "0.900 0.900" and ring["under_1"] == "2 of 2"
    assert ring["interval"] == [0.9, 0.9]  # 7 ratios: enough for a 95% interval
    auto = rows["minddp_auto"]  # ratios 1.05 1.1 0.95 1.0 | 0.95 1.05 1.0
    assert abs(auto["ratio"] - 1.0) < 1e-12 and auto["runs"] == "1.025 1.000"
    assert auto["under_1"] == "0 of 2"
    # --baseline: the same pairing against another row
    rows = {r["name"]: r for r in pool.main(["--baseline", "minddp_ring", a, b])}
    assert set(rows) == {"torch_ddp", "minddp_auto"}
    assert abs(rows["torch_ddp"]["ratio"] - 1 / 0.9) < 1e-12


def test_pool_exposed_communication_is_step_minus_no_comm_of_the_same_run(tmp_path):
    from benchmarks import pool
    # Run b's CPU is twice as slow (no_comm 200 ms, not 100) but the link is the
    # same: torch leaves 100 ms exposed in both, the planned row 40 in a and 60 in b.
    a = _compare_json(tmp_path / "a.json", {"no_comm": [100.0] * 3, "torch_ddp": [200.0] * 3,
                                            "minddp_auto@auto": [140.0] * 3})
    b = _compare_json(tmp_path / "b.json", {"no_comm": [200.0] * 2, "torch_ddp": [300.0] * 2,
                                            "minddp_auto@auto": [260.0] * 2})
    rows = {r["name"]: r for r in pool.main([a, b])}
    planned = rows["minddp_auto@auto"]
    assert planned["exposed_runs"] == "0.40 0.60"
    assert planned["exposed_ms"] == 40.0 and planned["exposed_ratio"] == 0.4  # 3 of 5 steps
    assert "exposed_ms" not in rows["no_comm"]
    # Without no_comm in every run there is nothing to subtract: no exposed columns.
    c = _compare_json(tmp_path / "c.json", {"torch_ddp": [200.0], "minddp_auto@auto": [150.0]})
    assert "exposed_ms" not in pool.main([a, c])[0]


def test_pool_refuses_a_run_without_torch_ddp(tmp_path):
    import pytest

    from benchmarks import pool
    a = _compare_json(tmp_path / "a.json", {"torch_ddp": [1.0], "minddp_ring": [1.0]})
    b = _compare_json(tmp_path / "b.json", {"minddp_ring": [1.0]})
    with pytest.raises(SystemExit, match="b.json has no torch_ddp row for transformer"):
        pool.main([a, b])
