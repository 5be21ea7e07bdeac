"""unpermute: a naive loop spec (with a down-projection bias, a narrower output), -1 skipping,
dtype, the round trip with permute, errors, opcheck (CPU)."""

import pytest
import torch

from epmoe import ops
from tests._opcheck import opcheck


def naive_unpermute(y, inv_perm, w, bias=None, m_indices=None, hidden=None):
    M, K = inv_perm.shape
    cols = y.shape[1] if hidden is None else hidden
    out = torch.zeros((M, cols), dtype=torch.float64)
    for t in range(M):
        for k in range(K):
            r = int(inv_perm[t, k])
            if r >= 0:
                v = y[r, :cols].double()
                e = -1 if bias is None else int(m_indices[r])
                if 0 <= e < (0 if bias is None else bias.shape[0]):
                    v = v + bias[e, :cols].double()
                out[t] += float(w[t, k]) * v
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [0, 1, 9])
def test_unpermute_matches_naive(dtype, M, seed):
    M_sum, K, H = 40, 3, 20
    y = torch.randn(M_sum, H).to(dtype)
    y[-1] = float("nan")  # never named by inv_perm: must never be read
    inv = torch.randint(-1, M_sum - 1, (M, K), dtype=torch.int32)
    w = torch.rand(M, K)
    out = ops.unpermute(y, inv, w)
    assert out.dtype == dtype and out.shape == (M, H)
    want = naive_unpermute(y, inv, w).to(dtype)
    torch.testing.assert_close(out, want, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [None, 13, 1])
def test_unpermute_bias_hidden_matches_naive(bias_dtype, hidden, seed):
    M_sum, K, H, E, M = 40, 3, 20, 4, 9
    y = torch.randn(M_sum, H).bfloat16()
    inv = torch.randint(-1, M_sum, (M, K), dtype=torch.int32)
    m_idx = torch.randint(-1, E, (M_sum,), dtype=torch.int32)  # -1: padding rows, no bias
    w = torch.rand(M, K)
    b = (torch.randn(E, H + 5) * 2).to(bias_dtype)[:, 2:]  # strided, wider than the output
    out = ops.unpermute(y, inv, w, bias=b, m_indices=m_idx, hidden=hidden)
    cols = H if hidden is None else hidden
    assert out.dtype == y.dtype and out.shape == (M, cols)
    want = naive_unpermute(y, inv, w, b, m_idx, hidden).bfloat16()
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)
    # a narrower output alone: the first columns of the full one; m_indices without a bias: unused
    full = ops.unpermute(y, inv, w)
    assert torch.equal(ops.unpermute(y, inv, w, hidden=hidden), full[:, :cols])
    assert torch.equal(ops.unpermute(y, inv, w, m_indices=m_idx), full)


def test_unpermute_round_trip_with_bias(seed):
    """K = 1, unit weights: unpermute(permute(x)) with a bias is x + bias[id] (0 for id -1)."""
    from epmoe import reference

    x = torch.randn(30, 24)
    ids = torch.randint(-1, 5, (30, 1))
    b = torch.randn(5, 24)
    p = reference.permute(x, ids, 5, 8)
    out = ops.unpermute(p[0], p[3], torch.ones(30, 1), bias=b, m_indices=p[2], hidden=20)
    want = torch.where(ids >= 0, x + b[ids.clamp(min=0).squeeze(1)], 0.0)[:, :20]
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_unpermute_opcheck(seed):
    y = torch.randn(16, 8).bfloat16()
    inv = torch.randint(-1, 16, (5, 2), dtype=torch.int32)
    opcheck(torch.ops.epmoe.unpermute.default, (y, inv, torch.rand(5, 2)))
    opcheck(torch.ops.epmoe.unpermute.default, (y, inv, torch.rand(5, 2), False))
    b, m_idx = torch.randn(3, 8).bfloat16(), torch.randint(-1, 3, (16,), dtype=torch.int32)
    opcheck(torch.ops.epmoe.unpermute.default, (y, inv, torch.rand(5, 2), True, b, m_idx, None))
    opcheck(
        torch.ops.epmoe.unpermute.default, (y, inv, torch.rand(5, 2), False, b.float(), m_idx, 5)
    )
    opcheck(torch.ops.epmoe.unpermute.default, (y, inv, torch.rand(5, 2), True, None, None, 3))


@pytest.mark.parametrize(
    "args,match",
    [
        (
            (torch.zeros(4, 8), torch.zeros(2, 2), torch.zeros(2, 2)),
            "unpermute: inv_perm expected dtype",
        ),
        (
            (torch.zeros(4, 8), torch.full((2, 2), 4), torch.zeros(2, 2)),
            "unpermute: inv_perm expected ids",
        ),
        (
            (torch.zeros(4, 8), torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 3)),
            "unpermute: topk_weights expected shape",
        ),
        (
            (
                torch.zeros(4, 8, dtype=torch.int8),
                torch.zeros(2, 2, dtype=torch.long),
                torch.zeros(2, 2),
            ),
            "unpermute: y expected dtype",
        ),
    ],
)
def test_unpermute_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        ops.unpermute(*args)


def test_unpermute_bias_hidden_bad_input():
    y, inv, w = torch.zeros(4, 8), torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2)
    b, m_idx = torch.zeros(3, 8), torch.zeros(4, dtype=torch.int32)
    cases = [
        (dict(bias=b), "unpermute: m_indices expected permute's m_indices with a bias"),
        (dict(bias=b.int(), m_indices=m_idx), "unpermute: bias expected dtype"),
        (dict(bias=b[0], m_indices=m_idx), "unpermute: bias expected a 2-D tensor"),
        (dict(bias=b[:, :7], m_indices=m_idx), "unpermute: bias expected at least 8 columns"),
        (dict(bias=b[:, :4], m_indices=m_idx, hidden=5), "unpermute: bias expected at least 5"),
        (dict(bias=b, m_indices=m_idx.long()), "unpermute: m_indices expected dtype torch.int32"),
        (dict(bias=b, m_indices=m_idx[:3]), r"unpermute: m_indices expected shape \[4\]"),
    ]
    for bad in (0, 9, False, 2.0):
        msg = rf"unpermute: hidden expected None or an int in \[1, 8\] \(y's columns\), got {bad!r}"
        cases.append((dict(hidden=bad), msg))
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.unpermute(y, inv, w, **kwargs)
