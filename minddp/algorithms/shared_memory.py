"""Shared-memory all-reduce, for ranks on one host: sum through memory every rank maps.

gloo on one machine sends over loopback TCP: every byte of every hop is copied
into the kernel and out again, and the copies take the CPU the backward needs.
Ranks on one host can read one another's memory instead. Each rank's tensor
sits in a file under /dev/shm that every rank has mapped; rank r sums slice r
of all the ranks' copies into its own (reduce-scatter) and then copies every
other slice from its owner (all-gather). Phases order the steps, each one
every rank's arrival at it; a dead or stuck peer gets the group's timeout (an
error, never a hang):

    agree    every rank passes the same buffer, offset and size (which mode);
             every rank is done reading the scratch files of the last call
    written  (only when copied in or encoded) every rank's data is in its file
    summed   every slice's owner has added the others' copies into its own
    read     (buckets only) every rank has copied what it needs: the bucket
             may change again (a scratch file is written only after the next
             call's agree, so it needs none)

A phase is a flag in shared memory where the extension has them (csrc/
shm_flags.cpp: each rank bumps its own word, and waits in the kernel for its
peers'; within microseconds where a gloo all-reduce of one value took 0.2-0.9
ms on 2 CPU ranks), else a small gloo all-reduce.

Where the tensor is a bucket the reducer allocated through `allocate` (the
reduction offers it; reducer.py and buckets.py call it), the bucket already is
the shared file and nothing is copied in: `setup` maps every peer's copy of
each bucket once (the wrapper calls it on every rank with the buckets). Any
other tensor is copied into a scratch file per group first.

With a codec (compression) the slices travel encoded, through the scratch
files, as on a per-hop algorithm's hops (p2p.py): rank r writes the wire of
every slice j != r, slice j's owner decodes and adds them into its fp32 copy
and writes the sum's wire, which every rank decodes, the owner too. Each rank
encodes each element once, so error feedback holds (p2p.run's `error`).

Cost for n bytes on p ranks, a bucket: 3 phases, then the sum of one slice
from p copies ((p-1)/p n bytes added) and the copy of the others ((p-1)/p n).
Not bandwidth-bound on a network but on memory, so it wins where the copies
through the kernel cost more than a pass over memory: large buckets; the
phases make it lose on small ones.
Every rank ends bitwise identical: each slice is summed by its owner only
(with a codec, every rank decodes the owner's one wire of it).
"""
import logging
import os
import uuid
import weakref

import torch
import torch.distributed as dist

from minddp import devices, errors, registry
from minddp.algorithms import lanes, native, p2p, ring  # native, ring: where /dev/shm has no room

try:  # the phases' flags (csrc/shm_flags.cpp); without them, a gloo all-reduce per phase
    from minddp._C import flag_arrive, flag_wait
except ImportError:
    flag_arrive = flag_wait = None
# False: phases through gloo even where the flags are built (tests run both). The sizes and
# the cost below follow the build only, so that auto's candidates are alike on every rank.
USE_FLAGS = flag_wait is not None and os.environ.get("MINDDP_SHM_FLAGS") != "0"

log = logging.getLogger("minddp.algorithms")

DIRECTORY = "/dev/shm"
# Below this a bucket stays ordinary memory and auto does not time the algorithm: each
# phase's latency costs more than the copies saved. Phases through gloo (0.2-0.9 ms each):
# on 2 CPU ranks it lost up to 4 MiB copied in, won from 32 MiB. Through the flags (tens of
# microseconds) it was as fast as gloo's all-reduce at 64 KiB copied in, 2x at 256 KiB and
# 5x at 1 MiB (docs/performance.md).
MIN_BYTES = 1 << 16 if flag_wait is not None else 1 << 20
FLAG_PHASE_S = 30e-6  # a phase through the flags, where nobody is late (cost)
HEADROOM, HEADROOM_BYTES = 0.25, 256 << 20  # of /dev/shm left free (_room_for)
_groups = weakref.WeakKeyDictionary()  # group -> _Group
_pending = {}  # storage address -> (path, nbytes): allocated, not yet mapped by the peers
_layouts = weakref.WeakKeyDictionary()  # codec -> {(numel, dtype, p): _layout's}


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_namespace():
    try:
        ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return ns.st_dev, ns.st_ino


