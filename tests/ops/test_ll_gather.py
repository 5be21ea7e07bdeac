"""ll_gather / ll_gather_out on CPU (their references): the contract, errors, opcheck."""

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
        (torch.empty((3, 16), dtype=torch.bfloat16), r"ll_gather: out expected shape \[2, 16\]"),
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
