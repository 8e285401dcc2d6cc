"""Lightning on minddp: the stock Trainer, with minddp's strategy instead of "ddp".

    python examples/lightning_example.py                        # Lightning starts 2 CPU processes
    torchrun --nproc_per_node=2 examples/lightning_example.py   # or under torchrun

`import minddp.lightning` registers the strategy "minddp"; for minddp's own keywords, pass
`strategy=MinddpStrategy(algorithm="ring", compression="fp16")` instead.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as L

import minddp.lightning  # noqa: F401 - registers strategy="minddp"


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, index):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    L.seed_everything(0)
    x = torch.randn(1024, 16)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="minddp", max_epochs=3,
                        accumulate_grad_batches=2, logger=False, enable_checkpointing=False)
    trainer.fit(Regression(), DataLoader(data, batch_size=32))
    # The strategy unwraps the model after fit, as Lightning's own DDP strategy does.
    print(f"rank {trainer.global_rank}: final loss {trainer.callback_metrics['loss']:.4f}")
