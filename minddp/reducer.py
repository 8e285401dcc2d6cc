"""The reducer: gradient readiness, bucket launch in order, finalize after backward.

One iteration, as the reducer sees it (torch's reducer.cpp keeps the same rules):

    forward   check_finished()          raise if the previous backward did not finish
              prepare_for_backward()    ARMED; note the parameters the outputs cannot
                                        reach (find_unused_parameters)
    backward  a hook per parameter      copy its .grad into its bucket slot (divided by
                                        the world size if the reduction wants that); a
                                        full bucket is launched once every bucket before
                                        it has been: launches go in index order on every
                                        rank, whatever order gradients arrive in
              last bucket launched      queue finalize for the end of backward
    end       finalize                  wait for each bucket in turn and write it to
                                        .grad (writing one overlaps the next one's
                                        communication); IDLE again

`.grad` is not touched between the hooks and finalize, except with
gradient_as_bucket_view, where it is the bucket slot itself.

Phases: IDLE (hooks are ignored: no_sync, the bare module called directly, a
nested wrapper's own backward), ARMED (a synced forward ran), RUNNING (its
backward has begun) and BROKEN. A backward that ends while RUNNING (an
exception inside it, or parameters that never got a gradient) is found at the
next forward: the reducer waits for the buckets it launched, so nothing of
that iteration can pair with the next one's, tells its peers through the
store, and raises; every later forward raises too. The peers, waiting for
buckets this rank will never send, read the note and raise (at the latest at
the process group's timeout).

static_graph=True: in the first iteration the hooks only count how often each
parameter's gradient arrives, and everything is reduced at the end of
backward; later a parameter is ready once its gradient has arrived that many
times (reentrant checkpointing runs backward through a segment more than
once), and the parameters the first iteration did not use are ready at once.

Ordering invariants. Named here once and asserted where they must hold
(errors.invariant, as torch's reducer.cpp asserts its own with
TORCH_INTERNAL_ASSERT): a failure is a bug in minddp, and its message says
what would have gone wrong. Per bucket or per backward, never per gradient.

    layout        every parameter sits in exactly one bucket, and bucket k is
                  buckets[k] (set at each layout)
    fill once     a bucket becomes full once per backward, never after it has
                  launched (torch: bucket_index >= next_bucket_)
    in order      a bucket launches once, in index order, only after its
                  gradients were copied in
    counts        no bucket's count of pending parameters falls below zero
    all launched  finalize runs once every bucket was filled and launched
                  (torch: next_bucket_ == buckets_.size() in its finalize
                  callback)
    waited once   finalize waits for each launched bucket's Future once
    stamp back    a stamp bucket 0 carried comes back with its sum (step_check.py)
"""
import enum
import warnings
import weakref

import torch
import torch.distributed as dist

from minddp import optim_in_backward, readiness
from minddp.errors import first_line, invariant, warn_as_reducer
from minddp.grad_bucket import GradBucket
from minddp.graph import reached_parameters
from minddp.overlap import PLAN_AT, Recorder
from minddp.reduction import HOOK
from minddp.rpc_grads import current_context, gradients
from minddp.step_check import StepCheck
from minddp.timeline import now_us, profiled

BACKEND = "the backend's all-reduce"  # what the step check and the used map run on


def _outside_dynamo(fn):
    """For what autograd calls back into (the hooks, the sink, end-of-backward
    callbacks). A backward run inside a torch.compile'd function would otherwise
    have dynamo compile the reducer itself, guarding on its counters (a recompile
    every step); torch's reducer is C++, which dynamo never sees. About 1.3 us a
    call: once per bucket and per backward on the extension's path, once per
    gradient on the pure-Python one."""
    return torch._disable_dynamo(fn)


class Phase(enum.Enum):
    IDLE = "idle"
    ARMED = "armed"
    RUNNING = "running"
    BROKEN = "broken"


