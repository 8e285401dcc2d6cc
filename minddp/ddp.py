"""The wrapper: minddp.DistributedDataParallel, a drop-in for torch's.

Construction checks the model and the settings on every rank, broadcasts rank
0's parameters and buffers, takes the communication engine of the group
(comm.py) and hands the parameters to a Reducer (reducer.py), which reduces
every bucket through one Reduction (reduction.py): minddp's algorithms, or a
comm hook registered with `register_comm_hook`.
"""
import contextlib
import functools
import logging
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join as TorchJoin, _JoinConfig
from torch.nn.parallel.distributed import _BufferCommHookLocation
from torch.utils import _pytree as pytree

from minddp import arguments
from minddp import buckets as bucketing
from minddp import comm
from minddp import groups
from minddp import compression as compressing
from minddp.algorithms import native
from minddp.errors import first_line
from minddp.health import PeerProgress
from minddp.join import Join, JoinHook
from minddp.logging_data import DDPLogger
from minddp import optim_in_backward, overlap
from minddp.devices import group_device
from minddp.model_sync import ModelMismatch, broadcast_from_first, check_same_model, shapes
from minddp import python_reducer
from minddp.reducer import Phase, Reducer
from minddp.reduction import HookReduction, bucket_storage
from minddp.replicas import (DEFAULT_INTERVAL, ReplicaCheck, interval_of, keeps_replicas_apart,
                             renormalised_in_forward)
from minddp.timeline import align as align_clocks
from minddp.timeline import from_environment

log = logging.getLogger("minddp")
# torch's class, taken from its defining module, which replace_torch_ddp() never rebinds.
TorchDDP = nn.parallel.distributed.DistributedDataParallel


