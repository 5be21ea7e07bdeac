"""quantize on CUDA (Triton kernels): byte-exact against the CPU reference, every specified element
written (outputs poisoned first), opcheck on CUDA inputs, CUDA-graph replay with new masked_m."""

import pytest
import torch

from epmoe import reference
from epmoe.ops import quantize
from tests._opcheck import NO_VALUE_COMPARE, opcheck
from tests.ops import _stage_cases as C

pytestmark = pytest.mark.gpu
Q = C.quantize_mod


def _check(x_cpu, scheme, group_size=128, masked_m=None, layout="row", x_dev=None, width=None):
    """Run the op on CUDA under both poison patterns; compare written rows with the reference."""
    x = x_dev if x_dev is not None else x_cpu.cuda()
    mm = None if masked_m is None else masked_m.cuda()
    rq, rs = reference.quantize(x_cpu, scheme, group_size, width)
    lead = x_cpu.shape[:-1]
    rows = C.masked_rows(*(lead if x.dim() == 3 else (1, lead[0])), masked_m).reshape(lead)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            q, s = quantize(x, scheme, group_size, mm, scale_layout=layout, width=width)
        torch.cuda.synchronize()
        C.assert_equal(q.cpu()[rows], rq[rows], "q")
        C.assert_equal(s.cpu()[rows], rs[rows], "s")
    return q, s


@pytest.mark.parametrize("layout", ["row", "deepgemm"])
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,h", [(0, 7168), (1, 7168), (300, 7168), (37, 384)])
def test_matches_reference(m, h, dtype, scheme, layout):
    x = (torch.randn((m, h), generator=torch.Generator().manual_seed(m + h)) * 5).to(dtype)
    _, s = _check(x, scheme, layout=layout)
    if layout == "deepgemm":
        assert s.stride() == (1, (m + 3) // 4 * 4)


@pytest.mark.parametrize("layout", ["row", "deepgemm"])
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_masked_3d(scheme, layout):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((8, 64, 7168), generator=gen).to(torch.bfloat16)
    masked_m = torch.tensor([0, 64, 5, 1, 8, 63, 2, 100], dtype=torch.int32)
    _, s = _check(x, scheme, masked_m=masked_m, layout=layout)
    if layout == "deepgemm":
        assert s.stride() == (s.shape[-1] * 64, 1, 64)


def test_odd_shapes_and_two_pass():
    gen = torch.Generator().manual_seed(2)
    for scheme in ("fp8", "int8"):
        _check((torch.randn((65, 1024), generator=gen) * 3).to(torch.float16), scheme)
    _check(torch.randn((5, 288), generator=gen), "fp8", group_size=96)
    _check(torch.randn((7, 20000), generator=gen).to(torch.bfloat16), "int8")  # two-pass rows
    _check(torch.randn((3, 5, 200), generator=gen), "int8", masked_m=torch.tensor([5, 0, 3]))


def test_strided_input():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn((64, 2 * 7168), generator=gen).to(torch.bfloat16)
    for scheme in ("fp8", "int8"):
        _check(base[:, ::2], scheme, x_dev=base.cuda()[:, ::2])


def test_rounding_edges():
    r0 = torch.zeros(256)
    r0[1] = -0.0
    r1 = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 0.49999997] + [0.0] * 248)
    r2 = torch.randn(256, generator=torch.Generator().manual_seed(4)) * 1e-3
    r2[0], r2[129] = 448.0, -448.0  # s = 1: the rest land in e4m3 subnormals
    x = torch.stack([r0, r1, r2])
    for dtype in (torch.float32, torch.bfloat16):
        for scheme in ("fp8", "int8"):
            _check(x.to(dtype), scheme)


def test_random_magnitudes_byte_exact():
    """Wide dynamic range per row: exercises every e4m3 binade and int8 rounding boundary."""
    gen = torch.Generator().manual_seed(5)
    spread = torch.logspace(-4, 4, 2048)[torch.randperm(2048, generator=gen)]
    x = torch.randn((512, 2048), generator=gen) * spread
    for scheme in ("fp8", "int8"):
        _check(x, scheme)
        _check(x.to(torch.bfloat16), scheme)


def test_opcheck_cuda():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn((33, 512), generator=gen).to(torch.bfloat16).cuda()
    opcheck(torch.ops.epmoe.quantize.default, (x, "fp8", 128, None, "deepgemm"))
    opcheck(torch.ops.epmoe.quantize.default, (x, "int8", 128, None, "row"))
    x3 = torch.randn((4, 9, 256), generator=gen).cuda()
    mm = torch.tensor([0, 9, 3, 1], dtype=torch.int32, device="cuda")
    opcheck(
        torch.ops.epmoe.quantize.default, (x3, "int8", 128, mm, "deepgemm"), utils=NO_VALUE_COMPARE
    )
    opcheck(torch.ops.epmoe.quantize.default, (x3, "fp8", 128, mm, "row"), utils=NO_VALUE_COMPARE)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_cuda_graph_replay(scheme):
    """Captured once; new data and new masked_m replay through the same fixed grid."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((16, 32, 1024), generator=gen).to(torch.bfloat16).cuda()
    mm = torch.randint(0, 33, (16,), generator=gen, dtype=torch.int32).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        quantize(x, scheme, masked_m=mm, scale_layout="deepgemm")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = quantize(x, scheme, masked_m=mm, scale_layout="deepgemm")
    for trial in range(2):
        x.copy_(torch.randn(x.shape, generator=gen).to(torch.bfloat16))
        mm.copy_(torch.randint(0, 33, (16,), generator=gen, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        rq, rs = reference.quantize(x.cpu(), scheme)
        rows = C.masked_rows(16, 32, mm)
        C.assert_equal(q.cpu()[rows], rq[rows], f"q replay {trial}")
        C.assert_equal(s.cpu()[rows], rs[rows], f"s replay {trial}")


@pytest.mark.parametrize("layout", ["row", "deepgemm"])
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("m,h,width", [(300, 2880, 2944), (37, 160, 256), (5, 20000, 20096)])
def test_width_matches_reference(m, h, width, scheme, layout):
    """Codes wider than x (a zero-padded hidden): zero codes past H, byte-exact scales."""
    x = (torch.randn((m, h), generator=torch.Generator().manual_seed(m + h)) * 5).bfloat16()
    q, _ = _check(x, scheme, layout=layout, width=width)
    assert q.shape == (m, width) and (q[:, h:].float() == 0).all()


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_width_masked_3d_and_opcheck(scheme):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn((8, 64, 2880), generator=gen).to(torch.bfloat16)
    masked_m = torch.tensor([0, 64, 5, 1, 8, 63, 2, 100], dtype=torch.int32)
    _check(x, scheme, masked_m=masked_m, layout="deepgemm", width=2944)
    args = (x.cuda(), scheme, 128, masked_m.cuda(), "deepgemm", 2944)
    opcheck(torch.ops.epmoe.quantize.default, args, utils=NO_VALUE_COMPARE)
    opcheck(torch.ops.epmoe.quantize.default, (x[0].cuda(), scheme, 128, None, "row", 3072))
