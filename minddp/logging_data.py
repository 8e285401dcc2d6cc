"""What the wrapper logs about itself: torch DDP's logging data, with minddp's values.

    data = ddp._get_ddp_logging_data()          # a dict with torch's keys
    ddp._set_ddp_runtime_logging_sample_rate(n)  # runtime stats every n-th iteration

torch's DDP keeps this in a C++ Logger (torch/csrc/distributed/c10d/logger.cpp)
that its own tests and frameworks read (Lightning's teardown reads
"can_set_static_graph"). `DDPLogger` keeps the same keys:

- at construction: the wrapper's arguments, the module's name, the
  parameters' count, bytes and dtypes, the bucket sizes of minddp's buckets,
  the process group's backend and the environment variables torch records;
- "comm_hook" (the hook's __qualname__, or str(BuiltinCommHookType)),
  "static_graph", "join_uneven_inputs", once they apply;
- "has_error", "error" and "iteration" of the last error the wrapper raised
  through `set_error_and_log` (torch's `_log_and_throw` and reducer checks);
- "can_set_static_graph": 0 once, with find_unused_parameters, the set of
  unused parameters changed between iterations (as torch, which also logs 1
  only when its logger is destroyed, where no one can read it);
- runtime stats, in nanoseconds, in the synced iterations torch samples: the
  first 10, then every `sample_rate`-th (default 100). A sampled iteration's
  stats are logged at the start of the next synced forward, "iteration" then
  being the sampled one's number (counting synced forwards from 1).

The runtime stats come from five events, stamped (time.time_ns(), unix time
as torch's) only in sampled iterations, so other iterations cost one flag
test per event:

    forward_start   the wrapper's synced forward begins
    backward_armed  that forward ends (torch's "backward compute start": it is
                    stamped when the reducer is prepared for backward)
    comm_start      bucket 0 is handed to the reduction
    backward_end    the end-of-backward callback, before finalize waits
    comm_end        finalize has written every bucket back to .grad

    forward_compute_time                forward_start  -> backward_armed
    backward_compute_time               backward_armed -> backward_end
    backward_comm_time                  comm_start     -> comm_end
    backward_compute_comm_overlap_time  comm_start     -> backward_end

and avg_* is each one's mean over the sampled iterations that had both ends.
"prev_iteration_grad_ready_order_indices" is the order in which the sampled
iteration's gradients arrived (parameter indices, unused ones left out).

Where minddp's values differ from torch's meaning:
- "has_rebuilt_buckets": torch lays buckets out in reverse registration order,
  then re-lays them once in the order gradients arrived in the first
  iteration (not at all with find_unused_parameters). minddp lays them out
  at construction in that same reverse order and keeps them (bucket_cap_mb=
  "auto" re-lays them once, from measured ready times). minddp logs 1 where
  torch does (from the forward after the one torch rebuilds in, and never with
  find_unused_parameters without a static graph), with "auto" only once its
  plan is made; "rebuilt_bucket_sizes" and "rebuilt_per_bucket_param_indices"
  then describe that layout.
- "num_buckets_reduced": minddp reduces every bucket, every iteration
  (skip_all_reduce_unused_params is accepted but changes nothing).
- "can_set_static_graph" is kept per wrapper (torch's is logged once per process).
"""
import operator
import os
import time
import weakref

import torch
import torch.distributed as dist

DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate
ALWAYS_SAMPLED = 10        # torch samples the first 10 iterations
# torch's names for the parameters' dtypes (caffe2 TypeMeta names).
_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                torch.bfloat16: "c10::BFloat16", torch.complex64: "c10::complex<float>",
                torch.complex128: "c10::complex<double>"}
# torch's timer spans: key -> (start event, end event)
_SPANS = {"forward_compute_time": ("forward_start", "backward_armed"),
          "backward_compute_time": ("backward_armed", "backward_end"),
          "backward_comm_time": ("comm_start", "comm_end"),
          "backward_compute_comm_overlap_time": ("comm_start", "backward_end")}
