"""The wrapper: minddp.DistributedDataParallel, a drop-in for torch's.

Construction checks the model and the settings on every rank, broadcasts rank
0's parameters and buffers, takes the communication engine of the group
(comm.py) and hands the parameters to a Reducer (reducer.py), which reduces
every bucket through one Reduction (reduction.py): minddp's algorithms, or a
comm hook registered with `register_comm_hook`.
"""
import collections
import contextlib
import functools
import inspect
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from minddp import algorithms
from minddp import buckets as bucketing
from minddp import comm
from minddp import compression as compressing
from minddp.algorithms import native
from minddp.grad_bucket import GradBucket
from minddp.health import PeerProgress
from minddp.join import Join
from minddp import overlap
from minddp.compression_auto import AutoCompression
from minddp.model_sync import ModelMismatch, broadcast_from_first, check_same_model
from minddp.reducer import Phase, Reducer
from minddp.powersgd import PowerSGD, PowerSGDReduction
from minddp.reduction import AlgorithmReduction, HookReduction, setup_job
from minddp.timeline import from_environment

COMPRESSIONS = (None, "fp16", "bf16", "int8", "powersgd", "auto")  # or a PowerSGD(...)
# From torch 2.13 on, forward_sync_buffers replaces broadcast_buffers; older
# torch has only the old name, and minddp's warnings follow the torch it runs on.
_TORCH_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(
    nn.parallel.DistributedDataParallel.__init__).parameters
