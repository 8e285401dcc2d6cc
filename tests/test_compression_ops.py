"""torch.ops.minddp.compress / decompress / decompress_add_ against the pure-torch reference.

Every implementation (the reference itself, the CPU kernels, the CUDA kernels)
must keep the error of compress -> decompress within 2^-10 (fp16) / 2^-7 (bf16)
/ 1/254 (int8: of its block's) largest magnitude, keep inf/NaN (int8: turn the
block holding one NaN), and the kernels must match the reference bit for bit
(NaN payloads aside).
"""
import os
import subprocess
import sys

import pytest
import torch

from minddp import compression
from minddp.compression import reference

TOLERANCE = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
DTYPES = list(TOLERANCE)
needs_extension = pytest.mark.skipif(not compression.HAVE_EXTENSION,
                                     reason="minddp._C is not built")
needs_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and compression.HAVE_EXTENSION and
         compression.kernels_for("cuda") is torch.ops.minddp), reason="needs CUDA")

IMPLEMENTATIONS = [
    pytest.param(reference, "cpu", id="reference-cpu"),
    pytest.param(torch.ops.minddp, "cpu", id="kernels-cpu", marks=needs_extension),
    pytest.param(torch.ops.minddp, "cuda", id="kernels-cuda", marks=needs_cuda_kernels),
]


