"""compression="powersgd": rank-r gradient compression with error feedback (Vogels et al. 2019).

Each gradient of two or more dimensions is seen as a matrix M (first dimension x the rest);
with Q (m x r) kept from the previous step (warm start), every step is

    M = gradient + error      error feedback: what earlier approximations left out
    P = M Q                   n x r, summed over the ranks, then its columns orthonormalised
    Q = M^T P                 m x r, summed over the ranks
    result = P Q^T            the rank-r approximation of the sum of the ranks' M
    error = M - result / p    each rank keeps its share of what the approximation missed

so a matrix sends r (n + m) numbers instead of n m, and both sums are plain all-reduces: they
run on any of minddp's algorithms (`algorithm=` picks it), which is why PowerSGD pays off where
other compressors do not. Vectors (biases, norms), matrices too small to gain, and buckets that
are not float32/float64 are summed uncompressed, in one all-reduce per bucket. The first
`warmup_steps` steps sum every bucket in full precision, as the paper's warm-up does.

A step whose summed P is not finite (an inf or NaN gradient) is summed uncompressed so the
optimizer (or GradScaler) sees it, and clears the error. A parameter no rank used in a step
(find_unused_parameters) keeps its .grad, but the error feedback still counts the step's
approximation as delivered. The state (error, Q, step count) lives in the wrapper and starts
afresh in a pickled, deep-copied or loaded copy.

Every rank ends with bitwise-identical gradients: the two sums are identical on every rank
(every algorithm guarantees that), orthonormalisation is deterministic, and Q starts from the
same seeded random matrix on every rank. The error buffers differ between ranks by design.
"""
import dataclasses

import torch

from minddp import registry
from minddp.buckets import elements
from minddp.reduction import OWN, dense, is_sparse, launch_sparse, setup_collective


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """Settings for `compression=PowerSGD(...)`; `compression="powersgd"` is PowerSGD().

    rank: columns of P and Q (the paper's r; higher is closer to the exact mean, sends more).
    warmup_steps: steps summed in full precision before compression starts.
    seed: for the initial Q, the same on every rank.
    """
    rank: int = 4
    warmup_steps: int = 10
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"PowerSGD warmup_steps must be >= 0, got {self.warmup_steps!r}")


def worth_compressing(shape, rank):
    """True when a rank-r factorisation of a gradient of `shape` sends fewer numbers."""
    if len(shape) < 2:
        return False
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    return rank * (n + m) < n * m


def orthonormalise_(p, eps=1e-8):
    """Gram-Schmidt on the columns of p (n x r), in place; deterministic, so every rank
    that holds the same p gets the same result."""
    for i in range(p.shape[1]):
        col = p[:, i]
        col.div_(col.norm() + eps)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest.sub_(torch.outer(col, col @ rest))
    return p


def _carry_over(old, new):
    """Move each parameter's error feedback, and the step count, from the states
    of one bucket layout to those of another (Q starts afresh: the shapes it
    stacks change with the layout)."""
    steps = max(s.steps for s in old.values())
    errors = {id(param): view for s in old.values() for param, view in s.error_views()}
    for s in new.values():
        s.steps = steps
        for param, view in s.error_views():
            if id(param) in errors:
                view.copy_(errors[id(param)])


