"""silu_and_mul(_quant) on CUDA (Triton kernels).

silu_and_mul against the CPU reference at the dtype tolerance (the GPU exp is not the CPU exp to the
last bit); the fused quant kernel byte for byte against the reference quantizer applied to the CUDA
silu_and_mul output (and against the unfused CUDA ops); every specified element written (outputs
poisoned first); masked and m_indices layouts; every gate kind and the expert bias; CUDA-graph
replay; opcheck on CUDA inputs.
"""

import importlib

import pytest
import torch

from epmoe import reference
from epmoe.ops import quantize, silu_and_mul, silu_and_mul_quant
from tests._opcheck import NO_VALUE_COMPARE, opcheck
from tests.ops import _stage_cases as C

pytestmark = pytest.mark.gpu


def _live(y, masked_m=None, m_indices=None):
    if y.dim() == 3:
        return C.masked_rows(y.shape[0], y.shape[1], masked_m)
    if m_indices is not None:
        return m_indices.cpu() >= 0
    return torch.ones(y.shape[0], dtype=torch.bool)


def _dev(t):
    return None if t is None else t.cuda()


def _check_silu(y, masked_m=None, m_indices=None, gate="silu", bias=None, offsets=None):
    live = _live(y, masked_m, m_indices)
    ref = reference.silu_and_mul(y, gate, bias, m_indices)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            h = silu_and_mul(
                y.cuda(), _dev(masked_m), _dev(m_indices), _dev(offsets), gate, _dev(bias)
            )
        torch.cuda.synchronize()
        assert h.dtype == y.dtype and h.shape == ref.shape
        C.assert_close(h.cpu()[live], ref[live])


def _check_quant(
    y, scheme, masked_m=None, group_size=128, m_indices=None, layout="row", gate="silu", bias=None
):
    live = _live(y, masked_m, m_indices)
    yd, mm, mi, b = y.cuda(), _dev(masked_m), _dev(m_indices), _dev(bias)
    h = silu_and_mul(yd, mm, mi, gate=gate, bias=b)
    C.assert_close(h.cpu()[live], reference.silu_and_mul(y, gate, bias, m_indices)[live])
    rq, rs = reference.quantize(h.cpu(), scheme, group_size)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            q, s = silu_and_mul_quant(
                yd, scheme, mm, group_size, mi, scale_layout=layout, gate=gate, bias=b
            )
        torch.cuda.synchronize()
        C.assert_equal(q.cpu()[live], rq[live], "q")
        C.assert_equal(s.cpu()[live], rs[live], "s")
    # fused == unfused on the same backend
    q2, s2 = quantize(h, scheme, group_size, mm)
    C.assert_equal(q.cpu()[live], q2.cpu()[live], "q vs unfused")
    C.assert_equal(s.cpu()[live], s2.cpu()[live], "s vs unfused")
    return q, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [0, 1, 777])
def test_silu_2d(m, dtype):
    y = (torch.randn((m, 4096), generator=torch.Generator().manual_seed(m)) * 4).to(dtype)
    _check_silu(y)


def test_silu_masked_and_m_indices():
    gen = torch.Generator().manual_seed(1)
    y3 = torch.randn((16, 64, 4096), generator=gen).to(torch.bfloat16)
    _check_silu(y3, masked_m=torch.randint(0, 65, (16,), generator=gen, dtype=torch.int32))
    y2 = torch.randn((300, 1000), generator=gen).to(torch.bfloat16)  # I = 500: partial chunk
    mi = torch.where(torch.rand(300, generator=gen) < 0.4, -1, 0).to(torch.int32)
    _check_silu(y2, m_indices=mi)