class DistributedDataParallel(TorchDDP):
    """Data-parallel wrapper: after `loss.backward()` every `.grad` is the mean over ranks.

    A subclass of torch's DistributedDataParallel whose constructor never runs
    torch's (docs/design.md, "Why a subclass"): frameworks that test
    `isinstance(model, DistributedDataParallel)` before they unwrap it or call
    its reducer (Lightning, Accelerate, the HF Trainer) take minddp's wrapper
    for torch's, and every torch method they reach is minddp's own.

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
    bounds every wait for a peer in minddp's own communication (default: the
    process group's; the buffer broadcast and a comm hook's collectives run on
    the wrapped group and wait its timeout, as in torch's DDP), `timeline`
    is a path prefix for a Chrome trace of this rank's buckets (default:
    $MINDDP_TIMELINE), `check_replicas` compares the ranks' weights bit for bit
    every so many synced steps and raises on every rank if they differ (0 or
    None: never; replicas.py).
    """

    _use_python_reducer = False  # optimize_ddp="python_reducer" (also: older pickles)
    _lazy_init_ran = False  # as torch's: the first forward takes over optim_in_backward's
    _ddp_sink_clone = True  # for pickles from before _set_ddp_sink_clone
    _rebuilt_when_copied = False  # see _has_rebuilt_buckets

    def __init__(self, module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=None, init_sync=True, process_group=None, bucket_cap_mb=None,
                 find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None,
                 *, algorithm="auto", compression=None, timeout=None, timeline=None,
                 check_replicas=DEFAULT_INTERVAL):
        nn.Module.__init__(self)  # not torch's DDP constructor: minddp builds its own parts
        self._join_config = _JoinConfig.construct_disabled_join_config()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("minddp: the default process group is not initialised; call "
                               "torch.distributed.init_process_group() (torchrun sets the "
                               "environment for it) before wrapping the model.")
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
            self.device_mesh = device_mesh
            process_group = device_mesh.get_group(mesh_dim=0)
            if device_mesh._get_root_mesh() != device_mesh:
                # The data-parallel slice of a larger mesh (DDP + tensor parallel): as torch's
                # DDP, turn the DTensor parameters into their local shards, which are what
                # this slice's ranks hold alike and reduce.
                from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

                _pre_dp_module_transform(module)
        group = process_group if process_group is not None else dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):  # torch's DDP: a TypeError from C++
            what = ("dist.GroupMember.NON_GROUP_MEMBER: this rank is not in that group, and "
                    "only the group's ranks wrap the model" if
                    group is dist.GroupMember.NON_GROUP_MEMBER else
                    f"{type(group).__name__} {group!r}")
            raise TypeError(f"minddp (rank {dist.get_rank()}): process_group must be a "
                            f"torch.distributed.ProcessGroup (dist.new_group(ranks) makes "
                            f"one), got {what}.")
        if not comm.registered(group):
            raise ValueError(
                f"minddp (rank {group.rank()} of process_group): process_group {group!r} is "
                f"not registered with torch.distributed (a ProcessGroup built directly, not by "
                f"dist.new_group or init_process_group): minddp reduces on process groups of "
                f"its own over the same ranks, so it needs the group's global ranks. Create "
                f"the group with dist.new_group(ranks), or use torch's DDP for this one.")
        rank = dist.get_rank(group)
        arguments.refuse_unimplemented(
            rank, delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision)
        # optimize_ddp="python_reducer": the compiler reduces (python_reducer.py)
        self._use_python_reducer = python_reducer.active()
        self._ddp_sink_clone = True  # torch's default; _set_ddp_sink_clone
        if self._use_python_reducer:
            python_reducer.configure(bucket_cap_mb, bucket_cap_mb_list)
        # skip_all_reduce_unused_params and batched_grad_copy only make torch's
        # DDP faster; minddp accepts them and gives the same gradients without.
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module "
                          "is deprecated. Please avoid using it.", FutureWarning, stacklevel=2)
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        if isinstance(module, TorchDDP):
            raise ValueError(
                f"minddp (rank {rank}): the module is already a DistributedDataParallel "
                f"({type(module).__module__}.{type(module).__qualname__}); wrapping it again "
                f"would reduce every gradient twice. Wrap the bare model (its .module) once.")
        named = self._trainable(module)
        self.bucket_bytes_cap_default = bucket_cap_mb is None  # torch's attributes, as torch
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params  # sets them
        self.batched_grad_copy, self.mixed_precision = batched_grad_copy, mixed_precision
        self.is_multi_device_module = False  # refused below: a bucket is on one device
        self.broadcast_bucket_size = 250 * 1024 * 1024
        bucket_cap_mb = 25 if bucket_cap_mb is None else bucket_cap_mb
        arguments.check_arguments(named, rank, device_ids, output_device, bucket_cap_mb,
                                  bucket_cap_mb_list, algorithm, compression)
        self.forward_sync_buffers, sync_buffers_at_init = arguments.buffer_sync(
            broadcast_buffers, forward_sync_buffers)
        self.module = module
        self._assign_modules_buffers()
        self.device = named[0][1].device
        if self.device.type == "cpu" and any(isinstance(m, nn.SyncBatchNorm)
                                             for m in module.modules()):
            raise ValueError(f"SyncBatchNorm layers only work with GPU modules (minddp, rank "
                             f"{rank}: as torch's DDP; on CPU use BatchNorm, e.g. build the "
                             f"model without nn.SyncBatchNorm.convert_sync_batchnorm)")
        self.device_ids = None if device_ids is None or self.device.type == "cpu" else [
            arguments.index(d) for d in device_ids]
        self.output_device = None if self.device_ids is None else arguments.index(
            output_device if output_device is not None else device_ids[0])
        self.dim = dim
        self.process_group = group
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = False
        self.algorithm, self.compression = algorithm, compressing.settings(compression)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        # "auto": buckets planned from the first iterations (overlap.py).
        self._plan_buckets = bucket_cap_mb == "auto"
        # torch's: the largest of a bucket_cap_mb_list (DDPOptimizer cuts graphs by it)
        cap_mb = (overlap.PROBE_CAPS_MB[-1] if self._plan_buckets else
                  max(bucket_cap_mb_list) if bucket_cap_mb_list else bucket_cap_mb)
        self.bucket_bytes_cap = int(cap_mb * 1024 * 1024)
        self.bucket_bytes_cap_list = [int(c * 1024 * 1024) for c in bucket_cap_mb_list or []]
        self._join = None  # the active join() context, if any
        self._generic_join = None  # what a torch Join([self, ...]) drives (join_hook)
        self._timeout = timeout
        self.check_replicas = interval_of(check_replicas, rank)
        self.world_size = dist.get_world_size(group)
        self.timeline = from_environment(rank, timeline)
        settings = {"bucket_cap_mb": bucket_cap_mb, "algorithm": algorithm,
                    "compression": str(self.compression),
                    "find_unused_parameters": find_unused_parameters,
                    "gradient_as_bucket_view": gradient_as_bucket_view,
                    "static_graph": static_graph, "forward_sync_buffers": self.forward_sync_buffers,
                    "check_replicas": self.check_replicas, "bucket_cap_mb_list": bucket_cap_mb_list,
                    "sync_buffers_at_init": sync_buffers_at_init,
                    # broadcast at construction or before forwards, where they are synced (else
                    # they may differ, as in torch); frozen parameters are broadcast at
                    # construction and compared by the replica check
                    "buffers": (shapes(module.named_buffers(), self.parameters_to_ignore)
                                if sync_buffers_at_init or self.forward_sync_buffers else None),
                    "frozen parameters": shapes(((n, p) for n, p in module.named_parameters()
                                                 if not p.requires_grad),
                                                self.parameters_to_ignore)}
        self._ranks = "-".join(map(str, dist.get_process_group_ranks(self.process_group)))
        self._take_name()
        with _current(self.device):
            self._join_peers(named, settings, rank, init_sync, sync_buffers_at_init)
            if self.world_size > 1:  # one clock for diagnose.py, where any rank records
                align_clocks(self.timeline, self.engine.check_group)
            self._build_reducer(named, static_graph)
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
            renew = False  # init_sync=False: no collective to agree on a new engine in
            if init_sync:
                # An engine stopped by an earlier wrapper's error is replaced, on every rank
                # at once: as under torch's DDP, a new wrapper over healthy ranks trains.
                renew = check_same_model(named, settings, self.process_group, comm.failed_engine(
                    self.process_group, self._timeout, self.device))
                broadcast_from_first([p.data for p in self._parameters_to_sync()] +
                                     (self.modules_buffers if sync_buffers else []),
                                     self.process_group)
            self.engine = comm.engine_for(self.process_group, self._timeout, self.device, renew)
        except ModelMismatch:
            raise
        except Exception as e:
            raise RuntimeError(
                f"minddp (rank {rank}): start-up agreement with the other ranks failed: a peer "
                f"died or did not construct the wrapper within the process group's timeout, "
                f"or this rank could not take part (the cause says which). "
                f"Cause: {first_line(e)}") from e

    def _build_reducer(self, named, static_graph):
        """The buckets, the reduction and the reducer (construction and unpickling)."""
        group = self.engine.group
        rank = dist.get_rank(self.process_group)
        planned = self._plan_buckets and self.world_size > 1
        limits = (overlap.probe_limits() if planned else
                  self.bucket_bytes_cap_list or bucketing.caps(self.bucket_bytes_cap))
        reduction = compressing.reduction(self.compression, self.engine, self.algorithm, group,
                                          f"algorithm {self.algorithm!r}", self.timeline,
                                          self.world_size)
        buckets = bucketing.build([p for _, p in named], limits, stamp=self.world_size > 1,
                                  sparse=bucketing.expect_sparse_gradient(self.module, named),
                                  # no shared-memory files where nothing will sum in them
                                  zeros=None if self._use_python_reducer else
                                  bucket_storage(reduction, self.gradient_as_bucket_view))
        device = self.engine.device
        count_used = functools.partial(_sum_on_engine, self.engine, device, "used-map")
        sum_step = functools.partial(_sum_async, self.engine.check_group,
                                     group_device(self.engine.check_group))
        progress = (PeerProgress(self.process_group, self._member)
                    if self.world_size > 1 else None)
        self.reducer = Reducer(
            named, buckets, reduction, rank=rank, world_size=self.world_size,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view, static_graph=static_graph,
            count_used=count_used, sum_step=sum_step if self.world_size > 1 else None,
            timeline=self.timeline, progress=progress,
            planner=self._planned_buckets if planned else None,
            replicas=self._replica_check(rank))
        self.logger = DDPLogger(self)  # what DDP logs about itself (logging_data.py)
        self.reducer.logger = self.logger
        if self._use_python_reducer:  # as torch: its reducer is never armed
            self.reducer.close()
            self._accum_grad_hooks = python_reducer.register(self, [p for _, p in named])
            # dynamo traces the module's forward whole: nothing of the wrapper's runs
            self.__dict__["forward"] = self.module.__call__
            return
        try:  # algorithm="auto" times its candidates here, with every peer
            reduction.setup(self.reducer.buckets, provisional=planned)
        except Exception as e:
            raise RuntimeError(
                f"minddp (rank {rank}): setting up {self.algorithm!r} with the other ranks "
                f"failed while building the wrapper (a peer that died or stalled, or the cause "
                f"here). Cause: {first_line(e)}") from e

    def _replica_check(self, rank):
        """Every check_replicas synced steps, compare the ranks' weights (replicas.py)."""
        interval = self.__dict__.get("check_replicas", DEFAULT_INTERVAL)  # older pickles
        if not interval or self.world_size == 1:
            return None
        named = [(n, p) for n, p in self.module.named_parameters()
                 if n not in self.parameters_to_ignore]
        return ReplicaCheck(named, self.engine, interval, rank, self.world_size,
                            renormalised=renormalised_in_forward(self.module))

    def _planned_buckets(self, ready_times):
        """bucket_cap_mb="auto", once, on every rank together: measure the link as
        buckets use it, agree on ready times and link costs, plan, and build the
        planned buckets (overlap.py)."""
        return overlap.planned_buckets(self.engine, self.reducer, self.device,
                                       dist.get_rank(self.process_group), self.timeline,
                                       ready_times)

    def _take_name(self):
        """Name this wrapper's entries in the store (health.py). Constructions are
        collective over the group's ranks, so the count, and the name, is the same
        on each of them."""
        self._member = f"{self._ranks}/{groups.number(('wrapper', self._ranks))}"

    def _parameters_to_sync(self):
        return [p for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    def _named_buffers_to_sync(self):
        return {n: b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore}

    def _buffers_to_sync(self):
        """The module's buffers (those not ignored) as they are now."""
        return list(self._named_buffers_to_sync().values())

    def _assign_modules_buffers(self):
        """torch's: read the module's buffers (those not ignored) again, since a module may
        have reassigned one (torch issue 63916)."""
        self.named_module_buffers = self._named_buffers_to_sync()
        self.modules_buffers = list(self.named_module_buffers.values())

    def will_sync_module_buffers(self):
        """torch's rule: buffers are broadcast before a forward only where the module had
        some when wrapped (a module without buffers is not searched every forward; one
        given a buffer later is not synced, in torch's DDP as here)."""
        return (self.require_forward_param_sync and self.forward_sync_buffers and
                len(self.modules_buffers) > 0)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore):
        """torch's way to keep parameters and buffers (by qualified name) out of
        synchronisation: set on the module before wrapping it."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True  # read by other torch.distributed parts

    def _set_ddp_sink_clone(self, val):
        """torch's private switch: False hands the module's outputs through the sink
        as they are, saving a copy of each, for a loss that is not modified in place."""
        self._ddp_sink_clone = val

    def _set_static_graph(self):
        """torch's private switch, also set by static_graph=True: the graph is the
        same every iteration (see reducer.py)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if self.reducer.iterations or self.reducer.phase is not Phase.IDLE:
            self._log_and_throw(RuntimeError, f"minddp (rank {self.reducer.rank}): "
                                f"_set_static_graph() should be called before training loop "
                                f"starts and after DistributedDataParallel is constructed; pass "
                                f"static_graph=True to the constructor instead.")
        self.static_graph = True
        self.reducer.set_static_graph()
        self.logger._set_static_graph()
        if self.find_unused_parameters:
            warnings.warn("You passed find_unused_parameters=true to DistributedDataParallel, "
                          "`_set_static_graph` will detect unused parameters automatically, "
                          "so you do not need to set find_unused_parameters=true, just be sure "
                          "these unused parameters will not change during training loop while "
                          "calling `_set_static_graph`.", stacklevel=2)

    # -- forward -----------------------------------------------------------------
    # torch's order: the finished-backward check, join's notice and the buffer
    # broadcast before the module runs; whether this step synchronises is read
    # after it, since the module may switch it (Lightning's manual optimisation
    # and accumulation do).
    @torch._disable_dynamo(recursive=False)  # see _pre_forward
    def forward(self, *inputs, **kwargs):
        with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
            inputs, kwargs = self._pre_forward(*inputs, **kwargs)
            with _compiled_in_buckets(self):
                outputs = self.module(*inputs, **kwargs)
            return self._post_forward(outputs)

    # Under torch.compile dynamo compiles the module's forward only, as with
    # torch's DDP: forward's own frame is skipped (recursive=False: what it
    # calls is still compiled) and the wrapper's bookkeeping runs eagerly.
    @torch._disable_dynamo
    def _pre_forward(self, *inputs, **kwargs):
        if self._use_python_reducer:  # as torch's; replicate() calls this
            return inputs, kwargs
        if not self._lazy_init_ran:  # as torch's _lazy_init, at the first forward
            self._lazy_init_ran = True
            self._setup_in_backward_optimizers()
        grad_enabled = torch.is_grad_enabled()
        recomputing = grad_enabled and self._recomputing()
        if grad_enabled and not recomputing:
            self.reducer.check_finished()
            _refuse_outer_wrapper(self)
        synced = grad_enabled and self.require_backward_grad_sync and not recomputing
        if synced and self.reducer.closed:  # torch's DDP would train on apart, silently
            self._log_and_throw(RuntimeError, (
                f"minddp (rank {self.reducer.rank}): this wrapper's gradient hooks were removed "
                f"(close(), the end of its `with` block, or _remove_autograd_hooks()), so its "
                f"backward would not synchronise gradients and the ranks would part. Wrap the "
                f"module again (minddp.DDP(ddp.module, ...)), or run this forward under "
                f"no_sync() or torch.no_grad()."))
        if synced:
            self.logger.forward_start()  # logs the layout as it was before this forward
        if grad_enabled:
            self.reducer.forward_started()
        buffers = []
        if hasattr(self, "buffer_hook"):  # torch's: the hook, before or after, not the broadcast
            if self._check_sync_bufs_pre_fwd():
                self._sync_buffers()
        elif self.world_size > 1 and self.will_sync_module_buffers():
            self._assign_modules_buffers()
            buffers = self.modules_buffers
        # torch's DDP, once any join has been entered, takes buffers from the highest rank
        # (its _join_config stays enabled after the join ends).
        source = self.world_size - 1 if self._join_config.enable else 0
        self._divisor = self.world_size
        join = self._join
        if join is None and self._generic_join is not None:  # inside torch's Join([self])
            TorchJoin.notify_join_context(self)  # count in first, as torch's DDP
            join = self._generic_join
        if join is not None:  # uneven inputs: tell the joined ranks what comes
            source, self._divisor = join.before_forward(bool(buffers), synced)
        if buffers:
            # As torch's: the broadcast leaves the buffers' version counters alone, so a
            # module run twice before one backward (BatchNorm on two views of a batch)
            # does not find its saved running stats "modified by an inplace operation".
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(
                    tuple(buffers)):
                broadcast_from_first(buffers, self.process_group, src=source)
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs),
                                        torch.device(self.device.type, self.device_ids[0]))
        return inputs, kwargs

    def _register_buffer_comm_hook(self, state, hook,
                                   comm_hook_location=_BufferCommHookLocation.POST_FORWARD):
        """torch's private seam: `hook(state, named_buffers)` syncs the buffers before or
        after each forward in place of the broadcast from rank 0. Futures it returns are
        waited for at the end of the next synced backward (Reducer.install_futures)."""
        if self._join is not None or self._generic_join is not None:
            self._refuse_buffer_hook_with_join()
        super()._register_buffer_comm_hook(state, hook, comm_hook_location)

    def _refuse_buffer_hook_with_join(self):
        self._log_and_throw(NotImplementedError, (
            f"minddp (rank {self.reducer.rank}): a buffer comm hook "
            f"(_register_buffer_comm_hook) and join() do not go together in minddp: a joined "
            f"rank would not run the hook's collectives, and its peers would wait for them. "
            f"Use join() without the hook, or the hook with even inputs."))

    def _setup_in_backward_optimizers(self):
        """Optimizers from `_apply_optimizer_in_backward` step at finalize, on the
        averaged gradients, not in their own hooks on this rank's (optim_in_backward.py)."""
        self.reducer.stepped_in_backward = optim_in_backward.take_over(self.reducer.params)

    def _recomputing(self):
        """A forward run while this wrapper's own backward runs: autograd recomputing it
        for activation checkpointing around the whole wrapper
        (`checkpoint(ddp, x, use_reentrant=False)`; with static_graph the backward has
        begun before any gradient). It belongs to the step under way, so it neither
        checks that the previous one finished nor arms a new one; buffers are broadcast
        as in any forward, as torch's DDP does."""
        return (self.reducer.phase is Phase.RUNNING and
                torch._C._current_graph_task_id() != -1)

    @torch._disable_dynamo
    def _post_forward(self, outputs):
        if self._use_python_reducer:
            return outputs
        if self._check_sync_bufs_post_fwd():  # only with a buffer hook (torch's)
            self._sync_buffers()
        if torch.is_grad_enabled() and self._recomputing():
            return outputs
        if not (torch.is_grad_enabled() and self.require_backward_grad_sync):
            self.require_forward_param_sync = False
            return outputs
        self.require_forward_param_sync = True
        self.reducer.prepare_for_backward(outputs, self._divisor)
        self.logger.backward_armed(self.reducer)
        if self.reducer.find_unused or self.reducer.in_first_static_iteration:
            outputs = _through_sink(outputs, weakref.ref(self.reducer), self._ddp_sink_clone)
        return outputs

    # -- the torch API around the reducer ---------------------------------------
    def join(self, divide_by_initial_world_size=True, enable=True,
             throw_on_early_termination=False):
        """Context manager for uneven inputs: ranks that run out of batches keep
        matching the others' communication until every rank is done (join.py)."""
        self.logger._set_uneven_input_join()  # also when not enabled, as torch logs it
        if enable and hasattr(self, "buffer_hook"):
            self._refuse_buffer_hook_with_join()
        # torch's join is Join([self]), which leaves this config behind (see _pre_forward)
        self._join_config = _JoinConfig(enable=enable,
                                        throw_on_early_termination=throw_on_early_termination,
                                        is_first_joinable=True)
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
        try:
            arguments.check_comm_hook(hook)
        except (TypeError, ValueError) as e:
            self.logger.set_error_and_log(f"{type(e)}: {e}")
            raise
        self._refuse_second_hook("register_comm_hook", "register_builtin_comm_hook")
        if self._use_python_reducer:  # torch's fails at backward, in the hook
            self._log_and_throw(NotImplementedError, (
                f"minddp (rank {self.reducer.rank}): comm hooks do not run under "
                f"torch._dynamo.config.optimize_ddp='python_reducer' (torch's DDP calls them "
                f"with (grad, param), which hooks written for buckets cannot take); leave the "
                f"hook out, or choose another optimize_ddp before building the wrapper."))
        self.reducer.set_reduction(HookReduction(state, hook))
        self.logger._set_comm_hook_name(getattr(hook, "__qualname__", type(hook).__qualname__))
        if self.reducer.replicas is not None and keeps_replicas_apart(state, hook):
            self.reducer.replicas = None  # every rank registers the same hook: off everywhere
            log.info("minddp: check_replicas is off: the comm hook (local SGD, or no "
                     "communication) lets the ranks' weights differ by design")

    def _register_builtin_comm_hook(self, comm_hook_type):
        """torch's C++ built-in hooks, as the Python hooks that do the same."""
        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        if comm_hook_type not in hooks:  # torch's binding refuses the argument's type
            raise TypeError(f"_register_builtin_comm_hook(): incompatible function arguments: "
                            f"{comm_hook_type!r}; pass one of {list(hooks)} (minddp).")
        self._refuse_second_hook("register_builtin_comm_hook", "register_comm_hook")
        self.register_comm_hook(self.process_group, hooks[comm_hook_type])
        self.reducer.reduction.name = str(comm_hook_type)
        self.logger._set_comm_hook_name(str(comm_hook_type))

    def join_hook(self, divide_by_initial_world_size=True, **kwargs):
        """For torch's generic `Join([ddp, ...])` (with ZeroRedundancyOptimizer, say): the
        hook a joined rank runs to match the others' steps (join.JoinHook). torch's Join
        raises early termination itself, so minddp's join here never throws."""
        self.logger._set_uneven_input_join()
        if hasattr(self, "buffer_hook"):
            self._refuse_buffer_hook_with_join()
        self._generic_join = Join(self, divide_by_initial_world_size, False)
        return JoinHook(self._generic_join)

    def _get_ddp_logging_data(self):
        """torch's dict of what DDP logs about itself, with minddp's values
        (logging_data.py says which keys and when)."""
        return self.logger._get_ddp_logging_data()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate):
        """Runtime stats in the first 10 synced iterations, then every
        `sample_rate`-th (default 100); at least 1."""
        try:
            self.logger.set_sample_rate(sample_rate)
        except ValueError as e:
            self._log_and_throw(ValueError, str(e))

    def _refuse_second_hook(self, called, other):
        """torch's reducer takes one hook; its message (logged as it is: torch's C++ check
        logs no type) names the method called second."""
        if isinstance(self.reducer.reduction, HookReduction):
            message = f"{called} or {other} can only be called once."
            self.logger.set_error_and_log(message)
            raise RuntimeError(message)

    def _log_and_throw(self, err_type, err_msg):
        """Note the error in the logging data, then raise it (torch's helper)."""
        self.logger.set_error_and_log(f"{err_type}: {err_msg}")
        raise err_type(err_msg)

    # Read by torch's inherited scatter / to_kwargs; minddp moves inputs itself.
    use_side_stream_for_tensor_copies = False

    @property
    def device_type(self):
        return self.device.type

    def _check_reducer_finalized(self):
        """torch's private check that no backward is half way through."""
        if self.reducer.phase is Phase.RUNNING:
            raise RuntimeError(f"minddp (rank {self.reducer.rank}): the reducer has not "
                               f"finalized the previous backward pass.")

    @property
    def broadcast_buffers(self):
        return self.forward_sync_buffers

    @property
    def _has_rebuilt_buckets(self):
        """torch's flag that the bucket layout is final (ZeRO's hook_with_zero_step waits
        for it before it maps buckets to its shards). torch's is an attribute, so a copy
        (deepcopy, pickle) of a wrapper that had rebuilt starts with it true."""
        return self._rebuilt_when_copied or self.reducer.layout_settled

    @broadcast_buffers.setter
    def broadcast_buffers(self, value):
        self.forward_sync_buffers = value

    def close(self):
        """Remove this wrapper's gradient hooks (also done when it is garbage
        collected): the model can then be wrapped again."""
        reducer = self.__dict__.get("reducer")
        if reducer is not None:
            reducer.close()
        for handle in self.__dict__.get("_accum_grad_hooks", ()):
            handle.remove()

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
        for key in ("process_group", "reducer", "engine", "_join", "_generic_join", "timeline",
                    "logger", "_accum_grad_hooks"):
            state.pop(key, None)
        if self._use_python_reducer:
            state.pop("forward", None)  # the module's, set again on load
        state["_static_graph"] = state.pop("static_graph")
        state["_rebuilt_when_copied"] = self._has_rebuilt_buckets
        return state

    def __setstate__(self, state):
        static_graph = state.pop("_static_graph")
        nn.Module.__setstate__(self, state)  # not torch DDP's: it would build torch's reducer
        self._assign_modules_buffers()  # older pickles lack the list
        self.process_group = dist.group.WORLD
        self._join, self._generic_join, self.static_graph = None, None, False
        self.timeline = None
        self._lazy_init_ran = False  # the new reducer takes optimizers over afresh
        self._take_name()  # the original may live on beside this copy
        with _current(self.device):
            self.engine = comm.engine_for(self.process_group, self._timeout, self.device)
            self._build_reducer(self._trainable(self.module), static_graph)
        if static_graph:
            self._set_static_graph()


