"""`train.py --compare`: the same training under torch DDP and every minddp flavour.

    torchrun --standalone --nproc_per_node=2 examples/train.py --compare

Each flavour trains from the same seeds (initial weights, data order, dropout
masks), one after the other in one process group, into OUT/<flavour>/. Then
rank 0 writes OUT/compare.png (training and validation loss overlaid) and
OUT/compare.json, and prints the final losses with each flavour's relative
difference from torch DDP. A flavour this build of minddp lacks is listed as
absent with minddp's reason, not run. `--flavours` picks the rows, e.g.
`--flavours torch_ddp,minddp_ring,minddp_ring_fp16,torch_ddp_fp16`; with
`--resume` each flavour continues from OUT/<flavour>/latest.pt where there is one.
"""
import argparse
import os

from examples import train_utils as tu
from benchmarks.measure import format_table
from examples.train_utils import FlavourUnavailable

# Default rows: "torch_ddp[_fp16|_bf16]" or "minddp_<algorithm>[_fp16|_bf16]".
FLAVOURS = ["torch_ddp", "minddp_native", "minddp_ring", "minddp_tree", "minddp_ring_fp16"]


def parse_flavour(name):
    """A row name as (--ddp, --algorithm, --compression): "minddp_ring_fp16" ->
    ("minddp", "ring", "fp16"), "torch_ddp" -> ("torch", "auto", None)."""
    rest, compression = name, None
    for suffix in ("_fp16", "_bf16"):
        if rest.endswith(suffix):
            rest, compression = rest[:-len(suffix)], suffix[1:]
    if rest == "torch_ddp":
        return "torch", "auto", compression
    if rest.startswith("minddp_") and len(rest) > len("minddp_"):
        return "minddp", rest[len("minddp_"):], compression
    raise ValueError(f"--flavours: {name!r} is not torch_ddp[_fp16|_bf16] or "
                     f"minddp_<algorithm>[_fp16|_bf16] (e.g. minddp_ring_fp16)")


COLUMNS = [("name", "flavour", "{}"), ("seconds", "time s", "{:.1f}"),
           ("samples_per_s", "samples/s", "{:.1f}"),
           ("train_loss", "train loss", "{:.6f}"), ("val_loss", "val loss", "{:.6f}"),
           ("val_rel_diff", "val vs torch", "{:.2e}")]


def compare(args, rank, world_size, device, train_one):
    """Run `train_one(args, rank, world_size, device)` (train.run) for every flavour;
    a flavour it refuses with FlavourUnavailable is reported absent.

    Every rank calls it. Returns the table's rows: name, seconds (training and
    validation), samples_per_s (training, all ranks), train_loss
    (mean of the last epoch), val_loss (last epoch), val_rel_diff (against
    torch_ddp); or name and absent (the reason) for a flavour minddp lacks.
    """
    histories, rows = {}, []
    for name in args.flavours:
        ddp, algorithm, compression = parse_flavour(name)
        out = os.path.join(args.out, name)
        # --resume continues an interrupted comparison: each flavour from its own
        # latest checkpoint (a finished one just reloads its history).
        resume = args.resume and os.path.exists(os.path.join(out, "latest.pt"))
        flavour_args = argparse.Namespace(**{
            **vars(args), "ddp": ddp, "algorithm": algorithm, "compression": compression,
            "compare": False, "resume": resume, "out": out})
        if rank == 0:
            print(f"== {name}", flush=True)
        try:
            history = train_one(flavour_args, rank, world_size, device)
        except FlavourUnavailable as e:  # raised on every rank alike: safe to go on
            rows.append({"name": name, "absent": str(e)})
            continue
        histories[name] = history
        last = history["epochs"][-1]
        epochs = history["epochs"]
        rows.append({"name": name, "seconds": sum(e["seconds"] for e in epochs),
                     "samples_per_s": sum(e["samples_per_s"] for e in epochs) / len(epochs),
                     "train_loss": last["train_loss"], "val_loss": last["val_loss"]})
    reference = next((r["val_loss"] for r in rows if r["name"] == "torch_ddp"), None)
    for row in rows:
        if "val_loss" in row and reference:
            row["val_rel_diff"] = abs(row["val_loss"] - reference) / abs(reference)
    if rank == 0:
        tu.write_history(os.path.join(args.out, "compare.json"), {"rows": rows})
        tu.plot_overlay(histories, os.path.join(args.out, "compare.png"))
        print(f"\n{args.epochs} epochs, {args.samples} samples, batch {args.batch_size} x "
              f"{world_size} ranks on {device.type}; losses of the last epoch")
        print(format_table(rows, COLUMNS))
        for row in rows:
            if "absent" in row:
                print(f"absent: {row['name']}: {row['absent']}")
        print(f"wrote {args.out}/compare.json and {args.out}/compare.png", flush=True)
    return rows
