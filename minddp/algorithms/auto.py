"""algorithm="auto": per bucket, the algorithm the cost model predicts to be fastest.

A Chooser measures the links once (cost_model.measure, a collective on the
group, 0.1-0.5 s; later groups over the same ranks and backend reuse it) and
then decides from the bucket's size alone, so every rank picks the same
algorithm for the same bucket without talking.
Each new bucket size logs its choice once at debug level
(logger "minddp.algorithms").
"""
import logging

import torch.distributed as dist

from minddp.algorithms import cost_model, halving_doubling, native, ring, tree

log = logging.getLogger("minddp.algorithms")

# The algorithms auto chooses among, in order of preference on a tie.
CANDIDATES = {"ring": ring, "tree": tree, "halving_doubling": halving_doubling,
              "native": native}

_choosers = {}  # (group, with_native) -> Chooser, for calls outside a wrapper
# (global ranks, backend) -> Costs. Every rank of a group builds the same
# groups in the same order, so all find (or all miss) the same entry.
_measured = {}


class Chooser:
    """Picks an algorithm name per tensor size; construct it on every rank of `group` at once."""

    def __init__(self, group, with_native=True, costs=None):
        self.p = group.size()
        self.costs = costs if costs is not None or self.p == 1 else _costs_of(group)
        # A codec can only ride on our own hops, not inside the backend's all-reduce.
        self.names = [n for n in CANDIDATES if with_native or n != "native"]
        self._picked = {}

    def pick(self, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes not in self._picked:
            if self.costs is None:
                self._picked[nbytes] = self.names[0]
                return self.names[0]
            predicted = {n: cost_model.predict(n, nbytes, self.p, self.costs) for n in self.names}
            self._picked[nbytes] = min(self.names, key=predicted.__getitem__)
            log.debug("minddp auto on %d ranks: %d-byte bucket -> %s (predicted %s)", self.p,
                      nbytes, self._picked[nbytes],
                      ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in predicted.items()))
        return self._picked[nbytes]


def _costs_of(group):
    key = (tuple(dist.get_process_group_ranks(group)), dist.get_backend(group))
    if key not in _measured:
        _measured[key] = cost_model.measure(group)
    return _measured[key]


def all_reduce(tensor, group=None, codec=None):
    """In-place sum of `tensor` over `group` with the predicted-fastest algorithm.

    The first call on a group measures it (every rank of the group must call).
    """
    group = group if group is not None else dist.group.WORLD
    key = (group, codec is None)
    if key not in _choosers:
        _choosers[key] = Chooser(group, with_native=codec is None)
    name = _choosers[key].pick(tensor)
    if name == "native":
        return native.all_reduce(tensor, group)
    return CANDIDATES[name].all_reduce(tensor, group, codec=codec)
