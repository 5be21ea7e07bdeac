"""unpermute on CUDA (Triton kernel) against the CPU reference at the dtype tolerance, every output
element written (outputs poisoned first), round trip with permute, opcheck on CUDA inputs."""

import pytest
import torch

import epmoe
from epmoe import reference
from epmoe.ops import permute, unpermute
from tests._opcheck import opcheck
from tests.ops import _stage_cases as C

pytestmark = pytest.mark.gpu


def _inputs(m, k, rows, h, dtype, gen, neg=0.5):
    y = (torch.randn((rows, h), generator=gen) * 3).to(dtype)
    inv = torch.randint(0, max(rows, 1), (m, k), generator=gen)
    inv = torch.where(torch.rand((m, k), generator=gen) < neg, -1, inv).to(torch.int32)
    return y, inv, torch.rand((m, k), generator=gen)


def _check(y, inv, w):
    ref = reference.unpermute(y, inv, w)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            out = unpermute(y.cuda(), inv.cuda(), w.cuda())
        torch.cuda.synchronize()
        assert out.dtype == y.dtype and out.shape == ref.shape
        C.assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_workload_w_like(dtype):
    gen = torch.Generator().manual_seed(0)
    _check(*_inputs(1024, 8, 4096, 7168, dtype, gen))


@pytest.mark.parametrize(
    "m,k,h,neg", [(0, 8, 7168, 0.5), (1, 1, 7168, 0.0), (64, 8, 300, 1.0), (33, 3, 1000, 0.2)]
)
def test_edge_cases(m, k, h, neg):
    gen = torch.Generator().manual_seed(m + h)
    _check(*_inputs(m, k, 200, h, torch.bfloat16, gen, neg))


def test_int64_rows_bf16_weights_strided():
    gen = torch.Generator().manual_seed(1)
    y, inv, w = _inputs(50, 4, 300, 512, torch.bfloat16, gen)
    _check(y, inv.long().t().contiguous().t(), w.to(torch.bfloat16).t().contiguous().t())
    wide = torch.randn((300, 1024), generator=gen).to(torch.bfloat16)
    ref = reference.unpermute(wide[:, ::2], inv, w)
    C.assert_close(unpermute(wide.cuda()[:, ::2], inv.cuda(), w.cuda()), ref)


def test_round_trip_with_permute():
    """K = 1 and unit weights: unpermute(permute(x)) is x itself (0 for tokens with id -1)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn((700, 1024), generator=gen).to(torch.bfloat16).cuda()
    ids = C.routing(700, 1, 16, gen, local=0.8).cuda()
    p = permute(x, ids, 16, 128)
    back = unpermute(p.x, p.inv_perm, torch.ones((700, 1), device="cuda"))
    assert torch.equal(back, torch.where(ids >= 0, x, 0.0).to(torch.bfloat16))


def test_bad_rows_raise_in_debug_mode():
    y = torch.zeros((4, 64), dtype=torch.bfloat16, device="cuda")
    inv = torch.tensor([[0, 5]], dtype=torch.int32, device="cuda")
    epmoe.set_debug(True)
    try:
        with pytest.raises(ValueError, match=r"unpermute: inv_perm expected ids in \[0, 4\) or -1"):
            unpermute(y, inv, torch.ones((1, 2), device="cuda"))
    finally:
        epmoe.set_debug(False)


def test_opcheck_cuda():
    gen = torch.Generator().manual_seed(3)
    y, inv, w = _inputs(24, 4, 64, 256, torch.bfloat16, gen)
    opcheck(torch.ops.epmoe.unpermute.default, (y.cuda(), inv.cuda(), w.cuda()))
    opcheck(torch.ops.epmoe.unpermute.default, (y.float().cuda(), inv.long().cuda(), w.cuda()))


def test_cuda_graph_replay():
    gen = torch.Generator().manual_seed(4)
    y, inv, w = (t.cuda() for t in _inputs(256, 8, 1024, 2048, torch.bfloat16, gen))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        unpermute(y, inv, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = unpermute(y, inv, w)
    y2, inv2, w2 = _inputs(256, 8, 1024, 2048, torch.bfloat16, gen)
    for dst, src in ((y, y2), (inv, inv2), (w, w2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    C.assert_close(out, reference.unpermute(y2, inv2, w2))


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h,hidden", [(7168, None), (2944, 2880), (512, 1)])
def test_bias_hidden_matches_reference(bias_dtype, h, hidden):
    """bias[m_indices[row]] before the weighting (m_indices -1: none), the first Ho columns."""
    gen = torch.Generator().manual_seed(5)
    y, inv, w = _inputs(300, 8, 1024, h, torch.bfloat16, gen)
    b = torch.randn((16, h), generator=gen).to(bias_dtype)
    m_idx = torch.randint(-1, 16, (1024,), generator=gen, dtype=torch.int32)
    ref = reference.unpermute(y, inv, w, b, m_idx, hidden)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            out = unpermute(
                y.cuda(), inv.cuda(), w.cuda(), bias=b.cuda(), m_indices=m_idx.cuda(), hidden=hidden
            )
        torch.cuda.synchronize()
        assert out.shape == ref.shape
        C.assert_close(out, ref)
    args = (y.cuda(), inv.cuda(), w.cuda(), True, b.cuda(), m_idx.cuda(), hidden)
    C.assert_equal(torch.ops.epmoe.unpermute.default(*args), out, "dispatcher")
    opcheck(torch.ops.epmoe.unpermute.default, args)


def test_round_trip_with_permute_bias():
    """K = 1, unit weights, a bias by permute's m_indices: x + bias[id] (0 for id -1)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn((700, 1024), generator=gen).to(torch.bfloat16).cuda()
    ids = C.routing(700, 1, 16, gen, local=0.8).cuda()
    b = torch.randn((16, 1024), generator=gen).cuda()
    p = permute(x, ids, 16, 128)
    w = torch.ones((700, 1), device="cuda")
    back = unpermute(p.x, p.inv_perm, w, bias=b, m_indices=p.m_indices, hidden=1000)
    want = torch.where(ids >= 0, x.float() + b[ids.clamp(min=0).squeeze(1)], 0.0)[:, :1000]
    assert torch.equal(back, want.to(torch.bfloat16))
