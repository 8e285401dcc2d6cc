"""The replica check: every N synced steps, are the ranks' weights still bit for bit equal?

Data parallelism rests on every rank holding the same weights: each applies
the same update to the same averaged gradients, so they stay equal without
ever being compared. Nothing in torch's DDP notices when they stop being
equal (an optimizer step run on some ranks only, a checkpoint loaded on one
rank after wrapping, a per-rank learning rate, a flipped bit in memory), and
training then goes on with ranks that each train a different model.
`check_replicas=N` (the wrapper's keyword; 0 or None: off) compares them
every N synced steps, at synced steps 1, N+1, 2N+1, ...: the first check
also catches ranks that started from different weights (init_sync=False).

What is compared: a checksum per parameter, over its bits. The parameter's
bytes are read as 64-bit integers and summed modulo 2**64 (int64 wraps),
plus its last few bytes when its size is not a multiple of 8. Integer sums
are exact in any order, so every rank computes the same checksum for the
same bits whatever its threads do; one flipped bit changes one word by
+-2**k, which no wrap-around can cancel. (A float sum would miss a flip in
a low mantissa bit, and differ with summation order.) Every parameter the
wrapper synchronises is checked, frozen ones too (they are broadcast at
construction and should stay equal); those in parameters_to_ignore are not.

Buffers are not checked: there is no point where they must be equal. With
forward_sync_buffers, rank 0's buffers overwrite the others' before every
synced forward (equal by construction there, and a divergence is healed at
the next forward), and the forward itself then updates them from the local
batch (BatchNorm's running statistics), so they differ legitimately at
backward. Without it they are never re-synchronised and may differ by design.

Where it runs, so that every rank issues it at the same point among the
wrapper's other collectives: in finalize, once bucket 0's step check has
agreed (reducer._launch_replica_check), the reducer submits it to the
communication engine, behind every bucket and the used-parameter map on the
gradient group's FIFO. Not earlier: whether a check is due follows the count
of synced forwards, which is exactly what differs between ranks when the step
check fails, and a check due on one rank only would pair its gather with a
peer's bucket. The job computes the checksums on the communication thread
(while finalize writes .grad; the optimizer steps only after backward; with a
comm hook or optimizers in backward, once .grad is written: see below) and
all-gathers one row per rank: [present, checksum of each parameter], world x
(1 + parameters) int64 in all. Finalize waits for it at its end: a mismatch
raises from backward on every rank with the same message (every rank reads
the same gathered rows), and the wrapper is broken from then on, as after any
failed backward. The wait is bounded like a bucket's (the group's timeout, a
peer's note): never a hang.

- no_sync(): its backwards communicate nothing and are not counted; the check
  runs at synced steps only, when accumulation has ended and the weights were
  last updated from the same averaged gradients.
- static_graph: the first backward reduces everything at its end, and its
  finalize submits the check as any other.
- a comm hook: it communicates on its own group; the check is on the gradient
  group and does not touch the hook. It is submitted once every bucket is
  written, not after bucket 0: a hook's callbacks may step an optimizer
  (torch's _hook_then_optimizer, `_register_fused_optim`), and the weights
  must be read after every one of them.
  torch's local SGD hook (post_localSGD_hook) and noop_hook turn the check
  off: from its start step each rank's weights move on their own between
  model averagings, by design (keeps_replicas_apart).
- join(): a rank that has joined shadows the check (reducer.shadow_backward)
  with a row marked absent: its weights lag behind legitimately (it skips
  the optimizer steps until the join ends and rank 0's weights are
  broadcast), so only the ranks still training are compared. It reads the
  same rows and raises the same error as the others.
- a second wrapper over the same ranks shares the engine and its FIFO; each
  wrapper's check is submitted in its own backward's program order, before
  its own buckets, and its due steps follow its own synced forwards.

Cost: one checksum pass over the weights (about as long as summing them once; on the
communication thread, beside finalize's write-back, or after it where a comm hook
reduces) and a collective of a few hundred
bytes per checked step. docs/performance.md has the measured figures behind
DEFAULT_INTERVAL.
"""
import torch
import torch.distributed as dist

# Synced steps between checks when the wrapper is not told otherwise:
# docs/performance.md ("The replica check") measures the cost behind it.
DEFAULT_INTERVAL = 100
SHOWN = 5  # differing parameters named in the message


class ReplicasDiverged(RuntimeError):
    """The ranks' weights differ (raised on every rank, with the same message)."""