# torch DDP's private methods that minddp's wrapper does not provide: inherited,
# they would run torch's code on parts minddp does not have, so each raises.
_TORCH_PRIVATE_NOT_PROVIDED = (
    "_register_accum_grad_hook", "_delayed_all_reduce_hook", "_register_delay_all_reduce_hook",
    "_fire_reducer_autograd_hook", "_root_copy_hook",
    "_module_wait_for_copy_hook", "_ddp_init_helper",
    "_get_parameters", "_run_ddp_forward", "_clear_grad_buffer", "_lazy_init",
    "_check_global_requires_backward_grad_sync", "_check_and_sync_module_buffers",
    "_sync_final_model", "_match_all_reduce_for_bwd_pass", "_match_unused_params_allreduce",
    "_passing_sync_batchnorm_handle", "_set_sparse_metadata", "_update_process_group",
)


def _not_provided(name):
    def method(self, *args, **kwargs):
        raise NotImplementedError(
            f"minddp: torch DDP's private {name}() is not part of minddp's wrapper, whose "
            f"reducer is its own (docs/differences.md); use "
            f"torch.nn.parallel.DistributedDataParallel where you need it.")
    method.__name__ = name
    return method


for _name in _TORCH_PRIVATE_NOT_PROVIDED:
    setattr(DistributedDataParallel, _name, _not_provided(_name))


