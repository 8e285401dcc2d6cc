"""Bucket assignment: which parameters share a flat gradient buffer.

Gradients become ready roughly in reverse registration order (the last layer's
first), so buckets are filled in that order: bucket 0 holds the last
parameters and is the first one that can be sent while backward goes on.
The first bucket is capped small (1 MiB as in torch, or the cap if smaller)
so communication starts early; the others at `bucket_cap_mb`. A bucket never
mixes dtypes or devices, because it is one flat tensor.
"""
from dataclasses import dataclass

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
    pending: int = 0      # parameters not ready yet in this iteration

    def view(self, i):
        """The slice of the buffer that holds parameter i's gradient, shaped like it."""
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

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


def build(params, names, cap_bytes, first_cap_bytes=FIRST_BUCKET_BYTES):
    """Allocate the buckets for `params` (registration order); see `assign`."""
    buckets = []
    for b, indices in enumerate(assign(params, cap_bytes, first_cap_bytes)):
        members = [params[i] for i in indices]
        offsets, total = [], 0
        for p in members:
            offsets.append(total)
            total += p.numel()
        buffer = torch.zeros(total, dtype=members[0].dtype, device=members[0].device)
        buckets.append(Bucket(b, indices, members, [names[i] for i in indices], offsets,
                              buffer))
    return buckets