def inputs():
    g = torch.Generator().manual_seed(0)
    cases = {f"randn*{m:g}-n{n}": torch.randn(n, generator=g) * m
             for m in (1e-9, 1e-3, 1.0, 1e7) for n in (1, 7, 17, 1000)}
    cases["wide-range"] = torch.logspace(-9, 7, 4099) * torch.randn(4099, generator=g).sign()
    cases["zeros"] = torch.zeros(33)
    cases["empty"] = torch.zeros(0)
    cases["fp32-subnormal"] = torch.full((19,), 1e-40)
    cases["big-2d"] = torch.randn(513, 1031, generator=g) * 3e4  # several threads' worth
    # The CPU kernel packs 64 KiB blocks with the largest value seen so far and
    # re-packs those that a later, larger value made stale: magnitudes that grow
    # along the tensor, and one outlier at its very end.
    cases["growing"] = torch.logspace(-9, 7, 300_001) * torch.randn(300_001, generator=g).sign()
    outlier = torch.randn(300_001, generator=g)
    outlier[-1] = 1e6
    cases["outlier-last"] = outlier
    special = torch.randn(1000, generator=g)
    special[[3, 500, 999]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    cases["nan-inf"] = special
    # int8 blocks: an exact multiple of the block, and an inf in the middle block only
    cases["two-int8-blocks"] = torch.randn(2 * reference.INT8_BLOCK, generator=g)
    middle = torch.randn(3 * reference.INT8_BLOCK, generator=g)
    middle[reference.INT8_BLOCK + 5] = float("inf")
    cases["inf-in-middle-block"] = middle
    return cases


CASES = inputs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ops,device", IMPLEMENTATIONS)
def test_round_trip_error_and_specials(ops, device, name, dtype):
    src = CASES[name].to(device)
    packed, scale = ops.compress(src, dtype)
    assert packed.dtype == dtype and packed.shape == src.shape
    assert scale.dtype == torch.float32 and scale.shape == (1,) and scale.device == src.device
    out = ops.decompress(packed, scale)
    assert out.dtype == torch.float32 and out.shape == src.shape
    finite = torch.isfinite(src)
    torch.testing.assert_close(out[~finite], src[~finite], equal_nan=True)  # inf/NaN kept
    if finite.any():
        amax = src[finite].abs().max()
        assert (out[finite] - src[finite]).abs().max() <= TOLERANCE[dtype] * amax
        assert torch.isfinite(out[finite]).all()  # no overflow
        assert (out[finite] != 0).sum() >= (src[finite].abs() > amax * 2.0 ** -20).sum()
    acc = torch.ones_like(src)
    ops.decompress_add_(acc, packed, scale)
    torch.testing.assert_close(acc, 1 + out, equal_nan=True, rtol=0, atol=0)
    into = torch.full_like(src, 7.0)  # decompress.out overwrites, it does not add
    assert ops.decompress.out(packed, scale, out=into) is into
    torch.testing.assert_close(into, out, equal_nan=True, rtol=0, atol=0)
    assert_compress_out_is_compress(ops, src, dtype, packed, scale)


def assert_compress_out_is_compress(ops, src, dtype, packed, scale):
    """compress.out writes into the buffers it is given exactly what compress returns."""
    # slots inside larger buffers, at offsets, as in a shared file's layout
    room = torch.full((packed.numel() + 24,), 3, dtype=packed.dtype, device=src.device)
    slots = (room[8:8 + packed.numel()].view(packed.shape),
             torch.full((scale.numel() + 3,), 5.0, device=src.device)[1:1 + scale.numel()])
    returned = ops.compress.out(src, dtype, packed=slots[0], scale=slots[1])
    assert all(got is slot for got, slot in zip(returned, slots))
    bits = torch.int16 if dtype != torch.int8 else torch.int8
    assert torch.equal(slots[0].view(bits), packed.view(bits))
    torch.testing.assert_close(slots[1], scale, equal_nan=True, rtol=0, atol=0)
    assert (room[:8] == 3).all() and (room[8 + packed.numel():] == 3).all()  # nothing outside


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ops,device", IMPLEMENTATIONS)
def test_int8_round_trip_error_and_specials(ops, device, name):
    src = CASES[name].to(device)
    packed, scale = ops.compress(src, torch.int8)
    block, blocks = reference.INT8_BLOCK, reference.int8_blocks(src.numel())
    assert blocks == max(1, -(-src.numel() // 1024))  # one scale per 1024 values, at least one
    assert packed.dtype == torch.int8 and packed.shape == src.shape and scale.shape == (blocks,)
    out = ops.decompress(packed, scale)
    flat_src, flat_out, flat_packed = src.flatten(), out.flatten(), packed.flatten()
    for b in range(blocks):
        part = slice(b * block, (b + 1) * block)
        x, y, q = flat_src[part], flat_out[part], flat_packed[part]
        if not torch.isfinite(x).all():  # no inf or NaN in int8: the block decodes as NaN
            assert torch.isnan(y).all() and torch.isnan(scale[b])
        elif x.numel():  # and only that block: its neighbours keep finite scales
            assert torch.isfinite(scale[b]) and torch.isfinite(y).all()
            amax = x.abs().max()  # the error is bounded by the block's own largest value
            assert (y - x).abs().max() <= max(amax * (0.5 / 127) * (1 + 1e-5), 2.0 ** -120)
            assert q.abs().max() == (127 if amax >= 2.0 ** -120 else 0)
    acc = torch.ones_like(src)
    ops.decompress_add_(acc, packed, scale)
    torch.testing.assert_close(acc, 1 + out, equal_nan=True, rtol=0, atol=0)
    into = torch.full_like(src, 7.0)
    assert ops.decompress.out(packed, scale, out=into) is into
    torch.testing.assert_close(into, out, equal_nan=True, rtol=0, atol=0)
    assert_compress_out_is_compress(ops, src, torch.int8, packed, scale)


@pytest.mark.parametrize("ops,device", IMPLEMENTATIONS)
def test_int8_scales_are_per_block(ops, device):
    """A huge value costs only its own block precision: the next block keeps 127 levels."""
    block = reference.INT8_BLOCK
    src = torch.randn(2 * block, generator=torch.Generator().manual_seed(3)).to(device)
    src[5] = 1e6
    packed, scale = ops.compress(src, torch.int8)
    out = ops.decompress(packed, scale)
    assert (packed[:block] != 0).sum() < 10  # flattened beside the outlier
    small = src[block:]
    assert (out[block:] - small).abs().max() <= small.abs().max() / 254 * (1 + 1e-5)


@pytest.mark.parametrize("dtype", DTYPES + [torch.int8])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ops,device", IMPLEMENTATIONS[1:])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset-view"])
def test_kernels_match_reference_bitwise(ops, device, name, dtype, offset):
    src = CASES[name].to(device).flatten()[offset:]  # a bucket's chunk may start anywhere
    packed, scale = ops.compress(src, dtype)
    ref_packed, ref_scale = reference.compress(src, dtype)
    exact = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(scale, ref_scale, **exact)  # int8: NaN for a block with inf
    torch.testing.assert_close(packed, ref_packed, **exact)
    torch.testing.assert_close(ops.decompress(packed, scale), reference.decompress(packed, scale),
                               **exact)
    dst = torch.randn(src.shape, generator=torch.Generator().manual_seed(1)).to(device)
    expected = reference.decompress_add_(dst.clone(), packed, scale)
    assert ops.decompress_add_(dst, packed, scale) is dst
    torch.testing.assert_close(dst, expected, **exact)


# Byte offsets of packed data (16-byte aligned, 4-byte aligned only, misaligned) and element
# offsets of float32 output: the kernels take a different path for each alignment.
@pytest.mark.parametrize("dtype", DTYPES + [torch.int8])
@pytest.mark.parametrize("ops,device", IMPLEMENTATIONS[1:])
@pytest.mark.parametrize("packed_at", [0, 4, "one value"], ids=["packed16", "packed4", "packed1"])
@pytest.mark.parametrize("dst_at", [0, 1], ids=["dst16", "dst1"])
def test_decompress_from_slots_at_any_alignment(ops, device, dtype, packed_at, dst_at):
    src = CASES["outlier-last"][:5 * reference.INT8_BLOCK + 37].to(device)
    packed, scale = reference.compress(src, dtype)
    size = packed.element_size()
    at = size if packed_at == "one value" else packed_at  # a byte offset
    room = torch.zeros(packed.numel() * size + 16, dtype=torch.uint8, device=device)
    slot = room[at:at + packed.numel() * size].view(packed.dtype)
    slot.copy_(packed)
    dst_room = torch.randn(src.numel() + 1, generator=torch.Generator().manual_seed(3)).to(device)
    dst = dst_room[dst_at:dst_at + src.numel()]
    exact = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ops.decompress(slot, scale), reference.decompress(packed, scale),
                               **exact)
    expected = reference.decompress_add_(dst.clone(), packed, scale)
    ops.decompress_add_(dst, slot, scale)
    torch.testing.assert_close(dst, expected, **exact)


