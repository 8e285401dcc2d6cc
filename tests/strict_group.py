"""A process group that refuses what NCCL refuses, on CPU: NCCL's rules testable without a GPU.

    group = strict_group.new_group()          # on every rank, like dist.new_group
    with strict_group.default_device_refused():
        minddp.all_reduce(tensor, "ring", group=group)

It moves data over a gloo group of its own, and refuses, with an error that
names the rule:
- a tensor not on its declared device (cpu; devices.group_device gives it) or
  not contiguous, in any call. Inside `default_device_refused()` a tensor made
  without an explicit device lands on "meta" and is refused: on a GPU it would
  have landed on the CPU, which NCCL refuses;
- a receive matched with a send of another size, dtype or tag. Like NCCL it
  matches point-to-point by posting order per peer and ignores tags: the k-th
  send to a peer meets the peer's k-th receive from us. NCCL would truncate,
  hang or silently deliver another phase's data; this group says which
  message met which receive;
- a send to and a receive from one peer both outstanding (posted, not yet
  waited) outside a group: NCCL runs them one after the other and two ranks
  doing that deadlock. Calls inside one `dist.batch_isend_irecv` form a group
  (torch posts a Python group's batch one op at a time; the double finds the
  batch_isend_irecv call on the stack and runs its ops as one group).

Like one NCCL stream, it runs this rank's calls strictly in posting order, one
at a time, each group's messages together (a thread of its own does it): an
order that would deadlock on NCCL deadlocks here too, and ends in the gloo
timeout's error. That is NCCL when torch runs every point-to-point call of a
group on its communicator (a group made with a device_id); with one
communicator per pair of ranks (torch's default otherwise) NCCL serialises
only the calls with one peer, so this double is the stricter of the two. A
failed call fails every later one, as an aborted NCCL communicator does.
"""
import contextlib
import queue
import sys
import threading

import torch
import torch.distributed as dist

from minddp import devices
from minddp.algorithms import lanes

BACKEND = "strict"
DEVICE = torch.device("cpu")
# The data types a header can name (matched sends and receives must agree).
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
_BATCH_CODE = dist.batch_isend_irecv.__code__


class StrictRuleError(RuntimeError):
    """A call NCCL would refuse, hang on, or get wrong."""


def new_group(ranks=None, timeout=None):
    """A StrictGroup over `ranks` (default: all); every rank calls it, as dist.new_group.

    `timeout` defaults to the default group's, so a deadlock fails as fast there.
    """
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, StrictGroup, devices=[DEVICE.type])
    devices.DEVICE_BACKENDS.add(BACKEND)
    timeout = timeout or lanes.timeout_of(dist.group.WORLD)
    return dist.new_group(ranks, timeout=timeout, backend=BACKEND)


@contextlib.contextmanager
def default_device_refused():
    """Inside, tensors made without an explicit device land on meta, which no group takes."""
    with torch.device("meta"):
        yield


