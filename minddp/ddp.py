"""The wrapper: minddp.DistributedDataParallel, a drop-in for torch's.

Construction checks the model and the settings on every rank, broadcasts rank
0's parameters and buffers, opens a process group for gradient traffic and
hands the parameters to a Reducer (reducer.py), which does the real work.
"""
import contextlib
import datetime

import torch
import torch.distributed as dist
from torch import nn

from minddp import algorithms
from minddp import compression as compressing
from minddp.algorithms import lanes
from minddp.comm import CommEngine
from minddp.health import PeerProgress
from minddp.join import Join
from minddp.model_sync import broadcast_from_first, check_same_model
from minddp.reducer import Reducer
from minddp.timeline import from_environment

COMPRESSIONS = (None, "fp16", "bf16")


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper: after `loss.backward()` every `.grad` is the mean over ranks.

    Every rank of `process_group` (default: the world) must construct it with
    the same model and arguments. Keywords mean what they mean in torch's DDP;
    `algorithm` picks the all-reduce ("native" is the backend's own, "auto"
    chooses), `compression` sends gradients as fp16/bf16. `in_place_mb`: our
    own algorithms reduce gradients of at least this many MiB where they lie in
    `.grad`, with no copy through the bucket (None: never; such a `.grad` holds
    partial sums until backward returns, see reducer.py). `timeout` bounds the
    wait for a peer (default: the process group's); `timeline` is a path prefix
    for a Chrome trace of this rank's buckets (default: $MINDDP_TIMELINE).
    """

    def __init__(self, module, device_ids=None, output_device=None, broadcast_buffers=True,
                 process_group=None, bucket_cap_mb=25, find_unused_parameters=False,
                 gradient_as_bucket_view=False, algorithm="auto", compression=None,
                 in_place_mb=1, timeout=None, timeline=None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("minddp: the default process group is not initialised; call "
                               "torch.distributed.init_process_group() (torchrun sets the "
                               "environment for it) before wrapping the model.")
        group = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._check_arguments(module, named, rank, device_ids, bucket_cap_mb, algorithm,
                              compression, in_place_mb)
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.broadcast_buffers = broadcast_buffers
        self.process_group = group
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.algorithm, self.compression = algorithm, compression
        self.require_backward_grad_sync = True
        # torch broadcasts buffers only in a forward that follows a synced
        # forward (its require_forward_param_sync); kept for exact parity.
        self._sync_buffers_next = True
        self._join = None  # the active join() context, if any
        self.world_size = dist.get_world_size(group)

        settings = {"bucket_cap_mb": bucket_cap_mb, "algorithm": algorithm,
                    "compression": compression, "find_unused_parameters": find_unused_parameters,
                    "gradient_as_bucket_view": gradient_as_bucket_view,
                    "broadcast_buffers": broadcast_buffers, "in_place_mb": in_place_mb}
        self.comm_group = self._join_peers(module, named, settings, group, rank, timeout)
        # A Chrome trace of this rank's buckets (timeline.py), if asked for.
        self.timeline = from_environment(rank, timeline)
        self.engine = CommEngine(self.comm_group, timeline=self.timeline)
        # Per-bucket all-reduce; "auto" measures the links here (every rank at once).
        if compression is None:
            job = algorithms.planner(algorithm, self.comm_group)
        else:
            job = compressing.all_reduce_job(algorithm, self.comm_group, compression)
        used_job = algorithms.ALGORITHMS["native"].all_reduce_async
        self.reducer = Reducer(
            named, world_size=self.world_size, rank=rank,
            bucket_cap_bytes=int(bucket_cap_mb * 1024 * 1024),
            reduce=lambda buffer, label: self.engine.submit(job, buffer, self.comm_group,
                                                            label=label),
            reduce_used=lambda used, label: self.engine.submit(used_job, used, self.comm_group,
                                                               label=label),
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view, describe=f"algorithm {algorithm!r}",
            in_place_bytes=None if in_place_mb is None else int(in_place_mb * 1024 * 1024),
            takes_pieces=getattr(job, "takes_pieces", None),
            timeline=self.timeline,
            progress=PeerProgress(group, self.comm_group) if self.world_size > 1 else None)
        if getattr(job, "chooser", None) is not None:
            # auto: time the candidates on each bucket size now, every rank
            # at once, rather than inside the first backward.
            # Native would copy in-place gradients back from the bucket: timed too.
            job.chooser.tune([bucket.buffer for bucket in self.reducer.buckets],
                             copied=[bucket.large_bytes for bucket in self.reducer.buckets])

    @staticmethod
    def _join_peers(module, named, settings, group, rank, timeout):
        """Agree on the model, take rank 0's weights, open the gradient process group.

        Every rank of `group` must call it; a peer that dies or never arrives
        turns into an error here (within the group's timeout), not a hang.
        """
        timeout = timeout if timeout is not None else lanes.timeout_of(group)
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        try:
            check_same_model(named, settings, group)
            broadcast_from_first([p.data for _, p in module.named_parameters()] +
                                 list(module.buffers()), group)
            comm_group = dist.new_group(dist.get_process_group_ranks(group),
                                        backend=dist.get_backend(group), timeout=timeout,
                                        use_local_synchronization=group is not dist.group.WORLD)
            lanes.open_lanes(comm_group)  # here, not on first use in the comm thread
            return comm_group
        except ValueError:
            raise  # a mismatch, already explained
        except Exception as e:
            raise RuntimeError(
                f"minddp (rank {rank}): start-up agreement with the other ranks failed: a peer "
                f"died or did not construct the wrapper within the process group's timeout. "
                f"Cause: {str(e).splitlines()[0]}") from e

    @staticmethod
    def _check_arguments(module, named, rank, device_ids, bucket_cap_mb, algorithm, compression,
                         in_place_mb):
        where = f"minddp (rank {rank})"
        if not named:
            raise ValueError(f"{where}: the module has no parameter that requires grad, so "
                             f"there is nothing to synchronise; wrap a trainable module.")
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            placed = ", ".join(f"{n} on {p.device}" for n, p in named[:4])
            raise ValueError(f"{where}: parameters live on several devices ({placed}, ...); "
                             f"move the whole module to one device before wrapping it.")
        device = devices.pop()
        if device.type == "meta":
            raise ValueError(f"{where}: the module is on the meta device; materialise it "
                             f"(module.to_empty(device=...)) and initialise it first.")
        if device_ids is not None and (device.type == "cpu" or len(device_ids) != 1 or
                                       torch.device(device.type, device.index) !=
                                       torch.device(device.type, _index(device_ids[0]))):
            raise ValueError(f"{where}: device_ids={device_ids!r} does not match the module's "
                             f"device {device}; pass device_ids=None for CPU modules, or "
                             f"[the single GPU the module is on].")
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"{where}: bucket_cap_mb must be a positive number of MiB, "
                             f"got {bucket_cap_mb!r}.")
        if in_place_mb is not None and (not isinstance(in_place_mb, (int, float)) or
                                        in_place_mb < 0):
            raise ValueError(f"{where}: in_place_mb must be a number of MiB >= 0, or None to "
                             f"copy every gradient through its bucket; got {in_place_mb!r}.")
        if algorithm not in algorithms.CHOICES:
            raise ValueError(f"{where}: unknown algorithm {algorithm!r}; choose one of "
                             f"{list(algorithms.CHOICES)}.")
        algorithms.resolve(algorithm)  # raises, naming the choices, for an unknown name
        if compression not in COMPRESSIONS:
            raise ValueError(f"{where}: unknown compression {compression!r}; choose one of "
                             f"{list(COMPRESSIONS)}.")

    # -- forward -----------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        self.reducer.check_finished()
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs), torch.device("cuda", _index(self.device_ids[0])))
        self._check_parameters_unchanged()
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        buffers = (list(self.module.buffers()) if self.broadcast_buffers and
                   self.world_size > 1 and self._sync_buffers_next else [])
        source = 0
        if self._join is not None:  # uneven inputs: tell the joined ranks what comes
            source = self._join.before_forward(bool(buffers), synced)
        if buffers:
            broadcast_from_first(buffers, self.process_group, src=source)
        outputs = self.module(*inputs, **kwargs)
        if synced:
            self.reducer.prepare(outputs)
        elif torch.is_grad_enabled():
            self.reducer.prepare_local()
        self._sync_buffers_next = synced
        return outputs

    def _check_parameters_unchanged(self):
        trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if len(trainable) != len(self.reducer.params) or any(
                p is not q for (_, p), q in zip(trainable, self.reducer.params)):
            known = {id(p) for p in self.reducer.params}
            added = [n for n, p in trainable if id(p) not in known] or ["(a parameter's "
                                                                       "requires_grad changed)"]
            raise RuntimeError(
                f"minddp (rank {self.reducer.rank}): the module's trainable parameters changed "
                f"after it was wrapped: {', '.join(added)}. minddp buckets parameters once, at "
                f"construction; finish building (and freezing) the model, then wrap it.")

    def join(self, divide_by_initial_world_size=True):
        """Context manager for uneven inputs: ranks that run out of batches keep
        matching the others' communication until every rank is done (join.py)."""
        return Join(self, divide_by_initial_world_size)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients locally; the next synced step reduces them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        self.reducer.in_no_sync = True
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
            self.reducer.in_no_sync = not previous

    def register_comm_hook(self, state, hook):
        """Use `hook(state, bucket) -> Future[Tensor]` to reduce each bucket (torch's protocol).

        The bucket's buffer holds the local sum of gradients (not divided by
        the world size); the future's value must be the averaged buffer.
        Must be called before the first backward, at most once.
        """
        if not callable(hook):
            raise TypeError(f"minddp: the comm hook must be callable, got {type(hook).__name__}")
        self.reducer.set_comm_hook(state, hook)

    def __del__(self):
        engine = self.__dict__.get("engine")
        if engine is not None:
            engine.close(timeout=1.0)


def _index(device_id):
    return device_id.index if isinstance(device_id, torch.device) else int(device_id)


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj
