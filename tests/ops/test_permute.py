"""permute: opcheck, a naive loop spec, invariants and random routings (CPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epmoe import ops, reference
from tests._opcheck import opcheck
from tests._routing import random_ids


def naive_permute(x, topk_ids, E, A):
    """Loop spec written independently of reference.permute."""
    M, K = topk_ids.shape
    M_sum = -(-(M * K + E * (A - 1)) // A) * A
    xo = torch.zeros((M_sum, x.shape[1]), dtype=torch.float32)
    m_idx = torch.full((M_sum,), -1, dtype=torch.int32)
    src = torch.full((M_sum,), -1, dtype=torch.int32)
    inv = torch.full((M, K), -1, dtype=torch.int32)
    offsets = [0]
    row = 0
    for e in range(E):
        start = row
        for t in range(M):
            for k in range(K):
                if int(topk_ids[t, k]) == e:
                    xo[row] = x[t].float()
                    m_idx[row] = e
                    src[row] = t
                    inv[t, k] = row
                    row += 1
        n = row - start
        row = start + -(-n // A) * A
        offsets.append(row)
    return xo, m_idx, inv, torch.tensor(offsets, dtype=torch.int32), src


def check_against_naive(x, ids, E, A, scales=None):
    p = ops.permute(x, ids, num_experts=E, alignment=A, x_scales=scales)
    xo, m_idx, inv, offsets, src = naive_permute(x, ids, E, A)
    assert p.x.shape == xo.shape and p.x.dtype == x.dtype
    assert torch.equal(p.m_indices, m_idx)
    assert torch.equal(p.inv_perm, inv)
    assert torch.equal(p.expert_offsets, offsets)
    assert torch.equal(p.src_rows, src)
    used = m_idx >= 0
    assert torch.equal(p.x.float()[used], xo[used])
    if scales is not None:
        flat = ids.reshape(-1)
        rows = inv.reshape(-1)
        for i in range(flat.numel()):
            if flat[i] >= 0:
                assert torch.equal(p.x_scales[rows[i]], scales[i // ids.shape[1]])
    else:
        assert p.x_scales is None
    return p


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("A", [1, 4, 16])
def test_permute_matches_naive(dtype, A, seed):
    M, K, E, H = 13, 3, 5, 24
    x = (torch.randn(M, H) * 10).to(dtype)
    ids = random_ids(M, K, E)
    check_against_naive(x, ids, E, A, scales=torch.rand(M, 3))


@pytest.mark.parametrize(
    "case", ["zero_tokens", "one_token", "one_expert_all", "all_minus_one", "E1", "odd_H", "empty"]
)
def test_permute_edge_cases(case, seed):
    M, K, E, H, A = 9, 2, 4, 7, 8
    if case == "zero_tokens":
        M = 0
    if case == "one_token":
        M = 1
    if case == "E1":
        E, K = 1, 1
    if case == "odd_H":
        H = 131
    x = torch.randn(M, H).bfloat16()
    ids = random_ids(M, K, E)
    if case == "one_expert_all":
        ids = torch.full((M, K), 2, dtype=torch.long)
        ids[:, 1] = -1
    if case == "all_minus_one":
        ids = torch.full((M, K), -1, dtype=torch.long)
    if case == "empty":  # experts 1 and 3 receive nothing
        ids = torch.where((ids == 1) | (ids == 3), -1, ids)
    p = check_against_naive(x, ids, E, A)
    assert p.x.shape[0] == reference.permuted_rows(M, K, E, A)
    assert (p.expert_offsets % A == 0).all()
    if case == "all_minus_one":
        assert (p.m_indices == -1).all() and int(p.expert_offsets[-1]) == 0


def test_permute_without_columns_gives_the_index_outputs(seed):
    """x[:, :0] (what a GEMM that gathers its own rows asks for): the same index outputs, and
    x[src_rows] is the copy the full permute makes."""
    M, K, E, A, H = 11, 3, 5, 4, 16
    x = torch.randn(M, H).bfloat16()
    ids = random_ids(M, K, E)
    full = ops.permute(x, ids, num_experts=E, alignment=A)
    idx = ops.permute(x[:, :0], ids, num_experts=E, alignment=A)
    assert idx.x.shape == (full.x.shape[0], 0)
    for name in ("m_indices", "inv_perm", "expert_offsets", "src_rows"):
        assert torch.equal(getattr(idx, name), getattr(full, name)), name
    live = full.m_indices >= 0
    assert torch.equal((full.src_rows >= 0), live)
    assert torch.equal(x[full.src_rows[live].long()], full.x[live])


def test_permute_unpermute_roundtrip(seed):
    """unpermute(permute(x)) with unit weights gives x times the number of valid choices."""
    M, K, E, H = 17, 4, 6, 32
    x = torch.randn(M, H)
    ids = random_ids(M, K, E)
    p = ops.permute(x, ids, num_experts=E, alignment=8)
    out = ops.unpermute(p.x, p.inv_perm, torch.ones(M, K))
    nvalid = (ids >= 0).sum(dim=1, keepdim=True).float()
    torch.testing.assert_close(out, x * nvalid)
    # inv_perm is the inverse of the scatter: each valid (t, k) names a distinct row holding x[t]
    rows = p.inv_perm[ids >= 0]
    assert rows.unique().numel() == rows.numel()
    assert (p.m_indices[rows.long()] == ids[ids >= 0].int()).all()


@settings(max_examples=200, deadline=None)
@given(
    M=st.integers(0, 12),
    K=st.integers(1, 4),
    E=st.integers(1, 6),
    A=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**31 - 1),
    p_none=st.floats(0.0, 1.0),
)
def test_permute_random_routings(M, K, E, A, seed, p_none):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, E, (M, K), generator=gen)
    drop = torch.rand((M, K), generator=gen) < p_none
    ids = torch.where(drop, -1, ids)
    x = torch.randn((M, 5), generator=gen)
    check_against_naive(x, ids, E, A)


def test_permute_opcheck(seed):
    x = torch.randn(6, 16).bfloat16()
    ids = random_ids(6, 2, 3)
    opcheck(torch.ops.epmoe.permute.default, (x, ids, 3, 4, None))
    opcheck(torch.ops.epmoe.permute.default, (x, ids.int(), 3, 4, torch.rand(6, 2)))
    xq = x.float().to(torch.float8_e4m3fn)
    opcheck(torch.ops.epmoe.permute.default, (xq, ids, 3, 4, torch.rand(6, 2)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(topk_ids=torch.zeros(4, 2)), "permute: topk_ids expected dtype"),
        (dict(topk_ids=torch.zeros(3, 2, dtype=torch.long)), "permute: topk_ids expected shape"),
        (dict(topk_ids=torch.full((4, 2), 5, dtype=torch.long)), "permute: topk_ids expected ids"),
        (dict(alignment=0), "permute: alignment expected a positive int"),
        (dict(alignment=2.5), "permute: alignment expected a positive int"),
        (dict(x_scales=torch.zeros(4, 1, dtype=torch.float16)), "permute: x_scales expected dtype"),
        (dict(x=torch.zeros(4)), "permute: x expected a 2-D tensor"),
        (dict(x=torch.zeros(())), "permute: x expected a 2-D tensor"),
        (dict(topk_ids=torch.zeros((), dtype=torch.long)), "permute: topk_ids expected shape"),
    ],
)
def test_permute_bad_input(kwargs, match):
    args = dict(
        x=torch.zeros(4, 8),
        topk_ids=torch.zeros(4, 2, dtype=torch.long),
        num_experts=3,
        alignment=4,
        x_scales=None,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ops.permute(**args)


def test_no_l2_prefetch_of_rows_without_columns():
    """x[:, :0] (the gathering path's permute) asks the L2 for nothing: a zero-size bulk
    prefetch is never issued."""
    import importlib

    P = importlib.import_module("epmoe.ops.permute")  # (the module: ops.permute is the function)
    x = torch.zeros(8, 256, dtype=torch.bfloat16)
    assert P._pf_ok(x, 2048) and not P._pf_ok(x[:, :0], 2048) and not P._pf_ok(x[:, :0], 8)