class Reducer:
    """Owns the buckets of one wrapped module and runs their reduction each iteration.

    `reduction` is the seam (reduction.py) every bucket goes through.
    `count_used(tensor) -> Future` sums the used-parameter map over the ranks
    (find_unused_parameters, static_graph's first iteration); `sum_step`, the
    same for the step check (step_check.py; None: no check).
    """

    logger = None        # logging_data.DDPLogger (set by the wrapper): events and errors
    _ready_order = None  # parameter indices as gradients arrive, in a backward it samples

    def __init__(self, named_params, buckets, reduction, *, rank, world_size,
                 find_unused_parameters=False,
                 gradient_as_bucket_view=False, static_graph=False, count_used=None,
                 sum_step=None, progress=None, timeline=None, planner=None, replicas=None):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.buckets = buckets
        self.reduction = reduction
        self.rank, self.world_size = rank, world_size
        self.find_unused = find_unused_parameters and not static_graph
        self.static_graph = static_graph
        # As torch's reducer, fixed at construction: with it off, errors name parameters
        # by index and suggest turning it on (minddp's own lines name them anyway).
        self._debug = dist.get_debug_level() != dist.DebugLevel.OFF
        self.as_view = gradient_as_bucket_view
        self.count_used = count_used
        self.step_check = StepCheck(sum_step, rank, world_size)
        self.replicas = replicas  # replicas.ReplicaCheck, or None: check_replicas is off
        self.dist_context = None  # the armed backward's distributed autograd context (rpc_grads)
        self._context_seen = False
        self._replica_future = None
        self.progress = progress  # health.PeerProgress: names the peer when a bucket fails
        self.timeline = timeline  # see timeline.py; None records nothing
        # bucket_cap_mb="auto" (overlap.py): planner(notes) -> new buckets, once.
        self.planner = planner
        self.recorder = Recorder(len(self.params)) if planner is not None else None
        self._measuring = False
        # On the CPU, as torch keeps it: a hook marks it without a device kernel.
        self.local_used = torch.zeros(len(self.params), dtype=torch.int32, device="cpu")
        self.readiness = readiness.make(self.params, *_callbacks(self))
        self._expected = [1] * len(self.params)  # gradients that make a parameter ready
        self._set_layout(buckets)
        self.iterations = 0          # backward passes finalized
        self._settled = False        # torch's has_rebuilt_bucket_: set by forward_started
        self.forwards = 0            # synced forwards: what the step check compares
        self.divisor = 1
        self._broken = None          # the error every forward raises once BROKEN
        self._unused = []            # parameters the forward's outputs cannot reach
        self._static_counts = None   # static_graph: gradients per parameter per iteration
        self._global_used = None     # static_graph: the first iteration's used map
        self._used_reduced = None    # the latest summed used map (a list), once waited for
        self._joined_used = None     # what this rank, joined, adds to the peers' used maps
        self._warned_create_graph = False
        # Indices of the parameters whose optimizers run in backward, stepped at finalize
        # on their averages (optim_in_backward.py; the wrapper sets it at its first forward).
        self.stepped_in_backward = frozenset()
        self._installed = []  # futures finalize waits for last (install_futures)
        self.phase = Phase.IDLE

    @property
    def phase(self):
        return self._phase

    @phase.setter
    def phase(self, phase):
        """Also tells the hooks (readiness.py) what to do with a gradient."""
        self._phase = phase
        if phase is Phase.ARMED:  # the first gradient starts the backward (_start)
            self.readiness.set_mode(readiness.PYTHON)
        elif phase is not Phase.RUNNING:  # nothing to reduce: mark the used map at most
            self.readiness.set_mode(readiness.IGNORE, self._used_map_to_mark())

    def _used_map_to_mark(self):
        """The map a defined gradient marks used (on_gradient says when), or None."""
        return self.local_used if self.find_unused or self.in_first_static_iteration else None

    # -- forward -----------------------------------------------------------------
    def check_finished(self):
        """Raise if the previous backward pass did not finish (every grad-enabled forward)."""
        if self.phase is Phase.RUNNING:
            self._abandon()
        if self.phase is Phase.BROKEN:
            raise RuntimeError(self._logged(self._broken))
        if self.phase is Phase.ARMED:  # the last synced forward saw no gradient: why?
            self._check_hooks_reachable()

    def _check_hooks_reachable(self):
        """A parameter whose dtype or device changed after wrapping (model.double(),
        .half(), .to(...)) has a new gradient accumulator: the hooks sit on the old one,
        backward never reaches them and each rank would train alone, silently (as with
        torch's DDP). O(parameters), so only where a synced forward had no backward."""
        for index, param in enumerate(self.params):
            bucket = self._where[index][0]
            # (a complex parameter's bucket holds real numbers: buckets.py)
            if not bucket.sparse and (param.dtype.to_real(), param.device) != (
                    bucket.buffer.dtype, bucket.buffer.device):
                self._break(
                    f"minddp (rank {self.rank}): parameter '{self.names[index]}' is "
                    f"{param.dtype} on {param.device} but was {bucket.buffer.dtype} on "
                    f"{bucket.buffer.device} when the wrapper was built (model.double(), "
                    f".half() or .to() after wrapping?): its gradient hooks no longer fire, so "
                    f"the last backward was not synchronised. Convert the module first, then "
                    f"wrap it (again).")
                raise RuntimeError(self._logged(self._broken))

    def prepare_for_backward(self, outputs, divisor=None):
        """Arm the reducer for the backward of `outputs` (every synced forward);
        gradients will be divided by `divisor` (default the world size; fewer
        under join). torch's reducer has this method with `outputs` alone, and
        frameworks call it (Lightning before a backward inside the forward,
        Accelerate's trigger_sync_in_backward), so it keeps that signature."""
        self.phase = Phase.ARMED
        self.divisor = self.world_size if divisor is None else divisor
        self.dist_context = current_context()  # where this backward's gradients will be
        self._context_seen = False  # the first full bucket tells a local backward apart
        self.forwards += 1
        if self.find_unused:
            reached = reached_parameters(outputs)
            self._unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
            if not self._unused:
                _warn_nothing_unused(self.rank)

    def _rebuild_buckets(self):
        """torch's private call before a forward (its join hook makes it on joined
        ranks): raise if the previous backward did not finish. Always False: minddp
        never rebuilds here (bucket_cap_mb="auto" re-lays its buckets after a
        backward; forward_started tracks when torch's would have)."""
        self.check_finished()
        return False

    def _delay_all_reduce(self):
        """torch's private call that reduces static graph's first iteration at once
        (Lightning makes it after a backward run inside the forward). minddp queues
        that reduction for the end of the backward itself, so this only reduces
        now if the backward is still running."""
        if self.phase is Phase.RUNNING and self.in_first_static_iteration:
            self._reduce_all_at_end()

    def set_reduction(self, reduction):
        """Reduce buckets through `reduction` from the next backward on."""
        if self.phase is Phase.RUNNING:
            raise RuntimeError(f"minddp (rank {self.rank}): the reduction (a comm hook) cannot "
                               f"change during a backward pass.")
        self.reduction = reduction

    def set_static_graph(self):
        """From the next backward on, reduce as static_graph=True does (see above)."""
        self.static_graph, self.find_unused = True, False
        self.phase = self.phase  # the hooks mark the used map from now on

    @property
    def layout_settled(self):
        """What torch's _has_rebuilt_buckets and its logging's has_rebuilt_buckets report
        (see forward_started)."""
        return self._settled

    def forward_started(self):
        """A forward with gradients enabled begins: where torch's reducer rebuilds its
        buckets, once the backward it learns their order from is done (the first, the
        second with static_graph; never with find_unused_parameters alone). minddp's own
        layout is final by then too, unless bucket_cap_mb="auto" has yet to plan."""
        if not self._settled:
            self._settled = (self.planner is None and not self.find_unused and
                             self.iterations > (1 if self.static_graph else 0))

    @property
    def in_first_static_iteration(self):
        return self.static_graph and self._static_counts is None

    @_outside_dynamo
    def sink_backward(self):
        """Called when backward reaches the wrapper's outputs, before any gradient:
        static graph's first iteration queues its reduction for the end of this
        backward, the outermost one (a hook may run inside a reentrant one)."""
        if self.phase is Phase.ARMED and self.in_first_static_iteration:
            self._start()

    # -- backward ----------------------------------------------------------------
    def on_gradient(self, index, defined):
        """The hook: parameter `index`'s gradient accumulator ran (its incoming
        gradient was `defined` or not)."""
        if defined and (self.find_unused or self.in_first_static_iteration):
            # Marked even outside a synced backward: a parameter used under
            # no_sync() counts as used at the next synced step.
            self.local_used[index] = 1
        if self.phase is Phase.ARMED:
            self._start()
        elif self.phase is not Phase.RUNNING:
            return  # not a synced backward: accumulate locally, as torch does
        if self.in_first_static_iteration:
            self._counts[index] += 1
            return
        self._mark_ready(index)
        if self._ready_order is not None and self.readiness.is_ready(index):
            self._ready_order.append(index)

    def _start(self):
        """The first gradient (or the sink) of a synced backward."""
        self.phase = Phase.RUNNING
        self._backward_start = now_us()
        self._ready_order = self.logger.ready_order() if self.logger is not None else None
        if self.progress is not None:
            self.progress.entered(self.iterations, self.reduction.kind)
        # static_graph: ready after as many gradients as the first iteration saw
        self.readiness.reset(self._expected)
        self._futures = [None] * len(self.buckets)
        self._filled = [False] * len(self.buckets)  # gradients copied in (_fill)
        self._next = 0  # the next bucket to launch: every one before it has
        self._used_future = self._used_reduced = self._joined_used = None
        self.step_check.stamp(self.forwards, self.buckets, self.reduction)
        self._replica_future = None  # launched at finalize (replicas.py)
        self._measuring = self.recorder is not None and self.recorder.measuring(self.forwards)
        if self._measuring:
            self.recorder.begin()
        for index in self._unused:
            self._mark_ready(index)
        if self.in_first_static_iteration:
            self._counts = [0] * len(self.params)
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce_all_at_end)
        elif not self._measuring and self._ready_order is None and self.phase is Phase.RUNNING:
            # The rest of this backward's gradients are counted in C++ (readiness.py).
            self.readiness.set_mode(readiness.COUNT, self._used_map_to_mark())
        else:
            self.readiness.set_mode(readiness.PYTHON)

    def _mark_ready(self, index):
        """One gradient of parameter `index` has arrived (the fast path's twin)."""
        full = self.readiness.mark(index)
        if full == readiness.EXTRA:
            self._extra_gradient(index)
        if self._measuring and self.readiness.is_ready(index):
            self.recorder.ready_at(index, now_us())
        if full >= 0:
            self._bucket_full(full)

    def _extra_gradient(self, index):
        raise RuntimeError(self._logged(self._graph_changed(index) if self._static_counts
                                        else self._marked_twice(index)))

    def _bucket_full(self, b):
        invariant(b >= self._next and not self._filled[b],
                  "fill once: a bucket became full twice in one backward, or after it "
                  "launched; copying its gradients in again would overwrite a buffer its "
                  "reduction is reading")
        bucket = self.buckets[b]
        self._fill(bucket)
        self._filled[b] = True
        if self.timeline is not None:
            self.timeline.instant(f"ready b{b}", bytes=bucket.nbytes, iteration=self.iterations)
        self._launch_ready()

    def _fill(self, bucket):
        """Copy a full bucket's gradients into it, with one call for them all, and
        divide it with one more (torch's batched_grad_copy; its default copies
        each gradient as it arrives, a kernel per parameter, which on a short step
        with many small parameters is most of what the wrapper costs). torch's
        rule: what is reduced is each parameter's .grad (which may hold gradients
        accumulated under no_sync), or zeros where it has none. The numbers are
        torch's: a copied gradient times 1/divisor, one already in the bucket
        (gradient_as_bucket_view) divided by it."""
        present, plain = None, False
        if self.dist_context is not None:
            present = gradients(bucket.params, self.dist_context)
            if not self._context_seen:
                if all(g is None for g in present):  # loss.backward() inside a context: local
                    self.dist_context = present = None
                self._context_seen = True
        if present is None:
            present, _, plain = bucket.grads()
        if bucket.sparse:
            return self._sparse_ready(bucket.indices[0], bucket, present[0])
        as_view = self.as_view and self.dist_context is None  # a context's grads stay its own
        if not as_view and plain:  # the usual step: one copy, one scale
            if self.reduction.prescaled and self.divisor != 1:
                bucket.copy_scaled(present, 1.0 / self.divisor)
            else:
                torch._foreach_copy_(bucket.views, present)
            return
        copied, grads, in_place, zeros, adopt = [], [], [], [], []
        for slot, param in enumerate(bucket.params):
            grad, view = present[slot], bucket.views[slot]
            if grad is None:
                zeros.append(view)
            elif grad.is_sparse:
                # torch's DDP fails here too: NotImplementedError, "Cannot access
                # storage of SparseTensorImpl".
                raise NotImplementedError(
                    f"minddp (rank {self.rank}): parameter "
                    f"'{self.names[bucket.indices[slot]]}' got a sparse gradient, but it sits "
                    f"in a dense bucket: only the weight of an nn.Embedding or "
                    f"nn.EmbeddingBag constructed with sparse=True is expected to have one (as "
                    f"in torch's DDP). Compute it through such a module, or make its gradient "
                    f"dense.")
            elif as_view and _aliases(grad, view):
                in_place.append(view)
            else:
                if grad.requires_grad:  # backward(create_graph=True)
                    self._warn_create_graph()
                    grad = grad.detach()
                copied.append(view)
                grads.append(grad)
                if as_view:
                    adopt.append((param, view))
        if zeros:
            torch._foreach_zero_(zeros)
        if copied:
            torch._foreach_copy_(copied, grads)
        for param, view in adopt:
            param.grad = view
        if not self.reduction.prescaled or self.divisor == 1:
            return
        if not in_place:  # zeros stay zeros: one pass over the whole buffer
            bucket.buffer.mul_(1.0 / self.divisor)
        elif not copied:
            bucket.buffer.div_(self.divisor)
        else:
            torch._foreach_mul_(copied, 1.0 / self.divisor)
            torch._foreach_div_(in_place, self.divisor)

    def _sparse_ready(self, index, bucket, grad):
        """torch's rule for a parameter that expects a sparse gradient: its bucket is
        the sparse .grad itself, divided in place where the reduction wants it
        divided; finalize copies the sum back into it. torch's DDP raises, with
        the words quoted below, where it is missing or dense."""
        name = self.names[index]
        if grad is None:
            raise RuntimeError(
                f"minddp (rank {self.rank}): Expected sparse gradient to be defined: parameter "
                f"'{name}' (of a module with sparse=True) has no .grad in this backward, and a "
                f"sparse gradient cannot be stood in for by zeros. Use it in every synced "
                f"forward on every rank, or leave it out of the wrapper "
                f"(DistributedDataParallel._set_params_and_buffers_to_ignore_for_model).")
        if not grad.is_sparse:
            raise RuntimeError(
                f"minddp (rank {self.rank}): Expected variable to have sparse gradient: "
                f"parameter '{name}' belonged to a module with sparse=True when the wrapper "
                f"was built, but its gradient is dense (sparse switched off since, or the "
                f"weight used outside the embedding). Keep the module as it was wrapped, or "
                f"wrap the model again.")
        if self.reduction.prescaled:
            grad.div_(self.divisor)
        bucket.buffer = grad

    def _launch_ready(self):
        """Launch every full bucket whose predecessors have all been launched; once
        the last one is, reduce the used map and queue finalize."""
        while self._next < len(self.buckets):
            pending = self.readiness.pending(self._next)
            if pending:
                invariant(pending > 0,
                          "counts: a bucket's count of pending parameters fell below zero (a "
                          "gradient counted in a bucket it does not sit in); the bucket would "
                          "never launch, and every rank would wait for it")
                break
            invariant(self._filled[self._next],
                      "in order: a bucket with no parameter pending was about to launch before "
                      "its gradients were copied in; it would send the previous iteration's")
            self._futures[self._next] = self._launch(self._next)
            self._next += 1
        if self._next < len(self.buckets):
            return
        if self.find_unused or self.in_first_static_iteration:
            # A copy the next iteration's marks leave alone; not by aten.clone, which a step
            # of torch's DDP never calls (its test_ddp_sink_noclone fails on one).
            sent = torch.empty_like(self.local_used).copy_(self.local_used)
            self._used_future = self.count_used(sent)
        if not self.in_first_static_iteration:  # that one finalizes at once
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _launch(self, b):
        if b == 0 and self.logger is not None:
            self.logger.comm_started()
        bucket = GradBucket(self.buckets[b], is_last=b == len(self.buckets) - 1,
                            stamped=b == 0 and self.step_check.carried(self.buckets,
                                                                       self.reduction))
        return self.reduction.launch(bucket)

    @_outside_dynamo
    def _reduce_all_at_end(self):
        """static_graph, first iteration, end of backward: everything at once; from
        now on a parameter is ready after as many gradients as it got this time."""
        if self.phase is not Phase.RUNNING:
            return  # already reduced (_delay_all_reduce)
        for index in range(len(self.params)):
            self._mark_ready(index)
        self._static_counts = self._counts
        # An unused one (no gradient) is marked ready at the start of the backward.
        self._expected = [count or 1 for count in self._counts]
        self._unused = [i for i, count in enumerate(self._counts) if count == 0]
        self._finalize()

    # -- end of backward ---------------------------------------------------------
    @_outside_dynamo
    def _finalize(self):
        start = now_us()
        if self.logger is not None:
            self.logger.backward_ended()
        if self.timeline is not None:
            self.timeline.span("backward", self._backward_start, start)
        try:
            with profiled("minddp.finalize"):
                self._write_back()
            self.phase = Phase.IDLE
            if self.logger is not None:
                self.logger.comm_ended(len(self.buckets))
            if self._measuring:
                self._measuring = False
                self.recorder.end(self._backward_start)
            self._plan_if_due()
        except Exception as e:
            self._break(f"minddp (rank {self.rank}): the previous backward pass failed, so "
                        f"gradients are not synchronised; this wrapper cannot go on. Cause: "
                        f"{first_line(e)}")
            raise
        self.iterations += 1
        if self.timeline is not None:
            self.timeline.span("finalize", start, now_us())

    def _write_back(self):
        invariant(self._next == len(self.buckets) and all(self._filled),
                  "all launched: finalize ran before every bucket was filled and launched; "
                  "it would wait for a bucket never sent, or write back stale gradients")
        used = self._used_lookup()
        # The replica check reads the weights on the communication thread, so it waits
        # for whatever changes them in backward: optimizers run in backward, and a comm
        # hook's callbacks, which may step one (torch's _hook_then_optimizer does).
        late_check = self.stepped_in_backward or self.reduction.kind == HOOK
        for b, bucket in enumerate(self.buckets):
            # Each bucket is written as soon as it is reduced, as torch's
            # finalize does: writing one overlaps the next one's communication.
            result = self._collect(b)
            if b == 0:  # before any .grad is written
                self.step_check.verify(self.forwards, self.buckets, self._wait_step_check)
                if not late_check:
                    self._launch_replica_check()
            if bucket.sparse:  # .grad is the bucket: the sum goes into it, as in torch
                if result is not bucket.buffer:
                    bucket.buffer.copy_(result)
                views = [bucket.buffer]
            else:
                views = bucket.views_of(result)
                self._write_grads(bucket, views, used)
            if self.stepped_in_backward:
                optim_in_backward.step(bucket, views, self.stepped_in_backward)
        if self.stepped_in_backward:
            optim_in_backward.clear(self.params, self.stepped_in_backward)
        if late_check:
            self._launch_replica_check()
        if self._used_future is not None:
            self._used_map()  # its reduction must not outlive the iteration
        self._replicas_agreed()
        self._wait_installed()
        if self.find_unused:
            self.local_used.zero_()  # the next accumulation starts afresh

    def _ddp_graph_static(self):
        """torch's: whether every synced forward so far left the same parameters
        unused (always, without find_unused_parameters or with static_graph)."""
        return self.logger is None or self.logger.graph_static

    def install_futures(self, futures):
        """torch's reducer seam (`_install_post_backward_futures`, fed by a buffer comm
        hook): the next synced backward's finalize waits for `futures` after its buckets."""
        if not (isinstance(futures, (list, tuple)) and
                all(isinstance(f, torch._C.Future) for f in futures)):  # as torch's binding
            raise TypeError(f"minddp (rank {self.rank}): install_futures takes a list of "
                            f"torch.futures.Future; a buffer comm hook returns such a list "
                            f"or None (got {futures!r}).")
        self._installed.extend(futures)

    _install_post_backward_futures = install_futures

    def _wait_installed(self):
        """As torch's finalize, after every bucket is written: wait for the installed
        futures. One that failed does not fail the backward (torch's does not either;
        minddp warns); one still pending at the group's timeout does."""
        installed, self._installed = self._installed, []
        for future in installed:
            try:
                self._wait(future, "a future a buffer comm hook returned", "install_futures")
            except RuntimeError as e:
                if not future.done():
                    raise RuntimeError(
                        f"minddp (rank {self.rank}): a future the buffer comm hook returned "
                        f"(_register_buffer_comm_hook) was still pending at the end of "
                        f"backward, iteration {self.iterations}: {first_line(e)}") from e
                warnings.warn(f"minddp (rank {self.rank}): a future the buffer comm hook "
                              f"returned failed; training goes on, as under torch's DDP, with "
                              f"those buffers as they are: {first_line(e.__cause__ or e)}",
                              stacklevel=2)

    def _used_lookup(self):
        """index -> whether any rank used the parameter, or None when every one
        counts as used. The map's reduction is waited for only when a parameter
        is unused here (used here means used somewhere), as torch does, and in
        any case before finalize ends; with static_graph the first iteration's
        map decides for good."""
        if self.static_graph and self._global_used is None and self._used_future is not None:
            self._global_used = self._used_map()
        if self._global_used is not None:
            return lambda index: bool(self._global_used[index])
        if self._used_future is None:
            return None
        local = self.local_used.tolist()
        return lambda index: bool(local[index]) or bool(self._used_map()[index])

    def _used_map(self):
        """The summed used map of this iteration, waited for once."""
        if self._used_reduced is None:
            self._used_reduced = self._wait(self._used_future, "the used-parameter map",
                                            BACKEND).tolist()
        return self._used_reduced

    def _collect(self, b):
        """Wait for bucket b's reduction; the flat averaged result."""
        invariant(self._futures[b] is not None,
                  "waited once: finalize found no Future for a bucket (never launched, or "
                  "already collected); its .grad would get no sum, or another iteration's")
        bucket = self.buckets[b]
        what = f"bucket {b} ({len(bucket.params)} parameters, {bucket.nbytes} bytes)"
        result = self._wait(self._futures[b], what)
        self._futures[b] = None
        if isinstance(result, (list, tuple)) and len(result) == 1:
            result = result[0]
        if bucket.sparse:
            shape = bucket.params[0].shape
            if not isinstance(result, torch.Tensor) or result.shape != shape:
                raise RuntimeError(
                    f"minddp (rank {self.rank}): the reduction returned "
                    f"{getattr(result, 'shape', type(result).__name__)} for {what}, which "
                    f"holds the sparse gradient of '{self.names[bucket.indices[0]]}'; it must "
                    f"return a Future whose value is the reduced gradient, of shape "
                    f"{tuple(shape)}.")
            return result
        if b == 0:  # the step check may have ridden along: its sums are the tail
            result = self.step_check.take(bucket, result)
        if not isinstance(result, torch.Tensor) or result.numel() != bucket.buffer.numel():
            got = (f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor)
                   else type(result).__name__)
            raise RuntimeError(
                f"minddp (rank {self.rank}): the reduction returned {got} for {what}; it must "
                f"return a Future whose value is the reduced bucket buffer "
                f"({bucket.buffer.numel()} elements, {bucket.buffer.dtype}).")
        result = result.reshape(-1)
        if result.dtype != bucket.buffer.dtype:  # a hook reduced a cast copy (set_buffer):
            bucket.buffer.copy_(result)          # .grad keeps the parameter's dtype, as torch
            result = bucket.buffer
        if self.as_view and not _aliases(result, bucket.buffer):
            bucket.buffer.copy_(result)  # .grad is the bucket slot: the result goes there
            result = bucket.buffer
        return result

    def _write_grads(self, bucket, views, used):
        """Write a bucket's averaged gradients (`views`, shaped like its parameters)
        to .grad: one copy for the gradients that exist, one clone for those that
        do not (laid out like the parameter, as autograd would make them), and
        none where .grad is the bucket slot (gradient_as_bucket_view). A
        parameter no rank used (`used(index)` false) keeps its .grad, as in torch.
        Under distributed autograd the context's gradients get the sums instead
        (rpc_grads.py); one the context lacks is left out (it has no way in from Python)."""
        if self.dist_context is not None:
            grads, sums = [], []
            for slot, grad in enumerate(gradients(bucket.params, self.dist_context)):
                if grad is not None and (used is None or used(bucket.indices[slot])):
                    grads.append(grad)
                    sums.append(views[slot])
            if grads:
                torch._foreach_copy_(grads, sums)
            return
        if used is None and not self.as_view:  # the usual step: one call per bucket
            grads, defined, _ = bucket.grads()
            if not defined:  # zero_grad() set them to None
                for param, grad in zip(bucket.params, torch._foreach_clone(views)):
                    param.grad = grad
                return
            if defined == len(grads):
                torch._foreach_copy_(grads, views)
                return
        grads, sums, missing, fresh = [], [], [], []
        for slot, param in enumerate(bucket.params):
            if used is not None and not used(bucket.indices[slot]):
                continue
            grad, view = param.grad, views[slot]
            if self.as_view:
                if grad is None or not _aliases(grad, view):
                    param.grad = view
            elif grad is None:
                missing.append(param)
                fresh.append(view)
            else:
                grads.append(grad)
                sums.append(view)
        if grads:
            torch._foreach_copy_(grads, sums)
        if fresh:
            for param, grad in zip(missing, torch._foreach_clone(fresh)):
                param.grad = grad

    def _wait(self, future, what, via=None):
        """future.wait(), bounded by the group's timeout, and sooner when a peer has
        left a note that it gave up this iteration (health.PeerProgress.wait); a
        failure becomes an error naming `what`, `via` and the peer to blame."""
        try:
            return future.wait() if self.progress is None else self.progress.wait(future)
        except Exception as e:
            who = (self.progress.describe(self.iterations) if self.progress is not None
                   else "a peer may have died or stalled")
            cause = first_line(e).replace(
                "Got the following error when running the callback: ", "")
            raise RuntimeError(
                f"minddp (rank {self.rank}): all-reduce of {what} with "
                f"{via or self.reduction.name} failed in iteration {self.iterations}: {who}. "
                f"Cause: {cause}") from e

    def _wait_step_check(self, future):
        return self._wait(future, "the step check", BACKEND)

    def _launch_replica_check(self):
        """Queue this step's replica check, where one is due, behind every bucket and
        the used map. Only once the step check has agreed: whether a check is due
        follows the count of synced forwards, the very thing that differs between
        ranks when the step check fails, and a check due on one rank only would
        pair its gather with a peer's bucket."""
        if self.replicas is not None:
            self._replica_future = self.replicas.launch(self.forwards)

    def _replicas_agreed(self):
        """Raise (on every rank alike) if this backward's replica check, where it
        ran one, found the ranks' weights different (replicas.py)."""
        if self._replica_future is not None:
            future, self._replica_future = self._replica_future, None
            self.replicas.verify(self._wait(future, "the replica check", BACKEND), self.forwards)

    # -- broken iterations -------------------------------------------------------
    def _abandon(self):
        """The previous backward began but never reached finalize: drain what it
        launched, tell the peers, and become BROKEN."""
        missing = [i for i in range(len(self.params)) if not self.readiness.is_ready(i)]
        waiting = [b for b in range(len(self.buckets)) if self._futures[b] is None]
        if self.progress is not None:  # first: a peer may be waiting for this rank
            self.progress.abandon(f"abandoned iteration {self.iterations}: its backward did not "
                                  f"finish (buckets {_spans(waiting)} never launched)")
        launched = [f for f in [self.step_check.future, self._replica_future, *self._futures,
                                self._used_future, *self._installed] if f is not None]
        self._installed = []
        for future in launched:  # so that none of it can pair with a later iteration
            try:  # a peer that broke too leaves a note, which ends the wait at once
                self._wait(future, "a bucket of the broken iteration")
            except RuntimeError:
                pass  # the iteration is lost either way
        # torch's words first (its tests and users match them), then what minddp saw.
        if self.static_graph:
            cause = ("This error indicates that your training graph has changed in this "
                     "iteration, e.g., one parameter is used in first iteration, but then got "
                     "unused in the second iteration. this is not compatible with static_graph "
                     "set to True.")
        elif self.find_unused:
            cause = ("This error indicates that your module has parameters that were not used "
                     "in producing loss. Since `find_unused_parameters=True` is enabled, not "
                     "all `forward` outputs may participate in computing loss: make sure all "
                     "`forward` function outputs participate in calculating loss.")
        else:
            cause = ("This error indicates that your module has parameters that were not used "
                     "in producing loss. You can enable unused parameter detection by passing "
                     "the keyword argument `find_unused_parameters=True` to "
                     "`torch.nn.parallel.DistributedDataParallel`, and make sure all `forward` "
                     "function outputs participate in calculating loss.")
        indices = (f"Parameter indices which did not receive grad for rank {self.rank}: "
                   f"{' '.join(map(str, missing))}")
        names = [self.names[i] for i in missing]
        if self._debug:  # torch names them only here (sorted); its tests look for either form
            which = (f"Parameters which did not receive grad for rank {self.rank}: "
                     f"{', '.join(sorted(names))}\n{indices}")
        else:
            which = (f"{indices}\n In addition, you can set the environment variable "
                     f"TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL to print out information "
                     f"about which particular parameters did not receive gradient on this rank "
                     f"as part of this error")
        self._break(
            f"Expected to have finished reduction in the prior iteration before starting a new "
            f"one. {cause}\n{which}\n"
            f"minddp (rank {self.rank}): its backward pass did not finish, so buckets "
            f"{_spans(waiting)} of {len(self.buckets)} were never reduced and the other ranks "
            f"cannot complete that iteration. The parameters without a gradient: "
            f"{', '.join(names)}. Either an exception interrupted backward (DDP "
            f"cannot skip a batch after its backward started: let the error stop training on "
            f"every rank, or skip the batch before backward on every rank), or those "
            f"parameters took no part in the loss.")

    def _break(self, message):
        self.phase = Phase.BROKEN
        self._broken = message

    def _logged(self, message):
        """`message`, noted first as the wrapper's last error (logging_data.py)."""
        if self.logger is not None:
            self.logger.set_error_and_log(message)
        return message

    def _marked_twice(self, index):
        return (f"Expected to mark a variable ready only once. Parameter at index {index} "
                f"with name {self.names[index]} has been marked as ready twice. minddp (rank "
                f"{self.rank}): it received its gradient twice in one backward pass. It took "
                f"part in several backward passes over one forward (reentrant "
                f"checkpointing reusing it, or a parameter used outside forward), or it was "
                f"reported unused by find_unused_parameters but backward reached it. Pass "
                f"static_graph=True if the graph is the same every iteration.")

    def _graph_changed(self, index):
        return (f"Your training graph has changed in this iteration. minddp (rank "
                f"{self.rank}): parameter '{self.names[index]}' got more gradients than in the "
                f"first iteration (or was unused then). static_graph=True requires the same "
                f"graph every iteration; construct the wrapper without it.")

    def _warn_create_graph(self):
        if not self._warned_create_graph:
            self._warned_create_graph = True
            warn_as_reducer(
                "Using DistributedDataParallel with create_graph=True is not well-supported. "
                "The higher-order gradient will not be synchronized across ranks, and "
                "backpropagation through all_reduce operations will not occur (torch's "
                "words; minddp's DDP averages the gradients as torch's does).", self.rank)

    # -- join and clean-up -------------------------------------------------------
    def shadow_backward(self):
        """Take part in the other ranks' backward with zero gradients (a rank that
        has run out of inputs, see join.py): the step check, every bucket in
        order, then the used-parameter map, as they do. Leaves .grad alone."""
        self.forwards += 1  # the step it shadows counts here too (the step check)
        for bucket in self.buckets:
            if bucket.sparse:  # a gradient with no rows; the last one is .grad: keep it
                bucket.buffer = _no_rows(bucket.params[0])
            else:
                (bucket.carrier if bucket.carrier is not None else bucket.buffer).zero_()
        step = self.step_check.shadow(self.buckets, self.reduction)
        futures = [step] if step is not None else []
        launched = [self._launch(b) for b in range(len(self.buckets))]
        if not self.stepped_in_backward:
            futures += launched
        used = None
        if self.find_unused or self.in_first_static_iteration:
            # As torch's joined rank: its map as the last sum left it (the step it trained
            # last, then each step it shadows), not zeros; so a parameter used then counts
            # as used (a zero .grad, not None) in the peers' later steps.
            if self._joined_used is None:
                self._joined_used = (torch.zeros_like(self.local_used) if
                                     self._used_reduced is None else
                                     torch.tensor(self._used_reduced, dtype=torch.int32))
            used = self.count_used(self._joined_used)
        # Where the training ranks queue it (finalize): behind the buckets and the map.
        replica = (self.replicas.launch(self.forwards, present=False)  # not compared
                   if self.replicas is not None else None)
        for future in futures:
            self._wait(future, "the buckets (joined rank, zeros)")
        if self.stepped_in_backward:  # as torch's joined rank: its optimizers in backward
            for b, future in enumerate(launched):  # step on the peers' averages too, so
                self._futures[b] = future          # their state stays the peers'
                result = self._collect(b)
                optim_in_backward.step(self.buckets[b], [result] if self.buckets[b].sparse
                                       else self.buckets[b].views_of(result),
                                       self.stepped_in_backward)
            optim_in_backward.clear(self.params, self.stepped_in_backward)
        if used is not None:
            summed = self._wait(used, "the used-parameter map (joined rank)", BACKEND)
            self._joined_used = (summed[0] if isinstance(summed, list) else summed).clone()
        if replica is not None:  # the training ranks raise on a mismatch: so does this one
            self.replicas.verify(self._wait(replica, "the replica check", BACKEND), self.forwards)
        self._plan_if_due()  # the other ranks plan at this step: take part

    # -- bucket_cap_mb="auto" ----------------------------------------------------
    def _plan_if_due(self):
        """After the backward of synced forward PLAN_AT (or the first one after it),
        on every rank: agree on the measurements, plan, and use the planned buckets."""
        if self.planner is None or self.forwards < PLAN_AT:
            return
        planner, self.planner = self.planner, None
        self.use_buckets(planner(self.recorder.times()))
        self.recorder = None

    def use_buckets(self, buckets):
        """Reduce through `buckets` (a new layout of the same parameters) from the
        next backward on. With gradient_as_bucket_view the .grad tensors move into
        the new buckets, values kept."""
        if self.phase is Phase.RUNNING:
            raise RuntimeError(f"minddp (rank {self.rank}): buckets cannot change during a "
                               f"backward pass.")
        self._set_layout(buckets)
        if self.as_view:
            for index, param in enumerate(self.params):
                bucket, slot = self._where[index]
                if param.grad is not None and not bucket.sparse:  # sparse .grad is no view
                    view = bucket.view(slot)
                    view.copy_(param.grad)
                    param.grad = view

    def _set_layout(self, buckets):
        places = _places(buckets)
        invariant(set(places) == set(range(len(self.params))) and
                  sum(len(b.indices) for b in buckets) == len(self.params) and
                  all(b.index == k for k, b in enumerate(buckets)),
                  "layout: a parameter sits in no bucket or in two, or bucket k is not "
                  "buckets[k]; a bucket would never become full, or count a gradient twice")
        self.buckets, self._where = buckets, places
        self.readiness.set_layout([self._where[i][0].index for i in range(len(self.params))],
                                  len(buckets))

    @property
    def expect_sparse(self):
        """Per parameter: whether it expects a sparse gradient (a bucket of its own)."""
        return [self._where[index][0].sparse for index in range(len(self.params))]

    closed = False  # the hooks are gone: a synced forward would reduce nothing

    def close(self):
        """Remove the gradient hooks (the wrapper's close() and garbage collection)."""
        self.readiness.remove()
        self.closed = True