_STAMPS = {"forward_compute_time_start": "forward_start",
           "backward_compute_time_start": "backward_armed",
           "backward_compute_time_end": "backward_end",
           "backward_comm_time_start": "comm_start",
           "backward_comm_time_end": "comm_end"}


class DDPLogger:
    """The logging data of one wrapper (torch's dist.Logger, in Python).

    Made by the wrapper once its reducer exists (construction and
    unpickling); the wrapper and the reducer feed it through the event
    methods below, from the training thread.
    """

    def __init__(self, ddp):
        self._ddp = weakref.ref(ddp)  # the wrapper holds its logger, not the other way
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.iterations = 0        # synced forwards so far (torch's num_iterations_)
        self.sampling = False      # the current iteration is sampled
        self._stamps = {}          # event -> ns, of the sampled iteration
        self._ready_order = None   # parameter indices, of the sampled iteration
        self._buckets_reduced = None
        self._averaged = dict.fromkeys(_SPANS, 0)  # samples each avg_* is over
        self._prev_unused = None
        self.strs, self.ints = {}, {}
        self._construction_data(ddp)

    # -- construction ------------------------------------------------------------
    def _construction_data(self, ddp):
        reducer, group = ddp.reducer, ddp.process_group
        params = reducer.params
        backend = str(dist.get_backend(group))
        self.strs.update(
            module_name=type(ddp.module).__name__,
            dtypes=", ".join(sorted({_dtype_name(p.dtype) for p in params})),
            bucket_sizes=", ".join(str(_bucket_bytes(b)) for b in reducer.buckets),
            device_ids=", ".join(map(str, ddp.device_ids or [])),
            backend_name=backend)
        self.ints.update(
            world_size=dist.get_world_size(group), rank=dist.get_rank(group), iteration=0,
            is_multi_device_module=int(len({p.device for p in params}) > 1),
            num_parameter_tensors=len(params),
            total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
            output_device=-1 if ddp.output_device is None else ddp.output_device,
            broadcast_buffers=int(bool(ddp.forward_sync_buffers)),
            has_sync_bn=int(any(isinstance(m, torch.nn.SyncBatchNorm)
                                for m in ddp.module.modules())),
            bucket_cap_bytes=ddp.bucket_bytes_cap,
            find_unused_parameters=int(bool(ddp.find_unused_parameters)),
            gradient_as_bucket_view=int(bool(ddp.gradient_as_bucket_view)))
        env = ["MASTER_PORT", "MASTER_ADDR", "TORCH_DISTRIBUTED_DEBUG", "CUDA_VISIBLE_DEVICES"]
        if backend == "nccl":
            env += ["NCCL_SOCKET_IFNAME", "NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING",
                    "NCCL_DEBUG", "NCCL_NTHREADS", "NCCL_IB_TIMEOUT"]
        if backend == "gloo":
            env += ["GLOO_SOCKET_IFNAME", "GLOO_DEVICE_TRANSPORT"]
            threads = _gloo_threads(group)
            if threads is not None:
                self.ints["gloo_num_threads"] = threads
        for name in env:
            self.strs[name.lower()] = os.environ.get(name, "N/A")

    # -- torch's Logger methods ----------------------------------------------------
    def _get_ddp_logging_data(self):
        """Everything logged, as one dict (torch's strs_map and ints_map merged)."""
        return {**self.strs, **self.ints}

    def _set_comm_hook_name(self, name):
        self.strs["comm_hook"] = name

    def _set_static_graph(self):
        self.ints["static_graph"] = 1

    def _set_uneven_input_join(self):
        self.ints["join_uneven_inputs"] = 1

    def set_error_and_log(self, error):
        self.ints.update(has_error=1, iteration=self.iterations)
        self.strs["error"] = error

    def set_sample_rate(self, rate):
        """Runtime stats every `rate`-th synced iteration after the first 10."""
        rate = operator.index(rate)  # a TypeError for 2.5, as torch's binding gives
        if rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater "
                             "than 1")
        self.sample_rate = rate

    # -- events (wrapper and reducer) --------------------------------------------
    def forward_start(self):
        """A synced forward begins: log the sampled iteration before it, count this one."""
        if self.sampling:
            self._log_sample()
        self.iterations += 1
        n = self.iterations
        self.sampling = n <= ALWAYS_SAMPLED or n % self.sample_rate == 0
        if self.sampling:
            self._stamps = {"forward_start": time.time_ns()}
            self._ready_order, self._buckets_reduced = None, None

    @property
    def graph_static(self):
        """torch's reducer flag behind "can_set_static_graph": False once the set of
        unused parameters (find_unused_parameters) changed between synced forwards."""
        return "can_set_static_graph" not in self.ints

    def backward_armed(self, reducer):
        """The synced forward has ended and the reducer is armed for its backward."""
        if self.sampling:
            self._stamp("backward_armed")
        if reducer.find_unused and "can_set_static_graph" not in self.ints:
            unused = list(reducer._unused)
            if self._prev_unused is not None and unused != self._prev_unused:
                self.ints.update(can_set_static_graph=0, iteration=self.iterations)
            self._prev_unused = unused

    def ready_order(self):
        """A list for the reducer to append parameter indices to as their gradients
        arrive, in a sampled iteration; None otherwise."""
        if not self.sampling or self._ready_order is not None:
            return None
        self._ready_order = []
        return self._ready_order

    def comm_started(self):
        if self.sampling:
            self._stamp("comm_start")

    def backward_ended(self):
        if self.sampling:
            self._stamp("backward_end")

    def comm_ended(self, buckets_reduced):
        if self.sampling and "comm_end" not in self._stamps:
            self._stamp("comm_end")
            self._buckets_reduced = buckets_reduced

    def _stamp(self, event):
        # The first of each event counts: a backward after the sampled one (a
        # joined rank's, a second backward of one forward) does not move it.
        self._stamps.setdefault(event, time.time_ns())

    # -- at the next synced forward ----------------------------------------------
    def _log_sample(self):
        ddp = self._ddp()
        reducer = ddp.reducer if ddp is not None else None
        self.ints["iteration"] = self.iterations
        if reducer is not None:
            self._log_buckets(reducer)
        if self._ready_order:
            self.strs["prev_iteration_grad_ready_order_indices"] = ", ".join(
                map(str, self._ready_order))
        if self._buckets_reduced is not None:
            self.ints["num_buckets_reduced"] = self._buckets_reduced
        stamps = self._stamps
        for key in [*_SPANS, *_STAMPS]:
            self.ints[key] = 0
        for key, (start, end) in _SPANS.items():
            if start in stamps and end in stamps and stamps[end] >= stamps[start]:
                took = stamps[end] - stamps[start]
                self._averaged[key] += 1
                count, avg = self._averaged[key], self.ints.get("avg_" + key, 0)
                self.ints[key] = took
                self.ints["avg_" + key] = (took + avg * (count - 1)) // count
        for key, event in _STAMPS.items():
            if event in stamps:
                self.ints[key] = stamps[event]

    def _log_buckets(self, reducer):
        self.ints["unused_parameter_size"] = sum(
            reducer.params[i].numel() * reducer.params[i].element_size() for i in reducer._unused)
        settled = int(reducer.layout_settled)
        if self.ints.get("has_rebuilt_buckets") != settled:
            self.ints["has_rebuilt_buckets"] = settled
            if settled:
                self.strs["rebuilt_bucket_sizes"] = ", ".join(
                    str(_bucket_bytes(b)) for b in reducer.buckets)
                self.strs["rebuilt_per_bucket_param_indices"] = ", ".join(
                    " ".join(map(str, b.indices)) for b in reducer.buckets)


def _bucket_bytes(bucket):
    """A bucket's size as torch logs it: its parameters' bytes (also for a sparse one)."""
    return sum(p.numel() * p.element_size() for p in bucket.params)


def _dtype_name(dtype):
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _gloo_threads(group):
    """The gloo backend's thread count, where torch's binding shows it."""
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
