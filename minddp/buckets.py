"""Bucket assignment: which parameters share a flat gradient buffer.

Gradients become ready roughly in reverse registration order (the last layer's
first), so buckets are filled in that order: bucket 0 holds the last
parameters and is the first one that can be sent while backward goes on.
The first bucket is capped small (1 MiB as in torch, or the cap if smaller)
so communication starts early; the others at `bucket_cap_mb`. A bucket never
mixes dtypes or devices, because it is one flat tensor.

Large gradients can skip the buffer: our own all-reduce algorithms take a
bucket as a list of pieces (p2p.run), so a gradient of at least
`in_place_bytes` is reduced where it lies, in `.grad`, saving the copy back
out of the buffer (on the MLP benchmark, 2 CPU ranks, the ring's step / torch
DDP's went from 0.99-1.06 to 0.93-0.97; README, Results). The buffer
keeps a slot for each of them anyway: comm hooks, the backend's all-reduce
and gradients that cannot be used in place (missing, strided) go through it.
Within a bucket the small parameters come first, so they form one piece.
"""
from dataclasses import dataclass, field

import torch

FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass
class Bucket:
    """One flat gradient buffer and where each parameter's gradient lives in it."""
    index: int
    indices: list         # the parameters' positions in the list given to build()
    params: list          # the parameters, in the order they sit in the buffer
    names: list           # their names, for error messages
    offsets: list         # element offset of each parameter in the buffer
    buffer: torch.Tensor  # flat, 1-D, dtype and device of its parameters
    large: int = 0        # the last `large` parameters may be reduced in place
    pending: int = 0      # parameters not ready yet in this iteration
    live: dict = field(default_factory=dict)  # position -> .grad reduced in place this time

    def view(self, i):
        """The slice of the buffer that holds parameter i's gradient, shaped like it."""
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    @property
    def first_large(self):
        """Position of the first parameter that may be reduced in place."""
        return len(self.params) - self.large

    def pieces(self):
        """The bucket as pieces for an in-place all-reduce: the small parameters'
        slots as one flat piece, then each large parameter's live .grad, or its slot.
        The sizes are the same every time and on every rank."""
        first = self.first_large
        end = self.offsets[first] if self.large else self.buffer.numel()
        pieces = [self.buffer[:end]] if first else []
        for i in range(first, len(self.params)):
            # The .grad itself, never a view of it: a view would count as a second
            # owner of its memory (reducer._sole_owner) while the comm thread holds it.
            pieces.append(self.live[i] if i in self.live else self.view(i))
        return pieces

    @property
    def large_bytes(self):
        """Bytes of the parameters that may be reduced in place."""
        return sum(p.numel() * p.element_size() for p in self.params[self.first_large:])

    @property
    def nbytes(self):
        return self.buffer.numel() * self.buffer.element_size()


def assign(params, cap_bytes, first_cap_bytes=FIRST_BUCKET_BYTES):
    """Group parameter indices into buckets, filled in reverse order.

    `params` is the list of parameters in registration order. Returns a list of
    lists of indices: bucket 0 first, each bucket's indices in the order their
    gradients are expected to become ready. A bucket is closed once it reaches
    its cap, so a single parameter larger than the cap gets a bucket of its own.
    The first bucket is never capped above `cap_bytes`.
    """
    first_cap_bytes = min(first_cap_bytes, cap_bytes)
    closed, open_buckets = [], {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        indices, size, limit = open_buckets.get(key, ([], 0, first_cap_bytes))
        indices.append(i)
        size += p.numel() * p.element_size()
        if size >= limit:
            closed.append(indices)
            open_buckets[key] = ([], 0, cap_bytes)
        else:
            open_buckets[key] = (indices, size, limit)
    closed.extend(indices for indices, _, _ in open_buckets.values() if indices)
    return closed


def build(params, names, cap_bytes, first_cap_bytes=FIRST_BUCKET_BYTES, in_place_bytes=None):
    """Allocate the buckets for `params` (registration order); see `assign`.

    Parameters of at least `in_place_bytes` (None: none) go last in their
    bucket and are counted in `Bucket.large`.
    """
    buckets = []
    for b, indices in enumerate(assign(params, cap_bytes, first_cap_bytes)):
        is_large = [in_place_bytes is not None and
                    params[i].numel() * params[i].element_size() >= in_place_bytes
                    for i in indices]
        indices = ([i for i, big in zip(indices, is_large) if not big] +
                   [i for i, big in zip(indices, is_large) if big])
        members = [params[i] for i in indices]
        offsets, total = [], 0
        for p in members:
            offsets.append(total)
            total += p.numel()
        buffer = torch.zeros(total, dtype=members[0].dtype, device=members[0].device)
        buckets.append(Bucket(b, indices, members, [names[i] for i in indices], offsets,
                              buffer, large=sum(is_large)))
    return buckets
