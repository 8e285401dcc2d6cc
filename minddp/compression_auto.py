"""compression="auto": fp16 for a bucket only where it pays and stays accurate.

Compression is no free lunch: encoding and decoding cost time, and over a fast
link they cost more than the bytes they save (over loopback fp16 makes every
step slower). So each bucket decides for itself, twice:

  cost   at set-up (and again whenever the buckets change), every bucket's
         reduction is timed both ways on the real link, as the wrapper runs it:
         full precision and fp16 (compression.py's codec, partial sums in fp32
         at every hop), interleaved, a few rounds after barriers, the lower
         quartile, the slowest rank's time. A bucket is compressed only when
         fp16 is faster by more than MARGIN.
  error  a compressed bucket's first reduction, and every CHECK_EVERY-th after
         it, is also reduced in full precision, and the relative error of the
         reduced gradient, |fp16 sum - exact sum| / |exact sum|, is measured.
         Above ERROR_BUDGET the exact sum is used and the bucket stays full
         precision from then on. Both sums are bitwise equal on every rank, so
         every rank measures the same error and decides alike.

Every decision is logged (logger "minddp.compression", info) and marked on the
timeline ("compression plan", "compression off b<i>"). PowerSGD is not a
candidate: its error on one step is large by design and only error feedback
makes it good over many steps, which a per-step budget cannot judge.
"""
import logging

import torch
import torch.distributed as dist

from minddp.algorithms import planner, sum_now
from minddp.algorithms.cost_model import interleaved
from minddp.compression import codec_for

log = logging.getLogger("minddp.compression")

MARGIN = 0.05          # fp16 must be this much faster than full precision
ERROR_BUDGET = 1e-2    # relative error of a reduced bucket above which fp16 is dropped
CHECK_EVERY = 100      # reductions of a compressed bucket between error checks
TIMING_ROUNDS = 3


class AutoCompression:
    """The seam's interface (reduction.py): `algorithm` in full precision or in fp16,
    per bucket."""

    prescaled = True

    def __init__(self, engine, algorithm, group, name, timeline=None):
        self.engine, self.group, self.timeline = engine, group, timeline
        self.exact = planner(algorithm, group)
        self.lossy = planner(algorithm, group, codec_for("fp16"))
        self.job = self.exact  # what a full-precision reduction runs (overlap.py times it)
        self.name = f"{name} with compression 'auto'"
        self.compressed = {}  # bucket index -> whether it travels as fp16
        self._reductions = {}  # bucket index -> compressed reductions so far

    @property
    def carries_stamp(self):
        """Bucket 0 carries the step check only while it is summed exactly."""
        return not self.compressed.get(0, False)

    def setup(self, buckets):
        buffers = [b.carrier if b.carrier is not None else b.buffer for b in buckets]
        self.engine.run(self._decide, buckets, buffers, label="setup")

    def _decide(self, buckets, buffers):
        """On the communication thread, on every rank: time each bucket both ways."""
        for job in (self.exact, self.lossy):
            if getattr(job, "setup", None) is not None:
                job.setup(buffers)
        times = []
        for buffer in buffers:
            probe = torch.zeros_like(buffer)
            times += interleaved([lambda: sum_now(self.exact, probe),
                                  lambda: sum_now(self.lossy, probe)], TIMING_ROUNDS,
                                 self.group, probe.device)
        agreed = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        agreed = agreed.tolist()
        decisions = []
        for bucket, exact_s, fp16_s in zip(buckets, agreed[0::2], agreed[1::2]):
            compress = bucket.buffer.dtype == torch.float32 and fp16_s < exact_s * (1 - MARGIN)
            self.compressed[bucket.index] = compress
            self._reductions[bucket.index] = 0
            decisions.append({"bucket": bucket.index, "bytes": bucket.nbytes,
                              "exact_ms": round(exact_s * 1e3, 3),
                              "fp16_ms": round(fp16_s * 1e3, 3), "fp16": compress})
        log.info("minddp compression='auto' (rank %d): fp16 for buckets %s of %d; %s",
                 self.group.rank(), [d["bucket"] for d in decisions if d["fp16"]],
                 len(decisions), decisions)
        if self.timeline is not None:
            self.timeline.instant("compression plan", thread="comm", buckets=decisions)

    def launch(self, bucket):
        # The step check's slots ride only on an exact sum (carries_stamp).
        tensor = bucket.buffer() if self.compressed[bucket.index()] else bucket._to_sum()
        return self.engine.submit(self._reduce, bucket.index(), tensor,
                                  label=f"comm b{bucket.index()}", device=tensor.device,
                                  timeline=self.timeline)

    def _reduce(self, b, tensor):
        """On the communication thread: the bucket's sum, in fp16 where decided."""
        if not self.compressed[b]:
            return self.exact(tensor)
        n = self._reductions[b]
        self._reductions[b] = n + 1
        if n % CHECK_EVERY:
            return self.lossy(tensor)
        exact = sum_now(self.exact, tensor.clone())
        sum_now(self.lossy, tensor)
        error = float((tensor - exact).norm() / exact.norm().clamp_min(1e-30))
        if error > ERROR_BUDGET:
            self.compressed[b] = False
            tensor.copy_(exact)
            log.info("minddp compression='auto' (rank %d): bucket %d back to full precision: "
                     "fp16 error %.2e > budget %.0e", self.group.rank(), b, error,
                     ERROR_BUDGET)
            if self.timeline is not None:
                self.timeline.instant(f"compression off b{b}", thread="comm", error=error)
        return tensor
