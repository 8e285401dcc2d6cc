"""The course's training workflow on torch DDP or minddp.

    torchrun --standalone --nproc_per_node=2 examples/train.py --ddp minddp
    torchrun --standalone --nproc_per_node=2 examples/train.py --ddp torch
    torchrun --standalone --nproc_per_node=2 examples/train.py --ddp minddp --resume
    torchrun --standalone --nproc_per_node=2 examples/train.py --compare
    python examples/train.py --samples 64 --epochs 1      # one process, no torchrun

SimpleTransformer on DummyTextDataset; DistributedSampler with set_epoch; AdamW,
linear warm-up from 0.1x then cosine; gradient clipping; `--accumulate N` runs
N micro-batches per optimizer step with `no_sync` on all but the last;
autocast + GradScaler with `--amp` (CUDA only). After every epoch: validation
loss over the whole validation set (all ranks), rank 0 writes latest.pt and
best.pt (model, optimizer, scheduler, scaler, next sampler epoch, history),
history.json and train.png to --out. `--resume` continues from latest.pt on the
same trajectory as an uninterrupted run.

`--compare` trains the same seeds under torch DDP and each minddp flavour
(train_compare.py), overlays their loss curves and prints a final-loss table.

Loss normalisation: each optimizer step's loss is the mean over the step's
real tokens on this rank, so N accumulated micro-batches give exactly the
gradient of one N-times-larger batch. The validation set draws its own tokens
(seed + 1): with the training seed it would repeat the first training
sequences and measure memorisation.
"""
import argparse
import contextlib
import itertools
import math
import os
import shutil
import socket
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader, DistributedSampler

import minddp
from benchmarks.measure import Progress, init_distributed
from benchmarks.workloads import DummyTextDataset, SimpleTransformer, lm_loss
from examples import train_utils as tu
from examples.train_compare import FLAVOURS, compare, parse_flavour

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ddp", choices=["torch", "minddp"], default="minddp")
    p.add_argument("--algorithm", default="auto", help="minddp all-reduce: auto|native|ring|tree")
    p.add_argument("--compression", choices=["fp16", "bf16"], default=None,
                   help="gradient compression (torch DDP: its compress hook)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="per rank, per micro-batch")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--amp", action="store_true", help="autocast fp16 + GradScaler (CUDA only)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/latest.pt")
    p.add_argument("--stop-after", type=int, default=None, metavar="EPOCHS",
                   help="stop after this many epochs, as if preempted (resume with --resume)")
    p.add_argument("--out", default=None, help="output directory (default results/train, "
                   "or results/train_compare with --compare)")
    p.add_argument("--compare", action="store_true", help="torch DDP vs every minddp flavour")
    p.add_argument("--flavours", default=",".join(FLAVOURS),
                   help="--compare's rows, comma-separated (default: %(default)s)")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    # The course's sizes by default; smaller ones make tests and smoke runs quick.
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--val-samples", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ff", type=int, default=1024, help="feed-forward width")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join("results", "train_compare" if args.compare else "train")
    if args.accumulate < 1 or args.batch_size < 1 or args.epochs < 1:
        p.error("--epochs, --batch-size and --accumulate must be at least 1")
    args.flavours = [f for f in args.flavours.split(",") if f]
    for name in args.flavours:
        try:
            parse_flavour(name)
        except ValueError as e:
            p.error(str(e))
    if args.ddp == "torch" and args.algorithm != "auto":
        p.error(f"--algorithm {args.algorithm} chooses minddp's all-reduce; torch DDP has its own "
                f"(use --ddp minddp, or drop --algorithm)")
    return args


def flavour(args):
    if args.ddp == "torch":
        return "torch_ddp" + (f"_{args.compression}" if args.compression else "")
    return f"minddp_{args.algorithm}" + (f"_{args.compression}" if args.compression else "")


def wrap(model, args, device):
    """torch DDP or minddp around `model`.

    minddp checks its arguments on every rank alike before any communication,
    so a flavour it lacks (NotImplementedError) or refuses (ValueError) raises
    tu.FlavourUnavailable everywhere at once and the world stays usable.
    """
    kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
    if args.ddp == "minddp":
        try:
            return minddp.DDP(model, algorithm=args.algorithm, compression=args.compression,
                              **kwargs)
        except (NotImplementedError, ValueError) as e:
            raise tu.FlavourUnavailable(f"{flavour(args)}: {e}") from e
    ddp = TorchDDP(model, **kwargs)
    if args.compression:
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        ddp.register_comm_hook(dist.group.WORLD, hook[args.compression])
    return ddp


def train_step(ddp, group, optimizer, scaler, args, device):
    """One optimizer step over the micro-batches in `group`; returns (loss, grad norm).

    Gradients are reduced only in the last micro-batch's backward (no_sync on the
    others). Each micro-batch's loss is weighted by its share of the step's tokens.
    """
    tokens = max(1, sum(tu.token_count(b["labels"]) for b in group))
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for i, batch in enumerate(group):
        sync = i == len(group) - 1
        with (contextlib.nullcontext() if sync else ddp.no_sync()):
            with torch.autocast(device.type, dtype=torch.float16, enabled=args.amp):
                logits = ddp(batch["input_ids"].to(device), batch["attention_mask"].to(device))
                labels = batch["labels"].to(device)
                loss = lm_loss(logits, labels) * (tu.token_count(labels) / tokens)
            scaler.scale(loss).backward()
        total += loss.detach()
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
    scaler.step(optimizer)
    scaler.update()
    return total, grad_norm


