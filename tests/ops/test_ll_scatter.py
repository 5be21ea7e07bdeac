"""ll_scatter on CPU (its reference): the contract, edge cases, errors, opcheck; the round trip
through ll_gather and compiled == eager for both."""

import importlib

import pytest
import torch

from epmoe import ops, reference
from epmoe.ops.ll_gather import ll_gather, ll_gather_out
from epmoe.ops.ll_scatter import ll_scatter
from tests._opcheck import opcheck
from tests._routing import random_weights
from tests.ops import _ll_cases as L

QUANTS = ("bf16", "fp8", "int8")
_q = importlib.import_module("epmoe.ops.quantize")


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("col_major", [False, True])
def test_scatter_matches_contract(quant, dtype, col_major):
    gen = torch.Generator().manual_seed(0)
    T, K, H, E, C = 12, 4, 256, 6, 12
    x = L.tokens(T, H, gen, stride_pad=8)  # rows of a wider tensor
    topk = L.ids(T, K, E, gen, dtype=dtype, col_major=col_major)
    out = ll_scatter(x, topk, E, C, quant)
    L.check_scatter(out, x, topk, E, C, quant)


@pytest.mark.parametrize("dtype", L.RAW_DTYPES)
def test_scatter_raw_copies(dtype):
    """quant="bf16" copies 1- and 4-byte payloads as raw bytes (the torch backend's HT rows)."""
    gen = torch.Generator().manual_seed(20)
    T, K, H, E, C = 9, 3, 70, 4, 9
    x = L.raw_tokens(T, H, dtype, gen)
    topk = L.ids(T, K, E, gen, col_major=True)
    L.check_raw_scatter(ll_scatter(x, topk, E, C), x, topk, E, C)
    with pytest.raises(ValueError, match="ll_scatter: x expected dtype torch.bfloat16"):
        ll_scatter(x, topk, E, C, "int8")


def test_scatter_one_rank_of_several():
    """expert_lo / num_global_experts: only this rank's experts land, others are skipped."""
    gen = torch.Generator().manual_seed(1)
    T, K, H, E, P = 10, 4, 128, 3, 3
    x = L.tokens(T, H, gen)
    topk = L.ids(T, K, E * P, gen, col_major=True)
    for rank in range(P):
        out = ll_scatter(x, topk, E, T, "fp8", expert_lo=rank * E, num_global_experts=E * P)
        L.check_scatter(out, x, topk, E, T, "fp8", rank * E, E * P)


@pytest.mark.parametrize("quant", QUANTS)
def test_quant_bytes_equal_reference_quantize(quant):
    gen = torch.Generator().manual_seed(2)
    T, H, E = 5, 384, 2
    x = L.tokens(T, H, gen)
    x[1] = 0  # an all-zero token (scale floor)
    topk = torch.tensor([[0, 1]] * T)
    xo, s, mm, rows = ll_scatter(x, topk, E, T, quant)
    assert torch.equal(mm, torch.tensor([T, T], dtype=torch.int32))
    if quant == "bf16":
        assert xo.dtype == torch.bfloat16 and s.shape == (E, T, 0)
        assert torch.equal(xo[0], x) and torch.equal(xo[1], x)
        return
    q, qs = reference.quantize(x, quant)
    qd = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[quant]
    assert xo.dtype == qd
    for e in range(E):
        assert torch.equal(L.as_bytes(xo[e]), L.as_bytes(q)) and torch.equal(s[e], qs)
    # the same bytes as the quantize op
    oq, os_ = ops.quantize(x, quant)
    assert torch.equal(L.as_bytes(oq), L.as_bytes(xo[0])) and torch.equal(os_, s[0])


def test_all_minus_one_and_empty_experts():
    x = L.tokens(4, 128, torch.Generator().manual_seed(3))
    xo, s, mm, rows = ll_scatter(x, torch.full((4, 2), -1), 4, 4)
    assert torch.equal(mm, torch.zeros(4, dtype=torch.int32))
    assert torch.equal(rows, torch.full((4, 2), -1, dtype=torch.int32))
    topk = torch.tensor([[2, -1], [2, 0], [-1, -1], [0, 2]])  # experts 1 and 3 empty
    out = ll_scatter(x, topk, 4, 4)
    assert out[2].tolist() == [2, 0, 3, 0]
    assert out[3].tolist() == [[8, -1], [9, 0], [-1, -1], [1, 10]]
    L.check_scatter(out, x, topk, 4, 4, "bf16")


@pytest.mark.parametrize("quant", QUANTS)
def test_zero_tokens(quant):
    x = torch.empty((0, 256), dtype=torch.bfloat16)
    xo, s, mm, rows = ll_scatter(x, torch.empty((0, 3), dtype=torch.int64), 5, 4, quant)
    assert xo.shape == (5, 4, 256) and rows.shape == (0, 3)
    assert torch.equal(mm, torch.zeros(5, dtype=torch.int32))


