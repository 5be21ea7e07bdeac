"""Boundary cases of permute and unpermute: ids exactly at E and at -1, an expert of exactly
``alignment`` rows, token counts at each permute path threshold, fp32 accumulation in unpermute.

Each case runs on the reference (the CPU kernel of the op) and on the Triton kernels under
TRITON_INTERPRET=1 (conftest sets it when there is no GPU), so an off-by-one in a kernel's range
check (``>`` for ``>=``) or a dropped boundary fails here.
"""

import dataclasses
import os

import pytest
import torch

from epmoe import ops, reference
from tests.ops import _stage_cases as C

P, U = C.permute_mod, C.unpermute_mod
interpret = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter: TRITON_INTERPRET=1"
)
BAD_IDS = r"permute: topk_ids expected ids in \[0, 4\) or -1"


def _reference(x, ids, e, a, scales=None, layout="row"):
    return reference.permute(x, ids, e, a, scales)


def _triton(x, ids, e, a, scales=None, layout="row"):
    return P._permute_triton(x, ids, e, a, scales, layout)


def _triton_one_kernel(x, ids, e, a, scales=None, layout="row"):
    assert ids.shape[0] * 2 <= P.CONFIG.small_entries  # (k_pad = 2 below): the one-kernel path
    return P._permute_triton(x, ids, e, a, scales, layout)


def _triton_chain(x, ids, e, a, scales=None, layout="row"):
    chain = dataclasses.replace(P.CONFIG, small_entries=0)  # the count / scan / copy chain
    return P._permute_triton(x, ids, e, a, scales, layout, config=chain)


PERMUTES = [
    pytest.param(_reference, id="reference"),
    pytest.param(
        _triton_one_kernel, id="triton-one-kernel", marks=[interpret, pytest.mark.interpret]
    ),
    pytest.param(_triton_chain, id="triton-chain", marks=[interpret, pytest.mark.interpret]),
]


