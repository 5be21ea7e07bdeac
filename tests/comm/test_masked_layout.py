"""ll_scatter / ll_gather on CPU (their references): the contract, edge cases, errors, opcheck; and
the local backend's LL dispatch / combine through them."""

import importlib

import pytest
import torch

import epmoe
from epmoe import ops, reference
from epmoe.comm.masked_layout import alloc_scales, ll_gather, ll_scatter
from tests._opcheck import opcheck
from tests._routing import random_weights
from tests.comm import _ll_cases as L

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
    """The layout of epmoe.ops.quantize.alloc_scales for [E, C, G], the same values."""
    gen = torch.Generator().manual_seed(5)
    x = L.tokens(6, 256, gen)
    topk = L.ids(6, 2, 3, gen)
    xo, s, mm, rows = ll_scatter(x, topk, 3, 7, quant, scale_layout="deepgemm")
    want = _q.alloc_scales((3, 7), groups, "deepgemm", "cpu")
    assert s.shape == want.shape and s.stride() == want.stride()
    assert alloc_scales((3, 7), groups, "deepgemm", "cpu").stride() == want.stride()
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
        (lambda: ll_scatter(x, topk[:2], 2, 4), r"ll_scatter: topk_ids expected shape \[3, \*\]"),
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


def test_gather_matches_contract():
    gen = torch.Generator().manual_seed(7)
    E, C, H, T, K = 3, 5, 96, 6, 3
    y = torch.randn((E, C + 2, H), generator=gen).bfloat16()[:, :C]  # strided slots
    rows = torch.randint(-1, E * C, (T, K), generator=gen, dtype=torch.int32)
    w = random_weights(T, K, gen).t().contiguous().t()  # column-major weights
    assert torch.equal(ll_gather(y, rows, w), L.gather_oracle(y, rows, w))
    assert torch.equal(ll_gather(y, rows), L.gather_oracle(y, rows))
    assert torch.equal(ll_gather(y, rows.long(), w), L.gather_oracle(y, rows, w))
    out = torch.empty((T, H), dtype=torch.bfloat16)
    assert ll_gather(y, rows, w, out=out) is out
    assert torch.equal(out, L.gather_oracle(y, rows, w))
    # slots past masked_m may hold anything: never read
    y2 = y.clone()
    y2.view(E * C, H)[torch.tensor([r for r in range(E * C) if r not in rows])] = float("nan")
    assert torch.equal(ll_gather(y2, rows, w), L.gather_oracle(y, rows, w))
    assert ll_gather(y, rows[:0], w[:0]).shape == (0, H)


def test_gather_errors():
    y = torch.zeros((2, 3, 16), dtype=torch.bfloat16)
    rows = torch.tensor([[0, 5], [-1, 6]], dtype=torch.int32)
    w = torch.ones((2, 2))
    with pytest.raises(ValueError, match=r"ll_gather: rows expected rows in \[0, 6\) or -1"):
        ll_gather(y, rows, w)
    rows[1, 1] = -2
    with pytest.raises(ValueError, match=r"ll_gather: rows expected rows in \[0, 6\) or -1"):
        ll_gather(y, rows, w)
    rows[1, 1] = 1
    for bad, msg in [
        (torch.empty((2, 16)), "ll_gather: out expected dtype torch.bfloat16"),
        (torch.empty((3, 16), dtype=torch.bfloat16), r"ll_gather: out expected shape \[2, 16\]"),
        (torch.empty((16, 2), dtype=torch.bfloat16).t(), "ll_gather: out expected a contiguous"),
    ]:
        with pytest.raises(ValueError, match=msg):
            ll_gather(y, rows, w, out=bad)
    with pytest.raises(ValueError, match="ll_gather: y expected dtype torch.bfloat16"):
        ll_gather(y.float(), rows, w)
    with pytest.raises(ValueError, match="ll_gather: topk_weights expected shape"):
        ll_gather(y, rows, w[:1])


def test_opcheck_gather():
    gen = torch.Generator().manual_seed(8)
    y = torch.randn((3, 4, 64), generator=gen).bfloat16()
    rows = torch.randint(-1, 12, (5, 2), generator=gen, dtype=torch.int32)
    w = random_weights(5, 2, gen)
    opcheck(torch.ops.epmoe.ll_gather.default, (y, rows, w))
    opcheck(torch.ops.epmoe.ll_gather.default, (y, rows, None))
    opcheck(torch.ops.epmoe.ll_gather.default, (y, rows, w, False))
    out = torch.empty((5, 64), dtype=torch.bfloat16)
    opcheck(torch.ops.epmoe.ll_gather_out.default, (y, rows, w, out))