class _DDPSink(torch.autograd.Function):
    """The wrapper's outputs pass through here when it needs to see backward
    start (static_graph) or undefined gradients reach the parameters behind an
    output the loss ignores (find_unused_parameters), as torch's _DDPSink does."""

    @staticmethod
    def forward(ctx, reducer_ref, clone, *tensors):
        ctx.set_materialize_grads(False)  # an ignored output's gradient stays None
        ctx.reducer_ref = reducer_ref
        # Copies, as torch's sink makes unless told not to: a loss modified in
        # place must not modify the sink's own output.
        return tuple(t.clone() for t in tensors) if clone else tensors

    @staticmethod
    def backward(ctx, *grads):
        reducer = ctx.reducer_ref()
        if reducer is not None:
            reducer.sink_backward()
        return (None, None, *grads)


def _through_sink(outputs, reducer_ref, clone):
    """`outputs` with every tensor in autograd's graph passed through the sink. An output
    that is a parameter itself goes in too but comes back as it was (torch's rule): the
    sink's backward then hands that parameter an undefined gradient, which counts as its
    hook firing (static_graph counts it used; find_unused_parameters, having marked it
    unused, raises that it was marked twice, as torch's DDP does)."""
    leaves, spec = pytree.tree_flatten(outputs)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and
          (leaf.grad_fn is not None or leaf.requires_grad)]
    if not at:
        return outputs
    passed = _DDPSink.apply(reducer_ref, clone, *[leaves[i] for i in at])
    for i, tensor in zip(at, passed):
        if leaves[i].grad_fn is not None:
            leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec)