class BucketState:
    """Where one bucket's matrices sit and what PowerSGD keeps for it between steps.

    matrices: (gradient, error, P, Q) per compressed parameter, n x m / n x m / n x r / m x r
    views into the bucket's buffer and the flat error, p and q tensors; plain: (slice of the
    buffer, its place in `rest`) per parameter summed as it is. All fixed for the bucket's life.
    """

    def __init__(self, bucket, settings):
        r = settings.rank
        # Seeded per bucket: every rank draws the same Qs, now and whenever one is redrawn.
        self.generator = torch.Generator().manual_seed(settings.seed * 1000003 + bucket.index)
        buffer = bucket.buffer
        compress = buffer.dtype in (torch.float32, torch.float64)
        shapes, sizes = [], []  # (offset, n, m) of the matrices / (offset, numel) of the rest
        compressed = []
        for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
            if compress and worth_compressing(p.shape, r):
                compressed.append(i)
                shapes.append((offset, p.shape[0], elements(p) // p.shape[0]))
            else:
                sizes.append((offset, elements(p)))
        self.error = torch.zeros_like(buffer) if shapes else None
        self.p = buffer.new_empty(sum(n * r for _, n, _ in shapes))
        self.q = buffer.new_empty(sum(m * r for _, _, m in shapes))
        self.rest = buffer.new_empty(sum(numel for _, numel in sizes))
        self.matrices, at_p, at_q = [], 0, 0
        for o, n, m in shapes:
            self.matrices.append((buffer[o:o + n * m].view(n, m),
                                  self.error[o:o + n * m].view(n, m),
                                  self.p[at_p:at_p + n * r].view(n, r),
                                  self.q[at_q:at_q + m * r].view(m, r)))
            at_p, at_q = at_p + n * r, at_q + m * r
        self.plain, at = [], 0
        for o, numel in sizes:
            self.plain.append((buffer[o:o + numel], self.rest[at:at + numel]))
            at += numel
        self._compressed = [(bucket.params[i], o, n * m) for i, (o, n, m) in
                            zip(compressed, shapes)]
        # Q starts random, then warm-starts from the last step's.
        if shapes:
            self.q.copy_(self.random(self.q.numel()))
        self.steps = 0

    def error_views(self):
        """(parameter, its slice of the error buffer) per compressed parameter."""
        return [(param, self.error[o:o + numel]) for param, o, numel in self._compressed]

    def random(self, *shape):
        """Drawn on the host, where the generator lives; callers copy it to Q's device."""
        return torch.randn(*shape, generator=self.generator, dtype=self.q.dtype, device="cpu")


class PowerSGDReduction:
    """The seam's interface (reduction.py) for PowerSGD on a `collective` (registry.py)."""

    prescaled = True       # buckets hold gradient / world size: sums are means
    carries_stamp = False  # lossy: the step check runs on its own
    kind = OWN

    def __init__(self, engine, collective, settings, world_size, name, timeline=None):
        self.engine, self.collective, self.settings = engine, collective, settings
        self.world_size, self.timeline = world_size, timeline
        self.name = f"{name} with PowerSGD (rank {settings.rank})"  # for error messages
        self.states = {}

    def setup(self, buckets, provisional=False):
        old = self.states
        self.states = {b.index: BucketState(b, self.settings) for b in dense(buckets)}
        if old:  # new buckets (bucket_cap_mb="auto"): keep the step count and the error
            _carry_over(old, self.states)
        # auto decides per size: announce every size this reduction will sum.
        buffers = [b.buffer for b in dense(buckets)]
        for s in self.states.values():
            buffers += [t for t in (s.p, s.q, s.rest) if t.numel()]
        setup_collective(self.engine, self.collective, buffers, provisional)

    def launch(self, bucket):
        if is_sparse(bucket):  # no matrix to factorise: summed as it is
            return launch_sparse(self.engine, bucket, self.timeline)
        buffer = bucket.buffer()
        state = self.states[bucket.index()]
        return self.engine.submit(self._reduce, buffer, state, label=f"comm b{bucket.index()}",
                                  device=buffer.device, timeline=self.timeline)

    def _reduce(self, buffer, state):
        """On the communication thread: the bucket's averaged, compressed-and-restored
        gradients, written into `buffer`."""
        state.steps += 1
        if state.steps <= self.settings.warmup_steps or not state.matrices:
            return registry.wait_sum(self.collective, buffer)
        for grad, rest in state.plain:
            rest.copy_(grad)
        for grad, M, P, Q in state.matrices:
            M.add_(grad)  # M = gradient + error, built in the error buffer itself
            torch.matmul(M, Q, out=P)
        registry.wait_sum(self.collective, state.p)
        if not bool(torch.isfinite(state.p).all()):
            # An inf or NaN (an fp16 overflow GradScaler will skip) must reach .grad as it
            # is and must not live on in the error: this step goes uncompressed and the
            # error starts afresh. P's sum is the same everywhere: every rank branches alike.
            state.error.zero_()
            return registry.wait_sum(self.collective, buffer)
        for _, M, P, Q in state.matrices:
            orthonormalise_(P)
            # Q = M^T P computed as (P^T M)^T: M^T is a transposed view, and a product
            # that reads it so runs up to 8x slower on CPU (2048 x 2048, rank 4: 30 ms
            # against 4 ms on one thread).
            Q.copy_(torch.mm(P.t(), M).t())
        registry.wait_sum(self.collective, state.q)
        if state.plain:
            registry.wait_sum(self.collective, state.rest)
        for grad, M, P, Q in state.matrices:
            torch.matmul(P, Q.t(), out=grad)  # the result, in the bucket
            M.sub_(grad, alpha=1.0 / self.world_size)  # error = M - result / p, in place
            if bool((Q.norm(dim=0) == 0).any()):
                # M was zero on every rank (a parameter nobody used): Q = M^T P is zero and
                # would keep every later P = M Q zero. Start it afresh, alike on every rank.
                Q.copy_(state.random(*Q.shape))
        for grad, rest in state.plain:
            grad.copy_(rest)
        return buffer
