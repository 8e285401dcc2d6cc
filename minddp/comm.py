"""The communication engine: one background thread per gradient process group.

Why a thread: algorithms written on point-to-point send/recv are Python loops
that block; running them here lets backward go on computing while buckets
travel. Why one thread per group: buckets must be reduced in the same order on
every rank, and a single FIFO consumer makes that order the submission order.

`engine_for(group)` gives every wrapper over the same ranks the same engine
and the same gradient group (`dist.new_group` over those ranks, so the user's
collectives on their own group never interleave with gradient traffic), and
a side group for the wrappers' small checks. Two wrappers on one group share
its FIFO, as torch's DDPs share their process group; re-wrapping a model or
unpickling a wrapper needs no new group.

Futures carry the device of the tensor they return: on CUDA the consumer's
stream waits for the communication before it reads the result.

Streams: on a CUDA device a queued job runs on the engine's own stream, which
first waits for an event recorded on the submitter's current stream when it
submitted, as a collective follows its caller's stream at the call. Run on
the thread's default stream instead, a job's copies (gloo's CPU staging in
p2p.py and shared_memory.py) would wait for every kernel backward has queued
since, and its blocking copies would hold the thread until then: a bucket's
traffic could not start before the GPU had caught up with the training thread.

A job marked `job.nonblocking = True` (the backend's asynchronous all-reduce:
it only queues work on the backend's own threads or streams) runs on the
caller's thread when nothing is queued or running here, as torch's reducer
launches its collectives: the order is still the submission order, and a
short step saves two hand-overs between threads. On CUDA the collective then
follows the caller's current stream, as torch's does. Started there without
a timeline, its own Future is handed back as it is: no Python call on the
backend's thread when it completes.

Errors: an exception inside a job is set on that job's future (the training
process sees it when it waits, at the latest at the end of backward) and
poisons the engine, so later jobs fail at once instead of waiting for peers
that have moved on. A backend Future handed back as it is raises the
backend's error to its waiter alone (the reducer then refuses to go on, and
the group's connections to a dead peer are closed for whatever follows).

Exit: the thread is a daemon (a forgotten wrapper must not keep the process
alive), and every engine is stopped at interpreter exit: jobs not yet started
fail at once, and the thread and any completion still being handed on from
the backend's own thread are waited for, 5 s for all engines together. A
thread still inside Future.set_result while the interpreter finalizes would
abort the process ("terminate called without an active exception"). The
backend's thread takes the GIL once more after our callback, to drop its
references to it; that last step is given 20 ms.
"""
import atexit
import datetime
import queue
import threading
import time

import torch
import torch.distributed as dist

from minddp import hops
from minddp.algorithms import lanes
from minddp.devices import group_device, is_device_backend
from minddp.groups import enter_world, new_group, this_world
from minddp.timeline import now_us, profiled

_STOP = object()
_engines = {}  # (world, ranks, backend, timeout, device) -> CommEngine
_engines_lock = threading.Lock()


def future_on(device=None):
    """A Future for a value on `device`: a CUDA device makes it stream-aware (its
    waiters' streams wait for the value's), as every Future the wrapper hands back."""
    return torch.futures.Future(devices=[device] if device is not None and
                                device.type == "cuda" else None)


def _key(group, timeout, device):
    """(the engine's key in _engines, the timeout as a timedelta)."""
    timeout = timeout if timeout is not None else lanes.timeout_of(group)
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    cuda = device if device is not None and device.type == "cuda" else None
    ranks = tuple(dist.get_process_group_ranks(group))
    # the world: ranks run as threads of one process (torch's threaded process group)
    # each have their own, and their own engines
    return (id(this_world()), ranks, str(dist.get_backend(group)), timeout, cuda), timeout


