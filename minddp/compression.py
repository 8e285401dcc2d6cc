"""fp16/bf16/int8 gradient compression: codecs for the all-reduce algorithms, on minddp's kernels.

A `Codec` turns a chunk of a bucket into the tensors that travel and back:

    wire = codec.encode(chunk)        # [packed fp16/bf16/int8, scale float32[1]; int8:
                                      #  float32[one per 1024 values]]
    codec.decode_add_(dst, wire)      # dst += decoded, accumulated in dst's fp32
    codec.decode_(dst, wire)          # dst = decoded

Ring and tree call these per hop (`all_reduce(tensor, group, codec=codec)`), so
partial sums accumulate in fp32 and only the wire is 16-bit; torch's
fp16_compress_hook instead sums in fp16. As in Horovod's compression, only
float32 tensors are compressed: anything else travels as itself.

The kernels are torch.ops.minddp.* from the extension minddp._C where it has a
kernel for the tensor's device, else the pure-torch reference
(compression_reference.py): same numbers, slower; minddp says so once.
"""
import functools
import math
import warnings

import torch
import torch.distributed as dist

from minddp import compression_reference as reference
from minddp.algorithms import p2p

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}

try:
    import minddp._C  # noqa: F401 - loading it registers torch.ops.minddp.*
    HAVE_EXTENSION = True
except ImportError as e:
    HAVE_EXTENSION = False
    warnings.warn(f"minddp: the C++ extension minddp._C is not available ({e}); compression "
                  f"runs on pure torch ops, which is slower. Build it with `make setup` or "
                  f"`pip install --no-build-isolation -e .`.", RuntimeWarning, stacklevel=2)

_warned_devices = set()


def kernels_for(device):
    """The module whose compress/decompress/decompress_add_ serve tensors on `device`."""
    device_type = torch.device(device).type
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if HAVE_EXTENSION and key and torch._C._dispatch_has_kernel_for_dispatch_key(
            "minddp::compress", key):
        return torch.ops.minddp
    if HAVE_EXTENSION and device_type not in _warned_devices:
        _warned_devices.add(device_type)
        warnings.warn(f"minddp: minddp._C has no {device_type} kernels (built without CUDA?); "
                      f"compression of {device_type} tensors runs on pure torch ops. Rebuild "
                      f"where torch has CUDA and nvcc to get them.", RuntimeWarning, stacklevel=2)
    return reference


class Codec:
    """fp16, bf16 or int8 encoding of float32 chunks: fp16 and bf16 with one power-of-two
    scale per chunk, int8 with one scale per block of 1024 values (127 / the block's largest
    magnitude).

    `kernels`: the module providing the three ops (torch.ops.minddp or
    compression_reference); by default the fastest available for each chunk.
    """

    def __init__(self, compression, kernels=None):
        if compression not in DTYPES:
            raise ValueError(f"minddp: unknown compression {compression!r}; choose one of "
                             f"{sorted(DTYPES)} (or None for none).")
        self.name, self.dtype, self.kernels = compression, DTYPES[compression], kernels

    def __repr__(self):
        return f"Codec({self.name!r})"

    def compresses(self, tensor):
        return tensor.dtype == torch.float32

    def wire_itemsize(self, dtype):
        """Bytes per element on the wire for a tensor of `dtype` (the scale aside)."""
        return self.dtype.itemsize if dtype == torch.float32 else dtype.itemsize

    def _ops(self, tensor):
        return self.kernels or kernels_for(tensor.device)

    def encode(self, chunk):
        """The tensors to send for `chunk`: [packed, scale], or [chunk] if it is not float32."""
        if not self.compresses(chunk):
            return [chunk]
        return list(self._ops(chunk).compress(chunk.contiguous(), self.dtype))

    def encode_with_feedback(self, chunk, error, decode=False):
        """encode(chunk - error), then error = what that encoding changed (decoded minus
        encoded, where finite): error feedback, int8 only. With `decode`, chunk becomes
        the decoding too."""
        return list(self._ops(chunk).compress_with_feedback(chunk, self.dtype, error, decode))

    def decode_add_(self, dst, wire):
        """dst += the decoded wire, summed in dst's dtype (fp32 for compressed chunks)."""
        if len(wire) == 1:
            return dst.add_(wire[0].view_as(dst))
        return self._ops(dst).decompress_add_(dst, wire[0], wire[1])

    def decode_(self, dst, wire):
        """dst = the decoded wire."""
        if len(wire) == 1:
            return dst.copy_(wire[0].view_as(dst))
        return self._ops(dst).decompress.out(wire[0], wire[1], out=dst)