def _room_for(nbytes):
    """Whether DIRECTORY keeps HEADROOM of its size (at least HEADROOM_BYTES) free after
    `nbytes` more: DataLoader workers and torch.multiprocessing share tensors there too,
    and a small /dev/shm (Docker's 64 MiB) is left to them."""
    try:
        fs = os.statvfs(DIRECTORY)
    except OSError:
        return False
    free, size = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    return free - nbytes >= max(HEADROOM * size, HEADROOM_BYTES)


def _owner_tag():
    """'<pid namespace>-<pid>': who made a file, in its name (_sweep_dead reads it)."""
    namespace = _pid_namespace()
    return f"{namespace[1] if namespace else 'x'}-{os.getpid()}"


def _sweep_dead():
    """Remove the files that processes of this pid namespace made and left behind when
    they died (a SIGKILL while the wrapper was set up, before the peers had mapped
    them and they were unlinked): each held a whole bucket of /dev/shm. A file whose
    maker may live (this namespace cannot see it) stays."""
    namespace = _pid_namespace()
    if namespace is None:
        return
    prefix = f"minddp-{namespace[1]}-"
    try:
        names = [n for n in os.listdir(DIRECTORY) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(DIRECTORY, name))
        except OSError:  # gone already, or another user's
            pass


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


_swept = False


