"""The step check: every rank's backward belongs to the same synced forward.

Every backward sums (1, n, n^2) over the ranks, n being the number of synced
forwards so far, and finalize writes no .grad unless every rank had the same
n (then the sums are k, kn and kn^2). Buckets pair by launch order alone, so
a rank that lost a backward before it reached the wrapper (an exception in
the loss's own backward, caught and skipped) would otherwise pair its next
iteration with its peers' current one: wrong gradients, silently.

The stamp rides in slots behind bucket 0's buffer (buckets.STAMP of them, its
`carrier`) where minddp's own exact reduction sums it (n taken modulo a bound
under which the float sums are exact); elsewhere (a comm hook, compression,
half precision, a GPU bucket) it takes a small all-reduce of its own, a
collective more per backward, which the carried stamp saves. A rank that has
joined (join.py) adds zeros.

The reducer, each backward:

    check.stamp(n, buckets, reduction)   at its start, before bucket 0 can launch
    check.take(bucket, result)           bucket 0's reduced carrier -> its buffer
                                         part (the sums are kept)
    check.verify(n, buckets, wait)       after bucket 0 is reduced, before any
                                         .grad is written: raise if out of step
    check.shadow(buckets, reduction)     a joined rank's zeros instead of stamp
"""
import math

import torch

from minddp.buckets import STAMP
from minddp.errors import invariant


class StepCheck:
    """One per reducer. `sum_step(tensor) -> Future` sums a small int64 tensor over
    the ranks (a side group's all-reduce); None turns the check off (one rank)."""

    def __init__(self, sum_step, rank, world_size):
        self.sum_step = sum_step
        self.rank, self.world_size = rank, world_size
        self.future = None  # this backward's own collective, where bucket 0 cannot carry it
        self.sums = None    # the sums bucket 0 brought back
        self._carried = False  # whether this backward's stamp rides in bucket 0

    def carried(self, buckets, reduction):
        """Whether bucket 0 carries the stamp (its slots, summed exactly)."""
        return buckets[0].carrier is not None and reduction.carries_stamp

    def stamp(self, n, buckets, reduction):
        """Put the stamp of the backward of synced forward `n` where it will be summed
        (on every rank, at the start of its backward)."""
        self.sums = self.future = None
        self._carried = False
        if self.sum_step is None:
            return
        if self.carried(buckets, reduction):
            carrier = buckets[0].carrier
            m = n % self.modulus(carrier.dtype)
            for slot, value in zip(range(-STAMP, 0), (1, m, m * m)):
                carrier[slot].fill_(value)  # no host-to-device copy to wait for
            self._carried = True
            return
        self.future = self.sum_step(torch.tensor([1, n, n * n], dtype=torch.int64))

    def shadow(self, buckets, reduction):
        """A joined rank's part in the peers' check: the Future of its zeros, or None
        where bucket 0 carries them (the caller zeroes the whole carrier)."""
        if self.sum_step is not None and not self.carried(buckets, reduction):
            return self.sum_step(torch.zeros(3, dtype=torch.int64))
        return None

    def modulus(self, dtype):
        """Stamps (1, m, m^2) with m below this sum exactly in `dtype` over every rank."""
        exact = {torch.float32: 1 << 24, torch.float64: 1 << 53}[dtype]  # integers below: exact
        return max(2, math.isqrt(exact // self.world_size))

    def take(self, bucket, result):
        """`result`, bucket 0's reduction, less the stamp's sums where it carried
        them (they are kept for verify)."""
        if (bucket.carrier is not None and isinstance(result, torch.Tensor) and
                result.numel() == bucket.carrier.numel()):
            result = result.reshape(-1)
            self.sums = result[-STAMP:].tolist()
            result = result[:-STAMP]
        return result

    def verify(self, n, buckets, wait):
        """Raise, on every rank, if the ranks' stamps were not all `n`'s (the synced
        forwards so far). `wait(future)` waits for the check's own collective (the
        reducer's bounded wait)."""
        if self.future is not None:
            summed = wait(self.future)
            sums, expected = (summed[0] if isinstance(summed, list) else summed).tolist(), n
        elif self.sums is not None:
            sums = [round(v) for v in self.sums]
            expected = n % self.modulus(buckets[0].carrier.dtype)
        else:
            invariant(not self._carried,
                      "stamp back: bucket 0 carried the step check's stamp but its reduction "
                      "brought no sums back; the check would pass unchecked, and a rank out "
                      "of step would write another iteration's gradients")
            return
        ranks, total, squares = sums
        if total != ranks * expected or squares != ranks * expected * expected:
            raise RuntimeError(_out_of_step(self.rank, n, buckets))


def _out_of_step(rank, forwards, buckets):
    return (f"minddp (rank {rank}): ranks are out of step: this backward belongs to "
            f"rank {rank}'s synced forward #{forwards}, but not every other "
            f"rank's does. A rank skipped a backward (an exception inside backward, "
            f"caught and ignored) or ran a different number of forwards with gradients "
            f"enabled outside no_sync(); every rank must run the same synced forwards "
            f"and backwards. No gradient of this backward was written" +
            ("" if not any(b.sparse for b in buckets) else
             " (sparse gradients were divided by the world size in place, as torch's DDP "
             "divides them before reducing)"))
