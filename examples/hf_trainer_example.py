"""The Hugging Face Trainer on minddp: one line before the Trainer is built.

    HF_HUB_OFFLINE=1 torchrun --nproc_per_node=2 examples/hf_trainer_example.py

A tiny GPT-2 built from a config (nothing downloaded) trains on random token sequences.
The Trainer prepares the model with Accelerate, which builds its DDP by the name that
`minddp.replace_torch_ddp()` rebinds; saving and `from_pretrained` work as usual.
"""
import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

import minddp

minddp.replace_torch_ddp(algorithm="ring")  # the Trainer's DDP is now minddp's

set_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                   n_head=4))
tokens = torch.randint(0, 128, (256, 32))
train = [{"input_ids": row, "labels": row} for row in tokens]
out = os.path.join(tempfile.gettempdir(), "minddp-hf-example")  # the same path on every rank
args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, num_train_epochs=2,
                         learning_rate=3e-3, gradient_accumulation_steps=2, logging_steps=8,
                         use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=train)
trainer.train()
trainer.save_model(out)
trainer.accelerator.wait_for_everyone()
reloaded = GPT2LMHeadModel.from_pretrained(out)
if trainer.is_world_process_zero():
    print(f"trained through {type(trainer.model_wrapped).__module__}; saved to {out}")
