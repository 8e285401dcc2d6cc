"""One rank of the HF Trainer parity run (tests/test_frameworks.py launches it).

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc_per_node=2 tests/frameworks/hf_trainer_run.py OUT

Trains a tiny GPT-2 built from a config (nothing downloaded) twice in one
world, same seed and data: with the stock Trainer (torch's DDP through
Accelerate), then after `minddp.replace_torch_ddp(...)`. Each run uses
gradient accumulation and clipping, then `save_model` and `from_pretrained`.
Saves OUT/rank<r>.pt for the test.
"""
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

import minddp

OUT = sys.argv[1]


class Recording(Trainer):
    """The stock Trainer, noting each micro-batch's loss and the wrapper it ran through."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.seen.append((loss.detach().clone(), f"{type(model).__module__}"))
        return loss


def dataset():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (32, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def run(label):
    set_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    out_dir = os.path.join(OUT, label)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, num_train_epochs=1,
                             learning_rate=1e-2, max_grad_norm=0.5, seed=0, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Recording(model=model, args=args, train_dataset=dataset())
    trainer.seen = []
    trainer.train()
    trainer.save_model(out_dir)
    trainer.accelerator.wait_for_everyone()
    reloaded = GPT2LMHeadModel.from_pretrained(out_dir)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "reloaded": {n: p.detach().clone() for n, p in reloaded.named_parameters()},
            "losses": torch.stack([loss for loss, _ in trainer.seen]),
            "wrappers": sorted({w for _, w in trainer.seen})}


results = {"stock": run("stock")}
minddp.replace_torch_ddp(algorithm="ring")  # the one line (ring: no start-up timing in tests)
results["minddp"] = run("minddp")
torch.save(results, os.path.join(OUT, f"rank{torch.distributed.get_rank()}.pt"))
