"""Helpers of examples/train.py: schedule, seeding, checkpoints, history, plots.

Kept apart so train.py reads as the training loop and nothing else.
"""
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

# The run settings a checkpoint must share with the run that resumes it: any
# of them changes the trajectory (data order, schedule, model shape).
TRAJECTORY_KEYS = ("epochs", "batch_size", "accumulate", "samples", "val_samples", "seq_len",
                   "vocab", "d_model", "layers", "heads", "ff", "dropout", "lr",
                   "weight_decay", "warmup_steps", "clip", "seed", "world_size")


class FlavourUnavailable(RuntimeError):
    """This build of minddp lacks or refuses the --algorithm/--compression pair."""


class WarmupCosine:
    """LR multiplier for LambdaLR: linear from `start` to 1 over `warmup` steps,
    then cosine from 1 down to 0 at `total` steps (the course's LinearLR +
    CosineAnnealingLR, as one object so its state_dict is plain numbers)."""

    def __init__(self, warmup, total, start=0.1):
        self.warmup, self.total, self.start = warmup, total, start

    def __call__(self, step):
        if step < self.warmup:
            return self.start + (1.0 - self.start) * step / self.warmup
        # max(1, ...): a run shorter than its warm-up still gets a defined factor.
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def seed_step(seed, step, rank):
    """Seed every RNG (CPU and CUDA) for one optimizer step of one rank.

    Dropout draws from these generators, so torch DDP and minddp see the same
    masks when seeded alike; ranks get different streams, as independent
    processes would. Reseeding per step (rather than saving each rank's RNG
    state) lets a rank-0 checkpoint resume every rank on the exact trajectory,
    and keeps the masks the same even if something else draws from the global
    generator between steps (DataLoader does at each epoch start; minddp's
    algorithm="auto" does when it measures the links).
    """
    torch.manual_seed((seed * 1_000_003 + step) * 1_009 + rank)


def token_count(labels):
    """Tokens that count in the loss (label 0 is padding, ignored by lm_loss)."""
    return int((labels != 0).sum())


# -- checkpoints ----------------------------------------------------------------
def save_checkpoint(path, state):
    """Write atomically: a run killed mid-write leaves the previous file intact."""
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, config):
    """Load a checkpoint for resuming, refusing one written with other settings."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume: no checkpoint at {path}; run without --resume "
                                f"first (or point --out at the run to continue).")
    state = torch.load(path, map_location="cpu", weights_only=False)
    saved = state["config"]
    changed = [f"{k}: checkpoint {saved.get(k)!r}, now {config[k]!r}"
               for k in TRAJECTORY_KEYS if saved.get(k) != config[k]]
    if changed:
        raise ValueError(f"--resume: {path} was written with other settings, so it cannot "
                         f"continue the same trajectory ({'; '.join(changed)}). Rerun with the "
                         f"checkpoint's settings or start a fresh --out directory.")
    return state


# -- history: JSON and PNG --------------------------------------------------------
def write_history(path, history):
    with open(path, "w") as f:
        json.dump(history, f, indent=1)


def plot_history(history, path):
    """Three panels: training loss per optimizer step, validation loss per epoch, LR."""
    fig, (ax_loss, ax_val, ax_lr) = plt.subplots(1, 3, figsize=(15, 4.2))
    steps = [s["step"] for s in history["train"]]
    ax_loss.plot(steps, [s["loss"] for s in history["train"]], alpha=0.8)
    ax_loss.set(title="training loss (mean over ranks)", xlabel="optimizer step", ylabel="loss")
    val = history["val"]
    ax_val.plot([v["step"] for v in val], [v["loss"] for v in val], "o-", color="tab:orange")
    ax_val.set(title="validation loss", xlabel="optimizer step", ylabel="loss")
    ax_val.ticklabel_format(axis="y", useOffset=False)  # small changes, absolute values
    ax_lr.plot(steps, [s["lr"] for s in history["train"]], color="tab:green")
    ax_lr.set(title="learning rate", xlabel="optimizer step", ylabel="lr")
    for ax in (ax_loss, ax_val, ax_lr):
        ax.grid(True, alpha=0.3)
    fig.suptitle(history["label"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overlay(histories, path):
    """Loss curves of several runs on shared axes: training (left), validation (right)."""
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, history in histories.items():
        style = "--" if name.startswith("torch") else "-"
        ax_train.plot([s["step"] for s in history["train"]],
                      [s["loss"] for s in history["train"]], style, label=name, alpha=0.8)
        ax_val.plot([v["step"] for v in history["val"]], [v["loss"] for v in history["val"]],
                    style, marker="o", label=name)
    ax_train.set(title="training loss", xlabel="optimizer step", ylabel="loss")
    ax_val.set(title="validation loss", xlabel="optimizer step", ylabel="loss")
    for ax in (ax_train, ax_val):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
