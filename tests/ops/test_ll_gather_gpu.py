"""ll_gather on CUDA against the reference (eager, ``out``, dispatcher)."""

import pytest
import torch

from epmoe import reference
from epmoe.ops.ll_gather import ll_gather, ll_gather_out
from tests._routing import random_weights
from tests._tol import assert_close
from tests.ops import _ll_cases as L

pytestmark = pytest.mark.gpu
QUANTS = ("bf16", "fp8", "int8")


def _inputs(T, K, H, NG, seed, dtype=torch.int64, col_major=False, p_none=0.2):
    gen = torch.Generator().manual_seed(seed)
    x = L.tokens(T, H, gen)
    topk = L.ids(T, K, NG, gen, p_none=p_none, dtype=dtype, col_major=col_major)
    w = random_weights(T, K, gen)
    return x.cuda(), topk.cuda(), w.cuda()


@pytest.mark.parametrize("K,H", [(8, 7168), (6, 2176), (1, 512)])
def test_gather_matches_reference(K, H):
    gen = torch.Generator().manual_seed(2)
    E, C, T = 16, 64, 100
    y = torch.randn((E, C + 3, H), generator=gen).bfloat16().cuda()[:, 3:]  # strided slots
    rows = torch.randint(-1, E * C, (T, K), generator=gen, dtype=torch.int32).cuda()
    w = random_weights(T, K, gen).cuda()
    # unweighted: sums of bf16 values in k order, no products: exact
    assert torch.equal(ll_gather(y, rows), reference.ll_gather(y, rows))
    # weighted: the GPU may fuse the multiply-adds (one rounding fewer)
    assert_close(ll_gather(y, rows, w), reference.ll_gather(y, rows, w))
    out = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")
    assert ll_gather_out(y, rows.long(), w, out) is out
    assert torch.equal(out, ll_gather(y, rows, w))
    disp = torch.ops.epmoe.ll_gather.default(y, rows, w)
    assert torch.equal(disp, out)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H,hidden", [(7168, None), (2944, 2880), (512, 1)])
def test_gather_bias_hidden_matches_reference(bias_dtype, H, hidden):
    """A down-projection bias (by the slot's expert) and a narrower output (a padded hidden)."""
    gen = torch.Generator().manual_seed(3)
    E, C, T, K = 16, 64, 100, 8
    y = torch.randn((E, C + 3, H), generator=gen).bfloat16().cuda()[:, 3:]  # strided slots
    rows = torch.randint(-1, E * C, (T, K), generator=gen, dtype=torch.int32).cuda()
    w = random_weights(T, K, gen).cuda()
    b = torch.randn((E, H), generator=gen).to(bias_dtype).cuda()
    cols = H if hidden is None else hidden
    # unweighted: sums in k order, no products: exact
    assert torch.equal(
        ll_gather(y, rows, bias=b, hidden=hidden), reference.ll_gather(y, rows, None, b, hidden)
    )
    ref = reference.ll_gather(y, rows, w, b, hidden)
    assert ref.shape == (T, cols)
    assert_close(ll_gather(y, rows, w, bias=b, hidden=hidden), ref)
    out = torch.empty((T, cols), dtype=torch.bfloat16, device="cuda")
    assert ll_gather_out(y, rows, w, out, b) is out
    assert torch.equal(out, ll_gather(y, rows, w, bias=b, hidden=hidden))
    assert torch.equal(torch.ops.epmoe.ll_gather.default(y, rows, w, True, b, hidden), out)
