"""The local (one-rank) backend: LL dispatch / combine (the ll_scatter / ll_gather kernels) and HT
copies."""

import importlib

import pytest
import torch

import epmoe
from epmoe import ops
from epmoe.ops.ll_scatter import ll_scatter
from tests._opcheck import opcheck
from tests._routing import random_weights
from tests.ops import _ll_cases as L

QUANTS = ("bf16", "fp8", "int8")
_q = importlib.import_module("epmoe.ops.quantize")


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