def test_roundtrip_unit_weights():
    """ll_gather(ll_scatter(x)) with weights 1 per kept entry restores (#entries) * x."""
    gen = torch.Generator().manual_seed(9)
    x = L.tokens(7, 64, gen)
    topk = L.ids(7, 2, 4, gen)
    xo, _, _, rows = ll_scatter(x, topk, 4, 7)
    n = (topk >= 0).sum(1, keepdim=True).float()
    assert torch.equal(ll_gather(xo, rows), (x.float() * n).bfloat16())


# ------------------------------------------------------------------------------ the local backend
def _local(max_tokens=8, E=4, H=256):
    return epmoe.comm.create("local", None, E, H, max_tokens_per_rank=max_tokens)


def _same_result(got, want):
    """Two dispatch results: the same type, None in the same fields, the same bytes elsewhere."""
    leaves = torch.utils._pytree.tree_leaves
    assert type(got) is type(want)
    for a, b in zip(leaves(got), leaves(want), strict=True):
        if a is None or b is None:
            assert a is b
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.dtype == torch.float8_e4m3fn:  # (compared as bytes)
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_local_ll_dispatch_combine(use_fp8):
    gen = torch.Generator().manual_seed(10)
    c = _local()
    assert isinstance(c, epmoe.comm.LocalComm) and c.name == "local" and c.world_size == 1
    x = L.tokens(6, 256, gen)
    topk = L.ids(6, 2, 4, gen, col_major=True)
    w = random_weights(6, 2, gen)
    d = ops.ll_dispatch(x, topk, c.key, use_fp8=use_fp8)
    assert len(d.handle) == 1 and d.handle[0].dtype == torch.int32 and d.handle[0].shape == (6, 2)
    quant = "fp8" if use_fp8 else "bf16"
    want = ll_scatter(x, topk, 4, 8, quant)
    L.check_scatter((d.x, want[1], d.masked_m, d.handle[0]), x, topk, 4, 8, quant)
    if use_fp8:
        assert d.x_scales.shape == (4, 8, 2) and torch.equal(d.x_scales, want[1])
    y = torch.randn((4, 8, 256), generator=gen).bfloat16()
    got = ops.ll_combine(y, topk, w, d.handle, c.key)
    assert torch.equal(got, L.gather_oracle(y, d.handle[0], w))
    out = torch.empty_like(got)
    assert ops.ll_combine(y, topk, w, d.handle, c.key, out=out) is out
    assert torch.equal(out, got)
    # the layer's direct-path entries (the launches): the same results
    d2 = ops.ll_dispatch.launch(x, topk, c.key, use_fp8)
    _same_result(d2, d)
    assert torch.equal(ops.ll_combine.launch(y, topk, w, d.handle, c.key), got)
    out2 = torch.empty_like(got)
    assert ops.ll_combine.launch(y, topk, w, d.handle, c.key, out2) is out2
    assert torch.equal(out2, got)
    opcheck(torch.ops.epmoe.ll_dispatch.default, (x, topk, c.key, use_fp8))
    opcheck(torch.ops.epmoe.ll_combine.default, (y, topk, w, list(d.handle), c.key))
    opcheck(torch.ops.epmoe.ll_combine_out.default, (y, topk, w, list(d.handle), c.key, out2))


@pytest.mark.parametrize("worst", [False, True])
def test_local_ht_copies_with_column_major_ids(worst):
    """HT on one rank: copies (never aliases), column-major ids accepted (point 6)."""
    gen = torch.Generator().manual_seed(11)
    c = _local()
    x = L.tokens(5, 256, gen)
    topk = L.ids(5, 2, 4, gen, col_major=True)
    w = random_weights(5, 2, gen).t().contiguous().t()
    d = ops.ht_dispatch(x, topk, w, c.key, worst_case=worst)
    assert d.x.data_ptr() != x.data_ptr()
    n = (topk >= 0).any(1).sum()
    assert torch.equal(d.expert_counts, torch.bincount(topk[topk >= 0], minlength=4).int())
    got = sorted(d.x[i].float().tolist() for i in range(d.x.shape[0]) if (d.topk_ids[i] >= 0).any())
    assert len(got) == n and got == sorted(x[(topk >= 0).any(1)].float().tolist())
    back = ops.ht_combine(d.x, d.handle, c.key)
    assert torch.equal(back, torch.where((topk >= 0).any(1, keepdim=True), x, 0))
    # the layer's direct-path entries (the launches): the same results
    d2 = ops.ht_dispatch.launch(x, topk, w, c.key, None, worst)
    _same_result(d2, d)
    assert torch.equal(ops.ht_combine.launch(d.x, d.handle, c.key), back)


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
        ll_gather(y, rows, w, out=out)
        return out, ll_gather(y, rows), mm, rows

    torch._dynamo.reset()
    for a, b in zip(step(x, topk, w), torch.compile(step, fullgraph=True)(x, topk, w), strict=True):
        assert torch.equal(a, b)
