"""One rank of the Lightning parity run (tests/test_frameworks.py launches it).

    torchrun --standalone --nproc_per_node=2 tests/frameworks/lightning_run.py OUT_DIR

Runs the same scenarios with the stock strategy ("ddp", torch's DDP) and with
minddp's ("minddp"), same seeds and data, in one torchrun world (Lightning
finds torchelastic's environment and launches nothing itself), and saves
OUT_DIR/rank<r>.pt: {strategy: {scenario: {"params", "buffers", "losses"}}}
plus what each run saw of its wrapper. The test compares the files.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as L
from lightning.pytorch.strategies import DDPStrategy

from minddp.lightning import MinddpStrategy

OUT = sys.argv[1]


class Net(L.LightningModule):
    """A small MLP with BatchNorm (buffers to compare), automatic or manual optimisation."""

    def __init__(self, manual=False):
        super().__init__()
        self.automatic_optimization = not manual
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        self.losses, self.wrappers = [], set()

    def training_step(self, batch, index):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.wrappers.add(f"{type(self.trainer.strategy).__name__}/"
                          f"{type(self.trainer.strategy.model).__module__}")
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    return DataLoader(data, batch_size=4)  # DistributedSampler: 8 batches per rank


def trainer(strategy, **kwargs):
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=OUT, **kwargs)


def snapshot(model, trainer_):
    snap = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "losses": torch.stack(model.losses), "wrappers": sorted(model.wrappers),
            "unwrapped": trainer_.strategy.model is model}
    model.losses, model.wrappers = [], set()
    return snap


def run(label, make_strategy):
    out = {}
    L.seed_everything(0)
    model = Net()
    t = trainer(make_strategy(first=True), max_epochs=1, accumulate_grad_batches=2)
    t.fit(model, loader())
    out["accumulate"] = snapshot(model, t)
    ckpt = os.path.join(OUT, f"{label}.ckpt")
    t.save_checkpoint(ckpt)

    t = trainer(make_strategy(), max_epochs=1)
    t.fit(model, loader())  # a second fit of the same module
    out["second_fit"] = snapshot(model, t)

    L.seed_everything(1)  # other initial weights: the checkpoint must replace them
    resumed = Net()
    t = trainer(make_strategy(), max_epochs=2, accumulate_grad_batches=2)
    t.fit(resumed, loader(), ckpt_path=ckpt)
    out["resumed"] = snapshot(resumed, t)

    L.seed_everything(0)
    manual = Net(manual=True)
    t = trainer(make_strategy(), max_epochs=1)
    t.fit(manual, loader())
    out["manual"] = snapshot(manual, t)

    L.seed_everything(0)  # the stock strategy's static-graph path for manual optimisation
    manual = Net(manual=True)
    t = trainer(make_strategy(static_graph=True), max_epochs=1)
    t.fit(manual, loader())
    out["manual_static_graph"] = snapshot(manual, t)

    # Static graph with automatic optimisation (not with accumulate_grad_batches: the
    # stock run's torch reducer fails an internal assert there on the no_sync steps).
    L.seed_everything(0)
    model = Net()
    t = trainer(make_strategy(static_graph=True), max_epochs=1)
    t.fit(model, loader())
    out["automatic_static_graph"] = snapshot(model, t)

    L.seed_everything(0)
    model = Net()
    HOOK_CALLS.clear()
    t = trainer(make_strategy(ddp_comm_hook=counted), max_epochs=1)
    t.fit(model, loader())
    out["comm_hook"] = snapshot(model, t)
    out["comm_hook"]["hook_calls"] = len(HOOK_CALLS)
    return out


HOOK_CALLS = []


def counted(state, bucket):
    """torch's allreduce_hook, counting its calls (the stock strategy registers
    hooks on CUDA only, so on CPU its run never calls it)."""
    HOOK_CALLS.append(bucket.index())
    return default_hooks.allreduce_hook(state, bucket)


def stock(first=False, **kwargs):
    return DDPStrategy(**kwargs) if kwargs else "ddp"


def ours(first=False, **kwargs):
    # The registered name once (minddp's defaults, algorithm "auto"); then the class with a
    # fixed algorithm, which skips auto's start-up timing.
    return "minddp" if first else MinddpStrategy(algorithm="ring", **kwargs)


results = {"stock": run("stock", stock), "minddp": run("minddp", ours)}
torch.save(results, os.path.join(OUT, f"rank{torch.distributed.get_rank()}.pt"))
