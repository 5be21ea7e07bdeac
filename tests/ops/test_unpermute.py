"""unpermute: a naive loop spec, -1 skipping, dtype, opcheck (CPU)."""

import pytest
import torch

from epmoe import ops
from tests._opcheck import opcheck


def naive_unpermute(y, inv_perm, w):
    M, K = inv_perm.shape
    out = torch.zeros((M, y.shape[1]), dtype=torch.float64)
    for t in range(M):
        for k in range(K):
            r = int(inv_perm[t, k])
            if r >= 0:
                out[t] += float(w[t, k]) * y[r].double()
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


def test_unpermute_opcheck(seed):
    y = torch.randn(16, 8).bfloat16()
    inv = torch.randint(-1, 16, (5, 2), dtype=torch.int32)
    opcheck(torch.ops.epmoe.unpermute.default, (y, inv, torch.rand(5, 2)))
    opcheck(torch.ops.epmoe.unpermute.default, (y, inv, torch.rand(5, 2), False))


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
