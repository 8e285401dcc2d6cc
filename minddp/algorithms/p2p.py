"""Point-to-point plumbing shared by every all-reduce written on send/recv.

An algorithm is a function `body(link)` that moves slices of one flat tensor
between ranks with `link.exchange(sends, recvs, mode)`; `run()` prepares that
flat tensor and the link. Everything the algorithms would otherwise repeat
lives here:
- chunking (`chunk_bounds`) and segmenting (`link.segments`): large chunks are
  cut into segments so the reduction of one overlaps the transfer of the next;
- the codec hook: every hop goes through `link.wire` / `exchange` (encode,
  decode_add_, decode_), or plain tensors when there is no codec;
- staging: CUDA tensors on a gloo group are reduced in a pinned CPU copy
  (gloo's send/recv take CPU tensors only);
- reused scratch buffers (no allocation per call for plain tensors), and a
  window of them for receives to add (WINDOW_BYTES per peer, cache-warm);
- waits bounded by the process group's timeout, and errors that name the
  algorithm, this rank and the peer it was waiting for;
- the backend's matching rules, below.

Two sets of rules, chosen by the group's backend:
- gloo matches a message to the first receive posted for its peer and tag,
  and a send or receive proceeds on its own. Messages go out one by one as
  soon as they are ready (a pipeline), on lanes (lanes.py): to a higher rank
  on the group, to a lower one on its reverse lane, so no connection carries
  data both ways.
- NCCL's rules (devices.DEVICE_BACKENDS): tensors on the group's device,
  matching by posting order per peer (tags ignored), and calls outside a group
  run one after another on one stream (those with one peer always; those with
  all peers when torch reuses the group's communicator, as it does for a
  group made with a device_id), so a rank that sends and receives at once must
  post both in one group (dist.batch_isend_irecv). An exchange then
  runs in rounds: each round is one group holding every message of that
  round, posted once the previous round has finished, and a message's send
  and its receive sit in the same round on both ranks (the algorithms label
  them: `send_round`, `recv_rounds`). A group then waits only on groups its
  peers post at the same point of their programs, never on one they post
  after a group of their own that waits on it. Chunks are not segmented
  there: a round moves whole chunks, and NCCL cuts them itself.
Other backends are refused (`runs_on`): their matching rules are not known here.

Ordering, not tags, keeps buckets apart: one thread per process group runs
the calls in the same order on every rank and messages between two ranks with
one tag arrive in order. Each phase has its own tag, so on gloo ranks that
disagree on what they are doing time out with an error instead of mixing data.

The codec protocol (compression): `encode(chunk) -> list[Tensor]` (the wire),
`decode_add_(dst, wire)` (dst += decoded), `decode_(dst, wire)` (dst =
decoded) and `wire_itemsize(dtype, device)` (bytes per element on the wire, maybe
fractional); registry.Codec implements it from two functions.
Receive buffers take the shapes and dtypes of the codec's own encoding of a
chunk of the same size (found once per size, then cached).
"""
import math
import threading
import weakref

import torch
import torch.distributed as dist

from minddp import devices, hops
from minddp.algorithms import lanes
from minddp.errors import first_line

# Segment size: big enough that the per-message cost is small, small enough
# that adding one segment overlaps receiving the next. Larger than gloo's own
# ring's 1 MiB because each of our messages also costs a c10d work object, a
# Python wake-up and gloo's ready notices.
SEGMENT_BYTES = 2 << 20
# Bytes of receives in flight per peer while adding: reused buffers, so they
# stay in cache, yet enough segments (4) that the link never waits for a
# receive to be posted (a thread's wake-up can take a fraction of a
# millisecond on a busy machine).
WINDOW_BYTES = 8 << 20

_local = threading.local()  # per thread: scratch buffers, group membership
_wire_templates = weakref.WeakKeyDictionary()  # codec -> {(numel, dtype, device): wire shapes}


