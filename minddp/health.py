"""Which peer is to blame when a bucket's all-reduce fails.

A collective that fails says little: gloo reports a reset connection or a
timeout, not which rank stopped. So every rank publishes, in the process
group's key-value store, the iteration whose backward it has entered (one
small write per iteration). When a reduction fails, a rank reads its peers'
entries back: a peer still at an earlier iteration is the one that died or
got stuck before backward.

A rank that finds its own last backward unfinished (an exception inside it)
also leaves a note there: its peers, waiting for buckets it will never send,
read it and fail at once instead of at the timeout (`wait`).

The entry also says how the rank reduces its buckets (the reduction's
`kind`, reduction.py). Ranks that reduce one iteration differently (a comm
hook registered on some ranks only) wait for collectives their peers never
issue; a rank whose bucket is late compares its kind with the next rank's,
and on a difference fails, with a note for the others, instead of waiting
out the timeout. Each rank compares with one neighbour: if any two ranks
differ, some neighbours do.
"""
import threading

import torch.distributed as dist

# How often a rank waiting for a bucket looks for a peer's note that it gave up.
POLL_SECONDS = 0.5


class PeerProgress:
    """Publish this rank's iteration; name the peers that are behind it; wait for a
    bucket, but not for one a peer has given up on."""

    def __init__(self, group, name):
        """`name`: the same on every rank for one wrapper, different for others."""
        self.rank = dist.get_rank(group)
        self._global = dist.get_process_group_ranks(group)  # a subgroup's ranks, as torchrun
        world_size = dist.get_world_size(group)
        self.peers = [r for r in range(world_size) if r != self.rank]
        self.neighbour = (self.rank + 1) % world_size
        self.iteration = self.kind = None  # what `entered` published last
        self._compared = None  # the iteration whose kinds the neighbour's matched
        try:
            store = dist.distributed_c10d._get_default_store()
            self.store = dist.PrefixStore(f"minddp/{name}/", store)
        except Exception:  # noqa: BLE001 - no store (a custom init): diagnosis is best effort
            self.store = None

    def named(self, rank):
        """'rank R' for the group's rank R: the global rank, which launchers' logs show, with
        the group's own where they differ (a wrapper over a subgroup)."""
        world = self._global[rank]
        return f"rank {rank}" if world == rank else f"rank {world} ({rank} in the wrapper's group)"

    def entered(self, iteration, kind):
        """This rank has begun the backward of `iteration`, reducing it by `kind`."""
        self.iteration, self.kind = iteration, kind
        if self.store is not None and self.peers:
            try:
                self.store.set(f"rank{self.rank}", f"{iteration} {kind}")
            except Exception:  # noqa: BLE001 - rank 0, the store's host, is gone: the
                pass           # reduction fails next and says so

    def abandon(self, why):
        """Tell the peers this rank will not finish its current iteration."""
        if self.store is not None and self.peers:
            try:
                self.store.set("abandoned", f"{self.named(self.rank)} {why}")
            except Exception:  # noqa: BLE001 - the store's host is gone: nobody to tell
                pass

    def abandoned(self):
        """A peer's note that it gave up its iteration, or None."""
        if self.store is None or not self.peers:
            return None
        try:
            if self.store.check(["abandoned"]):
                return self.store.get("abandoned").decode()
        except Exception:  # noqa: BLE001 - the store's host is gone
            return None
        return None

    def wait(self, future):
        """future.wait(), but raise sooner when a peer has left a note that it gave
        up its iteration (`abandon`): what it did not send will never arrive; or
        when the neighbour reduces this iteration differently (then leave one)."""
        if not future.done():
            arrived = threading.Event()
            future.add_done_callback(lambda _: arrived.set())
            while not arrived.wait(POLL_SECONDS):
                note = self.abandoned()
                if note is not None:
                    raise RuntimeError(f"{note}; nothing it did not send will arrive")
                different = self._reduces_differently()
                if different is not None:
                    self.abandon(f"gave up iteration {self.iteration}: {different}")
                    raise RuntimeError(f"minddp (rank {self.rank}): {different}")
        return future.wait()

    def _entry(self, peer):
        """(iteration, kind) a peer published last, None if it has not (raises where the
        store cannot be read)."""
        key = f"rank{peer}"
        if not self.store.check([key]):
            return None
        iteration, kind = self.store.get(key).decode().split(" ", 1)
        return int(iteration), kind

    def _reduces_differently(self):
        """A sentence where the neighbour reduces this iteration otherwise than this rank
        does, else None. Read until the neighbour has entered this iteration, then no more."""
        if self.store is None or not self.peers or self._compared == self.iteration:
            return None
        try:
            entry = self._entry(self.neighbour)
        except Exception:  # noqa: BLE001 - the store's host is gone: the wait fails on its own
            return None
        if entry is None or entry[0] != self.iteration:
            return None
        self._compared = self.iteration
        if entry[1] == self.kind:
            return None
        return (f"{self.named(self.neighbour)} reduces iteration {self.iteration}'s buckets "
                f"with {entry[1]}, {self.named(self.rank)} with {self.kind}: their "
                f"collectives never pair. Every rank must call register_comm_hook (the same "
                f"hook) before the same iteration, or none")

    def behind(self, iteration):
        """Peers whose last published iteration is earlier than `iteration`, as
        {rank: their iteration or None}; None if the store cannot be read (it
        lives on rank 0, which may be the one that died)."""
        if self.store is None:
            return None
        late = {}
        try:
            for peer in self.peers:
                entry = self._entry(peer)
                if entry is None or entry[0] < iteration:
                    late[peer] = None if entry is None else entry[0]
        except Exception:  # noqa: BLE001 - the store's host is gone
            return None
        return late

    def describe(self, iteration):
        """A sentence for an error message: who this rank was waiting for."""
        late = self.behind(iteration)
        if late is None:
            return ("the peers' progress could not be read (the store on rank 0 is "
                    "unreachable: rank 0 may be the one that died)")
        if not late:
            return (f"every peer reached iteration {iteration}; one of them failed or stalled "
                    f"inside it (see its own error)")
        return "waiting for " + ", ".join(
            f"{self.named(peer)} (last entered iteration {seen})" if seen is not None else
            f"{self.named(peer)} (never entered a backward)"
            for peer, seen in sorted(late.items())) + \
            f", while this rank is in iteration {iteration}: dead or stuck"
