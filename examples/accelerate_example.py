"""Accelerate on minddp: one line before the model is prepared.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_example.py
    torchrun --nproc_per_node=2 examples/accelerate_example.py  # the same, without accelerate's CLI

(`--multi_gpu` picks Accelerate's torchrun launcher; on a machine without GPUs the two
processes train on the CPU over gloo. `--cpu` alone would start a single process.)
Everything else is Accelerate's usual loop: `accumulate`, `clip_grad_norm_`,
`unwrap_model`, `save_state` work as with torch's DDP.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.utils import set_seed

import minddp

minddp.replace_torch_ddp(algorithm="ring")  # Accelerate's DDP is now minddp's

# cpu=True on a machine without GPUs: that is what makes the launched processes a gloo world.
accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
set_seed(0)
x = torch.randn(1024, 16)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32, shuffle=True)
model, optimizer, data = accelerator.prepare(model, optimizer, data)

for epoch in range(3):
    for inputs, target in data:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(inputs), target)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    accelerator.print(f"epoch {epoch}: loss {accelerator.reduce(loss, 'mean').item():.4f} "
                      f"({type(model).__module__}.{type(model).__name__})")
bare = accelerator.unwrap_model(model)  # the nn.Sequential itself