_warned_nothing_unused = False


def _warn_nothing_unused(rank):
    """torch's hint, once a process as torch's TORCH_WARN_ONCE gives it: the search for
    unused parameters found none."""
    global _warned_nothing_unused
    if not _warned_nothing_unused:
        _warned_nothing_unused = True
        warn_as_reducer(
            "find_unused_parameters=True was specified in DDP constructor, but did not find "
            "any unused parameters in the forward pass. This flag results in an extra "
            "traversal of the autograd graph every iteration,  which can adversely affect "
            "performance. If your model indeed never has any unused parameters in the forward "
            "pass, consider turning this flag off. Note that this warning may be a false "
            "positive if your model has flow control causing later iterations to have unused "
            "parameters.", rank)


def _callbacks(reducer):
    """readiness.make's callbacks. They hold the reducer weakly, so a dropped
    wrapper's hooks do nothing."""
    ref = weakref.ref(reducer)

    def on_gradient(index, defined):
        r = ref()
        if r is not None:
            r.on_gradient(index, defined)

    def on_bucket(b):
        r = ref()
        if r is not None:
            r._bucket_full(b)

    def on_extra(index):
        r = ref()
        if r is not None:
            r._extra_gradient(index)

    return _outside_dynamo(on_gradient), _outside_dynamo(on_bucket), _outside_dynamo(on_extra)


def _no_rows(param):
    """A sparse gradient of `param` with no rows, laid out as an embedding's is
    (one sparse dimension), for a rank that takes part with zeros."""
    indices = torch.empty((1, 0), dtype=torch.long, device=param.device)
    return torch.sparse_coo_tensor(indices, param.new_empty((0, *param.shape[1:])), param.shape)


def _places(buckets):
    """parameter index -> (its bucket, its slot there)"""
    return {index: (bucket, slot) for bucket in buckets
            for slot, index in enumerate(bucket.indices)}


def _aliases(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and \
        a.data_ptr() == b.data_ptr()


def _spans(indices):
    """[3, 4, 5, 7] -> '3-5, 7'."""
    if not indices:
        return "none"
    parts, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)