@pytest.mark.parametrize("layout", ["row", "deepgemm"])
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_2d(scheme, dtype, layout):
    y = (torch.randn((513, 4096), generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    _, s = _check_quant(y, scheme, layout=layout)
    if layout == "deepgemm":
        assert s.stride() == (1, 516)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_quant_masked_and_m_indices(scheme):
    gen = torch.Generator().manual_seed(3)
    y3 = torch.randn((32, 256, 4096), generator=gen).to(torch.bfloat16)  # LL decode: ~8 rows
    mm = torch.randint(0, 17, (32,), generator=gen, dtype=torch.int32)
    mm[0], mm[1] = 0, 256
    _check_quant(y3, scheme, masked_m=mm, layout="deepgemm")
    y2 = torch.randn((1024, 4096), generator=gen).to(torch.bfloat16)
    mi = torch.where(torch.rand(1024, generator=gen) < 0.5, -1, 3).to(torch.int32)
    _check_quant(y2, scheme, m_indices=mi, layout="deepgemm")


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_quant_edges(scheme):
    gen = torch.Generator().manual_seed(4)
    _check_quant(torch.zeros((0, 4096), dtype=torch.bfloat16), scheme)
    _check_quant(torch.randn((1, 4096), generator=gen).to(torch.bfloat16), scheme)
    _check_quant(torch.zeros((3, 256), dtype=torch.bfloat16), scheme)


def test_quant_odd_group_and_two_pass():
    gen = torch.Generator().manual_seed(5)
    _check_quant(torch.randn((9, 384), generator=gen), "fp8", group_size=96)
    _check_quant(torch.randn((5, 40000), generator=gen).to(torch.bfloat16), "int8")  # I > 16384
    y3 = torch.randn((3, 7, 40000), generator=gen).to(torch.bfloat16)
    _check_quant(y3, "int8", masked_m=torch.tensor([7, 0, 2], dtype=torch.int32))
    # Mixtral's I = 14336: one pass, the row in registers (64 elements a thread)
    y3 = torch.randn((3, 7, 28672), generator=gen).to(torch.bfloat16)
    _check_quant(y3, "int8", masked_m=torch.tensor([7, 0, 2], dtype=torch.int32))
    _check_quant(y3[0], "int8")


def test_strided_input():
    gen = torch.Generator().manual_seed(6)
    y = torch.randn((64, 8192), generator=gen).to(torch.bfloat16)
    yd = y.cuda()[:, ::2]
    C.assert_close(silu_and_mul(yd), reference.silu_and_mul(y[:, ::2]))
    q, s = silu_and_mul_quant(yd, "fp8")
    rq, rs = reference.quantize(silu_and_mul(yd).cpu(), "fp8")
    C.assert_equal(q, rq, "q")
    C.assert_equal(s, rs, "s")


def test_opcheck_cuda():
    gen = torch.Generator().manual_seed(7)
    y = torch.randn((33, 512), generator=gen).to(torch.bfloat16).cuda()
    mi = torch.tensor([0, -1] * 16 + [1], dtype=torch.int32, device="cuda")
    opcheck(torch.ops.epmoe.silu_and_mul.default, (y,))
    opcheck(torch.ops.epmoe.silu_and_mul.default, (y, None, mi), utils=NO_VALUE_COMPARE)
    opcheck(
        torch.ops.epmoe.silu_and_mul_quant.default,
        (y, "fp8", None, 128, mi, "deepgemm"),
        utils=NO_VALUE_COMPARE,
    )
    opcheck(torch.ops.epmoe.silu_and_mul_quant.default, (y, "int8", None, 128, None, "row"))
    y3 = torch.randn((4, 9, 512), generator=gen).to(torch.bfloat16).cuda()
    mm = torch.tensor([0, 9, 2, 5], dtype=torch.int32, device="cuda")
    opcheck(torch.ops.epmoe.silu_and_mul.default, (y3, mm, None), utils=NO_VALUE_COMPARE)
    opcheck(
        torch.ops.epmoe.silu_and_mul_quant.default,
        (y3, "fp8", mm, 128, None, "deepgemm"),
        utils=NO_VALUE_COMPARE,
    )
    opcheck(
        torch.ops.epmoe.silu_and_mul_quant.default,
        (y3, "int8", mm, 128, None, "row"),
        utils=NO_VALUE_COMPARE,
    )


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_cuda_graph_replay(scheme):
    gen = torch.Generator().manual_seed(8)
    y = torch.randn((16, 64, 1024), generator=gen).to(torch.bfloat16).cuda()
    mm = torch.randint(0, 65, (16,), generator=gen, dtype=torch.int32).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        silu_and_mul_quant(y, scheme, mm, scale_layout="deepgemm")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = silu_and_mul_quant(y, scheme, mm, scale_layout="deepgemm")
    for _ in range(2):
        y.copy_(torch.randn(y.shape, generator=gen).to(torch.bfloat16))
        mm.copy_(torch.randint(0, 65, (16,), generator=gen, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        rq, rs = reference.quantize(silu_and_mul(y, mm).cpu(), scheme)
        rows = C.masked_rows(16, 64, mm)
        C.assert_equal(q.cpu()[rows], rq[rows], "q replay")
        C.assert_equal(s.cpu()[rows], rs[rows], "s replay")


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_expert_offsets_skip_the_tail(scheme):
    """The permute layout at a W-like ratio: rows past expert_offsets[-1] keep their poison."""
    from epmoe.ops import permute

    gen = torch.Generator().manual_seed(10)
    ids = C.routing(600, 8, 16, gen).cuda()
    p = permute(torch.empty((600, 16), dtype=torch.uint8, device="cuda"), ids, 16, 128)
    y = torch.randn((p.m_indices.numel(), 512), generator=gen).to(torch.bfloat16).cuda()
    used = int(p.expert_offsets[-1])
    assert 0 < used < y.shape[0]
    live = (p.m_indices >= 0).cpu()
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            if scheme == "bf16":
                out = silu_and_mul(y, None, p.m_indices, p.expert_offsets)
                C.assert_close(out.cpu()[live], reference.silu_and_mul(y.cpu())[live])
            else:
                out, s = silu_and_mul_quant(
                    y, scheme, None, 128, p.m_indices, "deepgemm", p.expert_offsets
                )
                rq, rs = reference.quantize(silu_and_mul(y, None, p.m_indices).cpu(), scheme)
                C.assert_equal(q := out.cpu()[live], rq[live], "q")
                C.assert_equal(s.cpu()[live], rs[live], "s")
                assert q.numel() > 0
        torch.cuda.synchronize()
        tail = out[used:].reshape(-1).view(torch.uint8)
        assert bool((tail == byte).all()), "a row past expert_offsets[-1] was written"
    opcheck(
        torch.ops.epmoe.silu_and_mul_quant.default,
        (y, "fp8", None, 128, p.m_indices, "deepgemm", p.expert_offsets),
        utils=NO_VALUE_COMPARE,
    )


GATES = C.ACT_GATES


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gates_2d(gate, dtype):
    gen = torch.Generator().manual_seed(20)
    y = torch.randn((777, C.gate_width(gate, 2500)), generator=gen) * 4  # I = 2500: a partial chunk
    _check_silu(y.to(dtype), gate=gate)


@pytest.mark.parametrize("gate", ["silu", *GATES])
def test_gate_bias_rows(gate):
    """Each row's expert bias: m_indices on a 2-D y (and the HT path's expert_offsets), e on a
    3-D masked y; float32 and bf16 biases."""
    from epmoe.ops import permute

    gen = torch.Generator().manual_seed(21)
    w = C.gate_width(gate, 1024)
    ids = C.routing(600, 8, 16, gen).cuda()
    p = permute(torch.empty((600, 16), dtype=torch.uint8, device="cuda"), ids, 16, 128)
    mi, offs = p.m_indices.cpu(), p.expert_offsets.cpu()
    y2 = (torch.randn((mi.numel(), w), generator=gen) * 3).to(torch.bfloat16)
    b = torch.randn((16, w), generator=gen) * 2
    _check_silu(y2, m_indices=mi, gate=gate, bias=b)
    _check_silu(y2, m_indices=mi, gate=gate, bias=b.to(torch.bfloat16), offsets=offs)
    y3 = (torch.randn((16, 64, w), generator=gen) * 3).to(torch.bfloat16)
    mm = torch.randint(0, 65, (16,), generator=gen, dtype=torch.int32)
    _check_silu(y3, masked_m=mm, gate=gate, bias=b.to(torch.bfloat16))


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("gate", GATES)
def test_gate_bias_quant(scheme, gate):
    gen = torch.Generator().manual_seed(22)
    w = C.gate_width(gate, 2048)
    b = torch.randn((32, w), generator=gen)
    y2 = (torch.randn((1024, w), generator=gen) * 3).to(torch.bfloat16)
    mi = torch.where(
        torch.rand(1024, generator=gen) < 0.3, -1, torch.randint(0, 32, (1024,), generator=gen)
    ).to(torch.int32)
    _check_quant(y2, scheme, m_indices=mi, layout="deepgemm", gate=gate, bias=b)
    y3 = (torch.randn((32, 64, w), generator=gen) * 3).to(torch.bfloat16)
    mm = torch.randint(0, 17, (32,), generator=gen, dtype=torch.int32)
    _check_quant(y3, scheme, masked_m=mm, layout="deepgemm", gate=gate, bias=b.half())
    _check_quant(y3, scheme, masked_m=mm, gate=gate)


@pytest.mark.parametrize("gate", ["silu:alpha=1.702,limit=7,up_offset=1", "relu2:glu=0"])
def test_gate_bias_int8_two_pass(gate):
    gen = torch.Generator().manual_seed(23)
    w = C.gate_width(gate, 20000)
    y3 = (torch.randn((3, 7, w), generator=gen) * 3).to(torch.bfloat16)
    b = torch.randn((3, w), generator=gen).to(torch.bfloat16)
    _check_quant(y3, "int8", masked_m=torch.tensor([7, 0, 2], dtype=torch.int32), gate=gate, bias=b)


def test_gate_bias_opcheck_cuda():
    gen = torch.Generator().manual_seed(24)
    y = torch.randn((33, 512), generator=gen).to(torch.bfloat16).cuda()
    mi = torch.tensor([0, -1] * 16 + [1], dtype=torch.int32, device="cuda")
    b = torch.randn((2, 512), generator=gen).cuda()
    spec = "silu:alpha=1.702,limit=7,up_offset=1"
    opcheck(torch.ops.epmoe.silu_and_mul.default, (y, None, None, None, "relu2:glu=0"))
    opcheck(
        torch.ops.epmoe.silu_and_mul.default, (y, None, mi, None, spec, b), utils=NO_VALUE_COMPARE
    )
    opcheck(
        torch.ops.epmoe.silu_and_mul_quant.default,
        (y, "fp8", None, 128, mi, "deepgemm", None, "gelu_tanh", b.bfloat16()),
        utils=NO_VALUE_COMPARE,
    )
    y3 = torch.randn((2, 9, 512), generator=gen).to(torch.bfloat16).cuda()
    mm = torch.tensor([9, 2], dtype=torch.int32, device="cuda")
    opcheck(
        torch.ops.epmoe.silu_and_mul_quant.default,
        (y3, "int8", mm, 128, None, "row", None, "relu2:glu=0", b),
        utils=NO_VALUE_COMPARE,
    )


def test_bad_gate_or_bias_before_any_kernel(monkeypatch):
    """On CUDA tensors (the public functions' direct path) a bad gate spec or bias is the
    contract's ValueError before any launch plan."""
    A = importlib.import_module("epmoe.ops.activation")

    def never(*a, **k):
        raise AssertionError("reached a kernel")

    monkeypatch.setattr(A, "_silu_launch", never)
    monkeypatch.setattr(A, "_silu_quant_launch", never)
    y = torch.zeros((4, 256), device="cuda")
    mi = torch.zeros(4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="silu_and_mul: gate expected a gate spec"):
        silu_and_mul(y, gate="swish")
    with pytest.raises(ValueError, match="silu_and_mul_quant: gate expected a gate spec"):
        silu_and_mul_quant(y, "fp8", gate="relu:alpha=2")
    with pytest.raises(ValueError, match="silu_and_mul: bias expected shape"):
        silu_and_mul(y, m_indices=mi, bias=torch.zeros((2, 128), device="cuda"))
    with pytest.raises(ValueError, match="silu_and_mul: m_indices expected int32"):
        silu_and_mul(y, bias=torch.zeros((2, 256), device="cuda"))
    with pytest.raises(ValueError, match="silu_and_mul: bias expected"):
        silu_and_mul(y, m_indices=mi, bias=torch.zeros((2, 256)))  # on the CPU


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_gate_bias_cuda_graph_replay(scheme):
    gen = torch.Generator().manual_seed(25)
    gate = "silu:alpha=1.702,limit=7,up_offset=1"
    y = torch.randn((16, 64, 1024), generator=gen).to(torch.bfloat16).cuda()
    b = torch.randn((16, 1024), generator=gen).to(torch.bfloat16).cuda()
    mm = torch.randint(0, 65, (16,), generator=gen, dtype=torch.int32).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        silu_and_mul_quant(y, scheme, mm, scale_layout="deepgemm", gate=gate, bias=b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = silu_and_mul_quant(y, scheme, mm, scale_layout="deepgemm", gate=gate, bias=b)
    for _ in range(2):
        y.copy_(torch.randn(y.shape, generator=gen).to(torch.bfloat16))
        b.copy_(torch.randn(b.shape, generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        rq, rs = reference.quantize(silu_and_mul(y, mm, gate=gate, bias=b).cpu(), scheme)
        rows = C.masked_rows(16, 64, mm)
        C.assert_equal(q.cpu()[rows], rq[rows], "q replay")
        C.assert_equal(s.cpu()[rows], rs[rows], "s replay")
