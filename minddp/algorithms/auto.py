"""algorithm="auto": per bucket size, the fastest algorithm, predicted and then timed.

A Chooser measures the links once (cost_model.measure, a few dozen
collectives on the group, more if it has to measure again; later groups over
the same ranks and backend reuse it), so the alpha-beta model predicts every
candidate's time for any size. The model ranks well where the algorithms
differ by their step counts, but where their times are close its error, tens
of percent on a busy or oversubscribed machine, is larger than the margin
that decides. So the first time a bucket size comes up (the wrapper announces
its buckets at start-up) the candidates are also timed on that size:
interleaved rounds after barriers (MIN_ROUNDS to 50, as many as fit in about
0.4 s by the model's account, but no more than fit in SIZE_BUDGET_S by the
first timed round's measure), the candidates in a fresh order each round,
the slowest rank's time per round agreed across ranks. The winner is the
candidate whose time is the lowest multiple of each round's best, in the
median over rounds. That costs a few dozen all-reduces of each candidate once
per size (not of one predicted over 3x the best and over 5 ms), and makes
every rank pick the same algorithm. Each choice is logged once at debug level
(logger "minddp.algorithms") with the predicted and measured times.

The candidates are the registered algorithms (registry.py) not registered
with auto=False, in registration order, that the group's backend can run
(`runnable`: Algorithm.runs_on; our send/recv ones where p2p.py knows the
backend's rules), and with a codec only those that put it on every hop. One
without a cost formula is timed on every size. Every tensor the timing puts
on the group is on the group's device (devices.group_device).

CUDA tensors on gloo (ranks sharing a GPU) go to the backend's all-reduce,
untimed, unless a codec is asked for. minddp's own algorithms reduce them in
host memory; timed here, on an idle GPU, they can win, but in training on one
H200 auto's picks took up to 1.29 times the step of the backend's all-reduce
(docs/performance.md, "One GPU"), when their copies ran on the communication
thread's default stream, behind every kernel backward had queued. They now run
on the engine's own stream, after what was queued before the bucket's submission
only (comm.py); until a GPU has timed them so in training, the backend's
all-reduce keeps these buckets.
"""
import functools
import logging
import random
import time

import torch
import torch.distributed as dist

from minddp import devices, registry
from minddp.algorithms import cost_model

log = logging.getLogger("minddp.algorithms")
NATIVE = "native"  # the backend's own all-reduce (native.py)

_choosers = {}  # (group, codec) -> Chooser: wrappers and calls on one group share its timings
# (global ranks, backend) -> Costs. Every rank of a group builds the same
# groups in the same order, so all find (or all miss) the same entry.
_measured = {}


