"""Gradient readiness: the hooks on every parameter, and which buckets are full.

A hook runs when a parameter's gradient accumulator has run (as torch's
reducer hooks them: unlike a tensor's post-accumulate hook, it runs also when
the incoming gradient is undefined, which find_unused_parameters must see).
Each backward the reducer says how many arrivals make each parameter ready
(`reset`: one, or with static_graph as many as the first iteration saw), and
a bucket is full once all its parameters are ready.

    readiness = make(params, on_gradient, on_bucket, on_extra)
    readiness.set_layout(bucket_of, buckets)
                                  parameter i sits in bucket bucket_of[i] (again
                                  whenever the buckets change)
    readiness.reset(expected)     a new backward: parameter i is ready after
                                  expected[i] arrivals
    readiness.mark(i)             count one arrival of parameter i: the bucket it
                                  completed, NOT_FULL, or EXTRA (one too many)
    readiness.set_mode(mode, used)  see below
    readiness.pending(b), readiness.is_ready(i), readiness.remove()

Two implementations with one behaviour. `Readiness` from the extension
(csrc/readiness.cpp) registers C++ hooks, which do what the mode says:
- PYTHON: call `on_gradient(i, defined)`; the reducer counts through `mark`;
- COUNT (a running backward): count the arrival in C++, without the GIL, and
  call Python only for a full bucket (`on_bucket(b)`) or an extra arrival
  (`on_extra(i)`);
- IGNORE (no synced backward running: no_sync, a broken wrapper): nothing.
In COUNT and IGNORE a defined gradient also marks `used` (a CPU int32 tensor,
the local used map) where one is given. On a short step with many small
parameters a Python call per gradient is most of what a wrapper costs, which
is why this lives in C++. `PyReadiness` (no extension) has PYTHON mode only.
The callbacks must hold the reducer weakly: the hooks live as long as the
parameters.
"""
import os
import threading

import torch

NOT_FULL = -1
EXTRA = -2
PYTHON, COUNT, IGNORE = 0, 1, 2  # modes

try:
    from minddp._C import Readiness
except ImportError:  # compression.py says once that the extension is missing
    Readiness = None
# False: PyReadiness even where the extension is built (tests run both; also
# the way to compare them, and to rule the C++ hooks out when hunting a bug).
USE_EXTENSION = Readiness is not None and os.environ.get("MINDDP_PY_HOOKS") != "1"


class PyReadiness:
    """The pure-torch Readiness: Python hooks, every gradient through on_gradient."""

    def __init__(self, params, on_gradient, on_bucket, on_extra):
        self._left = [0] * len(params)
        self._lock = threading.Lock()  # hooks of CUDA parameters run on autograd's device threads
        self._accumulators, self._handles = [], []
        with torch.enable_grad():
            for index, param in enumerate(params):
                accumulator = param.view_as(param).grad_fn.next_functions[0][0]
                self._accumulators.append(accumulator)  # keeps it, and the hook, alive
                self._handles.append(accumulator.register_hook(_hook(on_gradient, index)))

    def set_layout(self, bucket_of, buckets):
        with self._lock:
            self._bucket_of = list(bucket_of)
            self._sizes = [0] * buckets
            for b in self._bucket_of:
                self._sizes[b] += 1
            self._pending = list(self._sizes)

    def reset(self, expected):
        with self._lock:
            self._left = list(expected)
            self._pending = list(self._sizes)

    def set_mode(self, mode, used=None):
        pass  # PYTHON always: the reducer's on_gradient does what the others would

    def mark(self, index):
        with self._lock:
            if self._left[index] == 0:
                return EXTRA
            self._left[index] -= 1
            if self._left[index]:
                return NOT_FULL
            b = self._bucket_of[index]
            self._pending[b] -= 1
            return b if self._pending[b] == 0 else NOT_FULL

    def is_ready(self, index):
        return self._left[index] == 0

    def pending(self, bucket):
        return self._pending[bucket]

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _hook(on_gradient, index):
    def hook(grad_inputs, grad_outputs):
        on_gradient(index, grad_outputs[0] is not None)
    return hook


def make(params, on_gradient, on_bucket, on_extra):
    """The extension's Readiness where it is built (and USE_EXTENSION), else PyReadiness."""
    kind = Readiness if USE_EXTENSION else PyReadiness
    return kind(list(params), on_gradient, on_bucket, on_extra)
