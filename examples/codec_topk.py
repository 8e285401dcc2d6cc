"""A new codec in one file: top-k sparsification with error feedback.

    import minddp; minddp.registry.load("examples/codec_topk.py")   # or import it
    ddp = minddp.DDP(model, algorithm="ring", compression="topk")
    torchrun --nproc_per_node=2 benchmarks/compare.py --plugin examples/codec_topk.py \
        --configs torch_ddp,minddp_ring,minddp_ring_topk,minddp_auto_topk

Each chunk travels as its RATIO largest-magnitude values and their positions
(float32 values, int32 indices, the chunk's length): about 2 x RATIO of the
bytes. Registered with error_feedback=True, so what a hop leaves out is kept
per bucket and sent with the next step's gradients (Stich et al. 2018, "Sparsified
SGD with memory"); without it top-k loses most of every gradient for good.

minddp puts the codec on every hop of its per-hop algorithms (ring, tree,
halving-doubling, auto): partial sums stay float32 between hops, and every
rank decodes the same final encodings, so ranks end bitwise equal. The
backend's all-reduce ("native") cannot carry it: minddp says so. The shared
test battery (tests/test_battery.py loads every examples/codec_*.py) tests it.
"""
import math

import torch

import minddp

RATIO = 0.1  # share of each chunk's values sent


def encode(chunk):
    """(values, indices, length): the chunk's largest-magnitude RATIO share."""
    n = chunk.numel()
    k = max(1, math.ceil(RATIO * n))  # depends on the size only, as a codec's wire must
    indices = chunk.abs().topk(k, sorted=False).indices
    return chunk[indices], indices.to(torch.int32), torch.tensor([n], device=chunk.device)


def decode(wire):
    """A float32 tensor of the chunk's length: the sent values in place, zeros elsewhere."""
    values, indices, length = wire
    out = torch.zeros(int(length.item()), dtype=values.dtype, device=values.device)
    return out.index_copy_(0, indices.long(), values)


minddp.register_codec("topk", encode=encode, decode=decode, error_feedback=True)