class StrictGroup(dist.ProcessGroup):
    """The "strict" backend: a Python process group torch calls for every collective
    and message on the group (see the module docstring for what it refuses)."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._timeout = timeout.total_seconds()
        self._sent, self._received = {}, {}  # peer -> messages posted so far
        self._ungrouped = {}  # (peer, "send" or "recv") -> posted, not yet waited, outside a group
        self._batch = None  # (the batch_isend_irecv list being posted, its messages, works)
        self.posted = {"grouped": 0, "ungrouped": 0}  # messages, for tests of the pattern
        self._calls = queue.Queue()
        self._failed = None
        threading.Thread(target=self._run_calls, daemon=True).start()

    def getBackendName(self):
        return BACKEND

    # -- collectives: checked, then run in posting order -----------------------
    def allreduce(self, tensors, opts=None):
        self._check(tensors, "all_reduce")
        return self._submit(lambda: self._gloo.allreduce(tensors, opts).wait(), tensors)

    def broadcast(self, tensors, opts=None):
        self._check(tensors, "broadcast")
        return self._submit(lambda: self._gloo.broadcast(tensors, opts).wait(), tensors)

    def allgather(self, output_lists, inputs, opts=None):
        self._check(inputs + [t for outputs in output_lists for t in outputs], "all_gather")
        return self._submit(lambda: self._gloo.allgather(output_lists, inputs).wait(),
                            output_lists)

    def barrier(self, opts=None):
        return self._submit(lambda: self._gloo.barrier().wait(), [])

    # -- point-to-point ----------------------------------------------------------
    def send(self, tensors, peer, tag):
        return self._p2p("send", tensors, peer, tag)

    def recv(self, tensors, peer, tag):
        return self._p2p("recv", tensors, peer, tag)

    def _p2p(self, op, tensors, peer, tag):
        what = f"{op} {'to' if op == 'send' else 'from'} rank {peer}"
        self._check(tensors, what)
        batch = _batch_being_posted()
        other = (peer, "recv" if op == "send" else "send")
        if batch is None and self._ungrouped.get(other):
            raise StrictRuleError(
                f"strict group (rank {self.rank()}): {what} posted outside a group while a "
                f"{other[1]} with the same peer is outstanding; NCCL runs them one after "
                f"the other, so two ranks doing this deadlock. Post both in one "
                f"dist.batch_isend_irecv.")
        counts = self._sent if op == "send" else self._received
        messages = []
        for tensor in tensors:
            messages.append((op, peer, tensor, tag, counts.get(peer, 0)))
            counts[peer] = counts.get(peer, 0) + 1
        self.posted["grouped" if batch is not None else "ungrouped"] += len(tensors)
        if batch is None:
            self._ungrouped[(peer, op)] = self._ungrouped.get((peer, op), 0) + 1
            return self._submit(lambda: self._exchange(messages), tensors, (peer, op))
        if self._batch is None or self._batch[0] is not batch:
            assert self._batch is None, "a batch_isend_irecv ended before all its ops were posted"
            self._batch = (batch, [], [])
        ops, works = self._batch[1], self._batch[2]
        ops += messages
        work = _Work(self)
        works.append(work)
        if len(works) == len(batch):  # the batch's last op: the group goes as one call
            self._batch = None
            call = self._queue(lambda: self._exchange(ops), [])
            for w in works:
                w.call = call
        return work

    def _check(self, tensors, what):
        for tensor in tensors:
            if tensor.device != DEVICE:
                raise StrictRuleError(
                    f"strict group (rank {self.rank()}): {what} got a tensor on {tensor.device}; "
                    f"this group takes tensors on {DEVICE} only, as NCCL takes CUDA tensors of "
                    f"its device only. Make it on minddp.devices.group_device(group).")
            if not tensor.is_contiguous():
                raise StrictRuleError(f"strict group (rank {self.rank()}): {what} got a "
                                      f"non-contiguous tensor; NCCL takes contiguous ones only.")

    # -- the calls, one at a time in posting order (one NCCL stream) -------------
    def _submit(self, fn, tensors, ungrouped=None):
        return _Work(self, self._queue(fn, tensors), ungrouped)

    def _queue(self, fn, tensors):
        call = _Call(fn, tensors)
        self._calls.put(call)
        return call

    def _run_calls(self):
        while True:
            call = self._calls.get()
            try:
                if self._failed is not None:
                    raise StrictRuleError(f"strict group (rank {self.rank()}): an earlier call "
                                          f"failed ({self._failed}); the group is unusable.")
                call.fn()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                self._failed = self._failed or str(e).strip().splitlines()[0]
                call.fail(e)
            else:
                call.finish()

    def _exchange(self, messages):
        """Post one call's (or group's) messages together: a header each, then the data."""
        headers, data = [], []
        for op, peer, tensor, tag, n in messages:
            header = torch.tensor([tensor.numel(), _dtype_code(tensor), tag], device=DEVICE)
            if op == "send":
                headers.append((self._gloo.send([header], peer, 2 * n), None))
                data.append(self._gloo.send([tensor], peer, 2 * n + 1))
            else:
                received = torch.empty(3, dtype=torch.int64, device=DEVICE)
                headers.append((self._gloo.recv([received], peer, 2 * n),
                                (received, header, peer, n)))
        for work, check in headers:
            work.wait()
            if check is not None:
                self._check_match(*check)
        for op, peer, tensor, _tag, n in messages:
            if op == "recv":  # only once its header matched: gloo aborts on a size mismatch
                data.append(self._gloo.recv([tensor], peer, 2 * n + 1))
        for work in data:
            work.wait()

    def _check_match(self, sent, expected, peer, n):
        if torch.equal(sent, expected):
            return
        def describe(h):
            numel, code, tag = h.tolist()
            kind = _DTYPES[code] if 0 <= code < len(_DTYPES) else "another dtype"
            return f"{numel} x {kind}, tag {tag}"
        raise StrictRuleError(
            f"strict group (rank {self.rank()}): receive #{n} from rank {peer} "
            f"({describe(expected)}) met that rank's send #{n} to us ({describe(sent)}). NCCL "
            f"matches by posting order alone, ignoring tags: post receives in the order the "
            f"peer posts its sends.")


def _dtype_code(tensor):
    return _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)


def _batch_being_posted():
    """The op list of the dist.batch_isend_irecv call posting this message, if any."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code is _BATCH_CODE:
            return frame.f_locals["p2p_op_list"]
        frame = frame.f_back
    return None


class _Call:
    def __init__(self, fn, tensors):
        self.fn, self.done, self.error = fn, threading.Event(), None
        self.future = torch.futures.Future()
        self.tensors = tensors

    def finish(self):
        self.done.set()
        self.future.set_result(self.tensors)

    def fail(self, error):
        self.error = error
        self.done.set()
        self.future.set_exception(error)


class _Work(dist.Work):
    def __init__(self, group, call=None, ungrouped=None):
        super().__init__()
        self.group, self.call, self.ungrouped = group, call, ungrouped

    def wait(self, timeout=None):
        assert self.call is not None, "waited for before its batch_isend_irecv returned"
        # The gloo calls inside time out on their own; this bound only guards the thread.
        if not self.call.done.wait(2 * self.group._timeout + 10):
            raise StrictRuleError(f"strict group (rank {self.group.rank()}): a call did not "
                                  f"finish within twice the group's timeout")
        if self.ungrouped is not None:
            self.group._ungrouped[self.ungrouped] -= 1
            self.ungrouped = None
        if self.call.error is not None:
            raise self.call.error
        return True

    def is_completed(self):
        return self.call.done.is_set()

    def get_future(self):
        return self.call.future