class Chooser:
    """Picks an algorithm name per tensor size; construct it on every rank of `group` at once.

    timed=False decides from the model alone (no collective per new size).
    `codec` is what the candidates are timed with (compression).
    """

    def __init__(self, group, costs=None, codec=None, timed=True):
        self.group, self.p, self.codec, self.timed = group, group.size(), codec, timed
        self.names = runnable(group, codec)
        if not self.names:
            raise ValueError(f"minddp auto (rank {group.rank()}): no registered algorithm can "
                             f"run on the {devices.backend_of(group)!r} backend"
                             f"{' with compression ' + repr(codec.name) if codec else ''} "
                             f"(point-to-point rules unknown there, see p2p.runs_on); use "
                             f"compression=None or another algorithm.")
        self.collectives = {n: registry.algorithm(n).collective(group, codec)
                            for n in self.names}
        self.alone = self.p == 1 or len(self.names) == 1  # nothing to choose
        self.costs = costs if costs is not None or self.alone else _costs_of(group)
        self._picked = {}
        self._predicted_only = set()  # sizes picked by the model alone: tune() times them
        self._cuda_to_backend = None  # CUDA tensors go to native untimed (the module's doc)

    def tune(self, tensors, timed=True):
        """Decide now for each tensor's size (a collective: every rank, same tensors).

        timed=False picks by the model alone, for sizes in use only briefly (the
        buckets before bucket_cap_mb="auto"'s plan); a later tune() times them."""
        for tensor in tensors:
            if timed and tensor.nbytes in self._predicted_only:
                self._predicted_only.discard(tensor.nbytes)
                del self._picked[tensor.nbytes]
            self.pick(tensor, timed)

    def pick(self, tensor, timed=True):
        """The algorithm for `tensor`'s size, decided once, the first time it comes up."""
        # Later calls cost one lookup: an all-reduce of a few bytes is all
        # per-call overhead, a fraction of a millisecond, so every microsecond
        # of Python here shows.
        if tensor.is_cuda and self._leaves_cuda_to_backend():
            return NATIVE
        nbytes = tensor.nbytes
        picked = self._picked.get(nbytes)
        if picked is not None:
            return picked
        if self.alone:
            self._picked[nbytes] = self.names[0]
            return self.names[0]
        predicted = {n: None if self.costs is None else
                     cost_model.predict(n, nbytes, self.p, self.costs) for n in self.names}
        known = [t for t in predicted.values() if t is not None]
        if timed and self.timed and nbytes > 0:
            # Not worth timing: a candidate predicted to take over 3x the best
            # and over 5 ms (the tree on large buckets): the model's errors are
            # tens of percent, not 3x, and each round would cost the most. One
            # without a formula is always timed, as if it took the slowest's time.
            best, worst = (min(known), max(known)) if known else (0.0, 1e-3)
            guess = {n: worst if t is None else t for n, t in predicted.items()}
            candidates = [n for n in self.names if guess[n] <= max(3 * best, 5e-3)
                          or predicted[n] is None]
            times = self._time(tensor.numel(), tensor.dtype, tensor.device, candidates,
                               sum(guess[n] for n in candidates))
            measured = {n: times[i].median().item() for i, n in enumerate(candidates)}
            self._picked[nbytes] = _fastest(times, candidates)
        else:
            measured = {}
            modelled = [n for n in self.names if predicted[n] is not None] or self.names
            self._picked[nbytes] = min(modelled, key=lambda n: predicted[n] or 0.0)
            if self.timed and not timed:
                self._predicted_only.add(nbytes)
        log.debug("minddp auto on %d ranks: %d-byte bucket -> %s (predicted %s%s)",
                  self.p, nbytes, self._picked[nbytes],
                  ", ".join(f"{n} {t * 1e3:.3f} ms" if t is not None else f"{n} (no formula)"
                            for n, t in predicted.items()),
                  "; measured " + ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in measured.items())
                  if measured else "")
        return self._picked[nbytes]

    def _leaves_cuda_to_backend(self):
        """Whether CUDA tensors go to the backend's all-reduce (gloo, no codec), untimed."""
        if self._cuda_to_backend is None:
            self._cuda_to_backend = (self.codec is None and NATIVE in self.names and
                                     devices.backend_of(self.group) == "gloo")
        return self._cuda_to_backend

    def _time(self, numel, dtype, device, names, predicted_round):
        """Seconds of each of `names` (rows) per round (columns) on a scratch tensor
        of that size on `device`, the slowest rank's, the same on every rank."""
        scratch = self._like_a_bucket(numel, dtype, device)
        # Rounds: as many as fit in ~0.4 s by the model's account, MIN_ROUNDS
        # to 50. Small buckets take well under a millisecond, about as long as
        # the machine's hiccups, so they get the most rounds. A fresh order
        # each round (the same on every rank): what ran just before can slow
        # a call (a socket buffer still full, a cold cache), and a fixed
        # rotation would give each candidate the same predecessor every time.
        rounds = max(MIN_ROUNDS, min(50, int(0.4 / max(predicted_round, 1e-9))))
        self._round(scratch, names, random.Random(0).sample(names, len(names)))  # warms up
        first = self._round(scratch, names, random.Random(1).sample(names, len(names)))
        rounds = min(rounds, self._affordable(first))
        times = torch.zeros(len(names), rounds, dtype=torch.float64, device="cpu")
        times[:, 0] = torch.tensor(first, dtype=torch.float64, device="cpu")
        for r in range(1, rounds):
            order = random.Random(r + 1).sample(names, len(names))
            times[:, r] = torch.tensor(self._round(scratch, names, order), dtype=torch.float64,
                                       device="cpu")
        # The slowest rank's, agreed on the group's device (the CPU on gloo: no copy).
        agreed = times.to(devices.group_device(self.group))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        return agreed.cpu()

    def _like_a_bucket(self, numel, dtype, device):
        """Zeros where the wrapper's buckets of that size would live (a candidate's
        `allocate`, as bind offers it, set up by every candidate with a `setup`), so a
        candidate that sums such buckets in place is timed doing that; a collective."""
        entries = with_buffers(self.names, self.codec)
        allocate = first_allocate(entries)
        tensor = None if allocate is None else allocate(numel, dtype, device, self.group)
        if tensor is None:
            tensor = torch.zeros(numel, dtype=dtype, device=device)
        for entry in entries:
            entry.setup([tensor], self.group)
        return tensor

    def _round(self, scratch, names, order):
        """Seconds of each of `names` (in that order) run once each in `order`, after barriers."""
        seconds = [0.0] * len(names)
        for name in order:
            devices.barrier(self.group)
            start = time.perf_counter()
            self._run(name, scratch)
            if scratch.is_cuda:
                torch.cuda.synchronize(scratch.device)
            seconds[names.index(name)] = time.perf_counter() - start
        return seconds

    def _affordable(self, first):
        """How many rounds fit in SIZE_BUDGET_S, judged by the first timed round on the
        slowest rank (agreed: every rank must run as many), at least FEWEST_ROUNDS."""
        spent = torch.tensor([sum(first)], dtype=torch.float64, device="cpu")
        spent = spent.to(devices.group_device(self.group))
        dist.all_reduce(spent, op=dist.ReduceOp.MAX, group=self.group)
        return max(FEWEST_ROUNDS, int(SIZE_BUDGET_S / max(spent.item(), 1e-9)))

    def _run(self, name, tensor):
        return registry.wait_sum(self.collectives[name], tensor)


