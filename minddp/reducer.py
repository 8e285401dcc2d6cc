"""The reducer: gradient readiness, bucket launch in order, finalize after backward.

One iteration, as the reducer sees it:

    forward  -> prepare(outputs)       arm; note unused parameters (find_unused_parameters)
    backward -> hook(param) per param  copy .grad into its bucket slot (divided by the
                                       world size unless a comm hook runs), or divide a
                                       large .grad where it is (in place, see below); a
                                       bucket whose last gradient is ready is launched, but
                                       only once every bucket before it has been: launches
                                       go in index order on every rank, whatever order
                                       gradients arrive in
             -> finalize()             (autograd engine callback, end of backward) wait for
                                       each bucket in turn and write it back to .grad, so
                                       copying one overlaps the next one's communication

In place: when the bucket's algorithm is one of ours (not the backend's, not
a comm hook) and gradient_as_bucket_view is off, gradients of at least
`in_place_bytes` are all-reduced in .grad itself, the bucket being a list of
pieces (buckets.py). That skips the copy back out of the bucket; in exchange
such a .grad holds partial sums while backward runs (as with
gradient_as_bucket_view), and is the mean once backward returns. Only a .grad
that alone holds its memory qualifies: autograd may hand a parameter a view
of a gradient that other parts of backward still read (a .view() of it, one
sum feeding several parameters), and those are copied as before. So are the
gradients of parameters unused at forward (find_unused_parameters), whose
.grad must stay as it was if no rank used them.

A parameter that never got its gradient leaves its bucket unlaunched; that is
reported at the next forward, naming the parameters and the rank.
"""
import warnings

import torch
import torch.distributed as dist

from minddp import buckets as bucketing
from minddp.grad_bucket import GradBucket
from minddp.graph import reached_parameters
from minddp.timeline import now_us, profiled