def keeps_replicas_apart(state, hook):
    """Whether a comm hook lets ranks' weights differ on purpose: torch's local SGD
    (post_localSGD_hook, or any hook given its PostLocalSGDState), which stops
    averaging gradients over all ranks at its start step, and its noop_hook (no
    communication at all, for benchmarks)."""
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local_sgd
    return (hook in (local_sgd.post_localSGD_hook, debugging_hooks.noop_hook)
            or isinstance(state, local_sgd.PostLocalSGDState))


def interval_of(value, rank):
    """check_replicas= as an interval in synced steps (0: off); ValueError for anything else."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"minddp (rank {rank}): check_replicas must be a whole number of synced "
                         f"steps between replica checks (0 or None turns the check off), got "
                         f"{value!r}.")
    return value


def checksum(tensor):
    """A 0-d int64 tensor: `tensor`'s bytes read as int64 words, summed modulo 2**64,
    plus its trailing bytes (fewer than 8) as unsigned values. Exact and
    order-independent: equal bits give equal checksums on every rank and
    device; any single flipped bit changes it."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # strided: a copy
    words = raw.numel() // 8 * 8
    head = raw[:words]
    if head.storage_offset() % 8:  # a view into a larger tensor, off a word boundary
        head = head.clone()
    total = head.view(torch.int64).sum()
    if words < raw.numel():
        total = total + raw[words:].sum(dtype=torch.int64)
    return total


def checksums(tensors):
    """checksum() of each tensor, as one 1-D int64 tensor on their device."""
    return torch.stack([checksum(t) for t in tensors])


def differences(rows):
    """Compare gathered rows ([present, checksum, ...] per rank, as lists of ints).

    Returns (the present ranks, the indices of the parameters whose checksums
    differ between them); a rank marked absent (joined) is not compared."""
    present = [r for r, row in enumerate(rows) if row[0]]
    if len(present) < 2:
        return present, []
    first = rows[present[0]]
    differing = [i for i in range(len(first) - 1)
                 if any(rows[r][i + 1] != first[i + 1] for r in present[1:])]
    return present, differing