# Timed rounds per size where they are cheap. Large buckets fit only a
# handful of rounds into the 0.4 s the model's account allows, and with a
# handful one slow round decides between candidates a few percent apart.
MIN_ROUNDS = 24
# But not past SIZE_BUDGET_S per size (FEWEST_ROUNDS at least): over a slow
# link one round of a 25 MB bucket takes most of a second (1 Gbit/s: 24 rounds
# cost 25 s), and there the candidates differ by what they send, steadily
# from round to round, not by the machine's hiccups.
SIZE_BUDGET_S = 1.0
FEWEST_ROUNDS = 3


def _relative(times, names):
    """Each candidate's median, over rounds, of its time over that round's best.

    Candidates run back to back within a round, so dividing by the round's
    best cancels whatever slowed the whole round (another process, a page
    reclaim): the benchmarks compare algorithms the same way.
    """
    ratios = times / times.min(dim=0, keepdim=True).values.clamp_min(1e-12)
    return {n: ratios[i].median().item() for i, n in enumerate(names)}


# No side is favoured beyond the order of registration on an exact tie, which
# is not rare: a candidate's ratio is exactly 1 in each round it wins, and
# torch.median takes the lower middle of an even count, so two candidates
# that each win half the rounds both score 1 and the first listed is kept.
# The backend's all-reduce gets no head start for running off the Python
# thread: ours take about as much CPU per call (lanes.py, the early receives
# in p2p.py), so a margin in its favour would only keep it on sizes where
# another candidate is faster.
def _fastest(times, names):
    """The winner of `times` (candidates x rounds): the lowest `_relative` score,
    the first in `names` on a tie."""
    scores = _relative(times, names)
    return min(names, key=scores.__getitem__)


def runnable(group, codec=None):
    """The registered candidates that can run on `group` (with `codec` on every hop), in
    registration order."""
    return [n for n in registry.algorithm_names(auto_only=True)
            if registry.algorithm(n).can_run(group)
            and (codec is None or registry.algorithm(n).per_hop)]


def _costs_of(group):
    """The group's measured Costs, or None where the model cannot be calibrated (it times
    minddp's ring and tree, which the backend may not run): every candidate is timed."""
    if not cost_model.can_measure(group):
        return None
    key = (tuple(dist.get_process_group_ranks(group)), dist.get_backend(group))
    if key not in _measured:
        _measured[key] = cost_model.measure(group)
    return _measured[key]


def chooser(group, codec=None):
    """The one Chooser of `group` and `codec` (construct on every rank of the group at once)."""
    if (group, codec) not in _choosers:
        _choosers[group, codec] = Chooser(group, codec=codec)
    return _choosers[group, codec]


def bind(group, codec=None):
    """algorithm="auto"'s collective: `collective(tensor, error=None)`, with
    `collective.setup(buffers, provisional=False)`, which decides for each buffer's
    size now: a collective itself (every rank, same buffers, same point of its
    program), timing the candidates once per size, group and codec;
    provisional=True (sizes in use only briefly) asks the model alone."""
    def collective(tensor, error=None):
        picker = chooser(group, codec)
        run = picker.collectives[picker.pick(tensor)]
        return run(tensor) if error is None else run(tensor, error=error)

    entries = with_buffers(registry.algorithm_names(auto_only=True), codec)

    def setup(buffers, provisional=False):
        # First: shared memory's buckets are mapped by the peers and their files unlinked
        # before seconds of timing, in which a crash would leave the files behind.
        for entry in entries:
            entry.setup(buffers, group)
        chooser(group, codec).tune(buffers, not provisional)
    collective.setup = setup
    allocate = first_allocate(entries)
    if allocate is not None:
        collective.allocate = functools.partial(allocate, group=group)
    return collective


def with_buffers(names, codec=None):
    """Those of the algorithms `names` that set up the buckets they sum (Algorithm.setup;
    none with a codec, whose wire is not the bucket)."""
    entries = [registry.algorithm(n) for n in names] if codec is None else []
    return [e for e in entries if e.setup is not None]


def first_allocate(entries):
    """Where buckets live: the first of `entries` that offers storage (shared memory: a
    file every rank maps, summed in place), or None."""
    return next((e.allocate for e in entries if e.allocate is not None), None)


def all_reduce(tensor, group=None, codec=None, error=None):
    """In-place sum of `tensor` over `group` with the fastest algorithm for its size.

    Every rank of the group must call it: the first call on a group measures
    the links, the first call with each size times the candidates.
    """
    group = group if group is not None else dist.group.WORLD
    picker = chooser(group, codec)
    name = picker.pick(tensor)
    if codec is None:  # the plain, synchronous form (native's takes strided views too)
        registry.algorithm(name).all_reduce(tensor, group)
        return tensor
    run = picker.collectives[name]
    return registry.wait_sum(lambda t: run(t) if error is None else run(t, error=error), tensor)


registry.register_algorithm("auto", all_reduce, auto=False, per_hop=True, bind=bind)