def chunk_bounds(numel, parts):
    """Split range(numel) into `parts` contiguous (start, end) pairs, sizes differing by <= 1."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def runs_on(group):
    """Whether these algorithms can run on `group`'s backend: gloo, or one with NCCL's rules."""
    return devices.backend_of(group) == "gloo" or devices.is_device_backend(group)


def check_record(algorithm, rank, tensor, codec, error):
    """Raise unless `error` (error feedback's record, or None) fits `tensor` and `codec`:
    every per-hop algorithm's rule (run's `error`)."""
    if error is not None and (codec is None or error.numel() != tensor.numel()):
        raise ValueError(f"minddp {algorithm} all-reduce (rank {rank}): error feedback needs a "
                         f"codec and a record of {tensor.numel()} elements, got "
                         f"{error.numel()} with codec {codec!r}")


def run(algorithm, body, tensor, group, codec=None, segment_bytes=None, error=None):
    """Sum `tensor` in place over `group` with `body(link)`; return the tensor.

    Every rank of the group must call it with a tensor of the same shape and
    dtype; on a backend with NCCL's rules, on the group's device
    (devices.group_device). Non-contiguous tensors are reduced through a
    contiguous copy. `segment_bytes` defaults to SEGMENT_BYTES.

    `error` (with a codec: error feedback): float32, contiguous, as many
    elements as `tensor`, on its device. Every encoding on this rank's hops
    (Codec.encode_with_feedback) then encodes the values minus `error` at
    those elements and sets `error` there to what it changed (decoded minus
    encoded). The algorithm must encode each element exactly once on this
    rank (all of minddp's do); the sum checks that it did. The first call
    on a gloo group ends by opening the group's reverse lane (lanes.py), on
    every rank alike.
    """
    group = group if group is not None else dist.group.WORLD
    _check_dense(tensor, algorithm, group)
    rank, size, backend = _membership(group, algorithm)
    if size == 1 or tensor.numel() == 0:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    opened = lanes.is_open(group)
    check_record(algorithm, rank, tensor, codec, error)
    _reduce(algorithm, body, _flat(work), group, codec, segment_bytes, rank, size, backend,
            error)
    if work is not tensor:
        tensor.copy_(work)
    if not opened:
        lanes.open_lanes(group)
    return tensor


def _check_dense(tensor, algorithm, group):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"minddp {algorithm} all-reduce (rank {group.rank()}): got "
                        f"{type(tensor).__name__}; it reduces one tensor (torch.cat a list "
                        f"first).")
    if tensor.layout != torch.strided:
        raise TypeError(f"minddp {algorithm} all-reduce (rank {group.rank()}): the tensor has "
                        f"layout {tensor.layout}; only dense tensors can be reduced, call "
                        f".to_dense() first.")


def _flat(tensor):
    """A contiguous tensor as 1-D: itself if it already is (a view costs Python time)."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def _reduce(algorithm, body, flat, group, codec, segment_bytes, rank, size, backend, error):
    staged = flat if flat.is_cuda and backend == "gloo" else None
    owed = error
    if staged is not None:
        # gloo sends CPU tensors only: reduce a pinned CPU copy, then copy back.
        flat = _scratch(staged.numel(), staged.dtype, torch.device("cpu"), "stage", pinned=True)
        flat.copy_(staged)
        if error is not None:  # the encodings happen on the copy: so does their record
            owed = _scratch(error.numel(), error.dtype, flat.device, "stage-error", pinned=True)
            owed.copy_(error.view(-1))
    elif backend != "gloo" and flat.device != devices.group_device(group):
        raise ValueError(f"minddp {algorithm} all-reduce (rank {rank}): the tensor is on "
                         f"{flat.device}, but a {backend} group takes tensors on "
                         f"{devices.group_device(group)} only; move it there (or call "
                         f"torch.cuda.set_device for the device this rank drives).")
    link = Link(algorithm, flat, group, codec, segment_bytes or SEGMENT_BYTES, rank, size,
                backend, None if owed is None else owed.view(-1))
    body(link)
    if link.hops is not None:
        link.hops.flush()
    if owed is not None:
        _check_fed_back_once(link)
    if staged is not None:
        staged.copy_(flat)
        if error is not None:
            error.view(-1).copy_(owed)


def _check_fed_back_once(link):
    """Error feedback is exact only if this rank encoded every element once (run's error)."""
    covered = 0  # the stretches, in order, must tile [0, numel): no gap, no overlap
    for start, end in sorted(link.fed_back):
        covered = end if start == covered else -1
    if covered != link.numel:
        raise RuntimeError(
            f"minddp {link.algorithm} all-reduce (rank {link.rank}): error feedback needs each "
            f"element encoded exactly once by each rank, but this rank's encodings covered "
            f"{sorted(link.fed_back)[:8]} of {link.numel} elements; the algorithm must encode "
            f"every element it sends or finishes once per sum.")


class Link:
    """One all-reduce call as seen by one rank: its flat tensor, peers and codec."""

    def __init__(self, algorithm, flat, group, codec, segment_bytes, rank, size, backend,
                 error=None):
        self.algorithm, self.group, self.codec = algorithm, group, codec
        self.record = error  # flat's error feedback record (run's error)
        self.fed_back = []  # (start, end) of each stretch encoded with it
        self.reverse = lanes.reverse(group)  # carries messages to lower ranks
        # gloo's rules, or NCCL's (every other backend runs_on accepts).
        self.grouped = backend != "gloo"
        self.flat = flat  # 1-D, contiguous
        self.rank, self.size = rank, size
        self.numel, self.itemsize = flat.numel(), flat.element_size()
        # Segments are sized by what travels: compressed, twice the elements.
        wire_size = (codec.wire_itemsize(flat.dtype, flat.device) if codec is not None
                     else self.itemsize)
        self.segment = max(1, self.numel if self.grouped else int(segment_bytes // wire_size))
        # Each message's timing, while a timeline records (hops.py); gloo's only.
        self.hops = None if self.grouped else hops.start(group)

    def segments(self, start, end):
        """Views of the flat tensor's [start, end) cut into segments; an empty range
        gives no segment."""
        if start == 0 and end == self.numel <= self.segment:
            return [self.flat]  # the common small bucket: no slicing at all
        return [self.flat[s:min(s + self.segment, end)] for s in range(start, end, self.segment)]

    def wire(self, view, final=False, plain=False):
        """What goes on the wire for `view`: the view itself, or the codec's encoding.

        `final=True` marks a finished value leaving its owner: the owner also
        decodes its own encoding into `view`, so it ends with exactly the bits
        every receiver decodes.
        """
        if self.codec is None or plain:
            return [view]
        if self.record is not None and self.codec.compresses(view):
            start = view.storage_offset() - self.flat.storage_offset()
            end = start + view.numel()
            self.fed_back.append((start, end))
            return self.codec.encode_with_feedback(view, self.record[start:end], decode=final)
        wire = self.codec.encode(view)
        if final:
            self.codec.decode_(view, wire)
        return wire

    def exchange(self, sends, recvs, mode=None, tag=None, plain=False, forward=None,
                 send_round=0, recv_rounds=None):
        """Post the receives and the sends; combine each receive as it lands, in order.

        sends: [(peer, payload)] or [(peer, payload, tag)]. A payload is a view
        of the flat tensor, encoded just before its send is posted (the
        receives are up before any encoding starts), or a wire (a list, from
        `self.wire` or an earlier receive), sent as it is.
        recvs: [(peer, view)] or [(peer, view, mode, tag)]; mode "add" sums
        what arrives into `view`, "set" overwrites `view` with it. The call's
        `mode` and `tag` stand in for those not given.
        forward(i, wire), called once receive i is combined, may return more
        sends to post at once: a pipeline, in which a segment moves on as soon
        as it is ready instead of after the whole step.

        Under NCCL's rules the messages go in rounds (module docstring): the
        sends given here in round `send_round`, receive i in round
        `recv_rounds[i]` (default: all in round 0), and what forward returns
        for a receive in round k, in round k + 1. A receive's round must be
        the round in which its peer posts the matching send. gloo ignores
        the rounds.

        "set" receives go straight into place or, with a codec, into wires of
        their own; "add" receives land in reused buffers. Returns the
        received wires in `recvs` order (None for "add"), to forward. Blocks
        until all are done.
        """
        if not sends and not recvs:
            return []
        codec = None if plain else self.codec
        recvs = [item if len(item) == 4 else (*item, mode, tag) for item in recvs]
        if self.grouped:
            return self._exchange_in_rounds(sends, recvs, codec, tag, plain, forward,
                                            send_round, recv_rounds)
        return self._exchange_pipelined(sends, recvs, codec, tag, plain, forward)

    def _exchange_pipelined(self, sends, recvs, codec, tag, plain, forward):
        """gloo: each message on its own, as soon as it is ready.

        "add" receives land in reused buffers, WINDOW_BYTES per peer in flight:
        they stay in cache, where the kernel writes the data and the add reads
        it; a fresh buffer per segment would be cold for both.
        Receives are posted in list order (gloo matches a message to the
        first receive posted for its peer and tag), except that a "set" whose
        peer and tag no "add" shares goes up as soon as the window blocks,
        rather than behind it.
        """
        adders = {peer for peer, _, how, _ in recvs if how == "add"}
        per_peer = max(2, WINDOW_BYTES // (self.segment * self.itemsize))
        free = list(range(min(len(recvs), per_peer * len(adders))))  # window slots not in use
        wires, posted, slots = [None] * len(recvs), [None] * len(recvs), {}
        next_up = [0]  # receives before this index are posted

        def post(i):
            peer, view, how, its_tag = recvs[i]
            if how == "add":
                slots[i] = free.pop()
                bufs = self._slot_buffers(slots[i], view, codec)
            elif codec is None:
                bufs = [view]  # received straight into place
            else:
                bufs = [torch.empty(shape, dtype=dtype, device=view.device)
                        for shape, dtype in self._wire_template(view)]
            wires[i] = bufs
            posted[i] = self._post("recv", peer, bufs, its_tag)

        def post_in_order():
            while next_up[0] < len(recvs):
                i = next_up[0]
                if posted[i] is None:
                    if recvs[i][2] == "add" and not free:
                        return
                    post(i)
                next_up[0] += 1

        post_in_order()
        # A "set" whose peer and tag no "add" shares cannot take an add's
        # message, so it need not wait behind the window (under NCCL's rules,
        # which ignore tags, it could). gloo writes a message only once its
        # receive is posted, so held back, the ring's all-gather would wait
        # for the reduce-scatter's last adds.
        if next_up[0] < len(recvs):
            adders_tags = {(peer, its_tag) for peer, _, how, its_tag in recvs if how == "add"}
            for i in range(next_up[0], len(recvs)):
                peer, _, how, its_tag = recvs[i]
                if how == "set" and (peer, its_tag) not in adders_tags:
                    post(i)
        sent = [self._send(item, tag, plain) for item in sends]
        for i, (_, view, how, _) in enumerate(recvs):
            self._wait(posted[i])
            wire = wires[i]
            _combine(view, wire, how, codec)
            if how == "add":
                free.append(slots.pop(i))
                wires[i] = None
                post_in_order()
            if forward is not None:
                sent += [self._send(item, tag, plain) for item in forward(i, wire)]
        for works in sent:
            self._wait(works)
        return wires

    def _exchange_in_rounds(self, sends, recvs, codec, tag, plain, forward, send_round,
                            recv_rounds):
        """NCCL's rules: one group of messages per round, each finished before the next."""
        rounds = recv_rounds if recv_rounds is not None else [0] * len(recvs)
        due = {send_round: list(sends)} if sends else {}  # round -> sends to post in it
        wires, posted, slots, free = [None] * len(recvs), [False] * len(recvs), {}, []
        combined, last = 0, None  # receives before `combined` are combined
        while due or not all(posted):
            now = min([*due, *(k for k, up in zip(rounds, posted) if not up)])
            assert last is None or now > last, f"{self.algorithm}: round {now} after {last}"
            messages = []
            for item in due.pop(now, []):
                peer, payload = item[0], item[1]
                wire = payload if isinstance(payload, list) else self.wire(payload, plain=plain)
                messages.append(("send", peer, wire, item[2] if len(item) == 3 else tag))
            for i, (peer, view, how, its_tag) in enumerate(recvs):
                if posted[i] or rounds[i] != now:
                    continue
                if how == "add":
                    slots[i] = free.pop() if free else len(slots)  # all in use
                    wires[i] = self._slot_buffers(slots[i], view, codec)
                elif codec is None:
                    wires[i] = [view]  # received straight into place
                else:
                    wires[i] = [torch.empty(shape, dtype=dtype, device=view.device)
                                for shape, dtype in self._wire_template(view)]
                posted[i] = True
                messages.append(("recv", peer, wires[i], its_tag))
            self._post_group(messages)
            while combined < len(recvs) and posted[combined]:
                i, (_, view, how, _) = combined, recvs[combined]
                wire = wires[i]
                _combine(view, wire, how, codec)
                if how == "add":
                    free.append(slots.pop(i))
                    wires[i] = None
                if forward is not None:
                    more = forward(i, wire)
                    if more:
                        due.setdefault(now + 1, []).extend(more)
                combined += 1
            last = now
        return wires

    def _post_group(self, messages):
        """Post [(op, peer, tensors, tag)] as one group (dist.batch_isend_irecv); wait."""
        ops = [dist.P2POp(dist.isend if op == "send" else dist.irecv, t, group=self.group,
                          group_peer=peer, tag=tag)
               for op, peer, tensors, tag in messages for t in tensors]
        if not ops:
            return
        peers = sorted({peer for _, peer, _, _ in messages})
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait()  # bounded by the group's timeout, as in _wait
        except Exception as e:
            raise self.error("exchange with", peers, e) from e

    def _send(self, item, tag, plain):
        peer, payload = item[0], item[1]
        tag = item[2] if len(item) == 3 else tag
        wire = payload if isinstance(payload, list) else self.wire(payload, plain=plain)
        return self._post("send", peer, wire, tag)

    def lane(self, op, peer):
        """The process group for a message to ("send") or from ("recv") `peer`:
        the group toward higher ranks, its reverse lane toward lower ones."""
        return self.group if (self.rank < peer) == (op == "send") else self.reverse

    def scratch(self, view, slot):
        """The reused receive buffer of window slot `slot`, as many elements as `view`."""
        return _scratch(view.numel(), view.dtype, view.device, ("window", slot, 0))

    # -- internals --------------------------------------------------------------
    def _slot_buffers(self, slot, view, codec):
        """Receive buffers for `view` in reused slot `slot` of the add window."""
        if codec is None:  # the common case, kept cheap: a 1-D view needs no reshaping
            return [self.scratch(view, slot)]
        shapes = self._wire_template(view)
        return [_scratch(math.prod(shape), dtype, view.device, ("window", slot, k)).view(shape)
                for k, (shape, dtype) in enumerate(shapes)]

    def _wire_template(self, view):
        templates = _wire_templates.setdefault(self.codec, {})
        key = (view.numel(), view.dtype, view.device)
        if key not in templates:
            templates[key] = [(w.shape, w.dtype) for w in self.codec.encode(view)]
        return templates[key]

    def _post(self, op, peer, tensors, tag):
        """Start sending or receiving `tensors`; returns (what, peer, works, record) for
        _wait (record: the hop's index in self.hops, or None)."""
        what = "send to" if op == "send" else "receive from"
        record = None if self.hops is None else self.hops.posted(op, peer, tensors, tag)
        try:
            lane = self.lane(op, peer)
            post = lane.send if op == "send" else lane.recv
            return what, peer, [post([t], peer, tag) for t in tensors], record
        except Exception as e:
            raise self.error(what, peer, e) from e

    def _wait(self, posted):
        # Work.wait() with no argument is bounded by the process group's
        # timeout, so a dead or stuck peer raises instead of hanging.
        what, peer, works, record = posted
        try:
            for work in works:
                work.wait()
        except Exception as e:
            raise self.error(what, peer, e) from e
        if record is not None:
            self.hops.done(record)

    def error(self, what, peer, cause):
        """The error for a failed message to or from `peer` (a rank, or a list of them)."""
        who = f"rank {peer}" if isinstance(peer, int) else "ranks " + ", ".join(map(str, peer))
        return RuntimeError(
            f"minddp {self.algorithm} all-reduce (rank {self.rank} of {self.size}): failed to "
            f"{what} {who}: {first_line(cause)}. The peer died, is stuck, or called a different "
            f"collective (every rank must reduce the same buckets in the same order); fix the "
            f"peer's failure first, or raise the process group's timeout if it is just slow.")


def _combine(view, wire, how, codec):
    """Fold a received wire into `view`: add it ("add") or take it ("set")."""
    if codec is not None:
        (codec.decode_add_ if how == "add" else codec.decode_)(view, wire)
    elif how == "add":
        view.add_(wire[0])


def _membership(group, algorithm):
    """(rank, size, backend name) of this process in `group`, looked up once per group."""
    known = _cache("membership")
    if group not in known:
        if not runs_on(group):
            raise ValueError(
                f"minddp {algorithm} all-reduce (rank {group.rank()}): the "
                f"{devices.backend_of(group)!r} backend's point-to-point rules are not known "
                f"here (gloo's, or NCCL's for the backends in minddp.devices.DEVICE_BACKENDS); "
                f"use algorithm='native', or add the backend to DEVICE_BACKENDS if it follows "
                f"NCCL's.")
        known[group] = group.rank(), group.size(), devices.backend_of(group)
    return known[group]


def _cache(name):
    if not hasattr(_local, name):
        setattr(_local, name, {})
    return getattr(_local, name)


def _scratch(numel, dtype, device, purpose, pinned=False):
    """A reusable buffer of `numel` elements (a view of one grown as needed), per thread."""
    buffers = _cache("scratch")
    key = (purpose, dtype, device)
    base, view = buffers.get(key, (None, None))
    if view is not None and view.numel() == numel:
        return view  # the same size as last time: skip slicing again
    if base is None or base.numel() < numel:
        pin = pinned and torch.cuda.is_available()
        base = torch.empty(max(numel, 1), dtype=dtype, device=device, pin_memory=pin)
    buffers[key] = base, base[:numel]
    return buffers[key][1]