class ReplicaCheck:
    """One wrapper's check: which steps, the collective, and the verdict.

    `named`: (name, tensor) of everything compared, the same list on every
    rank; `engine`: the gradient group's communication engine (comm.py);
    `interval`: synced steps between checks (positive); `renormalised`: the
    names of parameters the forward itself changes (the message names the cause).
    """

    def __init__(self, named, engine, interval, rank, world_size, renormalised=()):
        self.renormalised = set(renormalised)  # names: renormalised_in_forward
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]
        self.engine, self.interval = engine, interval
        self.rank, self.world_size = rank, world_size
        self.passed = None  # the last synced step whose check found the ranks equal

    def due(self, step):
        return (step - 1) % self.interval == 0

    def launch(self, step, present=True):
        """At synced step `step` (1, 2, ...), on every rank at the same point of its
        program: queue the check on the engine if it is due. Returns the
        Future of the gathered rows, or None. present=False: a joined rank's
        row, not compared."""
        if not self.due(step):
            return None
        return self.engine.submit(self._gather, present, label="replica check",
                                  device=self.engine.device)

    def _gather(self, present):
        device = self.engine.device
        width = 1 + len(self.tensors)
        rows = torch.zeros(self.world_size, width, dtype=torch.int64, device=device)
        mine = torch.zeros(width, dtype=torch.int64, device=device)
        if present:
            mine[0] = 1
            mine[1:] = checksums(self.tensors).to(device)
        work = dist.all_gather(list(rows.unbind(0)), mine, group=self.engine.group,
                               async_op=True)

        def gathered(done):
            done.value()  # a failed gather raises here, never reads as rows
            return rows
        return work.get_future().then(gathered)

    def verify(self, rows, step):
        """Raise ReplicasDiverged if the present ranks' checksums in `rows` (the
        gathered tensor) differ; every rank reaches the same verdict."""
        rows = rows.tolist()
        present, differing = differences(rows)
        if not differing:
            self.passed = step
            return
        raise ReplicasDiverged(self._message(rows, present, differing, step))

    def _message(self, rows, present, differing, step):
        first = differing[0]
        groups = {}
        for r in present:
            groups.setdefault(rows[r][first + 1], []).append(r)
        reference = present[0]
        agree = groups[rows[reference][first + 1]]
        others = [r for r in present if r not in agree]
        split = " | ".join(_ranks(g) for g in groups.values())
        shown = ", ".join(f"'{self.names[i]}'" for i in differing[:SHOWN])
        more = f" and {len(differing) - SHOWN} more" if len(differing) > SHOWN else ""
        joined = [r for r in range(len(rows)) if r not in present]
        since = (f"They were equal at the previous check (synced step #{self.passed})"
                 if self.passed is not None else
                 "This is the first check: they started from different weights (with "
                 "init_sync=False every rank must build identical weights, e.g. from one seed) "
                 "or changed on some ranks before it")
        layer = [self.names[i] for i in differing if self.names[i] in self.renormalised]
        if layer:
            return (
                f"minddp (rank {self.rank}): replicas diverged at synced step #{step}: "
                f"parameter '{layer[0]}' is the weight of an nn.Embedding (or EmbeddingBag) "
                f"with max_norm, which the forward renormalises in place, in the rows each "
                f"rank looked up: its ranks part by the layer's design (under torch's DDP "
                f"they part too, silently). Ranks grouped by value: {split}. Fix: "
                f"max_norm=None (renormalise every row after the optimizer step, on every "
                f"rank, if the norm bound matters), or check_replicas=0 to train with the "
                f"replicas apart.")
        hooked = [self.names[i] for i in differing
                  if getattr(self.tensors[i], "_post_accumulate_grad_hooks", None)
                  or hasattr(self.tensors[i], "_in_backward_optimizers")]
        if hooked:
            return (
                f"minddp (rank {self.rank}): replicas diverged at synced step #{step}: "
                f"parameter '{hooked[0]}' has a hook that runs on this rank's gradient, "
                f"before the ranks' average (register_post_accumulate_grad_hook, or "
                f"_apply_optimizer_in_backward called after the wrapper's first forward, "
                f"when it takes those optimizers over): an optimizer step or a weight change "
                f"there is the likely cause (under torch's DDP the ranks part too, silently). "
                f"Fix: step the optimizer after backward, or call "
                f"torch.distributed.optim._apply_optimizer_in_backward before the first "
                f"forward (the wrapper then steps those optimizers on the averaged gradient, "
                f"as torch's DDP does); check_replicas=0 trains with the replicas apart. "
                f"Ranks grouped by value: {split}. {len(differing)} of {len(self.names)} "
                f"parameters differ: {shown}{more}. {since}.")
        return (
            f"minddp (rank {self.rank}): replicas diverged at synced step #{step}: parameter "
            f"'{self.names[first]}' is not bit for bit equal on every rank. Ranks that agree "
            f"with rank {reference}: {_list(agree)}; ranks that differ from it: {_list(others)} "
            f"(ranks grouped by value: {split})"
            + (f"; ranks {_list(joined)} have joined (uneven inputs) and were not compared"
               if joined else "")
            + f". {len(differing)} of {len(self.names)} parameters differ: {shown}{more}. "
            f"{since}. Since then something changed the weights on some ranks only: an "
            f"optimizer step or in-place update run on some ranks but not others (code under "
            f"`if rank == 0`), a learning rate, optimizer state or random seed that differs "
            f"between ranks, a checkpoint loaded on some ranks after wrapping, an update that "
            f"uses something other than the averaged .grad, a comm hook that averages over "
            f"some ranks only (local SGD: torch's post_localSGD_hook turns this check off by "
            f"itself), a backward run inside the "
            f"wrapper's forward before anything armed its reducer (it stays local, as under "
            f"torch's DDP: call ddp.reducer.prepare_for_backward([]) first, as Lightning "
            f"does), ranks on different hardware or "
            f"library versions computing the update differently, or a hardware fault (a "
            f"flipped bit in memory). Fix: apply the same update on every rank (load "
            f"checkpoints before wrapping the model, or on every rank); restart from a "
            f"checkpoint if it was a hardware fault. This backward's gradients were written "
            f"(averaged as usual). check_replicas=N sets how many synced steps apart the "
            f"check runs "
            f"(0 turns it off).")


def renormalised_in_forward(module):
    """Names of the parameters `module`'s forward changes in place, differently on each
    rank: the weights of embeddings with max_norm (each rank renormalises the rows its
    batch looked up)."""
    return [f"{name}.weight" if name else "weight" for name, m in module.named_modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
            and m.max_norm is not None]


def _list(ranks):
    return "[" + ", ".join(map(str, ranks)) + "]" if ranks else "none"


def _ranks(ranks):
    return "{" + ", ".join(map(str, ranks)) + "}"
