"""torch.library.opcheck on every op of minddp._C, and one torch.compile'd call of them.

opcheck runs four checks per call: test_schema (the schema's mutations and aliases
are what the kernel does), test_autograd_registration (the ops say they are not
differentiable: csrc/ops.cpp's Autograd fallthrough), test_faketensor (the Meta
kernels of csrc/compress_meta.cpp give the real kernels' shapes, dtypes and strides)
and test_aot_dispatch_dynamic (AOTAutograd traces the op with symbolic sizes and
gets the eager result). Together they are what torch.compile needs of an op.

    PYTHONPATH=. python -m pytest tests/test_opcheck.py -q
"""
import pytest
import torch

from minddp import compression
from minddp.compression import reference

pytestmark = pytest.mark.skipif(not compression.HAVE_EXTENSION, reason="minddp._C is not built")

ops = torch.ops.minddp
DTYPES = [torch.float16, torch.bfloat16, torch.int8]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() and compression.HAVE_EXTENSION and
             torch._C._dispatch_has_kernel_for_dispatch_key("minddp::compress", "CUDA")),
        reason="needs CUDA")),
]
# Empty, one value, one int8 block and one past it, a 2-D chunk, and a size past the
# CPU kernel's 16384-value block that is a multiple of neither block.
SHAPES = [(0,), (1,), (1024,), (1025,), (33, 65), (16384 + 1027,)]
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]


def test_every_op_is_covered():
    """Every overload the extension registers, as the dispatcher lists them: a new op
    fails here until it has its opcheck test below."""
    registered = {name for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("minddp::")}
    assert registered == {"minddp::compress", "minddp::compress.out",
                          "minddp::compress_with_feedback",
                          "minddp::decompress", "minddp::decompress.out",
                          "minddp::decompress_add_"}


def values(shape, device, requires_grad=False):
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    x = (torch.randn(shape, generator=g) * 1e3).to(device)
    return x.requires_grad_(requires_grad)


def wire(shape, dtype, device):
    """(packed, scale) as compress returns them."""
    return tuple(ops.compress(values(shape, device), dtype))


def check(op, args, kwargs=None):
    """Every opcheck test passes. Each caller hands in one tensor that requires grad:
    without one, test_autograd_registration returns without checking anything."""
    results = torch.library.opcheck(op, args, kwargs, raise_exception=False)
    failed = {test: result for test, result in results.items() if result != "SUCCESS"}
    assert not failed, f"{op}: {failed}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compress(device, shape, dtype):
    check(ops.compress.default, (values(shape, device, requires_grad=True), dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compress_out(device, shape, dtype):
    packed, scale = wire(shape, dtype, device)
    check(ops.compress.out, (values(shape, device, requires_grad=True), dtype),
          {"packed": torch.empty_like(packed), "scale": torch.empty_like(scale)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("decode", [False, True], ids=["feedback", "feedback-decode"])
def test_compress_with_feedback(device, shape, decode):
    error = (values(shape, device) * 1e-3).requires_grad_()
    check(ops.compress_with_feedback.default, (values(shape, device), torch.int8, error, decode))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decompress(device, shape, dtype):
    packed, scale = wire(shape, dtype, device)
    check(ops.decompress.default, (packed, scale.requires_grad_()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decompress_out(device, shape, dtype):
    packed, scale = wire(shape, dtype, device)
    check(ops.decompress.out, (packed, scale.requires_grad_()),
          {"out": torch.empty(shape, device=device)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decompress_add_(device, shape, dtype):
    packed, scale = wire(shape, dtype, device)
    check(ops.decompress_add_.default, (values(shape, device), packed, scale.requires_grad_()))


def test_meta_kernels_apply_the_checks():
    """Under torch.compile a wrong argument fails while tracing, with the kernels' message."""
    src = torch.empty(3000, device="meta")
    with pytest.raises(RuntimeError, match="src must be float32"):
        ops.compress(src.double(), torch.float16)
    packed, scale = ops.compress(src, torch.int8)
    assert scale.shape == (reference.int8_blocks(3000),)
    with pytest.raises(RuntimeError, match="dst has 2999 elements but packed has 3000"):
        ops.decompress_add_(torch.empty(2999, device="meta"), packed, scale)


def roundtrip_add(dst, src):
    packed, scale = torch.ops.minddp.compress(src, torch.int8)
    torch.ops.minddp.decompress_add_(dst, packed, scale)
    half, half_scale = torch.ops.minddp.compress(src * 2, torch.float16)
    return torch.ops.minddp.decompress(half, half_scale) + 1


def test_compiled_fullgraph_matches_eager():
    """The default backend (inductor) with fullgraph=True: one graph holding the ops."""
    src, dst = torch.randn(5000), torch.randn(5000)
    want_dst = dst.clone()
    want = roundtrip_add(want_dst, src)
    torch._dynamo.reset()
    got = torch.compile(roundtrip_add, fullgraph=True)(dst, src)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(dst, want_dst, rtol=0, atol=0)


def test_compiled_with_dynamic_sizes_traces_once():
    """Symbolic sizes reach the Meta kernels: chunks of different lengths share one graph
    (aot_eager: the same tracing as inductor, without generating code). The int8 scale's
    length, one per started block and at least one, still splits chunks of one block
    from longer ones, so all sizes here are past one block."""
    from torch._dynamo.testing import CompileCounterWithBackend
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(roundtrip_add, backend=backend, dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    for n in (3000, 5000, 7777):
        src, dst = torch.randn(n), torch.randn(n)
        want_dst = dst.clone()
        torch.testing.assert_close(compiled(dst, src), roundtrip_add(want_dst, src),
                                   rtol=0, atol=0)
        torch.testing.assert_close(dst, want_dst, rtol=0, atol=0)
    assert backend.frame_count == 1