_constructed = collections.Counter()  # ranks -> wrappers constructed over them


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper: after `loss.backward()` every `.grad` is the mean over ranks.

    Every rank of `process_group` (default: the world) must construct it with
    the same model and arguments. torch's keywords mean what they mean in
    torch's DDP (README lists the few minddp does not implement). minddp's
    own, keyword-only: `algorithm` picks the all-reduce ("native" is the
    backend's own, "auto" times the others at construction and picks per
    bucket size), `bucket_cap_mb="auto"` plans the buckets from the first
    steps (overlap.py), `compression` sends gradients as fp16/bf16 ("fp16",
    "bf16"), as int8 with error feedback ("int8"), as rank-r factors with
    error feedback ("powersgd", or minddp.PowerSGD(rank=..., warmup_steps=...)
    to choose), or as fp16 or int8 per bucket where that pays ("auto"), `timeout`
    bounds every wait for a peer (default: the process group's), `timeline`
    is a path prefix for a Chrome trace of this rank's buckets (default:
    $MINDDP_TIMELINE).
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=None, init_sync=True, process_group=None, bucket_cap_mb=None,
                 find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None,
                 *, algorithm="auto", compression=None, timeout=None, timeline=None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("minddp: the default process group is not initialised; call "
                               "torch.distributed.init_process_group() (torchrun sets the "
                               "environment for it) before wrapping the model.")
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
            process_group = device_mesh.get_group(mesh_dim=0)
        group = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        _refuse_unimplemented(rank, delay_all_reduce_named_params=delay_all_reduce_named_params,
                              param_to_hook_all_reduce=param_to_hook_all_reduce,
                              mixed_precision=mixed_precision)
        # skip_all_reduce_unused_params and batched_grad_copy only make torch's
        # DDP faster; minddp accepts them and gives the same gradients without.
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module "
                          "is deprecated. Please avoid using it.", FutureWarning, stacklevel=2)
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = self._trainable(module)
        bucket_cap_mb = 25 if bucket_cap_mb is None else bucket_cap_mb
        _check_arguments(named, rank, device_ids, bucket_cap_mb, bucket_cap_mb_list, algorithm,
                         compression)
        self.forward_sync_buffers, sync_buffers_at_init = _buffer_sync(broadcast_buffers,
                                                                      forward_sync_buffers)
        self.module = module
        self.device = named[0][1].device
        self.device_ids = None if device_ids is None or self.device.type == "cpu" else [
            _index(d) for d in device_ids]
        self.output_device = None if self.device_ids is None else _index(
            output_device if output_device is not None else device_ids[0])
        self.dim = dim
        self.process_group = group
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = False
        self.algorithm, self.compression = algorithm, compression
        if compression == "powersgd":
            self.compression = PowerSGD()
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        # "auto": buckets planned from the first iterations (overlap.py).
        self._plan_buckets = bucket_cap_mb == "auto"
        self.bucket_bytes_cap = int((overlap.PROBE_CAPS_MB[-1] if self._plan_buckets
                                     else bucket_cap_mb) * 1024 * 1024)
        self.bucket_bytes_cap_list = [int(c * 1024 * 1024) for c in bucket_cap_mb_list or []]
        self._join = None  # the active join() context, if any
        self._timeout = timeout
        self.world_size = dist.get_world_size(group)
        self.timeline = from_environment(rank, timeline)
        settings = {"bucket_cap_mb": bucket_cap_mb, "algorithm": algorithm,
                    "compression": str(self.compression),
                    "find_unused_parameters": find_unused_parameters,
                    "gradient_as_bucket_view": gradient_as_bucket_view,
                    "static_graph": static_graph, "forward_sync_buffers": self.forward_sync_buffers}
        self._ranks = "-".join(map(str, dist.get_process_group_ranks(self.process_group)))
        self._take_name()
        with _current(self.device):
            self._join_peers(named, settings, rank, init_sync, sync_buffers_at_init)
            self._build_reducer(named, static_graph)
            self.reducer.reduction.setup(self.reducer.buckets,
                                         provisional=self.reducer.planner is not None)
        if static_graph:
            self._set_static_graph()

    # -- construction ------------------------------------------------------------
    def _trainable(self, module):
        """(name, parameter) of every parameter minddp reduces, in registration order."""
        return [(n, p) for n, p in module.named_parameters()
                if p.requires_grad and n not in self.parameters_to_ignore]

    def _join_peers(self, named, settings, rank, init_sync, sync_buffers):
        """Agree on the model, take rank 0's weights, find the gradient group's engine.

        Every rank of the group must call it; a peer that dies or never arrives
        turns into an error here (within the group's timeout), not a hang.
        """
        try:
            if init_sync:
                check_same_model(named, settings, self.process_group)
                broadcast_from_first([p.data for p in self._parameters_to_sync()] +
                                     (self._buffers_to_sync() if sync_buffers else []),
                                     self.process_group)
            self.engine = comm.engine_for(self.process_group, self._timeout, self.device)
        except ModelMismatch:
            raise
        except Exception as e:
            raise RuntimeError(
                f"minddp (rank {rank}): start-up agreement with the other ranks failed: a peer "
                f"died or did not construct the wrapper within the process group's timeout. "
                f"Cause: {str(e).splitlines()[0]}") from e

    def _build_reducer(self, named, static_graph):
        """The buckets, the reduction and the reducer (construction and unpickling)."""
        group = self.engine.group
        rank = dist.get_rank(self.process_group)
        planned = self._plan_buckets and self.world_size > 1
        limits = (overlap.probe_limits() if planned else
                  self.bucket_bytes_cap_list or bucketing.caps(self.bucket_bytes_cap))
        buckets = bucketing.build([p for _, p in named], limits, stamp=self.world_size > 1)
        name = f"algorithm {self.algorithm!r}"
        if self.compression == "auto":
            reduction = AutoCompression(self.engine, self.algorithm, group, name, self.timeline)
        elif isinstance(self.compression, PowerSGD):
            job = algorithms.planner(self.algorithm, group)
            reduction = PowerSGDReduction(self.engine, job, self.compression, self.world_size,
                                          name, self.timeline)
        else:
            codec = (None if self.compression is None
                     else compressing.codec_for(self.compression))
            job = algorithms.planner(self.algorithm, group, codec)
            if self.compression == "int8":
                job = compressing.ErrorFeedback(job, codec)
            reduction = AlgorithmReduction(self.engine, job, name, self.timeline,
                                           exact=codec is None)
        device = self.engine.device
        count_used = functools.partial(_sum_on_engine, self.engine, device, "used-map")
        sum_step = functools.partial(_sum_now, self.engine.side_group, device)
        progress = (PeerProgress(self.process_group, self._member)
                    if self.world_size > 1 else None)
        self.reducer = Reducer(
            named, buckets, reduction, rank=rank, world_size=self.world_size,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view, static_graph=static_graph,
            count_used=count_used, sum_step=sum_step if self.world_size > 1 else None,
            timeline=self.timeline, progress=progress,
            planner=self._planned_buckets if planned else None)

    def _planned_buckets(self, ready_times):
        """bucket_cap_mb="auto", once, on every rank together: measure the link as
        buckets use it, agree on ready times and link costs, plan, and build the
        planned buckets (overlap.py)."""
        engine, reduction = self.engine, self.reducer.reduction
        job = getattr(reduction, "job", None)  # a comm hook is timed as the backend's sum
        job = job if job is not None else functools.partial(native.all_reduce,
                                                            group=engine.group)
        link = overlap.measure_link(lambda t: engine.run(job, t, label="link"),
                                    lambda t: engine.submit(job, t, label="link"),
                                    engine.side_group, self.device, self.reducer.params[0].dtype,
                                    lambda probes: setup_job(engine, job, probes, True))
        plan = overlap.plan(self.reducer.params, *overlap.agree(
            ready_times, link, engine.side_group, engine.device))
        buckets = bucketing.allocate(self.reducer.params, plan.buckets, stamp=True)
        self.reducer.reduction.setup(buckets)
        overlap.log.debug("minddp (rank %d): buckets planned: %s",
                          dist.get_rank(self.process_group), plan.describe())
        if self.timeline is not None:
            self.timeline.instant("bucket plan", **plan.describe())
        return buckets

    def _take_name(self):
        """Name this wrapper's entries in the store (health.py). Constructions are
        collective over the group's ranks, so the count, and the name, is the same
        on each of them."""
        _constructed[self._ranks] += 1
        self._member = f"{self._ranks}/{_constructed[self._ranks]}"

    def _parameters_to_sync(self):
        return [p for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    def _buffers_to_sync(self):
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore):
        """torch's way to keep parameters and buffers (by qualified name) out of
        synchronisation: set on the module before wrapping it."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True  # read by other torch.distributed parts

    def _set_static_graph(self):
        """torch's private switch, also set by static_graph=True: the graph is the
        same every iteration (see reducer.py)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if self.reducer.iterations or self.reducer.phase is not Phase.IDLE:
            raise RuntimeError(f"minddp (rank {self.reducer.rank}): _set_static_graph() should "
                               f"be called before training loop starts and after "
                               f"DistributedDataParallel is constructed; pass "
                               f"static_graph=True to the constructor instead.")
        self.static_graph = True
        self.reducer.set_static_graph()
        if self.find_unused_parameters:
            warnings.warn("You passed find_unused_parameters=true to DistributedDataParallel, "
                          "`_set_static_graph` will detect unused parameters automatically, "
                          "so you do not need to set find_unused_parameters=true, just be sure "
                          "these unused parameters will not change during training loop while "
                          "calling `_set_static_graph`.", stacklevel=2)

    # -- forward -----------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
            grad_enabled = torch.is_grad_enabled()
            if grad_enabled:
                self.reducer.check_finished()
            synced = grad_enabled and self.require_backward_grad_sync
            sync_buffers = (self.require_forward_param_sync and self.forward_sync_buffers and
                            self.world_size > 1)
            buffers = self._buffers_to_sync() if sync_buffers else []
            source, divisor = 0, self.world_size
            if self._join is not None:  # uneven inputs: tell the joined ranks what comes
                source, divisor = self._join.before_forward(bool(buffers), synced)
            if buffers:
                with torch.no_grad():
                    broadcast_from_first(buffers, self.process_group, src=source)
            if self.device_ids:
                inputs, kwargs = _to_device((inputs, kwargs),
                                            torch.device(self.device.type, self.device_ids[0]))
            outputs = self.module(*inputs, **kwargs)
            self.require_forward_param_sync = synced
            if not synced:
                return outputs
            self.reducer.prepare_for_backward(outputs, divisor)
            if self.reducer.find_unused or self.reducer.in_first_static_iteration:
                outputs = _through_sink(outputs, weakref.ref(self.reducer))
            return outputs

    # -- the torch API around the reducer ---------------------------------------
    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """Context manager for uneven inputs: ranks that run out of batches keep
        matching the others' communication until every rank is done (join.py)."""
        if not enable:
            return contextlib.nullcontext()
        return Join(self, divide_by_initial_world_size, throw_on_early_termination)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients locally; the next synced step reduces them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state, hook):
        """Reduce each bucket with `hook(state, bucket) -> Future[Tensor]` (torch's protocol).

        The bucket's buffer holds the local sum of gradients (not divided by
        the world size); the future's value must be the averaged buffer.
        At most once, and not during a backward pass.
        """
        _check_comm_hook(hook)
        if isinstance(self.reducer.reduction, HookReduction):
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                               "called once.")
        self.reducer.set_reduction(HookReduction(state, hook))

    @property
    def broadcast_buffers(self):
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value):
        self.forward_sync_buffers = value

    def close(self):
        """Remove this wrapper's gradient hooks (also done when it is garbage
        collected): the model can then be wrapped again."""
        reducer = self.__dict__.get("reducer")
        if reducer is not None:
            reducer.close()

    _remove_autograd_hooks = close  # torch's name

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        self.close()

    # -- pickling: torch drops the process group and the reducer, and rebuilds
    # them on load with the default group.
    def __getstate__(self):
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError("DDP Pickling/Unpickling are only supported when using DDP with "
                               "the default process group. That is, when you have called "
                               "init_process_group and have not passed process_group argument "
                               "to DDP constructor")
        state = dict(self.__dict__)
        for key in ("process_group", "reducer", "engine", "_join", "timeline"):
            state.pop(key, None)
        state["_static_graph"] = state.pop("static_graph")
        return state

    def __setstate__(self, state):
        static_graph = state.pop("_static_graph")
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        self._join, self.static_graph = None, False
        self.timeline = None
        self._take_name()  # the original may live on beside this copy
        with _current(self.device):
            self.engine = comm.engine_for(self.process_group, self._timeout, self.device)
            self._build_reducer(self._trainable(self.module), static_graph)
            self.reducer.reduction.setup(self.reducer.buckets,
                                         provisional=self.reducer.planner is not None)
        if static_graph:
            self._set_static_graph()


