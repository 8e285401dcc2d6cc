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

Counts are kept per world (its default group), and the registry of groups is
the calling thread's: under torch's threaded process group, ranks are threads
of one process, each with a world of its own.
"""
import collections
import inspect
import weakref

import torch.distributed as dist

# default group -> Counter: key -> how many times this rank counted it in that world
_numbers = weakref.WeakKeyDictionary()
_HELPER_PARAMETERS = ["group_size", "group_rank", "global_ranks_in_group", "backend", "store",
                      "group_name"]


def number(key):
    """0, 1, 2, ...: how many times this rank has counted `key` before, in this world.
    For what a group's ranks make together (a group, a wrapper over them), at the
    same point of their programs: the number is then the same on each of them. A new
    world (destroy_process_group() and init again, or a process that replaced a dead
    one) counts afresh, as its peers do."""
    counts = _numbers.setdefault(dist.distributed_c10d._get_default_group(),
                                 collections.Counter())
    counts[key] += 1
    return counts[key] - 1


def this_world():
    """torch's registry of process groups as the calling thread sees it: the process's,
    or, under torch's threaded process group (its test harness runs ranks as threads of
    one process), the calling thread-rank's own."""
    registry = dist.distributed_c10d._world
    return registry._get_world() if hasattr(registry, "_get_world") else registry


def enter_world(world):
    """Make the calling thread, one minddp started, see `world`: this_world() of the
    thread that started it (a new thread of a threaded world sees an empty one)."""
    registry = dist.distributed_c10d._world
    if hasattr(registry, "_get_world"):
        type(registry)._world.world = world


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
    name = f"minddp-{'-'.join(map(str, ranks))}-{number(('group', tuple(ranks)))}"
    store = c10d._world.pg_map[default][1]
    made = helper(len(ranks), ranks.index(dist.get_rank()), ranks, dist.Backend(backend),
                  store, name, timeout=timeout, device_id=getattr(default, "bound_device_id", None))
    group = made[0] if isinstance(made, tuple) else made  # (group, its store) since torch 2.2
    c10d._world.pg_group_ranks[group] = {r: i for i, r in enumerate(ranks)}  # as new_group
    return group
