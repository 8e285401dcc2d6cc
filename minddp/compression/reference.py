"""Pure-torch reference of the compression ops, and minddp's fallback without its extension.

Same contract, same numbers as torch.ops.minddp.* (csrc/): every kernel is
tested against these functions, bit for bit apart from NaN payloads.

    packed, scale = compress(src, torch.float16)   # packed = src * scale, scale: float32 [1]
    compress.out(src, torch.float16, packed=p, scale=s)  # the same, into p and s
    decompress(packed, scale)                       # packed / scale, float32
    decompress.out(packed, scale, out=dst)          # dst = packed / scale, in place
    decompress_add_(dst, packed, scale)             # dst += packed / scale, in place
    compress_with_feedback(src, torch.int8, error, decode)  # compress(src - error), then
                                                    # error = what that changed; int8 only

The scale is a power of two (so applying and removing it is exact) chosen from
the largest finite magnitude m: m * scale lands in [2^14, 2^15), below fp16's
largest value 65504 with a factor of two to spare, so nothing overflows and a
tensor of small values is not flushed to zero. inf and NaN do not take part in
choosing it and come out as inf and NaN. Everything stays on the tensor's
device: no host synchronisation.

int8 (dtype=torch.int8) takes one scale per block of INT8_BLOCK elements
(float32 [int8_blocks(numel)]): 127 / the block's largest magnitude (not a
power of two: int8 has too few bits to give one away); values round to
nearest even into [-127, 127] and decode by dividing by their block's scale.
int8 has no inf or NaN, so a block holding one gets a NaN scale: its values
pack as 0 and all decode as NaN, and the overflow still reaches the optimizer.
"""
import torch

TARGET_EXPONENT = 15  # csrc/scale.h: kTargetExponent
INT8_SMALLEST_AMAX = 2.0 ** -120  # csrc/scale.h: kInt8SmallestAmax (smaller: packed as zeros)
INT8_BLOCK = 1024  # csrc/scale.h: kInt8Block, values per int8 scale


def int8_blocks(numel):
    """How many scales int8 gives `numel` values: one per block, at least one."""
    return max(1, -(-numel // INT8_BLOCK))


def scale_from_amax(amax):
    """The power-of-two scale for a largest finite magnitude `amax` (a float32 tensor)."""
    exponent = torch.frexp(amax).exponent  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    # Clamped so that the scale and its reciprocal are finite fp32 numbers; the
    # power of two is assembled from its exponent bits, exact on every device.
    k = (TARGET_EXPONENT - exponent).clamp(-126, 127).to(torch.int32)
    scale = ((k + 127) << 23).view(torch.float32)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def finite_amax(src):
    """Largest magnitude among the finite values of `src` (0 when there are none)."""
    if src.numel() == 0:
        return src.new_zeros(())
    return src.abs().nan_to_num_(nan=0.0, posinf=0.0).amax()


def int8_scale(blocks):
    """Per row of `blocks` (rows of INT8_BLOCK values): 127 / the largest magnitude (inf
    and NaN count as infinite: then NaN), 1 when that is under INT8_SMALLEST_AMAX (zeros,
    or values too small to scale: they pack as 0)."""
    # posinf too: nan_to_num would otherwise turn inf into the largest finite value
    amax = blocks.abs().nan_to_num(nan=float("inf"), posinf=float("inf")).amax(dim=1)
    # a true division: `127.0 / amax` would be 127 * (1 / amax), rounded twice
    scale = torch.where(amax >= INT8_SMALLEST_AMAX, torch.full_like(amax, 127.0).div(amax),
                        torch.ones_like(amax))
    return torch.where(torch.isinf(amax), torch.full_like(amax, float("nan")), scale)


def _int8_blocks(src):
    """`src` as rows of INT8_BLOCK values, zero-padded at the end."""
    flat = src.reshape(-1)
    rows = src.new_zeros(int8_blocks(flat.numel()), INT8_BLOCK)
    rows.view(-1)[:flat.numel()] = flat
    return rows


def _per_value(scale, packed):
    """Each value's scale: one for 16 bits, its block's for int8."""
    if packed.dtype != torch.int8:
        return scale
    return scale.repeat_interleave(INT8_BLOCK)[:packed.numel()].view(packed.shape)


def compress(src, dtype):
    if dtype == torch.int8:
        rows = _int8_blocks(src)
        scale = int8_scale(rows)
        q = torch.round(rows * scale[:, None]).nan_to_num_(nan=0.0).clamp_(-127, 127)
        return q.view(-1)[:src.numel()].to(torch.int8).view(src.shape), scale
    scale = scale_from_amax(finite_amax(src)).reshape(1)
    return (src * scale).to(dtype), scale


def _compress_out(src, dtype, *, packed, scale):
    wire = compress(src, dtype)
    packed.copy_(wire[0].view_as(packed))
    scale.copy_(wire[1])
    return packed, scale


compress.out = _compress_out  # as the op's overload: torch.ops.minddp.compress.out


def decompress(packed, scale):
    return packed.float() / _per_value(scale, packed)


def _decompress_out(packed, scale, *, out):
    return out.copy_(decompress(packed, scale).view_as(out))


decompress.out = _decompress_out  # as the op's overload: torch.ops.minddp.decompress.out


def decompress_add_(dst, packed, scale):
    # Two roundings (divide, then add), as the kernels: they never fuse them.
    return dst.add_(decompress(packed, scale).view_as(dst))


def compress_with_feedback(src, dtype, error, decode):
    """int8 with error feedback: compress(src - error), then `error` becomes what that
    encoding changed, decompressed minus (src - error), where finite (0 where a value
    is inf or NaN). With `decode`, src also becomes the decompressed values (a
    finished sum leaving its owner takes its receivers' bits). `error`: contiguous
    float32, src's element count, on its device."""
    if dtype != torch.int8:
        raise RuntimeError(f"minddp.compress_with_feedback: only int8 has error feedback (fp16 "
                           f"and bf16 travel without it), got {dtype}; use minddp.compress for "
                           f"them")
    fed = src - error.view_as(src)
    packed, scale = compress(fed, dtype)
    decoded = decompress(packed, scale)
    change = decoded - fed
    kept = torch.where(torch.isfinite(change), change, torch.zeros_like(change))
    error.copy_(kept.view_as(error))
    if decode:
        src.copy_(decoded)
    return packed, scale