class _Sink(torch.autograd.Function):
    """The wrapper's outputs pass through here when it needs to see backward
    start (static_graph) or undefined gradients reach the parameters behind an
    output the loss ignores (find_unused_parameters), as torch's _DDPSink does."""

    @staticmethod
    def forward(ctx, reducer_ref, *tensors):
        ctx.set_materialize_grads(False)  # an ignored output's gradient stays None
        ctx.reducer_ref = reducer_ref
        # Copies, as torch's sink makes: a loss modified in place must not
        # modify the sink's own output.
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        reducer = ctx.reducer_ref()
        if reducer is not None:
            reducer.sink_backward()
        return (None, *grads)


def _through_sink(outputs, reducer_ref):
    leaves, spec = pytree.tree_flatten(outputs)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and
          leaf.grad_fn is not None]
    if not at:
        return outputs
    passed = _Sink.apply(reducer_ref, *[leaves[i] for i in at])
    for i, tensor in zip(at, passed):
        leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec)


def _buffer_sync(broadcast_buffers, forward_sync_buffers):
    """(sync buffers before each forward, sync them at construction), as torch decides."""
    if broadcast_buffers is not None and _TORCH_HAS_FORWARD_SYNC:
        if forward_sync_buffers is not None:
            warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                          "`broadcast_buffers` is deprecated and its value is ignored when "
                          "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
        else:
            warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` "
                          "instead. IMPORTANT: unlike `broadcast_buffers=False`, "
                          "`forward_sync_buffers=False` still syncs buffers at init.",
                          FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective


def _refuse_unimplemented(rank, **given):
    for name, value in given.items():
        if value not in (None, False):
            raise NotImplementedError(
                f"minddp (rank {rank}): torch DDP's {name}= is not implemented by minddp "
                f"(README, 'Differences from torch DDP'); leave it at its default or use "
                f"torch.nn.parallel.DistributedDataParallel.")


def _check_arguments(named, rank, device_ids, bucket_cap_mb, bucket_cap_mb_list, algorithm,
                     compression):
    where = f"minddp (rank {rank})"
    if not named:
        raise RuntimeError(f"{where}: DistributedDataParallel is not needed when a module "
                           f"doesn't have any parameter that requires a gradient.")
    for name, p in named:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(f"{where}: Modules with uninitialized parameters can't be used "
                               f"with `DistributedDataParallel` ('{name}'). Run a dummy forward "
                               f"pass to correctly initialize the modules")
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    devices = {p.device for _, p in named}
    if len({d.type for d in devices}) > 1 or len(devices) > 1:
        placed = ", ".join(f"{n} on {p.device}" for n, p in named[:4])
        raise ValueError(f"{where}: parameters live on several devices ({placed}, ...); "
                         f"move the whole module to one device before wrapping it.")
    device = devices.pop()
    if device.type == "meta":
        raise ValueError(f"{where}: the module is on the meta device; materialise it "
                         f"(module.to_empty(device=...)) and initialise it first.")
    if device_ids and (device.type == "cpu" or torch.device(device.type, device.index) !=
                       torch.device(device.type, _index(device_ids[0]))):
        raise ValueError(f"{where}: device_ids={device_ids!r} does not match the module's "
                         f"device {device}; DistributedDataParallel device_ids only work with "
                         f"single-device GPU modules: pass device_ids=None for CPU modules, or "
                         f"[the single GPU the module is on].")
    if bucket_cap_mb == "auto" and bucket_cap_mb_list:
        raise ValueError(f"{where}: bucket_cap_mb='auto' plans every bucket itself; pass "
                         f"either it or bucket_cap_mb_list, not both.")
    for cap in [bucket_cap_mb] + list(bucket_cap_mb_list or []):
        if cap != "auto" and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or
                              cap <= 0):
            raise ValueError(f"{where}: bucket_cap_mb must be a positive number of MiB or "
                             f"'auto' (planned from measured gradient-ready times), got {cap!r}.")
    if algorithm not in algorithms.CHOICES:
        raise ValueError(f"{where}: unknown algorithm {algorithm!r}; choose one of "
                         f"{list(algorithms.CHOICES)}.")
    if compression == "int8" and algorithm == "native":
        raise ValueError(f"{where}: compression='int8' needs one of minddp's own algorithms "
                         f"(they sum in fp32 at every hop; the backend's all-reduce would add "
                         f"8-bit values and overflow); use algorithm='ring' or 'auto'.")
    if compression not in COMPRESSIONS and not isinstance(compression, PowerSGD):
        raise ValueError(f"{where}: unknown compression {compression!r}; choose one of "
                         f"{list(COMPRESSIONS)} or minddp.PowerSGD(rank=..., warmup_steps=...).")


def _check_comm_hook(hook):
    """torch's checks on a comm hook, with torch's exception types."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable; minddp got "
                        f"{type(hook).__name__}.")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return
    bucket = signature.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty,
                                                        dist.GradBucket, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if signature.return_annotation not in (inspect.Signature.empty,
                                           torch.futures.Future[torch.Tensor]):
        raise ValueError("Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor].")


def _sum_now(group, device, tensor):
    """Start summing a small tensor on `group` from this thread; a Future of it.
    No Python runs when it completes: nothing to hand over between threads."""
    return dist.all_reduce(tensor.to(device), group=group, async_op=True).get_future()


def _sum_on_engine(engine, device, label, tensor):
    """Sum a small tensor (the used map) with the backend's all-reduce, in its
    place among the buckets on the gradient group. Waited for on the
    communication thread: for a few bytes that is cheaper than handing the
    result on from the backend's thread, which takes the GIL twice more."""
    return engine.submit(native.all_reduce, tensor.to(device), engine.group,
                         label=label, device=device)


def _current(device):
    """The CUDA device made current for a block (NCCL's object collectives and
    group creation use the current one), or nothing for a CPU model."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _index(device_id):
    return device_id.index if isinstance(device_id, torch.device) else int(device_id)


def _to_device(obj, device):
    return pytree.tree_map(
        lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, obj)
