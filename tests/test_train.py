"""examples/train.py: the course's training workflow on minddp, against torch DDP.

Every test trains a tiny SimpleTransformer (1 layer, d_model 32, 16 tokens,
vocabulary 100) for a few steps, in-process on a gloo world, so the whole file
runs in well under two minutes on two cores.
"""
import json
import math
import os

import pytest
import torch

from dist_harness import run_world
from examples import train, train_compare, train_utils
from minddp import registry

TINY = ["--samples", "32", "--val-samples", "16", "--seq-len", "16", "--vocab", "100",
        "--d-model", "32", "--layers", "1", "--heads", "2", "--ff", "64", "--batch-size", "4",
        "--warmup-steps", "3", "--device", "cpu"]


def _train(rank, world_size, out, *flags):
    args = train.parse_args(TINY + ["--out", out] + list(flags))
    return train.run(args, rank, world_size, torch.device("cpu"))


def _assert_losses_close(got, want, rtol, what):
    assert len(got) == len(want), f"{what}: {len(got)} steps, expected {len(want)}"
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {step}: {a!r} vs {b!r}"


def _train_losses(history):
    return [s["loss"] for s in history["train"]]


def _val_losses(history):
    return [v["loss"] for v in history["val"]]


# -- one epoch, world sizes 1 and 2 ----------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2])
def test_one_epoch_writes_everything(tmp_path, world_size):
    histories = run_world(_train, world_size, str(tmp_path), "--epochs", "1", timeout=120)
    steps = math.ceil(32 / world_size / 4)
    for history in histories:
        assert len(history["train"]) == steps and len(history["val"]) == 1
        assert all(math.isfinite(s["loss"]) and s["grad_norm"] > 0 for s in history["train"])
    # Validation and logged training losses are reduced over ranks: identical everywhere.
    assert len({h["val"][0]["loss"] for h in histories}) == 1
    assert len({tuple(_train_losses(h)) for h in histories}) == 1
    for name in ("latest.pt", "best.pt", "history.json", "train.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    with open(tmp_path / "history.json") as f:
        assert json.load(f)["train"] == histories[0]["train"]


# -- step-by-step parity with torch DDP -------------------------------------------
def _ours_and_torch(rank, world_size, out, *minddp_flags):
    ours = _train(rank, world_size, os.path.join(out, "minddp"), "--epochs", "2",
                  "--ddp", "minddp", *minddp_flags)
    ref = _train(rank, world_size, os.path.join(out, "torch"), "--epochs", "2", "--ddp", "torch")
    return ours, ref


def _algorithms(*names):
    """Parameters for `names`; one not registered is an explicit expected failure, not a
    skip."""
    return [pytest.param(name, marks=pytest.mark.xfail(
        name not in registry.algorithm_names(), run=False, strict=True,
        reason=f"no algorithm {name!r} is registered"))
        for name in names]


@pytest.mark.parametrize("algorithm", _algorithms("native", "ring", "tree"))
def test_fp32_losses_match_torch_ddp(tmp_path, algorithm):
    ours, ref = run_world(_ours_and_torch, 2, str(tmp_path), "--algorithm", algorithm,
                          timeout=120)[0]
    _assert_losses_close(_train_losses(ours), _train_losses(ref), 1e-5, "train loss")
    _assert_losses_close(_val_losses(ours), _val_losses(ref), 1e-5, "val loss")
    _assert_losses_close([s["grad_norm"] for s in ours["train"]],
                         [s["grad_norm"] for s in ref["train"]], 1e-5, "grad norm")


@pytest.mark.parametrize("algorithm", _algorithms("auto", "ring"))
def test_fp16_compression_stays_within_one_percent_of_torch_fp32(tmp_path, algorithm):
    ours, ref = run_world(_ours_and_torch, 2, str(tmp_path), "--algorithm", algorithm,
                          "--compression", "fp16", timeout=120)[0]
    _assert_losses_close(_train_losses(ours), _train_losses(ref), 1e-2, "train loss")
    _assert_losses_close(_val_losses(ours), _val_losses(ref), 1e-2, "val loss")


# -- resume ----------------------------------------------------------------------
def _resume(rank, world_size, out):
    whole = _train(rank, world_size, os.path.join(out, "whole"), "--epochs", "2")
    cut = os.path.join(out, "cut")
    first = _train(rank, world_size, cut, "--epochs", "2", "--stop-after", "1")
    resumed = _train(rank, world_size, cut, "--epochs", "2", "--resume")
    with pytest.raises(ValueError, match="epochs: checkpoint 2, now 3"):
        _train(rank, world_size, cut, "--epochs", "3", "--resume")
    return whole, first, resumed


def test_resume_continues_the_same_trajectory(tmp_path):
    whole, first, resumed = run_world(_resume, 2, str(tmp_path), timeout=120)[0]
    assert len(first["train"]) * 2 == len(whole["train"]) and len(first["val"]) == 1
    # Same data order, dropout masks, optimizer and schedule state: bitwise.
    assert _train_losses(resumed) == _train_losses(whole)
    assert _val_losses(resumed) == _val_losses(whole)
    assert [s["lr"] for s in resumed["train"]] == [s["lr"] for s in whole["train"]]


def test_resume_without_checkpoint_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train_utils.load_checkpoint(str(tmp_path / "latest.pt"), {})


# -- gradient accumulation -----------------------------------------------------------
def _accumulate(rank, world_size, out):
    # Dropout off: micro-batches draw their masks in another order than one batch.
    common = ["--epochs", "2", "--dropout", "0"]
    micro = _train(rank, world_size, os.path.join(out, "micro"), *common,
                   "--batch-size", "4", "--accumulate", "2")
    large = _train(rank, world_size, os.path.join(out, "large"), *common, "--batch-size", "8")
    return micro, large


def test_accumulation_with_no_sync_equals_one_large_batch(tmp_path):
    micro, large = run_world(_accumulate, 2, str(tmp_path), timeout=120)[0]
    _assert_losses_close(_train_losses(micro), _train_losses(large), 1e-5, "train loss")
    _assert_losses_close(_val_losses(micro), _val_losses(large), 1e-5, "val loss")
    a = torch.load(tmp_path / "micro" / "latest.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "large" / "latest.pt", weights_only=False)["model"]
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=key)


# -- checkpoints load into torch DDP ------------------------------------------------
def _load_into_torch(rank, world_size, out):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from benchmarks.workloads import SimpleTransformer

    _train(rank, world_size, out, "--epochs", "1", "--ddp", "minddp")
    state = torch.load(os.path.join(out, "latest.pt"), weights_only=False)
    args = train.parse_args(TINY)
    torch.manual_seed(123)  # different initial weights: the load must replace them all
    ref = TorchDDP(SimpleTransformer(args.vocab, args.d_model, args.heads, args.layers,
                                     max_seq_len=args.seq_len, dim_feedforward=args.ff))
    assert list(state["model"]) == list(ref.state_dict())
    ref.load_state_dict(state["model"])  # strict: same keys, same shapes
    optimizer = torch.optim.AdamW(ref.parameters())
    optimizer.load_state_dict(state["optimizer"])
    return {k: v.clone() for k, v in ref.state_dict().items()}, state["model"]


def test_checkpoint_loads_into_torch_ddp(tmp_path):
    loaded, saved = run_world(_load_into_torch, 2, str(tmp_path), timeout=120)[0]
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


# -- --compare ---------------------------------------------------------------------
def _compare(rank, world_size, out):
    def compare(*flags):
        args = train.parse_args(TINY + ["--compare", "--epochs", "1", "--out", out, *flags])
        return train_compare.compare(args, rank, world_size, torch.device("cpu"), train.run)
    return compare(), compare("--resume")


def test_compare_reports_every_flavour(tmp_path):
    rows, resumed = run_world(_compare, 2, str(tmp_path), timeout=180)[0]
    # Every flavour had finished: --resume reloads the same results.
    assert resumed == rows
    assert [r["name"] for r in rows] == train_compare.FLAVOURS
    by_name = {r["name"]: r for r in rows}
    assert by_name["torch_ddp"]["val_rel_diff"] == 0.0
    assert by_name["minddp_native"]["val_rel_diff"] <= 1e-5
    for row in rows:
        if "absent" in row:
            assert row["absent"].startswith(row["name"] + ": minddp"), row
    assert (tmp_path / "compare.png").stat().st_size > 0
    with open(tmp_path / "compare.json") as f:
        assert [r["name"] for r in json.load(f)["rows"]] == [r["name"] for r in rows]


# -- settings and schedule --------------------------------------------------------------
def test_schedule_warms_up_from_a_tenth_then_decays_to_zero():
    f = train_utils.WarmupCosine(warmup=10, total=30)
    assert f(0) == pytest.approx(0.1) and f(5) == pytest.approx(0.55)
    assert f(10) == pytest.approx(1.0) and f(20) == pytest.approx(0.5) and f(30) == pytest.approx(0)


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(SystemExit, match="needs CUDA"):
        train.run(train.parse_args(TINY + ["--amp"]), 0, 1, torch.device("cpu"))
    with pytest.raises(SystemExit):
        train.parse_args(["--ddp", "torch", "--algorithm", "ring"])
    with pytest.raises(SystemExit):
        train.parse_args(["--compare", "--flavours", "torch_ddp,ring"])
    assert train_compare.parse_flavour("minddp_halving_doubling_bf16") == (
        "minddp", "halving_doubling", "bf16")
    assert train_compare.parse_flavour("torch_ddp_fp16") == ("torch", "auto", "fp16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_amp_on_cuda(tmp_path):
    histories = run_world(_train_cuda_amp, 1, str(tmp_path), timeout=120)
    assert all(math.isfinite(s["loss"]) for s in histories[0]["train"])


def _train_cuda_amp(rank, world_size, out):
    args = train.parse_args([f if f != "cpu" else "cuda" for f in TINY] +
                            ["--out", out, "--epochs", "1", "--amp"])
    return train.run(args, rank, world_size, torch.device("cuda", 0))
