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
                               the bucket, exactly (reducer.py, the step check)
"""
import torch


def setup_job(engine, job, buffers, provisional=False):
    """Run `job.setup(buffers, provisional)` (algorithms.planner), where the job has one,
    on the engine, so it keeps its place among other wrappers' traffic."""
    setup = getattr(job, "setup", None)
    if setup is not None:
        engine.run(setup, buffers, provisional, label="setup")


class AlgorithmReduction:
    """Sums each bucket on the communication engine with `job(tensor) -> tensor or
    Future` (algorithms.planner), after the reducer has divided it."""

    prescaled = True

    def __init__(self, engine, job, name, timeline=None, exact=True):
        self.engine, self.job, self.timeline = engine, job, timeline
        self.name = name  # for error messages: "algorithm 'ring'"
        self.carries_stamp = exact  # not with a lossy codec

    def setup(self, buckets, provisional=False):
        buffers = [b.carrier if b.carrier is not None else b.buffer for b in buckets]
        setup_job(self.engine, self.job, buffers, provisional)

    def launch(self, bucket):
        tensor = bucket._to_sum()  # the step check's slots too, where bucket 0 has them
        return self.engine.submit(self.job, tensor, label=f"comm b{bucket.index()}",
                                  device=tensor.device, timeline=self.timeline)


class HookReduction:
    """A communication hook `hook(state, bucket) -> Future` as torch's DDP runs it."""

    prescaled = False
    carries_stamp = False
    name = "the communication hook"

    def __init__(self, state, hook):
        self.state, self.hook = state, hook

    def setup(self, buckets, provisional=False):
        pass

    def launch(self, bucket):
        future = self.hook(self.state, bucket)
        if not isinstance(future, torch._C.Future):  # the base of torch.futures.Future
            raise RuntimeError(
                f"minddp: the communication hook {getattr(self.hook, '__name__', self.hook)!r} "
                f"returned {type(future).__name__} for bucket {bucket.index()}; it must return "
                f"a torch.futures.Future whose value is the reduced bucket (e.g. "
                f"work.get_future() of an async all-reduce).")
        return future