def _x(m, h=8, seed=0):
    return torch.randn((m, h), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# ------------------------------------------------------------------------------------- id range
@pytest.mark.parametrize("permute", PERMUTES)
@pytest.mark.parametrize("bad", [4, -2], ids=["id == E", "id == -2"])
@pytest.mark.parametrize("where", [(0, 0), (5, 1)], ids=["first", "last"])
def test_id_just_outside_the_range_raises(permute, bad, where):
    """E = 4: id 4 (== E) and -2 (one below -1) are errors wherever they sit among valid ids."""
    ids = torch.tensor([[0, 1], [2, 3], [3, -1], [1, 0], [-1, 2], [0, 3]])
    ids[where] = bad
    with pytest.raises(ValueError, match=BAD_IDS):
        permute(_x(6), ids, 4, 4)


@pytest.mark.parametrize("permute", PERMUTES)
def test_ids_at_the_range_ends_are_placed(permute):
    """-1 (skip) and E - 1 (the last expert) are valid: -1 gets no row, E - 1 the last block."""
    ids = torch.tensor([[3, -1], [-1, 3], [0, 3], [-1, -1], [3, 0]])
    x = _x(5)
    out = permute(x, ids, 4, 4)
    C.assert_permute_equal(out, reference.permute(x, ids, 4, 4))
    m_idx, inv = out[2], out[3]
    assert (inv[ids == -1] == -1).all() and (inv[ids >= 0] >= 0).all()
    assert int((m_idx == 3).sum()) == 4 and int((m_idx == 0).sum()) == 2


def test_public_op_rejects_id_equal_to_num_experts():
    with pytest.raises(ValueError, match=BAD_IDS):
        ops.permute(_x(2), torch.tensor([[0, 4], [1, 2]]), num_experts=4, alignment=4)
    ops.permute(_x(2), torch.tensor([[0, 3], [-1, 2]]), num_experts=4, alignment=4)


# ------------------------------------------------------------------------------- block alignment
@pytest.mark.parametrize("permute", PERMUTES)
@pytest.mark.parametrize("count", [7, 8, 9], ids=["A-1", "A", "A+1"])
def test_expert_of_exactly_alignment_rows(permute, count):
    """Expert 0 with A - 1, A and A + 1 rows (A = 8): exactly A rows fill one block with no
    padding, and expert 1 starts right after it."""
    a = 8
    ids = torch.full((count + 3, 1), 1)
    ids[:count, 0] = 0
    x = _x(count + 3)
    out = permute(x, ids, 2, a)
    C.assert_permute_equal(out, reference.permute(x, ids, 2, a))
    offs = out[4].tolist()
    block = -(-count // a) * a
    assert offs == [0, block, block + a]  # block starts, then the used rows
    assert int((out[2][:block] == 0).sum()) == count  # the block's padding rows are -1
    assert (out[2][count:block] == -1).all()


# ----------------------------------------------------------------------------- path thresholds
@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("extra", [0, 1], ids=["SMALL_ENTRIES", "SMALL_ENTRIES+1"])
def test_token_count_at_the_one_kernel_threshold(extra, monkeypatch):
    """M * K_pad == SMALL_ENTRIES takes the one kernel (its entry vector exactly full), one more
    token the count / scan / copy chain: both exact against the reference, right at the switch.
    The threshold is lowered to 64 entries (the interpreter takes ~13 s at the default 2048); the
    kernel's entry vector is sized from it, so the boundary is the same."""
    C.set_config(monkeypatch, P, small_entries=64)
    k = 2
    m = P.CONFIG.small_entries // k + extra
    gen = torch.Generator().manual_seed(extra)
    x = torch.randn((m, 16), generator=gen).to(torch.bfloat16)
    ids = C.routing(m, k, 8, gen, local=0.8)
    ids[-1] = torch.tensor([7, -1])  # the last token, where a `<` vs `<=` on M would drop it
    scales = torch.rand((m, 2), generator=gen)
    out = _triton(x, ids, 8, 16, scales)
    C.assert_permute_equal(out, reference.permute(x, ids, 8, 16, scales))


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("extra", [-1, 0], ids=["MIN_ENTRIES-1", "MIN_ENTRIES"])
def test_token_count_at_the_row_block_scale_threshold(extra, monkeypatch):
    """DeepGEMM-layout scales: below SCALES_BY_ROW_MIN_ENTRIES entries per token, from it on per
    row block (its own kernel). The threshold is lowered to keep the interpreter fast."""
    C.set_config(monkeypatch, P, scales_by_row_min_entries=64, small_entries=0)
    k = 2
    m = 64 // k + extra
    gen = torch.Generator().manual_seed(3 + extra)
    x = torch.randn((m, 16), generator=gen).to(torch.bfloat16)
    ids = C.routing(m, k, 4, gen, local=0.8)
    ids[-1, 0] = 3
    scales = torch.rand((m, 3), generator=gen)
    out = _triton(x, ids, 4, 8, scales, "deepgemm")
    C.assert_permute_equal(out, reference.permute(x, ids, 4, 8, scales))


# -------------------------------------------------------------------------------------- unpermute
def _unpermute_reference(y, inv, w):
    return reference.unpermute(y, inv, w)


def _unpermute_triton(y, inv, w):
    return U._unpermute_triton(y, inv, w)


UNPERMUTES = [
    pytest.param(_unpermute_reference, id="reference"),
    pytest.param(_unpermute_triton, id="triton", marks=[interpret, pytest.mark.interpret]),
]


@pytest.mark.parametrize("unpermute", UNPERMUTES)
@pytest.mark.parametrize("bad", [6, -2], ids=["row == M_sum", "row == -2"])
def test_unpermute_row_just_outside_raises(unpermute, bad):
    y = _x(6)
    inv = torch.tensor([[0, 5], [-1, 3]], dtype=torch.int32)
    inv[1, 1] = bad
    with pytest.raises(ValueError, match=r"unpermute: inv_perm expected ids in \[0, 6\) or -1"):
        unpermute(y, inv, torch.ones((2, 2)))
    inv[1, 1] = -1 if bad < 0 else 5  # the ends themselves are fine
    unpermute(y, inv, torch.ones((2, 2)))


@pytest.mark.parametrize("unpermute", UNPERMUTES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unpermute_accumulates_in_float32(unpermute, dtype):
    """Each output is one large term plus K - 1 terms of a quarter of its ulp: summed in float32
    and rounded once they add up to two ulps; accumulated in the output dtype each one rounds
    away. The result must equal the float64 sum rounded once, bit for bit."""
    k, h = 8, 32
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # spacing of the values in [1, 2)
    gen = torch.Generator().manual_seed(1)
    big = 1.0 + torch.randint(0, 8, (4, h), generator=gen).double() * ulp
    y = torch.cat([big, torch.full((k - 1, h), ulp / 4, dtype=torch.float64)]).to(dtype)
    m = 5
    inv = torch.stack([torch.tensor([t % 4] + list(range(4, 4 + k - 1))) for t in range(m)]).to(
        torch.int32
    )
    inv[4, 3] = -1  # one choice skipped: its term is not added
    w = torch.ones((m, k))
    out = unpermute(y, inv, w)
    yd = y.double()
    want = torch.stack([sum(yd[r] for r in inv[t].tolist() if r >= 0) for t in range(m)])
    assert (want[:4] - yd[:4]).abs().min() >= 1.5 * ulp  # far from what dtype accumulation gives
    C.assert_equal(out, want.to(dtype), f"unpermute {dtype}")