@contextlib.contextmanager
@torch._disable_dynamo(recursive=False)  # torch's _inside_ddp_forward: the module still compiles
def _compiled_in_buckets(wrapper):
    """While the module runs, torch.compile takes `wrapper` for the active DDP
    (torch's own wrapper does the same): dynamo's DDPOptimizer then cuts the
    module's graph where `bucket_bytes_cap` ends a bucket. One compiled graph
    would give every gradient at the end of its backward, so no bucket could be
    reduced while backward still runs. DDPOptimizer refuses a cap below its
    first bucket's (1 MiB): below it minddp leaves the graph whole, where
    torch's DDP raises."""
    active = TorchDDP._active_ddp_module
    if wrapper.bucket_bytes_cap >= dist._DEFAULT_FIRST_BUCKET_BYTES:
        TorchDDP._active_ddp_module = wrapper
    try:
        yield
    finally:
        TorchDDP._active_ddp_module = active


def _refuse_outer_wrapper(ddp):
    """Raise if torch's DDP is running this wrapper inside its own forward over the
    same parameters (a framework wrapped minddp's wrapper again: Accelerate given
    it without replace_torch_ddp()); each gradient would be reduced twice. An
    outer DDP over other parameters (nested wrappers, as TorchRec builds) is fine."""
    outer = TorchDDP._active_ddp_module  # set by torch's DDP while its module runs
    if outer is None or outer is ddp:
        return
    ignored = getattr(outer, "parameters_to_ignore", ())
    theirs = {id(p) for n, p in outer.module.named_parameters() if n not in ignored}
    shared = [n for n, p in ddp._trainable(ddp.module) if id(p) in theirs]
    if shared:
        raise RuntimeError(
            f"minddp (rank {ddp.reducer.rank}): another DistributedDataParallel "
            f"({type(outer).__module__}) is running minddp's wrapper inside its forward and "
            f"both reduce '{shared[0]}' (and "
            f"{len(shared) - 1} more): every gradient would be reduced twice. Give the "
            f"framework the bare model; to have it build minddp's wrapper, call "
            f"minddp.replace_torch_ddp() first (README, 'With Lightning, Accelerate, the "
            f"HF Trainer').")


def _sum_async(group, device, tensor):
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


def _to_device(obj, device):
    return pytree.tree_map(
        lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, obj)
