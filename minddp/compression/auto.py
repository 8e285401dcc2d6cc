"""compression="auto": per bucket, fp16 or int8 only where it pays and stays accurate.

Compression is no free lunch: encoding and decoding cost time, and over a fast
link they cost more than the bytes they save (over loopback every codec makes
the step slower). So each bucket decides for itself, twice:

  cost   at set-up (and again whenever the buckets change), every bucket's
         reduction is timed each way on the real link, as the wrapper runs it:
         full precision, fp16, and int8 with its error feedback (compression.py's
         codecs, partial sums in fp32 at every hop; int8 not with
         algorithm="native", whose backend would add 8-bit values),
         interleaved, a few rounds after barriers, the lower quartile, the
         slowest rank's time. Candidates go in order of accuracy, and a codec
         is taken only where it beats every more accurate one by more than
         MARGIN: fp16 where it is clearly faster than full precision, int8
         where it is clearly faster than both.
  error  a compressed bucket's first reduction, and every CHECK_EVERY-th after
         it, is also reduced in full precision, and the relative error of what
         the optimizer receives, |compressed sum - exact sum| / |exact sum|, is
         measured. Above its codec's ERROR_BUDGET the exact sum is used and the
         bucket stays full precision from then on. Both sums are bitwise equal
         on every rank, so every rank measures the same error and decides alike.

int8's budget is wider than fp16's: error feedback sends what one step lost
with the next, so its error does not build up over steps; its budget only
catches a bucket whose values int8 cannot represent. Every decision is logged
(logger "minddp.compression", info) and marked on the timeline ("compression
plan", "compression off b<i>"). PowerSGD is not a candidate: its error on one
step is large by design and only error feedback over many steps makes it
good, and it changes how the loss falls per step, which no timing of one
reduction can weigh.
"""
import logging

import torch
import torch.distributed as dist

from minddp import devices, registry
from minddp.algorithms import collective
from minddp.algorithms.cost_model import interleaved
from minddp.compression.codecs import ErrorFeedback
from minddp.reduction import OWN, dense, is_sparse, launch_sparse, setup_collective

log = logging.getLogger("minddp.compression")

MARGIN = 0.05           # a codec must be this much faster than every more accurate one
# The registered codecs auto tries, in order of accuracy, with the relative
# error of a reduced bucket each may cause.
ERROR_BUDGET = {"fp16": 1e-2, "int8": 5e-2}
CHECK_EVERY = 100       # reductions of a compressed bucket between error checks
TIMING_ROUNDS = 3


def _lossy(algorithm, group, name):
    codec = registry.codec(name)
    run = collective(algorithm, group, codec)
    return ErrorFeedback(run, codec) if codec.error_feedback else run


class AutoCompression:
    """The seam's interface (reduction.py): `algorithm` in full precision, fp16 or int8,
    per bucket."""

    prescaled = True
    kind = OWN

    def __init__(self, engine, algorithm, group, name, timeline=None):
        self.engine, self.group, self.timeline = engine, group, timeline
        self.algorithm = algorithm
        self.exact = collective(algorithm, group)
        # those the algorithm can carry (the backend's all-reduce cannot sum int8)
        self.codecs = tuple(name for name in ERROR_BUDGET
                            if registry.algorithm(algorithm).carries(registry.codec(name)) is None)
        self.lossy = {name: _lossy(algorithm, group, name) for name in self.codecs}
        self.collective = self.exact  # what a full-precision reduction runs (overlap.py times it)
        self.name = f"{name} with compression 'auto'"
        self.compressed = {}  # bucket index -> the codec it travels with, or None
        self._reductions = {}  # bucket index -> compressed reductions so far

    @property
    def carries_stamp(self):
        """Bucket 0 carries the step check only while it is summed exactly."""
        return self.compressed.get(0) is None

    def setup(self, buckets, provisional=False):
        buckets = dense(buckets)  # sparse ones take the backend's sum (launch)
        buffers = [b.carrier if b.carrier is not None else b.buffer for b in buckets]
        if provisional:  # a few backwards before the plan: full precision, nothing timed
            self.compressed = {b.index: None for b in buckets}
            setup_collective(self.engine, self.exact, buffers, provisional=True)
            return
        self.engine.run(self._decide, buckets, buffers, label="setup")

    def _decide(self, buckets, buffers):
        """On the communication thread, on every rank: time each bucket every way."""
        for run in (self.exact, *self.lossy.values()):
            if getattr(run, "setup", None) is not None:
                run.setup(buffers)
        # Timed with their own error feedback, thrown away after: probes are not gradients.
        timed = [self.exact] + [_lossy(self.algorithm, self.group, name)
                                for name in self.codecs]
        ways = len(timed)
        times = []
        for buffer in buffers:
            probe = torch.zeros_like(buffer)
            times += interleaved([lambda run=run: registry.wait_sum(run, probe) for run in timed],
                                 TIMING_ROUNDS, self.group, probe.device)
        # The slowest rank's, agreed on the group's device (NCCL takes no CPU tensor).
        agreed = torch.tensor(times, dtype=torch.float64, device="cpu")
        agreed = agreed.to(devices.group_device(self.group))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        agreed = agreed.tolist()
        decisions = []
        for i, bucket in enumerate(buckets):
            seconds = dict(zip((None,) + self.codecs, agreed[i * ways:(i + 1) * ways]))
            chosen, fastest = None, seconds[None]
            if bucket.buffer.dtype == torch.float32:
                for name in self.codecs:  # each must beat everything more accurate
                    if seconds[name] < fastest * (1 - MARGIN):
                        chosen = name
                    fastest = min(fastest, seconds[name])
            self.compressed[bucket.index] = chosen
            self._reductions[bucket.index] = 0
            decisions.append({"bucket": bucket.index, "bytes": bucket.nbytes, "codec": chosen,
                              **{f"{name or 'exact'}_ms": round(s * 1e3, 3)
                                 for name, s in seconds.items()}})
        log.info("minddp compression='auto' (rank %d): %s of %d buckets compressed; %s",
                 self.group.rank(), {d["bucket"]: d["codec"] for d in decisions if d["codec"]},
                 len(decisions), decisions)
        if self.timeline is not None:
            self.timeline.instant("compression plan", thread="comm", buckets=decisions)

    def launch(self, bucket):
        if is_sparse(bucket):
            return launch_sparse(self.engine, bucket, self.timeline)
        b = bucket.index()
        tensor = bucket._to_sum()  # the step check's slots too, where they ride
        return self.engine.submit(self._reduce, b, tensor, label=f"comm b{b}",
                                  device=tensor.device, timeline=self.timeline)

    def _reduce(self, b, tensor):
        """On the communication thread: the bucket's sum, compressed where decided."""
        name = self.compressed[b]
        if name is None:
            return self.exact(tensor)
        n = self._reductions[b]
        self._reductions[b] = n + 1
        if n % CHECK_EVERY:
            return self.lossy[name](tensor)
        exact = registry.wait_sum(self.exact, tensor.clone())
        registry.wait_sum(self.lossy[name], tensor)
        error = float((tensor - exact).norm() / exact.norm().clamp_min(1e-30))
        if error > ERROR_BUDGET[name]:
            self.compressed[b] = None
            tensor.copy_(exact)
            log.info("minddp compression='auto' (rank %d): bucket %d back to full precision: "
                     "%s error %.2e > budget %.0e", self.group.rank(), b, name, error,
                     ERROR_BUDGET[name])
            if self.timeline is not None:
                self.timeline.instant(f"compression off b{b}", thread="comm", codec=name,
                                      error=error)
        return tensor