def _create(nbytes):
    """A new file of `nbytes` under DIRECTORY mapped here, as (path, uint8 tensor); None
    where it cannot be made (no /dev/shm, or too little space left in it: the space
    is reserved now, so a full /dev/shm fails here and not with a SIGBUS later)."""
    global _swept
    if not _swept:  # once a process: what dead ones left goes before the room is judged
        _swept = True
        _sweep_dead()
    if nbytes > 64 and not _room_for(nbytes):
        return None
    path = os.path.join(DIRECTORY, f"minddp-{_owner_tag()}-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path, _map(path, max(nbytes, 1))


def _map(path, nbytes):
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8, device="cpu")


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Group:
    """What one group shares: whether its ranks can map one another's files, the
    buckets mapped (this rank's storage address -> the ranks' copies, by rank), a
    scratch file per rank for other tensors."""

    def __init__(self, group):
        # Weakly: _groups forgets a group once it is destroyed.
        self._group, self.rank, self.size = weakref.ref(group), dist.get_rank(group), group.size()
        self.device = devices.group_device(group)  # the small all-reduces' tensors
        # _agree's through gloo: what each rank passes, gathered (gloo's all-reduce of 3 or
        # more values took ~1.3 ms on 2 CPU ranks, its all-gather of them ~0.3 ms)
        self.passed = torch.zeros(4, dtype=torch.int64, device=self.device)
        self.gathered = [torch.zeros_like(self.passed) for _ in range(self.size)]
        self.linked, self.next_key = {}, 0
        self.scratch = None  # a file per rank, mapped here, for tensors that are not buckets
        self.no_room = float("inf")  # the smallest scratch size a rank had no room for
        probes = self._map_everyone(64) if self.size > 1 else None
        self.shared = probes is not None
        self.words = self._flags(probes) if self.shared else None
        self.generation = 0  # of the phases passed, counted alike on every rank
        self.calls = 0  # all-reduces begun, alike on every rank (agree checks it)
        self.broken = None  # why an all-reduce failed midway: the files' state is unknown

    @property
    def group(self):
        return self._group()

    def _map_everyone(self, nbytes):
        """Every rank makes a file of `nbytes` and maps every rank's (a collective): the
        mappings by rank, or None on every rank where some rank could not (another host:
        another boot id; another /dev/shm; no room). The files are unlinked after, also
        where a peer died meanwhile: nothing is left under /dev/shm."""
        made = _create(nbytes)
        try:
            peers = self._exchange((_boot_id(), made[0] if made is not None else None))
            try:
                copies = ([_map(path, nbytes) for _, path in peers]
                          if all(b is not None and b == peers[0][0] and path is not None
                                 for b, path in peers) else None)
            except (OSError, RuntimeError):
                copies = None
            return copies if self._all([copies is not None])[0] else None
        finally:
            if made is not None:
                _unlink(made[0])

    def _exchange(self, obj):
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _all(self, oks):
        """For each of `oks`: True on every rank when it is true on every rank."""
        flags = torch.tensor([0 if ok else 1 for ok in oks], dtype=torch.int64,
                             device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [flag == 0 for flag in flags.tolist()]

    def _flags(self, probes):
        """Each rank's flag word, the first of its probe file that every rank mapped,
        and the ranks' process ids, to tell a dead peer from a slow one; None (gloo
        orders the phases) where some rank has no flags or sees other process ids
        (another pid namespace over a shared /dev/shm)."""
        seen = self._exchange((os.getpid(), _pid_namespace(), USE_FLAGS))
        if not all(has and ns is not None and ns == seen[0][1] for _, ns, has in seen):
            return None
        self.timeout = lanes.timeout_of(self.group).total_seconds()
        self.peers = [k for k in range(self.size) if k != self.rank]  # whom barrier waits for
        self.peer_pids = [seen[k][0] for k in self.peers]
        # After the word, the values each rank posts for the others (gather): every
        # mapping of one file, so a post is seen by every rank.
        self.posts = [probe[8:40].view(torch.int64) for probe in probes]
        words = [probe.data_ptr() for probe in probes]
        self.peer_words = [words[k] for k in self.peers]
        return words

    def gather(self, values):
        """Every rank's four `values` (ints), by rank (a collective). Through the
        flags where there are some: posted, then a barrier; a rank posts again only
        after a later barrier, which every peer passes after reading this one."""
        if self.words is None:
            self.passed.copy_(torch.tensor(values, device="cpu"))
            dist.all_gather(self.gathered, self.passed, group=self.group)
            return [t.tolist() for t in self.gathered]
        self.posts[self.rank].copy_(torch.tensor(values, device="cpu"))
        self.barrier()
        return [post.tolist() for post in self.posts]

    def barrier(self):
        """Every rank has come this far, and what it wrote before is visible (orders
        the phases of a sum); an error, naming the peer, where one died or did not
        come within the group's timeout."""
        if self.words is None:
            self._all([True])
            return
        self.generation = (self.generation + 1) % (1 << 32)
        flag_arrive(self.words[self.rank], self.generation)
        status, i = flag_wait(self.peer_words, self.generation, self.peer_pids, self.timeout)
        if status == 1:
            raise RuntimeError(f"minddp shared_memory (rank {self.rank}): rank "
                               f"{self.peers[i]}'s process exited while this rank waited "
                               f"for it in an all-reduce")
        if status == 2:
            raise RuntimeError(f"minddp shared_memory (rank {self.rank}): rank {self.peers[i]} did "
                               f"not reach the next phase of an all-reduce within the group's "
                               f"timeout ({self.timeout:.0f} s); it is stuck or far behind")

    def link(self, buffers):
        """Map every rank's copy of those of `buffers` allocated by `allocate` on every
        rank (a collective: every rank, the same buffers in the same order)."""
        mine = []
        for buffer in buffers:
            storage = buffer.untyped_storage()
            entry = _pending.get(storage.data_ptr())
            mine.append(None if entry is None else (entry[0], storage.nbytes()))
        everyone = self._exchange(mine)
        maps = []
        for i, _ in enumerate(buffers):
            files = [theirs[i] for theirs in everyone]
            try:
                maps.append(None if any(f is None or f[1] != files[0][1] for f in files) else
                            [_map(path, nbytes) for path, nbytes in files])
            except (OSError, RuntimeError):
                maps.append(None)
        everywhere = self._all([m is not None for m in maps])  # mapped on every rank
        for buffer, copies, ok in zip(buffers, maps, everywhere):
            storage = buffer.untyped_storage()
            if ok and storage.data_ptr() not in self.linked:
                copies[self.rank] = None  # our own: the buffer itself
                self.linked[storage.data_ptr()] = (self.next_key, copies)
                weakref.finalize(storage, self.linked.pop, storage.data_ptr(), None)
                self.next_key += 1

    def grow_scratch(self, nbytes):
        """Scratch files of at least `nbytes` on every rank (a collective): True where
        they are (on every rank), False where a rank had no room for them."""
        if self.scratch is not None and self.scratch[0].numel() >= nbytes:
            return True
        if nbytes >= self.no_room:  # the same answer as last time, on every rank
            return False
        copies = self._map_everyone(nbytes)
        if copies is None:
            self.no_room = nbytes
            log.warning("minddp shared_memory (rank %d): no room for %d more bytes under %s "
                        "on some rank (%.0f%% of it is kept free); tensors that are not "
                        "shared buckets go over gloo instead (give /dev/shm more room: "
                        "docker --shm-size)", self.rank, nbytes, DIRECTORY, HEADROOM * 100)
            return False
        self.scratch = copies
        return True


def _state(group):
    state = _groups.get(group)
    if state is None:
        state = _groups[group] = _Group(group)
    return state


def runs_on(group):
    """Whether the ranks of `group` (gloo) can map one another's memory: on one host
    with one /dev/shm. A collective the first time for each group (every rank)."""
    if devices.backend_of(group) != "gloo":
        return False
    return _state(group).shared


def allocate(numel, dtype, device, group):
    """Zeros of `numel` x `dtype` in a shared file, for a bucket this algorithm will sum
    in place; None where that cannot help (not the CPU, one rank, under MIN_BYTES) or be
    done. Local:
    `setup` later maps the peers' copies."""
    nbytes = numel * torch.empty((), dtype=dtype, device="cpu").element_size()
    if torch.device(device).type != "cpu" or group.size() == 1 or nbytes < MIN_BYTES:
        return None
    made = _create(nbytes)
    if made is None:
        return None
    path, mapped = made
    tensor = mapped[:nbytes].view(dtype)
    storage = tensor.untyped_storage()
    _pending[storage.data_ptr()] = (path, storage.nbytes())
    # Never mapped by the peers (the wrapper gone before setup): the file goes with it.
    weakref.finalize(storage, _forget, storage.data_ptr(), path)
    return tensor


def _forget(address, path):
    if _pending.get(address, (None,))[0] == path:  # not a later buffer at a reused address
        del _pending[address]
    _unlink(path)


def setup(buffers, group):
    """Map the peers' copies of the `buffers` made by `allocate` (every rank, the same
    buffers: the wrapper's setup of its buckets). Then their files are unlinked: the
    mappings stay, nothing is left under /dev/shm."""
    cpu = [b for b in buffers if b.device.type == "cpu"]
    if devices.backend_of(group) == "gloo" and group.size() > 1 and _state(group).shared:
        _state(group).link(cpu)
    for buffer in cpu:
        entry = _pending.pop(buffer.untyped_storage().data_ptr(), None)
        if entry is not None:
            _unlink(entry[0])


def all_reduce(tensor, group=None, codec=None, error=None):
    """In-place sum of `tensor` over `group` (every rank calls it); returns the tensor.

    With `codec`, every slice travels encoded and `error` (float32, as many elements,
    contiguous, on the tensor's device) is its error feedback record, as on p2p.py's
    algorithms (p2p.run)."""
    group = group if group is not None else dist.group.WORLD
    p2p.check_record("shared_memory", group.rank(), tensor, codec, error)
    if group.size() == 1 or tensor.numel() == 0:
        return tensor
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        work = tensor.detach().to("cpu", copy=True).contiguous()
        owed = None if error is None else error.detach().to("cpu", copy=True)
        tensor.copy_(all_reduce(work, group, codec, owed))
        if error is not None:  # the encodings happened on the copy: so did their record
            error.copy_(owed)
        return tensor
    state = _state(group)
    if not state.shared:
        raise RuntimeError(
            f"minddp shared_memory (rank {state.rank}): the ranks of this group cannot map "
            f"one another's memory (not all on one host, or {DIRECTORY} not shared); "
            f"choose another algorithm (auto leaves this one out there).")
    if state.broken is not None:
        raise RuntimeError(
            f"minddp shared_memory (rank {state.rank}): an earlier all-reduce on this group "
            f"failed midway ({state.broken}), so what its files hold is unknown; sum on a new "
            f"process group.")
    try:
        return _sum(state, tensor, group, codec, error)
    except BaseException as e:  # KeyboardInterrupt too: the phases stopped midway
        state.broken = errors.first_line(e)
        raise


def _sum(state, tensor, group, codec, error):
    flat = tensor.view(-1)
    nbytes = flat.numel() * flat.element_size()
    if codec is not None:
        _agree(state, -1, 0, nbytes)
        _sum_encoded(state, flat, codec, None if error is None else error.view(-1))
        return tensor
    storage = flat.untyped_storage()
    key, copies = state.linked.get(storage.data_ptr(), (-1, None))
    offset = flat.data_ptr() - storage.data_ptr()
    if copies is None:
        offset = 0
    agreed = _agree(state, key, offset, nbytes)
    if agreed is None or agreed < 0:
        if not state.grow_scratch(nbytes):
            return native.all_reduce(tensor, group)
        copies = [c[:nbytes].view(flat.dtype) for c in state.scratch]
        _copy_in(state, flat, copies)
        state.barrier()  # written
        _sum_and_gather(state, flat, copies)
        return tensor
    copies = [None if c is None else c[offset:offset + nbytes].view(flat.dtype)
              for c in copies]
    _sum_and_gather(state, flat, copies)
    state.barrier()  # read: every rank may write its bucket again
    return tensor


def _agree(state, key, offset, nbytes):
    """The buffer key every rank passes (-1: none is shared); None where they differ
    in key or offset (then each copies in); raises where they differ in size, or are
    not at the same call (a rank that went on after an error)."""
    state.calls += 1
    passed = state.gather([key, offset, nbytes, state.calls])
    if any(p[3] != state.calls for p in passed):
        raise RuntimeError(
            f"minddp shared_memory (rank {state.rank}): the ranks are at different "
            f"all-reduces (this rank's {state.calls}th, others' "
            f"{sorted({p[3] for p in passed})}); every rank must make the same calls.")
    sizes = [size for _, _, size, _ in passed]
    if min(sizes) != max(sizes):
        raise RuntimeError(
            f"minddp shared_memory (rank {state.rank}): the ranks passed tensors of "
            f"different sizes ({min(sizes)} to {max(sizes)} bytes; this rank {nbytes}); "
            f"every rank must all-reduce a tensor of the same shape and dtype.")
    return key if all(p[:2] == [key, offset] for p in passed) else None


def _bounds(numel, p):
    return [(i * numel // p, (i + 1) * numel // p) for i in range(p)]


def _copy_in(state, flat, copies):
    """Our tensor into our scratch copy: the slices the other ranks sum (ours is
    summed from the tensor itself)."""
    for j, (lo, hi) in enumerate(_bounds(flat.numel(), state.size)):
        if j != state.rank:
            copies[state.rank][lo:hi].copy_(flat[lo:hi])


def _sum_and_gather(state, flat, copies):
    bounds = _bounds(flat.numel(), state.size)
    lo, hi = bounds[state.rank]
    own = flat[lo:hi]
    for j in range(state.size):  # only the owner sums a slice: every rank gets its bits
        if j != state.rank:
            own.add_(copies[j][lo:hi])
    if copies[state.rank] is not None:  # a scratch copy: the others read the sum there
        copies[state.rank][lo:hi].copy_(own)
    state.barrier()  # summed
    for j, (a, b) in enumerate(bounds):
        if j != state.rank:
            flat[a:b].copy_(copies[j][a:b])


def _layout(codec, numel, dtype, p):
    """Where slice j's wire lies in every rank's scratch file: per slice, (offset, bytes,
    shape, dtype) of each wire tensor, and the bytes of them all. Wire sizes depend only
    on the slice's size and dtype (registry.Codec), so every rank finds the same layout by
    encoding zeros, once. Offsets are multiples of 16: a uint8 view at any of them can
    be viewed as any dtype."""
    known = _layouts.setdefault(codec, {})
    if (numel, dtype, p) not in known:
        layout, end = [], 0
        for lo, hi in _bounds(numel, p):
            wire = codec.encode(torch.zeros(hi - lo, dtype=dtype, device="cpu")) if hi > lo else []
            layout.append([])
            for w in wire:
                layout[-1].append((end, w.nbytes, w.shape, w.dtype))
                end += -(-w.nbytes // 16) * 16
        known[numel, dtype, p] = layout, end
    return known[numel, dtype, p]


def _encode(codec, view, error, slots, final=False):
    """`view`'s wire into `slots`, with its error feedback where there is a record
    (p2p.Link.wire); `final`: `view` becomes what its wire decodes to, as on every
    other rank."""
    if error is not None and codec.compresses(view):
        for slot, w in zip(slots, codec.encode_with_feedback(view, error, decode=final)):
            slot.copy_(w)
        return
    codec.encode_into(view, slots)
    if final:
        codec.decode_(view, slots)


def _sum_encoded(state, flat, codec, error):
    """The sum with every slice encoded where it leaves a rank: rank r writes the wire of
    each slice j != r into its scratch file; owner r decodes the peers' into its own in
    rank order and writes the sum's wire, which every rank decodes, r included. Each rank
    encodes every element once (error feedback's condition: p2p.run)."""
    layout, nbytes = _layout(codec, flat.numel(), flat.dtype, state.size)
    if not state.grow_scratch(max(nbytes, 1)):
        ring.all_reduce(flat, state.group, codec, error)
        return
    r, files = state.rank, state.scratch
    bounds = _bounds(flat.numel(), state.size)
    others = [(j, lo, hi) for j, (lo, hi) in enumerate(bounds) if j != r and hi > lo]

    def wire(k, j):  # slice j's wire in rank k's file
        return [files[k][o:o + n].view(dtype).view(shape) for o, n, shape, dtype in layout[j]]

    def owed(lo, hi):
        return None if error is None else error[lo:hi]

    for j, lo, hi in others:
        _encode(codec, flat[lo:hi], owed(lo, hi), wire(r, j))
    state.barrier()  # written
    lo, hi = bounds[r]
    if hi > lo:
        own = flat[lo:hi]
        for k in range(state.size):
            if k != r:
                codec.decode_add_(own, wire(k, r))
        _encode(codec, own, owed(lo, hi), wire(r, r), final=True)
    state.barrier()  # summed
    for j, lo, hi in others:
        codec.decode_(flat[lo:hi], wire(j, j))


def cost(nbytes, p, c):
    """Predicted seconds for a bucket: three phases (flags, or small all-reduces at the
    backend's latency), the owner's sum and the others' copy (each about one add's time
    per byte); never chosen under MIN_BYTES."""
    if nbytes < MIN_BYTES:
        return float("inf")
    phase = FLAG_PHASE_S if flag_wait is not None else c.native_alpha
    return 3 * phase + 2 * (p - 1) / p * nbytes * c.gamma


registry.register_algorithm("shared_memory", all_reduce, cost=cost, per_hop=True,
                            runs_on=runs_on, setup=setup, allocate=allocate)
