"""Uneven inputs: ranks that run out of batches early keep the others company.

    with ddp.join():
        for batch in my_batches:           # some ranks have fewer batches
            loss_fn(ddp(batch)).backward()
            optimizer.step()

Without this, a rank that stops training leaves the others waiting in their
next all-reduce until the timeout. Inside `join()`, every forward first
all-reduces a small status vector (who is still training, and what this step
will communicate). A rank that has left its loop ("joined") answers that
vector with zeros and then shadows what the step announced, in the same
order: the buffer broadcast, and every bucket's all-reduce with zero
gradients. When a status vector comes back all zeros, every rank has joined;
the parameters and buffers of a rank that trained until the end are then
broadcast to all (a joined rank skipped its optimizer steps). Buffers and that
final copy come from the highest rank among those training, as torch breaks the
tie (a lower rank's BatchNorm statistics would differ from torch's run).

Divisor: by default gradients are still divided by the full world size, as
torch does (`divide_by_initial_world_size=True`): a joined rank counts as a
rank with zero gradient. With False they are divided by the number of ranks
still training in that step, i.e. the mean over the ranks that had data.

throw_on_early_termination=True: once any rank has run out, every rank
raises at its next step instead (the joined one when it reaches the end of
its loop, the others in their next forward).
"""
import torch
import torch.distributed as dist
from torch.distributed.algorithms import join as torch_join

from minddp.model_sync import broadcast_from_first


# torch's words, which scripts match on (the rank that ran out says which it is).
EXHAUSTED = ("Detected at least one rank that exhausted inputs. Throwing across all ranks.")


class Join:
    """The context manager behind `DistributedDataParallel.join()`."""

    def __init__(self, ddp, divide_by_initial_world_size=True, throw_on_early_termination=False):
        self.ddp = ddp
        self.divide_by_initial = divide_by_initial_world_size
        self.throw = throw_on_early_termination
        self.group = ddp.process_group
        self.world = ddp.world_size
        self.rank = dist.get_rank(self.group)
        self.device = ddp.engine.device  # the user's group has the same backend
        self.last_active = None  # who trained in the latest step that had anyone

    def __enter__(self):
        self.ddp._join = self
        self.ddp._generic_join = None  # a torch Join left by an error: superseded
        return self

    def __exit__(self, exc_type, exc, tb):
        self.ddp._join = None
        if exc_type is not None:
            return False  # the error matters more than keeping the others company
        while True:
            status = self._exchange(active=False, broadcast_buffers=False, sync=False)
            if not status["anyone"]:
                break
            if self.throw:  # the others learn it from this same exchange
                raise RuntimeError(f"Rank {self.rank} exhausted all inputs.")
            self._shadow(status)
        self.sync_final_model()
        return False

    def sync_final_model(self):
        """Every rank: the parameters (and buffers, where the wrapper syncs them) of the
        highest rank that trained in the last step go to all (a joined rank skipped its
        optimizer steps); the highest rank of all where none trained, as torch."""
        if self.world > 1:
            buffers = self.ddp._buffers_to_sync() if self.ddp.forward_sync_buffers else []
            broadcast_from_first([p.data for p in self.ddp._parameters_to_sync()] + buffers,
                                 self.group, src=max(self.last_active or [self.world - 1]))

    def before_forward(self, broadcast_buffers, sync):
        """Called by a training rank's forward: announce the step; returns the rank
        buffers come from (the highest one still training) and what this step's
        gradients are divided by."""
        status = self._exchange(active=True, broadcast_buffers=broadcast_buffers, sync=sync)
        if self.throw and len(status["active"]) < self.world:
            raise RuntimeError(EXHAUSTED)
        divisor = self.world if self.divide_by_initial else len(status["active"])
        return max(status["active"]), divisor

    def _exchange(self, active, broadcast_buffers, sync):
        flags = torch.zeros(self.world + 2, dtype=torch.int32, device=self.device)
        if active:
            flags[self.rank] = 1
            flags[self.world] = int(broadcast_buffers)
            flags[self.world + 1] = int(sync)
        dist.all_reduce(flags, group=self.group)
        flags = flags.tolist()
        ranks = [r for r in range(self.world) if flags[r] > 0]
        if ranks:
            self.last_active = ranks
        return {"anyone": bool(ranks), "active": ranks,
                "broadcast_buffers": flags[self.world] > 0, "sync": flags[self.world + 1] > 0}

    def _shadow(self, status):
        """Match one step of the training ranks, with nothing of our own to add."""
        if status["broadcast_buffers"]:
            broadcast_from_first(self.ddp._buffers_to_sync(), self.group,
                                 src=max(status["active"]))
        if status["sync"]:
            self.ddp.reducer.shadow_backward()


class JoinHook(torch_join.JoinHook):
    """minddp's wrapper under torch's generic `Join([ddp, zero, ...])`: torch's loop
    runs main_hook on a rank that has joined, once per step the others still take
    (after its own count of who is left), and post_hook on every rank at the end.
    The wrapper's forward announces each step to it as inside `ddp.join()`."""

    def __init__(self, join):
        self.join = join

    def main_hook(self):
        self.join._shadow(self.join._exchange(active=False, broadcast_buffers=False, sync=False))

    def post_hook(self, is_last_joiner):
        # last_active, seen alike by every rank, is the set of last joiners
        self.join.sync_final_model()
        self.join.ddp._generic_join = None