@needs_cuda_kernels
@pytest.mark.parametrize("dtype", DTYPES + [torch.int8])
def test_cuda_kernels_match_reference_on_a_large_tensor(dtype):
    # past one pass of every thread of the grid (SMs x 8 blocks x 256 threads x 16 values)
    src = torch.randn((9 << 20) + 3, generator=torch.Generator().manual_seed(4)).cuda()
    src[-2] = 3e4  # the largest value in the last pass
    packed, scale = torch.ops.minddp.compress(src, dtype)
    ref_packed, ref_scale = reference.compress(src, dtype)
    exact = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(scale, ref_scale, **exact)
    torch.testing.assert_close(packed, ref_packed, **exact)
    torch.testing.assert_close(torch.ops.minddp.decompress(packed, scale),
                               reference.decompress(packed, scale), **exact)
    dst = torch.randn_like(src)
    expected = reference.decompress_add_(dst.clone(), packed, scale)
    torch.ops.minddp.decompress_add_(dst, packed, scale)
    torch.testing.assert_close(dst, expected, **exact)


@pytest.mark.parametrize("decode", [False, True], ids=["feedback", "feedback-decode"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ops,device", IMPLEMENTATIONS)
def test_compress_with_feedback_feeds_back_then_records(ops, device, name, decode):
    src = CASES[name].to(device).flatten()
    error = torch.randn(src.shape, generator=torch.Generator().manual_seed(2)).to(device) * 1e-3
    values, before = src.clone(), error.clone()
    packed, scale = ops.compress_with_feedback(values, torch.int8, error, decode)
    exact = dict(rtol=0, atol=0, equal_nan=True)
    fed = src - before  # what is encoded: the values minus last time's error
    want_packed, want_scale = ops.compress(fed, torch.int8)
    torch.testing.assert_close(packed, want_packed, **exact)
    torch.testing.assert_close(scale, want_scale, **exact)
    decoded = ops.decompress(packed, scale)
    change = decoded - fed
    recorded = torch.where(torch.isfinite(change), change, torch.zeros_like(change))
    torch.testing.assert_close(error, recorded, **exact)  # inf/NaN: 0, nothing carried on
    torch.testing.assert_close(values, decoded if decode else src, **exact)


@pytest.mark.parametrize("decode", [False, True], ids=["feedback", "feedback-decode"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ops,device", IMPLEMENTATIONS[1:])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset-view"])
def test_compress_with_feedback_matches_reference_bitwise(ops, device, name, decode, offset):
    src = CASES[name].to(device).flatten()[offset:]
    error = torch.randn(src.shape, generator=torch.Generator().manual_seed(2)).to(device) * 1e-3
    mine, theirs = (src.clone(), error.clone()), (src.clone(), error.clone())
    got = ops.compress_with_feedback(mine[0], torch.int8, mine[1], decode)
    want = reference.compress_with_feedback(theirs[0], torch.int8, theirs[1], decode)
    for a, b in zip((*got, *mine), (*want, *theirs)):  # packed, scale, values, error
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_extension
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_every_cpu_kernel_path_matches_reference(isa):
    # The extension picks its CPU kernels once, at load, so each path gets a
    # process of its own (MINDDP_CPU_ISA narrows the choice) running the
    # bitwise test above on the CPU kernels.
    env = dict(os.environ, MINDDP_CPU_ISA=isa)
    used = subprocess.run([sys.executable, "-c", "import minddp._C as c; print(c.cpu_isa)"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    if used != isa:
        pytest.skip(f"this CPU cannot run the {isa} kernels (it runs {used})")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", __file__,
                          "-k", "bitwise and kernels-cpu"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


@needs_extension
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda_kernels)])
def test_bad_arguments_are_rejected_with_the_fix(device):
    x = torch.randn(8, 6, device=device)
    with pytest.raises(RuntimeError, match=r"contiguous.*\.contiguous\(\)"):
        torch.ops.minddp.compress(x.t(), torch.float16)
    with pytest.raises(RuntimeError, match=r"float32.*\.float\(\)"):
        torch.ops.minddp.compress(x.double(), torch.float16)
    with pytest.raises(RuntimeError, match="torch.float16, torch.bfloat16 or torch.int8"):
        torch.ops.minddp.compress(x, torch.int16)
    packed, scale = torch.ops.minddp.compress(x, torch.float16)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.minddp.decompress(packed.t(), scale)
    with pytest.raises(RuntimeError, match="dst must be float32"):
        torch.ops.minddp.decompress_add_(x.half(), packed, scale)
    with pytest.raises(RuntimeError, match="dst must be contiguous"):
        torch.ops.minddp.decompress_add_(x.t(), packed, scale)
    with pytest.raises(RuntimeError, match="pass the chunk that was compressed"):
        torch.ops.minddp.decompress_add_(x[:4], packed, scale)
    with pytest.raises(RuntimeError, match=r"float32 tensor of 1 element\(s\)"):
        torch.ops.minddp.decompress(packed, scale.double())
    wide = torch.randn(2049, device=device)  # int8: a scale per 1024 values, 3 here
    packed8, scale8 = torch.ops.minddp.compress(wide, torch.int8)
    with pytest.raises(RuntimeError, match=r"float32 tensor of 3 element\(s\).*got Float with 1"):
        torch.ops.minddp.decompress(packed8, scale8[:1])
    with pytest.raises(RuntimeError, match="decompress.out: dst must be float32"):
        torch.ops.minddp.decompress.out(packed, scale, out=x.half())
    with pytest.raises(RuntimeError, match="pass the chunk that was compressed"):
        torch.ops.minddp.decompress.out(packed, scale, out=x[:4])
    with pytest.raises(RuntimeError, match=r"compress.out: packed must be a contiguous "
                                           r"Half tensor of src's 48 elements.*got BFloat16"):
        torch.ops.minddp.compress.out(x, torch.float16, packed=packed.bfloat16(), scale=scale)
    with pytest.raises(RuntimeError, match=r"packed must .* got Half with 47 elements"):
        torch.ops.minddp.compress.out(x, torch.float16, packed=packed.flatten()[:47], scale=scale)
    with pytest.raises(RuntimeError, match=r"compress.out: scale must be a contiguous float32 "
                                           r"tensor of 3 element\(s\).*got Float with 1"):
        torch.ops.minddp.compress.out(wide, torch.int8, packed=packed8, scale=scale8[:1])
    error = torch.zeros(48, device=device)
    with pytest.raises(RuntimeError, match="only int8 has error feedback.*minddp.compress"):
        torch.ops.minddp.compress_with_feedback(x, torch.float16, error, False)
    with pytest.raises(RuntimeError, match=r"error must be .* of src's 48 elements.*got Float "
                                           r"with 47"):
        torch.ops.minddp.compress_with_feedback(x, torch.int8, error[:47], False)


@needs_cuda_kernels
def test_cuda_ops_never_synchronise_with_the_host():
    x = torch.randn(1 << 20, device="cuda")
    x[1:].mul_(1e-3)  # unaligned views take the element-wise path
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for view in (x, x[1:]):
            for dtype in (torch.float16, torch.int8):
                packed, scale = torch.ops.minddp.compress(view, dtype)
                torch.ops.minddp.compress.out(view, dtype, packed=packed, scale=scale)
                torch.ops.minddp.decompress_add_(view, packed, scale)
                torch.ops.minddp.decompress(packed, scale)
                torch.ops.minddp.decompress.out(packed, scale, out=view)
            torch.ops.minddp.compress_with_feedback(view, torch.int8, torch.zeros_like(view), True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