class ErrorFeedback:
    """A summing job with error feedback, for int8. Each bucket keeps a record, one
    value per element, of what this rank's last encoding of that element changed
    (decoded minus encoded). Every encoding on this rank's hops (p2p.feeding_back)
    first takes the record away from what it encodes, whether that is the rank's
    own values, a partial sum or the finished sum, then records what it changes
    now. Each rank encodes each element once per sum, and whatever it encodes
    reaches the sum, so every sum returns exactly what the last one's roundings
    cost, at every hop and on every algorithm. Where a value was inf or NaN (its
    block decodes as NaN) the record is 0, so nothing non-finite is carried on.
    Records are kept per bucket buffer and dropped when the buckets change
    (setup). The job must be one of minddp's own algorithms (it records on their
    hops).
    """

    def __init__(self, job, codec):
        if codec.dtype != torch.int8:
            raise ValueError(f"minddp: error feedback is int8's (compress_with_feedback), not "
                             f"{codec.name}'s; use Codec('int8')")
        self.job, self.codec = job, codec
        self.errors = {}

    def setup(self, buffers, provisional=False):
        """New buckets: records start afresh (a new buffer may reuse an old one's memory)."""
        self.errors.clear()
        setup = getattr(self.job, "setup", None)
        if setup is not None:
            setup(buffers, provisional)

    def __call__(self, tensor):
        if not self.codec.compresses(tensor):
            return self.job(tensor)
        key = (tensor.data_ptr(), tensor.numel())
        error = self.errors.get(key)
        if error is None:
            error = self.errors[key] = torch.zeros(tensor.numel(), dtype=tensor.dtype,
                                                   device=tensor.device)
        with p2p.feeding_back(tensor, error):
            return self.job(tensor)


@functools.lru_cache(maxsize=None)
def codec_for(compression):
    """The one Codec of a compression name (auto keeps its timings per codec)."""
    return Codec(compression)


def native_all_reduce(tensor, group, codec):
    """Sum `tensor` in place over `group` with the backend's all-reduce in 16 bits.

    The backend adds packed values, so every rank must pack with the same
    scale: the smallest local one (the largest magnitude anywhere), lowered by
    the next power of two >= world size so that the sum cannot overflow either.
    Every rank decodes the same summed values with that scale: results are
    bitwise equal across ranks. Non-float32 tensors are summed as they are.
    `tensor` must be on a device the group's backend takes (NCCL: its CUDA
    device, devices.group_device): the packed values and the scale that go on
    the group are made from it, on its device.
    """
    from minddp.algorithms import native

    if not codec.compresses(tensor):
        return native.all_reduce(tensor, group)
    if codec.dtype == torch.int8:
        raise ValueError("minddp: int8 cannot be summed by the backend's all-reduce (8-bit sums "
                         "overflow); use one of minddp's algorithms (ring, tree, "
                         "halving_doubling, auto), which sum in fp32 at every hop.")
    if not tensor.is_contiguous():  # the kernels decode into contiguous tensors only
        tensor.copy_(native_all_reduce(tensor.contiguous(), group, codec))
        return tensor
    packed, scale = codec.encode(tensor)
    common = scale.clone()
    dist.all_reduce(common, op=dist.ReduceOp.MIN, group=group)
    common /= 2.0 ** math.ceil(math.log2(dist.get_world_size(group)))
    # Powers of two: exact apart from values that become fp16 subnormals.
    packed.mul_((common / scale).reshape(()))
    dist.all_reduce(packed, group=group)
    return codec.decode_(tensor, [packed, common])


def _is_native(algorithm):
    from minddp import algorithms
    return algorithms.resolve(algorithm) is algorithms.ALGORITHMS["native"]


def all_reduce(tensor, algorithm="ring", group=None, compression="fp16"):
    """minddp.all_reduce with compression: in-place sum of `tensor` over `group`, sent as 16 bits.

    Every rank of the group calls it with a tensor of the same shape and
    dtype; returns the tensor, bitwise equal on every rank.
    """
    from minddp import algorithms

    group = group if group is not None else dist.group.WORLD
    codec = codec_for(compression)
    if _is_native(algorithm):
        return native_all_reduce(tensor, group, codec)
    return algorithms.resolve(algorithm).all_reduce(tensor, group, codec=codec)
