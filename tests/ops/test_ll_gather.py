"""ll_gather / ll_gather_out on CPU (their references): the contract (with a down-projection bias
and a narrower output), errors, opcheck, compiled == eager."""

import importlib

import pytest
import torch

from epmoe.ops.ll_gather import ll_gather, ll_gather_out
from tests._opcheck import opcheck
from tests._routing import random_weights
from tests.ops import _ll_cases as L

QUANTS = ("bf16", "fp8", "int8")
_q = importlib.import_module("epmoe.ops.quantize")


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
    assert ll_gather_out(y, rows, w, out) is out
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
        (torch.empty((3, 16), dtype=torch.bfloat16), r"ll_gather: out expected shape \[2, any\]"),
        (torch.empty((2, 17), dtype=torch.bfloat16), r"ll_gather: out expected \[2, Ho\] with 1"),
        (torch.empty((2, 0), dtype=torch.bfloat16), r"Ho <= 16 \(y's columns\), got \[2, 0\]"),
        (torch.empty((16, 2), dtype=torch.bfloat16).t(), "ll_gather: out expected a contiguous"),
    ]:
        with pytest.raises(ValueError, match=msg):
            ll_gather_out(y, rows, w, bad)
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


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gather_bias_and_hidden(bias_dtype):
    """out[t] = sum_k w * (y[r, :Ho] + bias[r // C, :Ho]): the oracle's loop, bit for bit."""
    gen = torch.Generator().manual_seed(9)
    E, C, H, T, K = 3, 5, 96, 6, 3
    y = torch.randn((E, C + 2, H), generator=gen).bfloat16()[:, :C]  # strided slots
    rows = torch.randint(-1, E * C, (T, K), generator=gen, dtype=torch.int32)
    w = random_weights(T, K, gen)
    b = (torch.randn((E, H + 8), generator=gen) * 2).to(bias_dtype)[:, 3 : H + 5]  # strided, wider
    for hidden in (None, 80, 1):
        cols = H if hidden is None else hidden
        for ww in (w, None):
            want = L.gather_oracle(y, rows, ww, b, hidden)
            assert torch.equal(ll_gather(y, rows, ww, bias=b, hidden=hidden), want)
            out = torch.empty((T, cols), dtype=torch.bfloat16)
            assert ll_gather_out(y, rows, ww, out, b) is out and torch.equal(out, want)
        # a narrower output alone: the first columns of the full one
        assert torch.equal(ll_gather(y, rows, w, hidden=hidden), ll_gather(y, rows, w)[:, :cols])
    # the bias just as wide as the output
    assert torch.equal(
        ll_gather(y, rows, w, bias=b[:, :80], hidden=80), L.gather_oracle(y, rows, w, b, 80)
    )


def test_gather_bias_hidden_errors():
    y = torch.zeros((2, 3, 16), dtype=torch.bfloat16)
    rows = torch.tensor([[0, 5], [-1, 1]], dtype=torch.int32)
    b = torch.zeros((2, 16))
    out = torch.empty((2, 8), dtype=torch.bfloat16)
    cases = [
        (lambda: ll_gather(y, rows, bias=b.int()), "ll_gather: bias expected dtype"),
        (lambda: ll_gather(y, rows, bias=b[:1]), r"ll_gather: bias expected shape \[2, any\]"),
        (lambda: ll_gather(y, rows, bias=b[0]), r"ll_gather: bias expected shape \[2, any\]"),
        (lambda: ll_gather(y, rows, bias=b[:, :15]), "ll_gather: bias expected at least 16 col"),
        (lambda: ll_gather(y, rows, bias=b[:, :7], hidden=8), "ll_gather: bias expected at least"),
        (lambda: ll_gather_out(y, rows, None, out, b[:, :7]), "ll_gather: bias expected at least"),
    ]
    for bad in (0, 17, True, 8.0):
        want = rf"ll_gather: hidden expected None or an int in \[1, 16\] \(y's .*, got {bad!r}"
        cases.append((lambda bad=bad: ll_gather(y, rows, hidden=bad), want))
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


def test_opcheck_gather_bias_hidden():
    gen = torch.Generator().manual_seed(10)
    y = torch.randn((3, 4, 64), generator=gen).bfloat16()
    rows = torch.randint(-1, 12, (5, 2), generator=gen, dtype=torch.int32)
    w = random_weights(5, 2, gen)
    b = torch.randn((3, 64), generator=gen).bfloat16()
    opcheck(torch.ops.epmoe.ll_gather.default, (y, rows, w, True, b, None))
    opcheck(torch.ops.epmoe.ll_gather.default, (y, rows, None, False, b.float(), 40))
    opcheck(torch.ops.epmoe.ll_gather.default, (y, rows, w, True, None, 40))
    out = torch.empty((5, 40), dtype=torch.bfloat16)
    opcheck(torch.ops.epmoe.ll_gather_out.default, (y, rows, w, out, b))
    opcheck(torch.ops.epmoe.ll_gather_out.default, (y, rows, w, out))


def test_compiled_equals_eager_bias_hidden():
    """fullgraph torch.compile on CPU: the new arguments through the schema, the same bytes."""
    gen = torch.Generator().manual_seed(11)
    y = torch.randn((3, 4, 64), generator=gen).bfloat16()
    rows = torch.randint(-1, 12, (5, 2), generator=gen, dtype=torch.int32)
    w = random_weights(5, 2, gen)
    b = torch.randn((3, 64), generator=gen).bfloat16()

    def step(y, rows, w, b):
        out = torch.empty((5, 40), dtype=torch.bfloat16)
        ll_gather_out(y, rows, w, out, b)
        return ll_gather(y, rows, w, bias=b, hidden=40), out

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(y, rows, w, b)
    for a, e in zip(got, step(y, rows, w, b), strict=True):
        assert torch.equal(a, e)
