"""Which device a process group's collectives take their tensors on.

NCCL takes CUDA tensors only (on the device this process drives), gloo takes
CPU tensors for point-to-point and either for its collectives. Everything the
wrapper sends on a group of its own (flags, the used-parameter map, timing
probes) is made on `group_device(group)`, so the same code runs on both.
"""
import torch
import torch.distributed as dist

# Backends whose collectives take device tensors only, and whose
# point-to-point calls match by posting order (tags ignored), so a rank that
# sends to and receives from one peer at once must post both in one group
# (dist.batch_isend_irecv). A test double that refuses what NCCL refuses
# registers its name here too.
DEVICE_BACKENDS = {"nccl"}


def backend_of(group):
    """The backend's name for `group` ("gloo", "nccl", ...), lower case."""
    return str(dist.get_backend(group)).lower()


def is_device_backend(group):
    """Whether `group` runs NCCL's rules (device tensors, grouped point-to-point)."""
    return backend_of(group) in DEVICE_BACKENDS


def group_device(group):
    """The device of the tensors a collective on `group` must use.

    A device backend's is the first device type it registered with torch
    (NCCL: cuda, at the current device); every other backend's is the CPU.
    """
    if is_device_backend(group):
        kind = dist.Backend.backend_capability.get(backend_of(group), ["cuda"])[0]
        if kind == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(kind)
    return torch.device("cpu")


def barrier(group):
    """Return once every rank of `group` has called it, on any backend.

    gloo's barrier; on a device backend a one-element all-reduce on the
    group's device, waited for on the host (NCCL's barrier guesses the device
    and only blocks the stream).
    """
    if not is_device_backend(group):
        dist.barrier(group=group)
        return
    flag = torch.zeros(1, device=group_device(group))
    dist.all_reduce(flag, group=group)
    flag.item()  # a host sync: the all-reduce has finished on every rank
