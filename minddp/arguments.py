"""The wrapper's arguments: torch's checks with torch's exception types, and minddp's.

Every check runs on every rank at construction, before any collective, so a
bad argument is an error on each rank, never a hang.
"""
import inspect
import warnings

import torch
import torch.distributed as dist
from torch import nn

from minddp import compression as compressing
from minddp import registry
from minddp.grad_bucket import GradBucket

# From torch 2.13 on, forward_sync_buffers replaces broadcast_buffers; older
# torch has only the old name, and minddp's warnings follow the torch it runs on.
TORCH_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(
    nn.parallel.DistributedDataParallel.__init__).parameters


def buffer_sync(broadcast_buffers, forward_sync_buffers):
    """(sync buffers before each forward, sync them at construction), as torch decides."""
    if broadcast_buffers is not None and TORCH_HAS_FORWARD_SYNC:
        if forward_sync_buffers is not None:
            warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                          "`broadcast_buffers` is deprecated and its value is ignored when "
                          "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
        else:
            warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` "
                          "instead. IMPORTANT: unlike `broadcast_buffers=False`, "
                          "`forward_sync_buffers=False` still syncs buffers at init. If you "
                          "rely on buffers NOT being synced at init (e.g. rank-local buffers), "
                          "keep using `broadcast_buffers=False` until `init_sync_buffers` is "
                          "available.",
                          FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective


def refuse_unimplemented(rank, **given):
    for name, value in given.items():
        if value not in (None, False):
            raise NotImplementedError(
                f"minddp (rank {rank}): torch DDP's {name}= is not implemented by minddp "
                f"(docs/differences.md); leave it at its default or use "
                f"torch.nn.parallel.DistributedDataParallel.")


def check_arguments(named, rank, device_ids, output_device, bucket_cap_mb, bucket_cap_mb_list,
                    algorithm, compression):
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
    if device.type == "meta":  # torch's DDP fails here with a RuntimeError (Tensor.item())
        raise RuntimeError(f"{where}: the module is on the meta device; materialise it "
                           f"(module.to_empty(device=...)) and initialise it first.")
    if device.type == "cpu" and (device_ids or output_device):  # torch's test and words
        raise ValueError(f"DistributedDataParallel device_ids and output_device arguments only "
                         f"work with single-device/multiple-device GPU modules or CPU modules, "
                         f"but got device_ids {device_ids}, output_device {output_device}, and "
                         f"module parameters {{{device!r}}}. ({where}: pass neither for a CPU "
                         f"module.)")
    if device_ids and torch.device(device.type, device.index) != torch.device(
            device.type, index(device_ids[0])):
        raise ValueError(f"{where}: device_ids={device_ids!r} does not match the module's "
                         f"device {device}; pass [the single GPU the module is on].")
    if bucket_cap_mb == "auto" and bucket_cap_mb_list:
        raise ValueError(f"{where}: bucket_cap_mb='auto' plans every bucket itself; pass "
                         f"either it or bucket_cap_mb_list, not both.")
    # Zero or less is torch's too: every bucket closes at its first parameter.
    for cap in [bucket_cap_mb] + list(bucket_cap_mb_list or []):
        if cap != "auto" and (isinstance(cap, bool) or not isinstance(cap, (int, float))):
            raise ValueError(f"{where}: bucket_cap_mb must be a number of MiB or 'auto' "
                             f"(planned from measured gradient-ready times), got {cap!r}.")
    try:
        registry.algorithm(algorithm)
    except ValueError as e:
        raise ValueError(f"{where}: {e}.") from None
    compressing.check(compression, algorithm, rank)


def check_comm_hook(hook):
    """torch's checks on a comm hook, with torch's exception types."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable; minddp got "
                        f"{type(hook).__name__}.")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return
    bucket = signature.parameters.get("bucket")
    if bucket is None:  # torch looks the parameter up by this name: a KeyError there too
        raise KeyError(f"bucket: a comm hook is called as hook(state, bucket), and torch's DDP "
                       f"requires its second parameter to be named `bucket`; minddp got "
                       f"parameters {list(signature.parameters)}")
    if bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if signature.return_annotation not in (inspect.Signature.empty,
                                           torch.futures.Future[torch.Tensor]):
        raise ValueError("Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor].")


def index(device_id):
    return device_id.index if isinstance(device_id, torch.device) else int(device_id)
