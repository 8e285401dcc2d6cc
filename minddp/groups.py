"""The process groups minddp makes for itself, named alike on every member.

Its gradient groups (comm.py) and gloo's reverse lanes (algorithms/lanes.py) are
new groups over the ranks of the group a wrapper was given. Over the whole world
dist.new_group makes them (every rank calls it). Over a subgroup only its ranks
call, and dist.new_group(use_local_synchronization=True) would name the group
from how many groups the calling process already has (torch's
_hash_ranks_to_str): ranks that belong to different other groups (a rank in two
overlapping subgroups, say) compute different names, wait on different store
keys, and never meet. So here the name comes from what the subgroup's ranks
share: the ranks themselves and how many groups minddp has made over them before
(each made by all of them together), passed to the helper dist.new_group itself
calls. Where that helper is not what this code knows (another torch), or the
default group makes its own subgroups, dist.new_group after all.
"""
import collections
import inspect
import weakref

import torch.distributed as dist

# ranks -> groups this process made over them, in the world of _counted_in (a new world,
# after destroy_process_group(), counts afresh, as a process that replaced a dead one does).
_made = collections.Counter()
_counted_in = None
_HELPER_PARAMETERS = ["group_size", "group_rank", "global_ranks_in_group", "backend", "store",
                      "group_name"]


def new_group(ranks, backend, timeout):
    """A new group over `ranks` (global ranks, in group order), with `backend` and
    `timeout`. These ranks make the call together, at the same point of their
    programs: every rank of the world where `ranks` are all of them."""
    ranks = list(ranks)
    if len(ranks) == dist.get_world_size():
        return dist.new_group(ranks, backend=backend, timeout=timeout)
    c10d = dist.distributed_c10d
    helper = getattr(c10d, "_new_process_group_helper", None)
    default = c10d._get_default_group()
    if (helper is None or hasattr(default, "new_group")
            or list(inspect.signature(helper).parameters)[:6] != _HELPER_PARAMETERS):
        return dist.new_group(ranks, backend=backend, timeout=timeout,
                              use_local_synchronization=True)
    global _counted_in
    if _counted_in is None or _counted_in() is not default:
        _made.clear()
        _counted_in = weakref.ref(default)
    name = f"minddp-{'-'.join(map(str, ranks))}-{_made[tuple(ranks)]}"
    _made[tuple(ranks)] += 1
    store = c10d._world.pg_map[default][1]
    made = helper(len(ranks), ranks.index(dist.get_rank()), ranks, dist.Backend(backend),
                  store, name, timeout=timeout, device_id=getattr(default, "bound_device_id", None))
    group = made[0] if isinstance(made, tuple) else made  # (group, its store) since torch 2.2
    c10d._world.pg_group_ranks[group] = {r: i for i, r in enumerate(ranks)}  # as new_group
    return group