class Reducer:
    """Owns the buckets of one wrapped module and runs their reduction each iteration.

    `reduce(buffer) -> Future` sums a bucket buffer over the ranks (in place or
    not; the future's value is the reduced tensor). `reduce_used(tensor) ->
    Future` sums the used-parameter map (find_unused_parameters only).
    `takes_pieces(buffer) -> bool` says whether `reduce` may be given the
    bucket as a list of pieces in place instead (see the module docstring).
    """

    def __init__(self, named_params, *, world_size, rank, bucket_cap_bytes, reduce, reduce_used,
                 find_unused_parameters=False, gradient_as_bucket_view=False, describe="native",
                 first_bucket_bytes=bucketing.FIRST_BUCKET_BYTES, in_place_bytes=None,
                 takes_pieces=None, timeline=None, progress=None):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.world_size, self.rank = world_size, rank
        self.divisor = world_size  # what gradients are divided by (join() may lower it)
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.describe = describe  # the algorithm, for error messages
        self._reduce, self._reduce_used = reduce, reduce_used
        self.timeline = timeline  # see timeline.py; None records nothing
        self.progress = progress  # health.PeerProgress: names the peer when a bucket fails
        self.buckets = bucketing.build(self.params, self.names, bucket_cap_bytes,
                                       first_bucket_bytes,
                                       None if gradient_as_bucket_view else in_place_bytes)
        self._takes_pieces = takes_pieces
        self._in_place = None       # per bucket: reduced as pieces in place (decided once)
        self._where = {}  # parameter index -> (bucket, position in bucket)
        for bucket in self.buckets:
            for i, index in enumerate(bucket.indices):
                self._where[index] = (bucket, i)
        self.comm_hook = None
        self.hook_state = None
        self.used = torch.zeros(len(self.params), dtype=torch.int32)
        self._armed = False         # a synced forward ran; its backward will reduce
        self._started = False       # the first gradient hook of this backward has run
        self._unused_at_forward = []
        self._unfinished = None     # error for the next forward, if one iteration broke
        self._mode = None           # what the last forward was: "sync", "local" or "done"
        self.in_no_sync = False
        self._warned_late_backward = False
        self.iterations = 0         # backward passes finalized
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                         for i, p in enumerate(self.params)]

    # -- hooks API ---------------------------------------------------------------
    def set_comm_hook(self, state, hook):
        if self.comm_hook is not None:
            raise RuntimeError("minddp: register_comm_hook can only be called once")
        if self.iterations or self._started:
            raise RuntimeError("minddp: register_comm_hook must be called before the first "
                               "backward pass")
        self.comm_hook, self.hook_state = hook, state
        self._in_place = None  # a hook reduces the buffer: nothing in place

    # -- forward -----------------------------------------------------------------
    def check_finished(self):
        """Raise if the previous iteration left buckets unreduced."""
        if self._unfinished is not None:
            raise RuntimeError(self._unfinished)

    def prepare(self, outputs=None):
        """Arm the reducer for the backward of `outputs` (called by every synced forward)."""
        self.check_finished()
        if self.world_size == 1 and self.comm_hook is None:
            # A world of one: every .grad already is the mean. Skipping the
            # buckets keeps the wrapper free, as the benchmark checks.
            self._mode = "alone"
            return
        self._armed, self._started = True, False
        self._mode = "sync"
        self._unused_at_forward = []
        if self.find_unused:
            reached = reached_parameters(outputs)
            self._unused_at_forward = [i for i, p in enumerate(self.params)
                                       if id(p) not in reached]

    def prepare_local(self, in_no_sync=True):
        """A forward under no_sync(): its backward accumulates locally."""
        self._mode = "local"
        self.in_no_sync = in_no_sync

    # -- backward ----------------------------------------------------------------
    def _hook_for(self, index):
        def hook(param):
            if self._armed:
                self._on_ready(index)
            else:
                self._on_local(index)
        return hook

    def _on_local(self, index):
        """A gradient outside a synced backward: fine under no_sync, a mistake otherwise."""
        if self._mode == "alone":
            return
        if self._mode == "local":
            # Used under no_sync counts as used at the next synced step, as in
            # torch: its accumulated gradient is in the bucket and must be kept.
            self.used[index] = 1
            if not self.in_no_sync and not self._warned_late_backward:
                self._warned_late_backward = True
                warnings.warn(f"minddp (rank {self.rank}): this backward belongs to a forward "
                              f"that ran inside no_sync(), so it accumulates locally although "
                              f"no_sync() has exited; the next synced backward reduces it. Run "
                              f"the backward inside no_sync() too to make that explicit.")
            return
        raise RuntimeError(
            f"minddp (rank {self.rank}): parameter '{self.names[index]}' got a gradient from a "
            f"backward pass with no wrapper forward of its own ("
            f"{'the previous synced backward already consumed it' if self._mode == 'done' else 'the module was called directly'}"
            f"). Its gradients would not be synchronised. Call the wrapper (ddp(inputs)) "
            f"before each backward; do not call backward twice on one forward's graph.")

    def _start_backward(self):
        self._started = True
        self._backward_start = now_us()
        if self.progress is not None:
            self.progress.entered(self.iterations)
        self._ready = [False] * len(self.params)
        self._next = 0
        self._futures = [None] * len(self.buckets)
        self._used_future = None
        self._forget_in_place()
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        for index in self._unused_at_forward:
            self._mark_ready(index, unused=True)

    def _on_ready(self, index):
        if not self._started:
            self._start_backward()
        if self._ready[index]:
            raise RuntimeError(
                f"minddp (rank {self.rank}): parameter '{self.names[index]}' received its "
                f"gradient twice in one backward pass. Either it was reported unused at forward "
                f"(find_unused_parameters) but backward reached it, or it takes part in several "
                f"backward passes (reentrant checkpointing); give each backward its own forward.")
        self.used[index] = 1
        self._mark_ready(index)
        self._launch_ready()

    def _mark_ready(self, index, unused=False):
        bucket, i = self._where[index]
        param, view = bucket.params[i], bucket.view(i)
        grad = param.grad
        divide = self.comm_hook is None  # torch's contract: a comm hook gets plain sums
        if grad is None:
            view.zero_()
        elif grad.is_sparse:
            raise RuntimeError(f"minddp (rank {self.rank}): parameter '{self.names[index]}' has a "
                               f"sparse gradient, which minddp does not reduce; use a dense "
                               f"layer (e.g. nn.Embedding(sparse=False)).")
        elif self.as_view and grad.data_ptr() == view.data_ptr():
            if divide:
                view.div_(self.divisor)  # already accumulated in place, in the bucket
        elif not unused and i >= bucket.first_large and self.in_place(bucket) and \
                _fits(grad, view):
            grad.mul_(1.0 / self.divisor)  # reduced right here: no copy into the bucket
            bucket.live[i] = grad
        else:
            if divide:
                torch.mul(grad, 1.0 / self.divisor, out=view)  # divide while copying
            else:
                view.copy_(grad)
            if self.as_view:
                param.grad = view
        self._ready[index] = True
        bucket.pending -= 1
        if bucket.pending == 0 and self.timeline is not None:
            self.timeline.instant(f"ready b{bucket.index}", bytes=bucket.nbytes)

    def _launch_ready(self):
        """Launch every bucket that is full and whose predecessors have all been launched."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._futures[self._next] = self._launch(self.buckets[self._next])
            self._next += 1
        if self._next == len(self.buckets) and self.find_unused and self._used_future is None:
            self._used_future = self._reduce_used(self.used, "used-map")

    def in_place(self, bucket):
        """Whether `bucket` is reduced as pieces, its large gradients in place."""
        if self._in_place is None:
            self._in_place = [bool(b.large) and self.comm_hook is None and
                              self._takes_pieces is not None and self._takes_pieces(b.buffer)
                              for b in self.buckets]
        return self._in_place[bucket.index]

    def _launch(self, bucket):
        """Start reducing one bucket: the comm hook if one is set, else our all-reduce."""
        if self.comm_hook is None:
            what = bucket.pieces() if self.in_place(bucket) else bucket.buffer
            return self._reduce(what, f"comm b{bucket.index}")
        is_last = bucket.index == len(self.buckets) - 1
        return self.comm_hook(self.hook_state, GradBucket(bucket, is_last))

    def _finalize(self):
        """End of backward: wait for each bucket, write its means to .grad."""
        start = now_us()
        if self.timeline is not None:
            self.timeline.span("backward", self._backward_start, start)
        with profiled("minddp.finalize"):
            self._write_back()
        if self.timeline is not None:
            self.timeline.span("finalize", start, now_us())

    def _write_back(self):
        self._armed, self._started = False, False
        self._mode = "done"
        if self._next < len(self.buckets):
            missing = [self.names[i] for i in range(len(self.params)) if not self._ready[i]]
            self._unfinished = (
                f"minddp (rank {self.rank}): the previous backward pass produced no gradient for "
                f"{len(missing)} parameter(s): {', '.join(missing)}. Their buckets were never "
                f"reduced, so gradients are not synchronised. If some parameters legitimately "
                f"take no part in the loss, pass find_unused_parameters=True; otherwise make sure "
                f"every forward output contributes to the loss.")
            # Buckets already launched may still be summing .grad in place: the
            # error raised at the next forward says the step is broken.
            self._forget_in_place()
            return
        globally_used = None
        if self.find_unused:
            # Which gradients to write is known only once the used-parameter
            # map, launched after the last bucket, is back: wait for all first.
            for bucket in self.buckets:
                self._collect(bucket)
            globally_used = self._wait(self._used_future, "the used-parameter map") > 0
            self.used.zero_()  # the next accumulation starts afresh
        for bucket in self.buckets:
            # Write each bucket back as soon as it is reduced, as torch's
            # finalize does: copying one overlaps the next one's communication.
            if globally_used is None:
                self._collect(bucket)
            for i, index in enumerate(bucket.indices):
                if i in bucket.live:
                    continue  # reduced in place: .grad already is the mean
                if globally_used is not None and not globally_used[index]:
                    continue  # no rank used it: leave .grad as it was, as torch does
                self._write_grad(bucket.params[i], bucket.view(i))
        self._forget_in_place()
        self.iterations += 1

    def _forget_in_place(self):
        """Drop this iteration's in-place gradients. Outside a backward no bucket
        holds any: later reductions (join, benchmarks) must not touch .grad, and
        a .grad we still referred to would not count as alone in its memory."""
        for bucket in self.buckets:
            bucket.live.clear()

    def _write_grad(self, param, view):
        if self.as_view:
            if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                param.grad = view
        elif param.grad is None:
            param.grad = view.clone()
        else:
            param.grad.copy_(view)

    def _collect(self, bucket):
        """Wait for one bucket's reduction and leave the result in its buffer."""
        what = f"bucket {bucket.index} ({len(bucket.params)} parameters, {bucket.nbytes} bytes)"
        result = self._wait(self._futures[bucket.index], what)
        self._futures[bucket.index] = None
        if self.comm_hook is None and self.in_place(bucket):
            return  # our own algorithm summed the pieces where they lie
        if isinstance(result, (list, tuple)) and len(result) == 1:
            result = result[0]
        if not isinstance(result, torch.Tensor) or result.numel() != bucket.buffer.numel():
            got = (f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor)
                   else type(result).__name__)
            raise RuntimeError(
                f"minddp (rank {self.rank}): the communication hook returned {got} for "
                f"{what}; it must return a Future whose value is the reduced bucket "
                f"buffer ({bucket.buffer.numel()} elements, {bucket.buffer.dtype}).")
        if result is not bucket.buffer:
            bucket.buffer.copy_(result.reshape(-1))

    def _wait(self, future, what):
        try:
            return future.wait()
        except Exception as e:
            via = "the communication hook" if self.comm_hook is not None else self.describe
            who = (self.progress.describe(self.iterations) if self.progress is not None
                   else "a peer may have died or stalled")
            cause = str(e).split("\n")[0].replace(
                "Got the following error when running the callback: ", "")
            raise RuntimeError(
                f"minddp (rank {self.rank}): all-reduce of {what} with {via} failed in "
                f"iteration {self.iterations}: {who}. Cause: {cause}") from e

    def shadow_backward(self):
        """Take part in the other ranks' backward with zero gradients (a rank that
        has run out of inputs, see join.py): every bucket, in order, then the
        used-parameter map. Leaves .grad alone."""
        self._forget_in_place()
        for bucket in self.buckets:
            bucket.buffer.zero_()
        futures = [self._launch(bucket) for bucket in self.buckets]
        if self.find_unused:
            self.used.zero_()
            futures.append(self._reduce_used(self.used, "used-map"))
        for i, future in enumerate(futures):
            self._wait(future, f"bucket {i} (joined rank, zeros)")

    def communicate_only(self):
        """Reduce every bucket's current contents the way backward does, and wait.

        `.grad` is not touched. Every rank must call it; benchmarks use it to
        time communication alone (no backward to hide behind).
        """
        self._forget_in_place()
        for future in [self._launch(bucket) for bucket in self.buckets]:
            future.wait()

    def close(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _fits(grad, view):
    """Whether `grad` can be reduced where it is, standing in for its bucket slot `view`."""
    return (grad.is_contiguous() and grad.dtype == view.dtype and grad.device == view.device
            and grad.shape == view.shape and not grad.requires_grad and _sole_owner(grad))


def _sole_owner(grad):
    """Whether no tensor but `grad` refers to its memory (else changing it in place
    would change gradients that backward has yet to read)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False  # cannot tell: copy, which is always safe
    storage = grad.untyped_storage()
    return count(storage._cdata) == 2  # grad's reference and `storage`'s