@pytest.mark.parametrize("quant", QUANTS)
def test_expert_filled_to_exactly_capacity(quant):
    """C entries on one expert: every slot, the last one included, holds its token."""
    gen = torch.Generator().manual_seed(4)
    C, H = 9, 256
    x = L.tokens(C, H, gen)
    topk = torch.full((C, 2), -1)
    topk[:, 0] = 1  # every token on expert 1
    topk[::2, 1] = 0
    xo, s, mm, rows = out = ll_scatter(x, topk, 3, C, quant)
    assert mm[1] == C
    assert rows[:, 0].tolist() == [C + c for c in range(C)]
    q = x if quant == "bf16" else reference.quantize(x, quant)[0]
    for c in range(C):
        assert torch.equal(L.as_bytes(xo[1, c]), L.as_bytes(q[c]))
    L.check_scatter(out, x, topk, 3, C, quant)


def test_capacity_overflow_raises():
    x = torch.zeros((5, 128), dtype=torch.bfloat16)
    topk = torch.tensor([[0], [1], [0], [0], [0]])
    with pytest.raises(ValueError, match="ll_scatter: topk_ids expected at most capacity=3"):
        ll_scatter(x, topk, 2, 3)
    ll_scatter(x, topk, 2, 4)  # exactly 4: fine


@pytest.mark.parametrize("bad", [4, 7, -2])
def test_bad_ids_raise(bad):
    """An id == num_global_experts (or above, or below -1) is an error; -1 is not."""
    x = torch.zeros((3, 128), dtype=torch.bfloat16)
    topk = torch.tensor([[0, -1], [1, bad], [-1, -1]])
    with pytest.raises(ValueError, match=r"ll_scatter: topk_ids expected ids in \[0, 4\) or -1"):
        ll_scatter(x, topk, 2, 4, expert_lo=2, num_global_experts=4)
    topk[1, 1] = 3  # the largest valid id
    _, _, mm, rows = ll_scatter(x, topk, 2, 4, expert_lo=2, num_global_experts=4)
    assert mm.tolist() == [0, 1] and rows.tolist() == [[-1, -1], [-1, 4], [-1, -1]]


@pytest.mark.parametrize("quant,groups", [("fp8", 2), ("int8", 1)])
def test_deepgemm_scale_layout(quant, groups):
    """The layout of epmoe.kernels.scales.alloc_scales for [E, C, G], the same values."""
    gen = torch.Generator().manual_seed(5)
    x = L.tokens(6, 256, gen)
    topk = L.ids(6, 2, 3, gen)
    xo, s, mm, rows = ll_scatter(x, topk, 3, 7, quant, scale_layout="deepgemm")
    want = _q.alloc_scales((3, 7), groups, "deepgemm", "cpu")
    assert s.shape == want.shape and s.stride() == want.stride()
    _, s_row, _, _ = ll_scatter(x, topk, 3, 7, quant)
    assert torch.equal(s, s_row)


