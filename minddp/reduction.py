"""The seam between the reducer and everything that communicates.

The reducer hands each full bucket, in index order, to one `Reduction` and
knows nothing else about how it travels. Every way of reducing a bucket is
one: minddp's all-reduce algorithms (ring, tree, halving-doubling, the
backend's, auto, with or without fp16/bf16) through `AlgorithmReduction`,
a communication hook written for torch's DDP through `HookReduction`, and
PowerSGD through `powersgd.PowerSGDReduction`.

    reduction.prescaled        True: the reducer divides each gradient by the
                               world size while copying it into the bucket
                               (torch's built-in reduction does, and sums);
                               False: the bucket holds plain sums and the
                               reduction averages (torch's comm-hook contract)
    reduction.setup(buckets, provisional=False)
                               once, on every rank together, before the first
                               backward, with the buckets in launch order (auto
                               times its candidates on the sizes it will sum),
                               and again when the buckets change. provisional:
                               the buckets serve only the few backwards before
                               bucket_cap_mb="auto"'s plan, so nothing is timed
                               on the link for them
    reduction.launch(bucket)   start reducing a GradBucket; returns a Future
                               whose value is the averaged flat bucket (the
                               buffer itself or a tensor of its size) on the
                               bucket's device
    reduction.carries_stamp    True: it sums bucket 0's step-check slots with
                               the bucket, exactly (step_check.py)
    reduction.kind             how buckets travel, in words the same on every
                               rank that reduces alike (OWN or HOOK): ranks of
                               different kinds issue collectives that never
                               pair, which health.py tells them
    reduction.allocate         where present, allocate(numel, dtype, device) ->
                               zeros or None: the buckets' storage (shared memory)

Sparse buckets (buckets.py: one parameter whose .grad is sparse) are handed
over like any other; a comm hook gets the sparse gradient as bucket.buffer(),
as torch's hooks do. minddp's own reductions send them through
`launch_sparse` instead: its algorithms and codecs sum equal-sized flat
buffers, and the ranks' sparse gradients hold different rows.
"""
import torch
import torch.distributed as dist

from minddp.comm import future_on

# reduction.kind: the wrapper's own algorithms and compression (keywords every rank checks
# alike at construction), or a communication hook (registered by each rank on its own).
OWN = "minddp's own reduction"
HOOK = "a communication hook"


def setup_collective(engine, collective, buffers, provisional=False):
    """Run `collective.setup(buffers, provisional)` (registry.py), where it has one (auto),
    on the engine, so it keeps its place among other wrappers' traffic."""
    setup = getattr(collective, "setup", None)
    if setup is not None:
        engine.run(setup, buffers, provisional, label="setup")


def bucket_storage(reduction, as_view):
    """Where the buckets' storage comes from (buckets.allocate's zeros): the reduction's
    (shared memory), unless .grad will be a view of a bucket (gradient_as_bucket_view),
    which stays an ordinary tensor: picklable through torch.multiprocessing, not shared."""
    return None if as_view else getattr(reduction, "allocate", None)


def dense(buckets):
    """The buckets (buckets.Bucket) minddp's own reductions sum: all but the sparse ones."""
    return [b for b in buckets if not b.sparse]


def is_sparse(bucket):
    """Whether a GradBucket holds a sparse gradient (see launch_sparse)."""
    return bucket.buffer().is_sparse


def launch_sparse(engine, bucket, timeline=None):
    """Sum a sparse bucket (GradBucket; its buffer a parameter's sparse .grad, already
    divided by the reducer) with the backend's all-reduce, as torch's DDP does,
    whatever algorithm or compression the wrapper has: gloo gathers every rank's
    rows and adds them, writing the sum into the tensor. On the engine, so it keeps
    its place in bucket order."""
    tensor = bucket.buffer()
    return engine.submit(_sum_sparse, tensor, engine.group, label=f"comm b{bucket.index()}",
                         device=tensor.device, timeline=timeline)


def _sum_sparse(tensor, group):
    dist.all_reduce(tensor, group=group)
    return tensor


class AlgorithmReduction:
    """Sums each bucket on the communication engine with `collective(tensor) -> tensor or
    Future` (registry.py), after the reducer has divided it."""

    prescaled = True
    kind = OWN

    def __init__(self, engine, collective, name, timeline=None, exact=True):
        self.engine, self.collective, self.timeline = engine, collective, timeline
        self.name = name  # for error messages: "algorithm 'ring'"
        self.carries_stamp = exact  # not with a lossy codec
        # A sum over one rank is the bucket itself: no collective to launch (on one NCCL GPU
        # a kernel and its bookkeeping per bucket). With a codec the collective runs as it
        # would on more ranks: a whole-bucket encoding (native's) rounds the values, a
        # per-hop algorithm has no hop to encode on one rank and leaves them exact.
        self.alone = exact and dist.get_world_size(engine.group) == 1
        # Where the collective sums a bucket best in storage of its own (shared memory),
        # the reducer allocates the buckets there.
        self.allocate = None if self.alone else getattr(collective, "allocate", None)

    def setup(self, buckets, provisional=False):
        buffers = [b.carrier if b.carrier is not None else b.buffer for b in dense(buckets)]
        setup_collective(self.engine, self.collective, buffers, provisional)

    def launch(self, bucket):
        if is_sparse(bucket):
            return launch_sparse(self.engine, bucket, self.timeline)
        tensor = bucket._to_sum()  # the step check's slots too, where they ride
        if self.alone:
            fut = future_on(tensor.device)
            fut.set_result(tensor)
            return fut
        return self.engine.submit(self.collective, tensor, label=f"comm b{bucket.index()}",
                                  device=tensor.device, timeline=self.timeline)


class HookReduction:
    """A communication hook `hook(state, bucket) -> Future` as torch's DDP runs it."""

    prescaled = False
    carries_stamp = False
    kind = HOOK
    name = "the communication hook"

    def __init__(self, state, hook):
        self.state, self.hook = state, hook

    def setup(self, buckets, provisional=False):
        pass

    def launch(self, bucket):
        future = self.hook(self.state, bucket)
        if not isinstance(future, torch._C.Future):  # the base of torch.futures.Future
            # torch's words first (its tests and users match them), then the fix.
            kind = type(future)
            raise RuntimeError(
                f"DDP communication hook's callback must return a torch.futures.Future "
                f"object, but got {kind.__module__}.{kind.__qualname__} (minddp: the hook "
                f"{getattr(self.hook, '__name__', self.hook)!r}, bucket {bucket.index()}; "
                f"return e.g. work.get_future() of an async all-reduce, whose value is the "
                f"reduced bucket).")
        return future
