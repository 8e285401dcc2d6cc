"""Bucket assignment: which parameters share a flat gradient buffer.

Gradients become ready roughly in reverse registration order (the last layer's
first), so buckets are filled in that order: bucket 0 holds the last
parameters and is the first one that can be sent while backward goes on.
The first bucket is capped small (1 MiB as in torch, or the cap if smaller)
so communication starts early; the others at `bucket_cap_mb`. A list of caps
(torch's `bucket_cap_mb_list`) gives bucket k the k-th cap and every later
bucket the last one. A bucket never mixes dtypes or devices, because it is
one flat tensor.

A parameter that expects a sparse gradient (torch's rule: its module is an
nn.Embedding or nn.EmbeddingBag with sparse=True) gets a bucket of its own,
as in torch: sparse gradients cannot share a flat buffer. Such a bucket has
no buffer of its own; the reducer puts the parameter's sparse .grad there.

Gradient Layout Contract (torch's reducer.cpp): autograd makes the gradient
of a parameter whose memory is dense and non-overlapping with the
parameter's strides (channels_last convolutions), row-major otherwise. Each
parameter's view into a bucket has those same strides, so the copy into it
is a plain one and, with gradient_as_bucket_view, .grad looks as autograd
would have made it. Comm hooks' `bucket.gradients()` stay row-major slices
of the flat buffer, as torch's are.

A complex parameter's bucket holds its real and imaginary parts as real
numbers (torch's reducer does the same): the buffer, what every algorithm,
codec and comm hook sees, is float32 for complex64 (float64 for complex128),
two elements per value, and the parameter's view is a complex view of them.
"""
from dataclasses import dataclass
from typing import Optional

import torch

try:
    from minddp._C import gradients as _gradients_in_cpp
except ImportError:  # compression.py says once that the extension is missing
    _gradients_in_cpp = None

FIRST_BUCKET_BYTES = 1024 * 1024
# Gradients of at least this many elements are scaled as they are copied into the bucket,
# a call each (see Bucket.copy_scaled); smaller ones share one _foreach copy and one scale.
SCALED_COPY_ELEMENTS = 1 << 14  # 64 KiB of float32: past the caches' cheap second pass
STAMP = 3  # slots behind bucket 0's buffer for the reducer's step check


@dataclass
class Bucket:
    """One flat gradient buffer and where each parameter's gradient lives in it."""
    index: int
    indices: list         # the parameters' positions in the list given to build()
    params: list          # the parameters, in the order they sit in the buffer
    offsets: list         # element offset of each parameter in the buffer
    buffer: Optional[torch.Tensor]  # flat, 1-D, dtype (real for complex: above) and device
    #                                 of its parameters; sparse: the parameter's sparse .grad
    #                                 (None before one)
    carrier: Optional[torch.Tensor] = None  # buffer + STAMP trailing slots (see build)
    sparse: bool = False  # one parameter that expects a sparse gradient

    def __post_init__(self):
        # Made once, as torch's bucket views are: slicing anew in every
        # gradient hook costs more than the copy into the slot on a small layer.
        self.views = [] if self.sparse else self._slices(self.buffer)
        large = [] if self.sparse else [p.numel() >= SCALED_COPY_ELEMENTS for p in self.params]
        self._large = [i for i, big in enumerate(large) if big]
        self._small = [i for i, big in enumerate(large) if not big]
        self._small_views = [self.views[i] for i in self._small]

    def copy_scaled(self, grads, scale):
        """views[i] = grads[i] * scale for every slot, as torch's reducer fills a bucket
        (it scales while it copies). One _foreach copy and a scale of the whole buffer
        read and write the bucket twice: on the CPU, for a large gradient, a pass over
        memory costs more than a call of its own (2-3 us), so large gradients get one
        fused call each and only the small ones the two passes. On CUDA a second pass
        costs less than a kernel launch per tensor: the _foreach path always. Same bits
        either way (a float32 product by the same scalar)."""
        if self.buffer.is_cuda or not self._large:
            torch._foreach_copy_(self.views, grads)
            self.buffer.mul_(scale)
            return
        for i in self._large:
            torch.mul(grads[i], scale, out=self.views[i])
        if self._small:
            torch._foreach_copy_(self._small_views, [grads[i] for i in self._small])
            torch._foreach_mul_(self._small_views, scale)

    def grads(self):
        """(each parameter's .grad or None, how many exist, whether every one exists,
        strided and not requiring grad: the bucket can be copied in whole). One call
        into the extension where it is built (csrc/gradients.cpp): read from Python,
        an attribute and a test per parameter cost more than a small gradient's copy."""
        if _gradients_in_cpp is not None:
            return _gradients_in_cpp(self.params)
        return read_grads(self.params)

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
        flat = flat if flat.is_contiguous() else flat.contiguous()  # as_strided needs stride 1
        base = flat.storage_offset()
        views = []
        for p, o in zip(self.params, self.offsets):
            if p.is_complex():  # (real, imaginary) pairs, the value's stride doubled
                pairs = flat.as_strided((*p.shape, 2), (*(2 * s for s in gradient_strides(p)), 1),
                                        base + o)
                views.append(torch.view_as_complex(pairs))
            else:
                views.append(flat.as_strided(p.shape, gradient_strides(p), base + o))
        return views

    def flat_slices(self, flat):
        """Every parameter's slice of `flat` (the buffer, or a 1-D tensor of its size),
        row-major whatever its layout: what torch's GradBucket.gradients() returns
        (and PowerSGD reshapes); a complex parameter's as (..., 2) real pairs."""
        return [flat[o:o + elements(p)].view(*p.shape, 2) if p.is_complex() else
                flat[o:o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets)]

    @property
    def nbytes(self):
        if self.sparse:  # what travels: the gradient's indices and values
            grad = self.buffer
            return 0 if grad is None else sum(t.numel() * t.element_size()
                                              for t in (grad._indices(), grad._values()))
        return self.buffer.numel() * self.buffer.element_size()