def train_epoch(ddp, loader, optimizer, scheduler, scaler, args, rank, epoch, history, device):
    ddp.train()
    steps = math.ceil(len(loader) / args.accumulate)
    progress = Progress(steps, f"epoch {epoch + 1}/{args.epochs}", enabled=rank == 0)
    batches = iter(loader)
    for _ in range(steps):
        lr = optimizer.param_groups[0]["lr"]
        tu.seed_step(args.seed, len(history["train"]), rank)
        loss, grad_norm = train_step(ddp, list(itertools.islice(batches, args.accumulate)),
                                     optimizer, scaler, args, device)
        scheduler.step()
        # Logged as the mean over ranks: what the averaged gradient descends.
        dist.all_reduce(loss)
        loss = loss.item() / dist.get_world_size()
        history["train"].append({"step": len(history["train"]) + 1, "epoch": epoch + 1,
                                 "loss": loss, "lr": lr, "grad_norm": grad_norm.item()})
        progress.step(f"loss {loss:.4f} lr {lr:.2e}")


@torch.no_grad()
def validate(model, loader, args, device):
    """Mean loss per real token over the whole validation set, identical on every rank."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in loader:
        labels = batch["labels"].to(device)
        with torch.autocast(device.type, dtype=torch.float16, enabled=args.amp):
            logits = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        n = tu.token_count(labels)
        totals += torch.stack([lm_loss(logits.float(), labels).double() * n,
                               torch.tensor(float(n), dtype=torch.float64, device=device)])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def run(args, rank, world_size, device):
    """Train with `args` on this rank (every rank calls it); return the history.

    When it returns on any rank, rank 0's files in args.out are complete.
    """
    if args.amp and device.type != "cuda":
        raise SystemExit("--amp needs CUDA: autocast fp16 with GradScaler is a GPU recipe "
                         "(drop --amp on CPU)")
    config = {k: v for k, v in vars(args).items()
              if k not in ("out", "resume", "compare", "flavours", "stop_after", "device")}
    config["world_size"] = world_size
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)  # the same initial weights on every rank and flavour
    model = SimpleTransformer(args.vocab, args.d_model, args.heads, args.layers,
                              max_seq_len=args.seq_len, dim_feedforward=args.ff,
                              dropout=args.dropout).to(device)
    ddp = wrap(model, args, device)

    train_set = DummyTextDataset(args.samples, args.seq_len, args.vocab, seed=args.seed)
    val_set = DummyTextDataset(args.val_samples, args.seq_len, args.vocab, seed=args.seed + 1)
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed)
    # num_workers=0: the data is in memory, and worker processes would compete
    # with the ranks for the few cores.
    loader = DataLoader(train_set, args.batch_size, sampler=sampler)
    val_loader = DataLoader(val_set, args.batch_size,
                            sampler=DistributedSampler(val_set, world_size, rank, shuffle=False))

    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * math.ceil(len(loader) / args.accumulate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, tu.WarmupCosine(args.warmup_steps, total_steps))
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp)

    history = {"label": f"{flavour(args)}, {world_size} ranks", "config": config,
               "train": [], "val": [], "epochs": []}
    first_epoch, best = 0, float("inf")
    latest, best_path = os.path.join(args.out, "latest.pt"), os.path.join(args.out, "best.pt")
    if args.resume:
        state = tu.load_checkpoint(latest, config)
        ddp.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        first_epoch, best = state["next_epoch"], state["best_val_loss"]
        history.update(train=state["history"]["train"], val=state["history"]["val"],
                       epochs=state["history"]["epochs"])
        if rank == 0:
            print(f"resumed {latest}: {first_epoch} of {args.epochs} epochs done", flush=True)

    last_epoch = args.epochs if args.stop_after is None else min(args.epochs, args.stop_after)
    for epoch in range(first_epoch, last_epoch):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        done = len(history["train"])
        train_epoch(ddp, loader, optimizer, scheduler, scaler, args, rank, epoch, history, device)
        train_seconds = time.perf_counter() - start
        val_loss = validate(ddp.module, val_loader, args, device)
        seconds = time.perf_counter() - start
        losses = [s["loss"] for s in history["train"][done:]]
        history["val"].append({"step": len(history["train"]), "epoch": epoch + 1,
                               "loss": val_loss})
        history["epochs"].append({"epoch": epoch + 1, "seconds": seconds,
                                  "samples_per_s": len(sampler) * world_size / train_seconds,
                                  "train_loss": sum(losses) / len(losses), "val_loss": val_loss})
        is_best, best = val_loss < best, min(best, val_loss)
        if rank == 0:
            tu.save_checkpoint(latest, {
                "model": ddp.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "next_epoch": epoch + 1,  # also the sampler epoch to resume with
                "best_val_loss": best, "history": history, "config": config})
            if is_best:
                shutil.copyfile(latest, best_path)
            tu.write_history(os.path.join(args.out, "history.json"), history)
            tu.plot_history(history, os.path.join(args.out, "train.png"))
            last = history["epochs"][-1]
            print(f"epoch {epoch + 1}/{args.epochs}: train {last['train_loss']:.4f}"
                  f"  val {val_loss:.4f}{' (best)' if is_best else ''}  {seconds:.1f}s"
                  f"  ({last['samples_per_s']:.1f} samples/s)", flush=True)
    dist.barrier()  # rank 0's files are written before any rank moves on
    return history


def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))
    rank, world_size, device = init_distributed(args.device)
    try:
        if args.compare:
            compare(args, rank, world_size, device, run)
        else:
            history = run(args, rank, world_size, device)
            if rank == 0 and history["epochs"]:
                last = history["epochs"][-1]
                print(f"{history['label']}: final train loss {last['train_loss']:.6f}, val loss "
                      f"{last['val_loss']:.6f}, {sum(e['seconds'] for e in history['epochs']):.1f}s"
                      f" training; wrote {args.out}/")
    except tu.FlavourUnavailable as e:
        raise SystemExit(str(e)) from e
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
