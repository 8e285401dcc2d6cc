"""The communication engine: one background thread that runs all-reduces in order.

Why a thread: algorithms written on point-to-point send/recv are Python loops
that block; running them here lets backward go on computing while buckets
travel. Why one thread: buckets must be reduced in the same order on every
rank, and a single FIFO consumer makes that order the submission order.

The engine owns a process group of its own (`dist.new_group` over the same
ranks), so the user's collectives on the default group never interleave with
gradient traffic.

Errors: an exception inside a job is set on that job's future (the training
process sees it when it waits, at the latest at the end of backward) and
poisons the engine, so later jobs fail at once instead of waiting for peers
that have moved on.

Exit: the thread is a daemon (a forgotten wrapper must not keep the process
alive), and every live engine is stopped at interpreter exit. Without that,
a script that ends right after a backward could abort ("terminate called
without an active exception", SIGABRT): the thread, still inside
Future.set_result in C++, tried to take the GIL back while the interpreter
was finalizing and was unwound through a frame that cannot be.
"""
import atexit
import queue
import threading
import weakref

import torch

from minddp.timeline import now_us, profiled

_STOP = object()
_live = weakref.WeakSet()  # engines whose thread may still run, stopped at exit


class CommEngine:
    """Runs `job(*args)` callables on a background thread, in submission order."""

    def __init__(self, group, name="minddp-comm", timeline=None):
        self.group = group
        self.timeline = timeline  # records each job's span, see timeline.py
        self._jobs = queue.SimpleQueue()
        self._error = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def submit(self, job, *args, label="job"):
        """Queue `job(*args)`; return a Future of its result.

        A job may return a Future itself (an asynchronous backend operation);
        the engine's future then completes when that one does. `label` names
        the job in the timeline and in torch profiles.
        """
        fut = torch.futures.Future()
        if self._error is not None:
            fut.set_exception(RuntimeError(f"minddp: communication engine stopped after an "
                                           f"earlier error: {self._error}"))
        else:
            self._jobs.put((job, args, fut, label))
        return fut

    def close(self, timeout=5.0):
        """Stop the thread after the queued jobs; safe to call more than once."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout)

    def _loop(self):
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            self._run(*item)
            # Drop the finished job's tensors now, not when the next one comes.
            # The training thread may already be in the next backward by then:
            # nothing held here may be a view of a .grad (buckets.Bucket.pieces).
            del item

    def _run(self, job, args, fut, label):
        if self._error is not None:
            fut.set_exception(RuntimeError(f"minddp: communication engine stopped after an "
                                           f"earlier error: {self._error}"))
            return
        start = now_us()
        try:
            with profiled(f"minddp.{label}"):
                result = job(*args)
        except Exception as e:  # noqa: BLE001 - handed to the waiting thread
            self._error = e
            fut.set_exception(e)
            return
        # Backend work returns torch._C.Future, the base of torch.futures.Future.
        if isinstance(result, torch._C.Future):
            result.add_done_callback(
                lambda done, fut=fut, job=(job, label, start): self._forward(done, fut, job))
        else:
            self._record(job, label, start)
            fut.set_result(result)

    def _forward(self, done, fut, job):
        try:
            value = done.value()
        except Exception as e:  # noqa: BLE001 - the backend's error, passed on
            self._error = e
            fut.set_exception(e)
            return
        self._record(*job)
        fut.set_result(value)

    def _record(self, job, label, start):
        if self.timeline is not None:
            self.timeline.span(label, start, now_us(), thread="comm",
                               job=f"{getattr(job, '__module__', '')}.{job.__name__}")


@atexit.register
def _stop_all():
    # atexit runs before finalization: each thread can still take the GIL,
    # finish the job it is in and leave its loop.
    for engine in list(_live):
        engine.close()