def registered(group):
    """Whether torch.distributed knows `group` (its ranks): not after
    destroy_process_group(), nor for a ProcessGroup made other than by its API."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):  # KeyError in torch 2.13
        return False
    return True


def failed_engine(group, timeout=None, device=None):
    """Whether this rank's engine for `group` (engine_for's arguments) stopped after an
    error: its gradient group may hold collectives its peers never matched."""
    engine = _engines.get(_key(group, timeout, device)[0])
    return engine is not None and engine.failed()


def engine_for(group, timeout=None, device=None, renew=False):
    """The engine (and gradient group) for `group`'s ranks, made on first use.

    The first call for a set of ranks is a collective over them (it creates
    process groups): every rank of `group` makes it at the same point of its
    program, from its main thread. Later calls find the same engine on every
    rank; `renew=True`, which every rank must pass alike, makes a new one (after
    an error: failed_engine). `timeout` (a timedelta, seconds, or None for
    `group`'s own) bounds every wait on a peer. `device`: where the gradients
    live; a CUDA device is the one the thread works on, and the one NCCL's
    collectives use, whatever device is current in the caller (torch's DDP
    follows its parameters too).
    """
    key, timeout = _key(group, timeout, device)
    ranks, cuda = key[1], key[4]
    with _engines_lock:  # ranks that are threads of one process share the table
        stale = [k for k, old in _engines.items() if not old.registered()]
        stale = [_engines.pop(k) for k in stale]
    for old in stale:
        # destroy_process_group() ran since: the engine's groups went with that world,
        # and its thread, idle, is stopped. A new world gets groups of its own.
        old.stop_new_jobs("minddp: this wrapper's process groups were destroyed "
                          "(destroy_process_group()); wrap the model again in the new world")
        old.close(timeout=1.0)
    engine = _engines.get(key)
    if engine is not None and renew:
        engine.stop_new_jobs("minddp: a newer engine replaced this one")
        engine = None  # its thread may be stuck in a collective: left to the timeout
    if engine is None or not engine.alive():
        groups = [new_group(ranks, dist.get_backend(group), timeout) for _ in range(2)]
        lanes.open_lanes(groups[0])  # here, never from the communication thread
        on_device = is_device_backend(groups[0])
        collectives = cuda if cuda is not None and on_device else group_device(groups[0])
        # The step check's few bytes go through gloo on the CPU where the
        # gradients' backend is NCCL: summing them on the GPU would make the
        # host wait for the GPU every step to read the sums back.
        check = new_group(ranks, "gloo", timeout) if on_device else groups[1]
        engine = _engines[key] = CommEngine(*groups, collectives, cuda, check_group=check)
    return engine


class CommEngine:
    """Runs `job(*args)` callables on a background thread, in submission order.

    `group` carries the jobs; `side_group` (the same ranks) is for the
    wrappers' small set-up collectives on the gradients' device, and
    `check_group` (the side group, or a gloo group where that one is NCCL) for
    the few CPU bytes they sum straight from the training thread, in its
    program order (the step check): never through the thread, so they cost
    no hand-over between threads.
    """

    def __init__(self, group, side_group, device, cuda=None, name="minddp-comm",
                 check_group=None):
        self.group, self.side_group = group, side_group
        self.check_group = check_group if check_group is not None else side_group  # CPU tensors
        self.device = device  # the device of the tensors the group's collectives take
        self._cuda = cuda     # the CUDA device the thread works on, if any
        self._stream = None   # the thread's CUDA stream for queued jobs (made on the thread)
        self._world = this_world()  # where the groups are registered, as the thread sees too
        self._jobs = queue.SimpleQueue()
        self._queued = 0  # jobs submitted and not yet issued by the thread
        self._queue_lock = threading.Lock()
        self._error = None
        self._handing_on = 0  # backend futures whose result is not passed on yet
        self._handed_on = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def alive(self):
        return self._thread.is_alive()

    def failed(self):
        return self._error is not None

    def registered(self):
        """Whether the groups are still torch's: destroy_process_group() unregisters them.
        Asked of the engine's own world, whichever thread asks."""
        return self.group in self._world.pg_group_ranks

    def submit(self, job, *args, label="job", device=None, timeline=None):
        """Queue `job(*args)`; return a Future of its result.

        A job may return a Future itself (an asynchronous backend operation);
        the engine's future then completes when that one does. `device`: the
        device of the result (a CUDA device makes the future stream-aware).
        `label` names the job in `timeline` and in torch profiles.
        """
        if self._error is not None:
            return _failed(future_on(device), self._stopped())
        with self._queue_lock:
            if not (getattr(job, "nonblocking", False) and self._queued == 0):
                fut = future_on(device)
                self._queued += 1
                self._jobs.put((job, args, fut, label, timeline, device, self._submitted()))
                return fut
        # here: everything before it has been issued, so the order holds
        return self._run(job, args, None, label, timeline, device)

    def _submitted(self):
        """An event on the submitter's current stream (CUDA engines only): what the job
        waits for before it runs."""
        if self._cuda is None:
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._cuda))
        return ready

    def run(self, job, *args, label="job"):
        """submit() and wait: for set-up work that must keep the group's order."""
        return self.submit(job, *args, label=label).wait()

    def close(self, timeout=5.0):
        """Stop the thread after the queued jobs, and wait for the results still
        being passed on; safe to call more than once."""
        deadline = time.monotonic() + timeout
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout)
        with self._handed_on:
            self._handed_on.wait_for(lambda: self._handing_on == 0,
                                     max(0.0, deadline - time.monotonic()))

    def stop_new_jobs(self, reason):
        """Fail the jobs not started yet (and later ones) with `reason`."""
        if self._error is None:
            self._error = RuntimeError(reason)

    def _stopped(self):
        return RuntimeError(f"minddp: communication engine stopped after an earlier error: "
                            f"{self._error}")

    def _loop(self):
        enter_world(self._world)
        if self._cuda is not None:  # a new thread starts on cuda:0
            torch.cuda.set_device(self._cuda)
            self._stream = torch.cuda.Stream(self._cuda)
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            try:
                self._run(*item)
            finally:
                with self._queue_lock:
                    self._queued -= 1
            del item  # drop the finished job's tensors now, not when the next one comes

    def _run(self, job, args, fut, label, timeline, device=None, ready=None):
        """Run `job` and pass its result on to `fut`, which is returned. `fut` None (a
        job run on the caller's thread): one is made on `device` where needed, and a
        backend Future the job returns is handed back as it is when no timeline
        records (no Python call on the backend's thread when it completes). `ready`:
        the event of submit() on a CUDA engine; the job runs on the thread's stream
        after it, and its result is marked done on that stream."""
        if ready is None:
            return self._run_here(job, args, fut, label, timeline, device)
        self._stream.wait_event(ready)
        # A future without a CUDA device orders no waiter's stream after this one, so
        # the job's kernels must be finished before it completes: its waiter may free
        # a tensor the job still writes, and the allocator hand the memory on.
        settle = device is None or device.type != "cuda"
        with torch.cuda.stream(self._stream):
            return self._run_here(job, args, fut, label, timeline, device, settle)

    def _run_here(self, job, args, fut, label, timeline, device, settle=False):
        if self._error is not None:
            return _failed(fut if fut is not None else future_on(device), self._stopped())
        start = now_us()
        # Only while a timeline records do minddp's algorithms note their hops.
        previous = hops.recording(timeline, label) if timeline is not None else None
        try:
            with profiled(f"minddp.{label}"):
                result = job(*args)
                if settle:
                    self._stream.synchronize()
        except Exception as e:  # noqa: BLE001 - handed to the waiting thread
            self._error = e
            return _failed(fut if fut is not None else future_on(device), e)
        finally:
            if timeline is not None:
                hops.restore(previous)
        # Backend work returns torch._C.Future, the base of torch.futures.Future.
        is_future = isinstance(result, torch._C.Future)
        if is_future and fut is None and timeline is None:
            return result
        fut = fut if fut is not None else future_on(device)
        if is_future:
            with self._handed_on:
                self._handing_on += 1
            result.add_done_callback(
                lambda done, fut=fut, span=(timeline, label, start): self._forward(done, fut,
                                                                                   span))
        else:
            _record(timeline, label, start)
            fut.set_result(result)
        return fut

    def _forward(self, done, fut, span):
        # Runs on the backend's thread once its work is done (on CUDA with its
        # streams made current, so set_result records the right events).
        try:
            try:
                value = done.value()
            except Exception as e:  # noqa: BLE001 - the backend's error, passed on
                self._error = e
                fut.set_exception(e)
                return
            _record(*span)
            fut.set_result(value)
        finally:
            with self._handed_on:
                self._handing_on -= 1
                self._handed_on.notify_all()


def _failed(fut, error):
    fut.set_exception(error)
    return fut


def _record(timeline, label, start):
    if timeline is not None:
        timeline.span(label, start, now_us(), thread="comm")


@atexit.register
def _stop_all(timeout=5.0):
    # atexit runs before finalization: each thread can still take the GIL,
    # finish the job it is in and leave its loop.
    engines = list(_engines.values())
    for engine in engines:
        engine.stop_new_jobs("minddp: the interpreter is exiting")
    deadline = time.monotonic() + timeout
    for engine in engines:
        engine.close(max(0.0, deadline - time.monotonic()))
    if engines:
        # After a backend future's callbacks have run, its thread still takes
        # the GIL to drop its references to them (torch's PythonFunctionGuard):
        # let go of the GIL briefly so that happens before finalization.
        time.sleep(0.02)
