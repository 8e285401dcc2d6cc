"""Bucket assignment: which parameters share a flat gradient buffer.

Gradients become ready roughly in reverse registration order (the last layer's
first), so buckets are filled in that order: bucket 0 holds the last
parameters and is the first one that can be sent while backward goes on.
The first bucket is capped small (1 MiB as in torch, or the cap if smaller)
so communication starts early; the others at `bucket_cap_mb`. A list of caps
(torch's `bucket_cap_mb_list`) gives bucket k the k-th cap and every later
bucket the last one. A bucket never mixes dtypes or devices, because it is
one flat tensor.
"""
from dataclasses import dataclass
from typing import Optional

import torch

FIRST_BUCKET_BYTES = 1024 * 1024
STAMP = 3  # slots behind bucket 0's buffer for the reducer's step check


@dataclass
class Bucket:
    """One flat gradient buffer and where each parameter's gradient lives in it."""
    index: int
    indices: list         # the parameters' positions in the list given to build()
    params: list          # the parameters, in the order they sit in the buffer
    offsets: list         # element offset of each parameter in the buffer
    buffer: torch.Tensor  # flat, 1-D, dtype and device of its parameters
    carrier: Optional[torch.Tensor] = None  # buffer + STAMP trailing slots (see build)

    def __post_init__(self):
        # Made once, as torch's bucket views are: slicing anew in every
        # gradient hook costs more than the copy into the slot on a small layer.
        self.views = self._slices(self.buffer)

    def view(self, i):
        """Parameter i's slice of the buffer, shaped like the parameter."""
        return self.views[i]

    def views_of(self, flat):
        """Every parameter's slice of `flat` (a tensor of the buffer's size holding a
        reduced result), shaped like the parameters: the buffer's own views when
        `flat` is the buffer."""
        if flat.data_ptr() == self.buffer.data_ptr():
            return self.views
        return self._slices(flat)

    def _slices(self, flat):
        return [flat[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    @property
    def nbytes(self):
        return self.buffer.numel() * self.buffer.element_size()


def caps(cap_bytes, first_cap_bytes=FIRST_BUCKET_BYTES):
    """torch's default size limits: a small first bucket, then `cap_bytes` each."""
    return [min(first_cap_bytes, cap_bytes), cap_bytes]


def assign(params, limits):
    """Group parameter indices into buckets, filled in reverse order.

    `params` is the list of parameters in registration order; `limits` the size
    limits in bytes (bucket k of a dtype and device closes at limits[k], the
    last limit applying to every later one). Returns a list of lists of
    indices: bucket 0 first, each bucket's indices in the order their
    gradients are expected to become ready. A single parameter larger than
    its limit gets a bucket of its own.
    """
    closed, open_buckets = [], {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        indices, size, count = open_buckets.get(key, ([], 0, 0))
        indices.append(i)
        size += p.numel() * p.element_size()
        if size >= limits[min(count, len(limits) - 1)]:
            closed.append(indices)
            open_buckets[key] = ([], 0, count + 1)
        else:
            open_buckets[key] = (indices, size, count)
    closed.extend(indices for indices, _, _ in open_buckets.values() if indices)
    return closed


def build(params, limits, stamp=False):
    """Allocate the buckets for `params` (registration order); see `assign`."""
    return allocate(params, assign(params, limits), stamp)


def allocate(params, assignment, stamp=False):
    """Allocate buckets for `assignment`, lists of indices into `params` (bucket 0
    first, each in its gradients' expected ready order).

    stamp=True gives bucket 0, where it holds float32 or float64 values, STAMP
    more slots behind its buffer (`carrier`): the reducer's step check rides
    there on the bucket's own all-reduce instead of a collective of its own.
    """
    buckets = []
    for b, indices in enumerate(assignment):
        members = [params[i] for i in indices]
        offsets, total = [], 0
        for p in members:
            offsets.append(total)
            total += p.numel()
        dtype = members[0].dtype
        extra = STAMP if stamp and b == 0 and dtype in (torch.float32, torch.float64) else 0
        storage = torch.zeros(total + extra, dtype=dtype, device=members[0].device)
        buckets.append(Bucket(b, list(indices), members, offsets, storage[:total],
                              storage if extra else None))
    return buckets