def test_scatter_validation():
    x = torch.zeros((3, 192), dtype=torch.bfloat16)
    topk = torch.zeros((3, 2), dtype=torch.int64)
    cases = [
        (lambda: ll_scatter(x.double(), topk, 2, 4), "ll_scatter: x expected dtype torch.bfl"),
        (
            lambda: ll_scatter(x.float(), topk, 2, 4, "fp8"),  # raw copies with "bf16" only
            "ll_scatter: x expected dtype torch.bfloat16, got torch.float32",
        ),
        (lambda: ll_scatter(x, topk.float(), 2, 4), "ll_scatter: topk_ids expected dtype"),
        (lambda: ll_scatter(x, topk[:2], 2, 4), r"ll_scatter: topk_ids expected shape \[3, any\]"),
        (lambda: ll_scatter(x, topk, 0, 4), "ll_scatter: num_experts expected a positive int"),
        (lambda: ll_scatter(x, topk, 2, 0), "ll_scatter: capacity expected a positive int"),
        (lambda: ll_scatter(x, topk, 2, 4, "fp4"), "ll_scatter: quant expected one of"),
        (lambda: ll_scatter(x, topk, 2, 4, "fp8"), r"ll_scatter: x.shape\[1\] expected a mult"),
        (lambda: ll_scatter(x, topk, 2, 4, expert_lo=-1), "ll_scatter: expert_lo expected"),
        (
            lambda: ll_scatter(x, topk, 2, 4, expert_lo=2, num_global_experts=3),
            "ll_scatter: num_global_experts expected at least expert_lo \\+ num_experts = 4",
        ),
        (
            lambda: ll_scatter(x, topk, 2, 4, scale_layout="col"),
            "ll_scatter: scale_layout expected one of",
        ),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


@pytest.mark.parametrize("quant", QUANTS)
def test_opcheck_scatter(quant):
    gen = torch.Generator().manual_seed(6)
    x = L.tokens(8, 256, gen)
    topk = L.ids(8, 3, 8, gen, col_major=True)
    for args in (
        (x, topk, 4, 8, quant, 4, 8, "row"),
        (x, topk.int(), 8, 8, quant, 0, None, "deepgemm"),
        (x[:0], topk[:0], 4, 8, quant, 0, None, "row"),
    ):
        opcheck(torch.ops.epmoe.ll_scatter.default, args)


def test_roundtrip_unit_weights():
    """ll_gather(ll_scatter(x)) with weights 1 per kept entry restores (#entries) * x."""
    gen = torch.Generator().manual_seed(9)
    x = L.tokens(7, 64, gen)
    topk = L.ids(7, 2, 4, gen)
    xo, _, _, rows = ll_scatter(x, topk, 4, 7)
    n = (topk >= 0).sum(1, keepdim=True).float()
    assert torch.equal(ll_gather(xo, rows), (x.float() * n).bfloat16())


@pytest.mark.parametrize("quant", QUANTS)
def test_compiled_equals_eager(quant):
    """fullgraph torch.compile on CPU: the same bytes as eager (the CPU kernels stay opaque)."""
    gen = torch.Generator().manual_seed(12)
    x = L.tokens(6, 256, gen)
    topk = L.ids(6, 2, 4, gen, col_major=True)
    w = random_weights(6, 2, gen)

    def step(x, topk, w):
        xo, s, mm, rows = ll_scatter(x, topk, 4, 6, quant)
        y = xo.float() if quant == "bf16" else reference.dequantize(xo, s)
        y = y.bfloat16()
        out = torch.empty((6, 256), dtype=torch.bfloat16)
        ll_gather_out(y, rows, w, out)
        return out, ll_gather(y, rows), mm, rows

    torch._dynamo.reset()
    for a, b in zip(step(x, topk, w), torch.compile(step, fullgraph=True)(x, topk, w), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("H,width", [(160, 256), (256, 384), (128, 128)])
def test_scatter_width_zero_extends(quant, H, width):
    """A layout wider than x (a zero-padded hidden): each slot is x's row zero-extended, quantized
    as such (fp8: x need not fill whole groups); rows and masked_m as without it."""
    gen = torch.Generator().manual_seed(13)
    T, K, E, C = 10, 3, 4, 10
    x = L.tokens(T, H, gen, stride_pad=8)
    topk = L.ids(T, K, E, gen, col_major=True)
    out = ll_scatter(x, topk, E, C, quant, width=width)
    L.check_scatter(out, x, topk, E, C, quant, width=width)
    plain = ll_scatter(L.tokens(T, width, gen), topk, E, C, quant)
    assert torch.equal(out[2], plain[2]) and torch.equal(out[3], plain[3])
    live = torch.arange(C)[None, :] < out[2][:, None]
    assert (out[0][live][:, H:].float() == 0).all()


@pytest.mark.parametrize("dtype", L.RAW_DTYPES)
def test_scatter_raw_copies_width(dtype):
    """Raw copies into a wider layout: the bytes, then zero bytes."""
    gen = torch.Generator().manual_seed(21)
    T, K, H, E, C = 9, 3, 70, 4, 9
    x = L.raw_tokens(T, H, dtype, gen)
    topk = L.ids(T, K, E, gen, col_major=True)
    xo, s, mm, rows = ll_scatter(x, topk, E, C, width=96)
    assert xo.dtype == dtype and xo.shape == (E, C, 96)
    wide = torch.zeros((T, 96), dtype=dtype)
    wide.view(torch.uint8)[:, : H * x.element_size()] = x.contiguous().view(torch.uint8)
    L.check_raw_scatter((xo, s, mm, rows), wide, topk, E, C)


def test_scatter_width_errors():
    x = torch.zeros((3, 160), dtype=torch.bfloat16)
    topk = torch.zeros((3, 2), dtype=torch.int64)
    for quant, width, msg in [
        ("bf16", 159, r"ll_scatter: width expected None or an int >= H = 160 \(x's columns\)"),
        ("int8", True, "ll_scatter: width expected None or an int >= H = 160"),
        ("fp8", 256.0, "ll_scatter: width expected None or an int >= H = 160"),
        ("fp8", 200, "ll_scatter: width expected a multiple of 128"),
    ]:
        with pytest.raises(ValueError, match=msg):
            ll_scatter(x, topk, 2, 4, quant, width=width)


@pytest.mark.parametrize("quant", QUANTS)
def test_opcheck_scatter_width(quant):
    gen = torch.Generator().manual_seed(14)
    x = L.tokens(8, 160, gen)
    topk = L.ids(8, 3, 8, gen, col_major=True)
    for args in (
        (x, topk, 4, 8, quant, 4, 8, "row", 256),
        (x, topk.int(), 8, 8, quant, 0, None, "deepgemm", 384),
    ):
        opcheck(torch.ops.epmoe.ll_scatter.default, args)


def test_roundtrip_width_and_hidden():
    """ll_gather(ll_scatter(x, width), hidden=H) with weights 1 restores (#entries) * x."""
    gen = torch.Generator().manual_seed(15)
    x = L.tokens(7, 100, gen)
    topk = L.ids(7, 2, 4, gen)
    xo, _, _, rows = ll_scatter(x, topk, 4, 7, width=128)
    n = (topk >= 0).sum(1, keepdim=True).float()
    assert torch.equal(ll_gather(xo, rows, hidden=100), (x.float() * n).bfloat16())
