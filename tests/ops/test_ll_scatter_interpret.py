"""ll_scatter / ll_gather Triton kernels on CPU tensors under TRITON_INTERPRET=1, against the
contract (exact: rows, masked_m, every written slot's bytes; the gather's sum)."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

from epmoe import reference  # noqa: E402
from epmoe.kernels import gather as KG  # noqa: E402
from epmoe.kernels import scatter as KS  # noqa: E402
from tests._routing import random_weights  # noqa: E402
from tests.ops import _ll_cases as L  # noqa: E402
from tests.ops._stage_cases import POISON_BYTES, poisoned_empty  # noqa: E402

pytestmark = pytest.mark.interpret
QUANTS = ("bf16", "fp8", "int8")


@pytest.fixture(params=["default", "small_blocks", "blocked"])
def blocks(request, monkeypatch):
    """Default tiling, and tiny blocks: the slot count and masked_m loop over several id blocks,
    rows span several chunks (fp8: 2 groups a program; int8: the two-read path for the token's
    scale); blocked: the same, with the slot count over blocks of 8 ids past 16 (the count kernel
    first; its prefix over the blocks before one at a time, its own block 4 ids a step)."""
    memos = (KS._scatter_launch, KG._ll_gather_plan)  # (launches planned from these constants)
    for memo in memos:
        memo.cache_clear()
    if request.param == "blocked":
        monkeypatch.setattr(KS, "SCAN_IDS", 8)
        monkeypatch.setattr(KS, "BLOCK_B", 1)
    if request.param != "default":
        monkeypatch.setattr(KS, "BLOCK_N", 8 if request.param == "small_blocks" else 4)
        monkeypatch.setattr(KS, "HIST_N", 16)
        monkeypatch.setattr(KS, "TILE", 256)
        monkeypatch.setattr(KS, "INT8_SINGLE_MAX", 128)
        monkeypatch.setattr(KG, "GATHER_BYTES", 128)  # (test_roundtrip's gather)
    yield request.param
    for memo in memos:
        memo.cache_clear()


def _scatter(x, topk, E, C, quant, lo=0, NG=None, layout="row", width=None):
    out = None
    for byte in POISON_BYTES:
        with poisoned_empty(byte):
            out = KS._ll_scatter_triton(x, topk, E, C, quant, lo, NG, layout, width)
        L.check_scatter(out, x, topk, E, C, quant, lo, NG, width)
    return out


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("dtype,col_major", [(torch.int64, True), (torch.int32, False)])
def test_scatter_random(quant, dtype, col_major, blocks):
    gen = torch.Generator().manual_seed(0)
    T, K, H, E, C = 9, 3, 640, 5, 9  # K = 3: padded to 4; H = 640: 5 fp8 groups
    x = L.tokens(T, H, gen, stride_pad=16)
    topk = L.ids(T, K, E, gen, dtype=dtype, col_major=col_major)
    _scatter(x, topk, E, C, quant)


@pytest.mark.parametrize("dtype", L.RAW_DTYPES)
def test_scatter_raw_copies(dtype, blocks):
    gen = torch.Generator().manual_seed(7)
    T, K, H, E, C = 9, 3, 300, 4, 9  # H = 300: two chunks with small blocks
    x = L.raw_tokens(T, H, dtype, gen)
    topk = L.ids(T, K, E, gen, col_major=True)
    for byte in POISON_BYTES:
        with poisoned_empty(byte):
            out = KS._ll_scatter_triton(x, topk, E, C, "bf16")
        L.check_raw_scatter(out, x, topk, E, C)


@pytest.mark.parametrize("quant", QUANTS)
def test_scatter_one_rank_of_several_deepgemm(quant, blocks):
    gen = torch.Generator().manual_seed(1)
    T, K, H, E, P = 8, 4, 256, 3, 2
    x = L.tokens(T, H, gen)
    topk = L.ids(T, K, E * P, gen, col_major=True)
    for rank in range(P):
        xo, s, mm, rows = _scatter(x, topk, E, T, quant, rank * E, E * P, "deepgemm")
        _, s_ref, _, _ = reference.ll_scatter(x, topk, E, T, quant, rank * E, E * P)
        if s.shape[2]:
            want = KS.alloc_scales((E, T), s.shape[2], "deepgemm", "cpu")
            assert s.stride() == want.stride()
        live = torch.arange(T)[None, :] < mm[:, None]
        assert torch.equal(s[live], s_ref[live])


@pytest.mark.parametrize("quant", QUANTS)
def test_exact_capacity_and_zero_tokens(quant, blocks):
    gen = torch.Generator().manual_seed(2)
    C, H = 6, 256
    x = L.tokens(C, H, gen)
    topk = torch.full((C, 2), -1)
    topk[:, 1] = 2  # every token on expert 2: exactly C entries, the last slot included
    topk[1::2, 0] = 0
    xo, s, mm, rows = _scatter(x, topk, 3, C, quant)
    assert mm.tolist() == [C // 2, 0, C] and rows[:, 1].tolist() == [2 * C + c for c in range(C)]
    xo, s, mm, rows = _scatter(x[:0], topk[:0], 3, C, quant)
    assert mm.tolist() == [0, 0, 0] and rows.shape == (0, 2)
    _scatter(x, torch.full((C, 2), -1), 3, C, quant)  # all -1


def test_overflow_and_bad_ids_raise_and_stay_in_bounds(blocks, monkeypatch):
    x = L.tokens(5, 128, torch.Generator().manual_seed(3))
    topk = torch.tensor([[0, 1], [0, -1], [0, 1], [1, -1], [0, -1]])
    with pytest.raises(ValueError, match="ll_scatter: topk_ids expected at most capacity=3"):
        KS._ll_scatter_triton(x, topk, 2, 3)
    # the kernel itself: masked_m clamped to C, entries past capacity get no row and write
    # nothing (token 4's program runs last: a write to expert 0's slot 3, expert 1's slot 0,
    # would replace token 0 there)
    with monkeypatch.context() as mp:
        mp.setattr(KS._checks, "check_codes", lambda *a, **k: None)
        out = _scatter(x, topk, 2, 3, "bf16")
    assert out[2].tolist() == [3, 3]
    assert out[3].tolist() == [[0, 3], [1, -1], [2, 4], [5, -1], [-1, -1]]
    for bad in (6, -2):  # an id == num_global_experts, one below -1
        topk = torch.tensor([[0, -1], [5, bad]])
        with pytest.raises(ValueError, match=r"ll_scatter: topk_ids expected ids in \[0, 6\)"):
            KS._ll_scatter_triton(x[:2], topk, 3, 4, "bf16", 3, 6)


def test_roundtrip(blocks):
    gen = torch.Generator().manual_seed(5)
    x = L.tokens(6, 256, gen)
    topk = L.ids(6, 4, 8, gen)
    w = random_weights(6, 4, gen)
    xo, _, _, rows = KS._ll_scatter_triton(x, topk, 8, 6)
    out = torch.empty((6, 256), dtype=torch.bfloat16)
    KG._ll_gather_launch(xo, rows, w, out)
    keep = torch.where(topk >= 0, w, 0.0)
    want = torch.zeros((6, 256))
    for k in range(4):
        want += x.float() * keep[:, k : k + 1]
    assert torch.equal(out, want.bfloat16())


@pytest.mark.parametrize("quant", QUANTS)
def test_scatter_width(quant, blocks):
    """A layout wider than x (a zero-padded hidden): H = 160 into 256 (fp8: a partial group then
    a zero one), 640 into 768 (small blocks: several chunks; int8 the two-read path), strided
    ids; every written slot x's row zero-extended, never the poison."""
    gen = torch.Generator().manual_seed(8)
    T, K, E, C = 9, 3, 5, 9
    topk = L.ids(T, K, E, gen, col_major=True)
    for H, width, layout in ((160, 256, "row"), (640, 768, "deepgemm")):
        x = L.tokens(T, H, gen, stride_pad=16)
        xo, s, mm, rows = _scatter(x, topk, E, C, quant, layout=layout, width=width)
        assert xo.shape == (E, C, width)
        live = torch.arange(C)[None, :] < mm[:, None]
        assert (xo[live][:, H:].float() == 0).all()
    _scatter(x[:0], topk[:0], E, C, quant, width=768)  # zero tokens: masked_m, nothing else


