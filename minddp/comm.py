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
alive), and every live engine is stopped at interpreter exit: jobs not yet
started fail at once, and the thread and any completion still being handed
on from the backend's own thread (an asynchronous job's future) are waited
for, 5 s for all engines together. Without that, a script that ends right
after a backward could abort ("terminate called without an active
exception", SIGABRT): a thread still inside Future.set_result in C++ tried
to take the GIL back while the interpreter was finalizing, and was unwound
through a frame that cannot be. The backend's thread takes the GIL once more
after our callback, to drop it; that last step is only given 20 ms.
"""
import atexit
import queue
import threading
import time
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
        self._handing_on = 0  # backend futures whose result is not passed on yet
        self._handed_on = threading.Condition()
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
            with self._handed_on:
                self._handing_on += 1
            result.add_done_callback(
                lambda done, fut=fut, job=(job, label, start): self._forward(done, fut, job))
        else:
            self._record(job, label, start)
            fut.set_result(result)

    def _forward(self, done, fut, job):
        # Runs on the backend's thread once its work is done.
        try:
            try:
                value = done.value()
            except Exception as e:  # noqa: BLE001 - the backend's error, passed on
                self._error = e
                fut.set_exception(e)
                return
            self._record(*job)
            fut.set_result(value)
        finally:
            with self._handed_on:
                self._handing_on -= 1
                self._handed_on.notify_all()

    def _record(self, job, label, start):
        if self.timeline is not None:
            self.timeline.span(label, start, now_us(), thread="comm",
                               job=f"{getattr(job, '__module__', '')}.{job.__name__}")


@atexit.register
def _stop_all(timeout=5.0):
    # atexit runs before finalization: each thread can still take the GIL,
    # finish the job it is in and leave its loop.
    engines = list(_live)
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
