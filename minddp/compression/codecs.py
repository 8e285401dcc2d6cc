"""minddp's own codecs, fp16, bf16 and int8, on the extension's kernels (or their reference).

    wire = codec.encode(chunk)        # [packed fp16/bf16/int8, scale float32[1]; int8:
                                      #  float32[one per 1024 values]]
    codec.encode_into(chunk, slots)   # the same, into slots shaped as the wire (no copy)
    codec.decode_add_(dst, wire)      # dst += decoded, accumulated in dst's fp32
    codec.decode_(dst, wire)          # dst = decoded

Ring and tree call these per hop, so partial sums accumulate in fp32 and only
the wire is 16-bit; torch's fp16_compress_hook instead sums in fp16. As in
Horovod's compression, only float32 tensors are compressed: anything else
travels as itself. They register through minddp.register_codec, as any
researcher's codec does; ErrorFeedback serves every codec registered with
error_feedback=True (int8 here).
"""
import math

import torch
import torch.distributed as dist

from minddp import registry
from minddp.compression.kernels import kernels_for

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


class KernelCodec(registry.Codec):
    """fp16 or bf16 with one power-of-two scale per chunk, or int8 with one scale per
    block of 1024 values (127 / the block's largest magnitude), each step one kernel.

    `kernels`: the module providing the ops (torch.ops.minddp or reference.py); by
    default the fastest available for each chunk's device.
    """

    def __init__(self, dtype, kernels=None, error_feedback=False):
        super().__init__(error_feedback=error_feedback)
        self.dtype, self.kernels = dtype, kernels
        if dtype != torch.int8:  # 8-bit sums would overflow: int8 cannot be summed whole
            self.sum_whole = self._sum_whole

    def _ops(self, tensor):
        return self.kernels or kernels_for(tensor.device)

    def wire_itemsize(self, dtype, device="cpu"):
        return self.dtype.itemsize if dtype == torch.float32 else dtype.itemsize

    def encode(self, chunk):
        if not self.compresses(chunk):
            return [chunk]
        return list(self._ops(chunk).compress(chunk.contiguous(), self.dtype))

    def encode_into(self, chunk, slots):
        if not self.compresses(chunk):
            return super().encode_into(chunk, slots)
        self._ops(chunk).compress.out(chunk.contiguous(), self.dtype, packed=slots[0],
                                      scale=slots[1])
        return slots

    def encode_with_feedback(self, chunk, error, decode=False):
        return list(self._ops(chunk).compress_with_feedback(chunk, self.dtype, error, decode))

    def decode_add_(self, dst, wire):
        if len(wire) == 1:
            return dst.add_(wire[0].view_as(dst))
        return self._ops(dst).decompress_add_(dst, wire[0], wire[1])

    def decode_(self, dst, wire):
        if len(wire) == 1:
            return dst.copy_(wire[0].view_as(dst))
        return self._ops(dst).decompress.out(wire[0], wire[1], out=dst)

    def _sum_whole(self, tensor, group, all_reduce):
        """Sum `tensor` in place over `group` with a plain `all_reduce` of 16-bit values.

        The algorithm adds packed values, so every rank must pack with the same
        scale: the smallest local one (the largest magnitude anywhere), lowered
        by the next power of two >= world size so that the sum cannot overflow
        either. Every rank decodes the same summed values with that scale:
        results are bitwise equal across ranks. Non-float32 tensors are summed
        as they are. `tensor` must be on a device the group's backend takes
        (NCCL: its CUDA device, devices.group_device).
        """
        if not self.compresses(tensor):
            return registry.wait_sum(all_reduce, tensor)
        if not tensor.is_contiguous():  # the kernels decode into contiguous tensors only
            tensor.copy_(self._sum_whole(tensor.contiguous(), group, all_reduce))
            return tensor
        packed, scale = self.encode(tensor)
        common = scale.clone()
        dist.all_reduce(common, op=dist.ReduceOp.MIN, group=group)
        common /= 2.0 ** math.ceil(math.log2(dist.get_world_size(group)))
        # Powers of two: exact apart from values that become fp16 subnormals.
        packed.mul_((common / scale).reshape(()))
        registry.wait_sum(all_reduce, packed)
        return self.decode_(tensor, [packed, common])


class ErrorFeedback:
    """A collective with error feedback, for a codec registered with error_feedback=True.

    Each bucket keeps a record, one value per element, of what this rank's last
    encoding of that element changed (decoded minus encoded), and passes it to
    the algorithm (`error=`), whose every encoding on this rank's hops first
    takes the record away from what it encodes, whether that is the rank's own
    values, a partial sum or the finished sum, then records what it changes
    now. Each rank encodes each element once per sum, and whatever it encodes
    reaches the sum, so every sum returns exactly what the last one's roundings
    cost, at every hop and on every per-hop algorithm. Where a value was inf or
    NaN the record is 0, so nothing non-finite is carried on. Records are kept
    per bucket buffer and dropped when the buckets change (setup).
    """

    def __init__(self, collective, codec):
        self.collective, self.codec = collective, codec
        self.errors = {}

    def setup(self, buffers, provisional=False):
        """New buckets: records start afresh (a new buffer may reuse an old one's memory)."""
        self.errors.clear()
        setup = getattr(self.collective, "setup", None)
        if setup is not None:
            setup(buffers, provisional)

    def __call__(self, tensor):
        if not self.codec.compresses(tensor):
            return self.collective(tensor)
        key = (tensor.data_ptr(), tensor.numel())
        error = self.errors.get(key)
        if error is None:
            error = self.errors[key] = torch.zeros(tensor.numel(), dtype=tensor.dtype,
                                                   device=tensor.device)
        return self.collective(tensor, error=error)


for _name, _dtype in DTYPES.items():
    registry.register_codec(_name, codec=KernelCodec(_dtype, error_feedback=_dtype == torch.int8))