def elements(param):
    """How many elements of a bucket's buffer `param`'s gradient takes (complex: two a value)."""
    return param.numel() * 2 if param.is_complex() else param.numel()


def gradient_strides(param):
    """The strides autograd gives `param`'s gradient (the Gradient Layout Contract
    above): the parameter's own where its memory is non-overlapping and dense,
    row-major otherwise."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(param.shape, param.stride())
                               if sz != 1):
        if stride != expected:
            return torch.empty(param.shape, device="meta").stride()
        expected *= size
    return param.stride()


def expect_sparse_gradient(module, named):
    """For each (name, parameter) of `named`: whether it expects a sparse gradient.
    torch's rule (DistributedDataParallel._build_params_for_reducer): the first
    module in `module.named_modules()` holding the parameter is an nn.Embedding
    or nn.EmbeddingBag with sparse=True."""
    owner = {}
    for _, m in module.named_modules():
        for p in m.parameters(recurse=False):
            owner.setdefault(id(p), m)
    embeddings = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return [isinstance(owner.get(id(p)), embeddings) and bool(owner[id(p)].sparse)
            for _, p in named]


def caps(cap_bytes, first_cap_bytes=FIRST_BUCKET_BYTES):
    """torch's default size limits: a small first bucket, then `cap_bytes` each."""
    return [min(first_cap_bytes, cap_bytes), cap_bytes]


def assign(params, limits, sparse=None):
    """Group parameter indices into buckets, filled in reverse order.

    `params` is the list of parameters in registration order; `limits` the size
    limits in bytes (bucket k of a dtype and device closes at limits[k], the
    last limit applying to every later one); `sparse[i]`, where given, whether
    parameter i expects a sparse gradient (a bucket of its own). Returns a list
    of lists of indices: bucket 0 first, each bucket's indices in the order
    their gradients are expected to become ready; buckets ordered by the
    lowest index they hold, highest first, as torch orders them. A single parameter
    larger than its limit gets a bucket of its own.
    """
    closed, open_buckets = [], {}
    for i in reversed(range(len(params))):
        p = params[i]
        if sparse is not None and sparse[i]:
            closed.append([i])
            continue
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
    # torch's order (compute_bucket_assignment_by_size): by the bucket's oldest
    # parameter, newest first. Stable, so one dtype keeps its filling order; a
    # sparse parameter's bucket sits where its gradient is expected.
    closed.sort(key=lambda indices: -min(indices))
    return closed


def build(params, limits, stamp=False, sparse=None, zeros=None):
    """Allocate the buckets for `params` (registration order); see `assign`."""
    return allocate(params, assign(params, limits, sparse), stamp, sparse, zeros)


def allocate(params, assignment, stamp=False, sparse=None, zeros=None):
    """Allocate buckets for `assignment`, lists of indices into `params` (bucket 0
    first, each in its gradients' expected ready order); `sparse[i]` says
    whether parameter i expects a sparse gradient, which must be alone in its
    bucket.

    stamp=True gives bucket 0, where it holds float32 or float64 values on the CPU, STAMP
    more slots behind its buffer (`carrier`): the reducer's step check rides
    there on the bucket's own all-reduce instead of a collective of its own.
    A sparse bucket 0 carries nothing: the step check takes its own collective.
    zeros(numel, dtype, device), where given, makes the storage (None: torch.zeros):
    the reduction's `allocate` (reduction.py).
    """
    buckets = []
    for b, indices in enumerate(assignment):
        members = [params[i] for i in indices]
        if sparse is not None and any(sparse[i] for i in indices):
            if len(indices) != 1:
                raise ValueError(
                    f"minddp: bucket {b} holds parameters {list(indices)}, among them one "
                    f"that expects a sparse gradient; such a parameter needs a bucket of "
                    f"its own (buckets.assign and overlap.plan keep it alone).")
            buckets.append(Bucket(b, list(indices), members, [0], None, sparse=True))
            continue
        offsets, total = [], 0
        for p in members:
            offsets.append(total)
            total += elements(p)
        dtype = members[0].dtype.to_real()
        # On the CPU only: reading the sums back from a GPU would make the host
        # wait for it every step (the reducer's step check then takes a CPU
        # collective of its own).
        extra = (STAMP if stamp and b == 0 and dtype in (torch.float32, torch.float64) and
                 members[0].device.type == "cpu" else 0)
        storage = zeros(total + extra, dtype, members[0].device) if zeros else None
        if storage is None:
            storage = torch.zeros(total + extra, dtype=dtype, device=members[0].device)
        buckets.append(Bucket(b, list(indices), members, offsets, storage[:total],
                              storage if extra else None))
    return buckets


def read_grads(params):
    """Bucket.grads without the extension (and what tests compare it with)."""
    grads = [p.grad for p in params]
    defined = sum(g is not None for g in grads)
    plain = defined == len(grads) and all(g.layout == torch.strided and not g.requires_grad
                                          for g in grads)
    return grads, defined, plain
