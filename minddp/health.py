"""Which peer is to blame when a bucket's all-reduce fails.

A collective that fails says little: gloo reports a reset connection or a
timeout, not which rank stopped. So every rank publishes, in the process
group's key-value store, the iteration whose backward it has entered (one
small write per iteration). When a reduction fails, a rank reads its peers'
entries back: a peer still at an earlier iteration is the one that died or
got stuck before backward.
"""
import torch.distributed as dist


class PeerProgress:
    """Publish this rank's iteration; name the peers that are behind it."""

    def __init__(self, group, comm_group):
        self.rank = dist.get_rank(group)
        self.peers = [r for r in range(dist.get_world_size(group)) if r != self.rank]
        try:
            store = dist.distributed_c10d._get_default_store()
            self.store = dist.PrefixStore(f"minddp/{comm_group.group_name}/", store)
        except Exception:  # noqa: BLE001 - no store (a custom init): diagnosis is best effort
            self.store = None

    def entered(self, iteration):
        if self.store is not None and self.peers:
            self.store.set(f"rank{self.rank}", str(iteration))

    def behind(self, iteration):
        """Peers whose last published iteration is earlier than `iteration`, as
        {rank: their iteration or None}; None if the store cannot be read (it
        lives on rank 0, which may be the one that died)."""
        if self.store is None:
            return None
        late = {}
        try:
            for peer in self.peers:
                key = f"rank{peer}"
                seen = int(self.store.get(key)) if self.store.check([key]) else None
                if seen is None or seen < iteration:
                    late[peer] = seen
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
            f"rank {peer} (last entered iteration {seen})" if seen is not None else
            f"rank {peer} (never entered a backward)" for peer, seen in sorted(late.items())) + \
            f", while this rank is in iteration {iteration}: dead or stuck"
