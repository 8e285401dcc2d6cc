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
  (gloo's send/recv take CPU tensors only); NCCL groups use their own p2p;
- reused scratch buffers (no allocation per call for plain tensors);
- waits bounded by the process group's timeout, and errors that name the
  algorithm, this rank and the peer it was waiting for.

Ordering, not tags, keeps buckets apart: one thread per process group runs
the calls in the same order on every rank and messages between two ranks with
one tag arrive in order. Each phase has its own tag, so ranks that disagree
on what they are doing time out with an error instead of mixing data.

The codec protocol (compression): `encode(chunk) -> list[Tensor]` (the wire),
`decode_add_(dst, wire)` (dst += decoded) and `decode_(dst, wire)` (dst =
decoded). Receive buffers take the shapes and dtypes of the codec's own
encoding of a chunk of the same size (found once per size, then cached).
"""
import threading
import weakref

import torch
import torch.distributed as dist

# Segment size: big enough that the per-message cost is small, small enough
# that adding one segment overlaps receiving the next (gloo uses ~1 MiB).
SEGMENT_BYTES = 1 << 20

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


def run(algorithm, body, tensor, group, codec=None, segment_bytes=None):
    """Sum `tensor` in place over `group` with `body(link)`; return the tensor.

    Every rank of the group must call it with a tensor of the same shape and
    dtype. Non-contiguous tensors are reduced through a contiguous copy.
    `segment_bytes` defaults to SEGMENT_BYTES.
    """
    group = group if group is not None else dist.group.WORLD
    if tensor.layout != torch.strided:
        raise TypeError(f"minddp {algorithm} all-reduce (rank {group.rank()}): the tensor has "
                        f"layout {tensor.layout}; only dense tensors can be reduced, call "
                        f".to_dense() first.")
    rank, size, backend = _membership(group)
    if size == 1 or tensor.numel() == 0:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work if work.dim() == 1 else work.view(-1)
    staged = work.is_cuda and backend == "gloo"
    if staged:
        flat = _scratch(work.numel(), work.dtype, torch.device("cpu"), "stage", pinned=True)
        flat.copy_(work.view(-1))
    body(Link(algorithm, flat, group, codec, segment_bytes or SEGMENT_BYTES, rank, size))
    if staged:
        work.view(-1).copy_(flat)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


class Link:
    """One all-reduce call as seen by one rank: its flat tensor, peers and codec."""

    def __init__(self, algorithm, flat, group, codec, segment_bytes, rank, size):
        self.algorithm, self.flat, self.group, self.codec = algorithm, flat, group, codec
        self.rank, self.size = rank, size
        self.numel = flat.numel()
        self.segment = max(1, segment_bytes // flat.element_size())

    def segments(self, start, end):
        """Views of flat[start:end] cut into segments; an empty range gives no segment."""
        if start == 0 and end == self.numel <= self.segment:
            return [self.flat]  # the common small bucket: no slicing (each costs ~1 us)
        return [self.flat[s:min(s + self.segment, end)] for s in range(start, end, self.segment)]

    def wire(self, view, final=False, plain=False):
        """What goes on the wire for `view`: the view itself, or the codec's encoding.

        `final=True` marks a finished value leaving its owner: the owner also
        decodes its own encoding into `view`, so it ends with exactly the bits
        every receiver decodes.
        """
        if self.codec is None or plain:
            return [view]
        wire = self.codec.encode(view)
        if final:
            self.codec.decode_(view, wire)
        return wire

    def exchange(self, sends, recvs, mode, tag, plain=False, forward=None):
        """Post all receives, then all sends; combine each receive as it lands.

        sends: [(peer, wire)], wire from `self.wire` or from an earlier receive.
        recvs: [(peer, view)]; mode "add" sums what arrives into `view`, "set"
        overwrites `view` with it. `forward(i, wire)`, called once receive i is
        combined, may return more sends to post at once (a pipeline). Returns
        the received wires, in `recvs` order. Blocks until all are done.
        """
        if not sends and not recvs:
            return []
        codec = None if plain else self.codec
        buffers = self._receive_buffers(recvs, mode, codec)
        posted = [self._post("recv", peer, bufs, tag) for (peer, _), bufs in zip(recvs, buffers)]
        sent = [self._post("send", peer, wire, tag) for peer, wire in sends]
        for i, (peer, view) in enumerate(recvs):
            self._wait(posted[i])
            if codec is not None:
                (codec.decode_add_ if mode == "add" else codec.decode_)(view, buffers[i])
            elif mode == "add":
                view.add_(buffers[i][0])
            if forward is not None:
                sent += [self._post("send", to, wire, tag) for to, wire in forward(i, buffers[i])]
        for works in sent:
            self._wait(works)
        return buffers

    # -- internals --------------------------------------------------------------
    def _receive_buffers(self, recvs, mode, codec):
        if codec is not None:
            return [[torch.empty(shape, dtype=dtype, device=view.device)
                     for shape, dtype in self._wire_template(view)] for _, view in recvs]
        if mode == "set":
            return [[view] for _, view in recvs]  # received straight into place
        if len(recvs) == 1:
            return [[_scratch(recvs[0][1].numel(), self.flat.dtype, self.flat.device, "recv")]]
        scratch = _scratch(sum(v.numel() for _, v in recvs), self.flat.dtype, self.flat.device,
                           "recv")
        buffers, offset = [], 0
        for _, view in recvs:
            buffers.append([scratch[offset:offset + view.numel()]])
            offset += view.numel()
        return buffers

    def _wire_template(self, view):
        templates = _wire_templates.setdefault(self.codec, {})
        key = (view.numel(), view.dtype, view.device)
        if key not in templates:
            templates[key] = [(w.shape, w.dtype) for w in self.codec.encode(view)]
        return templates[key]

    def _post(self, op, peer, tensors, tag):
        """Start sending or receiving `tensors`; returns (what, peer, works) for _wait."""
        what = "send to" if op == "send" else "receive from"
        try:
            post = self.group.send if op == "send" else self.group.recv
            return what, peer, [post([t], peer, tag) for t in tensors]
        except Exception as e:
            raise self._error(what, peer, e) from e

    def _wait(self, posted):
        # Work.wait() with no argument is bounded by the process group's
        # timeout, so a dead or stuck peer raises instead of hanging.
        what, peer, works = posted
        try:
            for work in works:
                work.wait()
        except Exception as e:
            raise self._error(what, peer, e) from e

    def _error(self, what, peer, cause):
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
        return RuntimeError(
            f"minddp {self.algorithm} all-reduce (rank {self.rank} of {self.size}): failed to "
            f"{what} rank {peer}: {first_line}. The peer died, is stuck, or called a different "
            f"collective (every rank must reduce the same buckets in the same order); fix the "
            f"peer's failure first, or raise the process group's timeout if it is just slow.")


def _membership(group):
    """(rank, size, backend name) of this process in `group`, looked up once per group."""
    known = _cache("membership")
    if group not in known:
        known[group] = group.rank(), group.size(), dist.get_backend(group)
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
        return view  # the same size as last time: skip slicing (~1 us)
    if base is None or base.numel() < numel:
        pin = pinned and torch.cuda.is_available()
        base = torch.empty(max(numel, 1), dtype=dtype, device=device, pin_memory=pin)
    buffers[key] = base, base[:numel]
    return buffers[key][1]