def test_scatter_raw_copies_width(blocks):
    gen = torch.Generator().manual_seed(9)
    T, K, H, E, C = 9, 3, 300, 4, 9
    x = L.raw_tokens(T, H, torch.float8_e4m3fn, gen)
    topk = L.ids(T, K, E, gen, col_major=True)
    wide = torch.zeros((T, 384), dtype=x.dtype)
    wide.view(torch.uint8)[:, :H] = x.view(torch.uint8)
    for byte in POISON_BYTES:
        with poisoned_empty(byte):
            out = KS._ll_scatter_triton(x, topk, E, C, "bf16", 0, None, "row", 384)
        L.check_raw_scatter(out, wide, topk, E, C)


def test_roundtrip_width_hidden(blocks):
    """ll_gather(ll_scatter(x, width), hidden=H): the padded columns dropped, x weighted back."""
    gen = torch.Generator().manual_seed(10)
    x = L.tokens(6, 200, gen)
    topk = L.ids(6, 4, 8, gen)
    w = random_weights(6, 4, gen)
    xo, _, _, rows = KS._ll_scatter_triton(x, topk, 8, 6, "bf16", 0, None, "row", 256)
    out = torch.empty((6, 200), dtype=torch.bfloat16)
    KG._ll_gather_launch(xo, rows, w, out)
    keep = torch.where(topk >= 0, w, 0.0)
    want = torch.zeros((6, 200))
    for k in range(4):
        want += x.float() * keep[:, k : k + 1]
    assert torch.equal(out, want.bfloat16())
