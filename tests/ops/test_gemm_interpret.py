"""Our Triton grouped GEMM kernels (bf16, fp8, int8) on CPU tensors under TRITON_INTERPRET=1, vs the
reference.

Run: TRITON_INTERPRET=1 pytest -m interpret tests/ops/test_gemm_interpret.py
"""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.usefixtures("bf16_dots"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"
    ),
]

from epmoe import reference  # noqa: E402
from epmoe.ops.gemm import _ops, _triton  # noqa: E402
from tests._tol import GEMM_VS_QUANT_AWARE, assert_close, rel_l2  # noqa: E402

# Small tiles: the interpreter runs every program in Python.
CONTIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4)
MASKED = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4)


def _operands(lead, E, N, K, gen, scheme="int8"):
    a = torch.randn(*lead, K, generator=gen)
    w = torch.randn(E, N, K, generator=gen) / K**0.5
    if scheme == "bf16":
        return a.to(torch.bfloat16), None, w.to(torch.bfloat16), None
    aq, as_ = reference.quantize(a, scheme)
    wq, ws = reference.quantize_weights(w, scheme)
    return aq, as_, wq, ws


_int8_operands = _operands


def _contiguous_layout(counts, block):
    """m_indices for expert row counts, each expert's block padded to ``block`` rows with -1."""
    parts = []
    for e, c in enumerate(counts):
        pad = -(-c // block) * block - c
        parts += [torch.full((c,), e, dtype=torch.int32), torch.full((pad,), -1, dtype=torch.int32)]
    return torch.cat(parts)


@pytest.mark.parametrize(
    "counts,K",
    [
        ([5, 0, 16, 33], 64),  # empty expert, partial and exact blocks
        ([0, 0, 7, 0], 80),  # K not a multiple of BLOCK_K (masked K tail)
        ([17, 3, 0, 1], 96),
    ],
)
def test_int8_contiguous_matches_reference(counts, K):
    gen = torch.Generator().manual_seed(7)
    E, N = len(counts), 40  # N not a multiple of BLOCK_N: wrapped tail columns
    m_idx = _contiguous_layout(counts, CONTIG["BLOCK_M"])
    m_idx = torch.cat([m_idx, torch.full((16,), -1, dtype=torch.int32)])  # a whole -1 block
    a, as_, w, ws = _int8_operands((m_idx.numel(),), E, N, K, gen)
    y = _triton.contiguous_triton(a, w, m_idx, as_, ws, config=CONTIG)
    want = reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws)
    live = m_idx >= 0
    assert y.dtype == torch.bfloat16 and y.shape == want.shape
    assert_close(y[live], want[live])


def test_int8_contiguous_skips_minus_one_blocks():
    gen = torch.Generator().manual_seed(8)
    E, N, K = 2, 32, 64
    m1 = torch.full((16,), -1, dtype=torch.int32)
    m_idx = torch.cat([m1, torch.ones(16, dtype=torch.int32), m1, m1])
    a, as_, w, ws = _int8_operands((m_idx.numel(),), E, N, K, gen)
    as_[m_idx < 0] = float("nan")  # a -1 block's rows hold garbage: never used
    sentinel = torch.full((m_idx.numel(), N), 3.0, dtype=torch.bfloat16)
    y = _triton.contiguous_triton(a, w, m_idx, as_, ws, config=CONTIG, out=sentinel.clone())
    want = reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws)
    assert_close(y[16:32], want[16:32])
    assert torch.equal(y[m_idx < 0], sentinel[m_idx < 0])  # -1 blocks: no program wrote them


@pytest.mark.parametrize("expected_m", [0, 1, 9])
def test_int8_masked_matches_reference(expected_m):
    gen = torch.Generator().manual_seed(9)
    E, T, N, K = 4, 20, 24, 80
    masked_m = torch.tensor([0, 7, 20, 16], dtype=torch.int32)  # empty, partial, full, one block
    a, as_, w, ws = _int8_operands((E, T), E, N, K, gen)
    # rows past the count are never read: poison them
    live = torch.arange(T)[None, :] < masked_m[:, None]
    as_poison = torch.where(live.unsqueeze(-1), as_, float("nan"))
    a_poison = torch.where(live.unsqueeze(-1), a, torch.full_like(a, 127))
    sentinel = torch.full((E, T, N), 3.0, dtype=torch.bfloat16)
    y = _triton.masked_triton(
        a_poison, w, masked_m, as_poison, ws, expected_m, config=MASKED, out=sentinel.clone()
    )
    want = reference.grouped_gemm_masked(a, w, masked_m, as_, ws)
    assert y.shape == (E, T, N)
    assert torch.isfinite(y[live]).all()
    assert_close(y[live], want[live])
    assert torch.equal(y[~live], sentinel[~live])  # rows past the count: never computed


def test_int8_masked_split_loops_over_blocks():
    """A grid split smaller than the count's blocks: programs loop over their row blocks."""
    gen = torch.Generator().manual_seed(10)
    E, T, N, K = 2, 64, 16, 32
    masked_m = torch.tensor([64, 37], dtype=torch.int32)
    a, as_, w, ws = _int8_operands((E, T), E, N, K, gen)
    cfg = dict(MASKED, BLOCK_M=16, M_SPLIT=2)
    sentinel = torch.full((E, T, N), 3.0, dtype=torch.bfloat16)
    y = _triton.masked_triton(a, w, masked_m, as_, ws, config=cfg, out=sentinel.clone())
    want = reference.grouped_gemm_masked(a, w, masked_m, as_, ws)
    live = torch.arange(T)[None, :] < masked_m[:, None]
    assert_close(y[live], want[live])
    assert torch.equal(y[~live], sentinel[~live])


def test_masked_tiling_static():
    assert _triton._masked_tiling(256, 8) == (16, 1)
    assert _triton._masked_tiling(256, 0) == (64, 4)  # expected_m = T
    assert _triton._masked_tiling(256, 100) == (64, 2)
    assert _triton._masked_tiling(256, 33) == (64, 1)
    assert _triton._masked_tiling(8, 1000) == (16, 1)  # clamped to T
    # the tile holds the spread of the counts, not only their mean: 32 rows per expert on
    # average reach ~46, so 64-row tiles (one pass over the weights), 16 reach ~26
    assert _triton._masked_tiling(512, 32) == (64, 1)
    assert _triton._masked_tiling(512, 16) == (32, 1)
    assert _triton._masked_tiling(512, 2) == (16, 1)
    # masked GEMM1 + gate: fp8 at most 32 rows a tile (its two 64-row float32 sums spill)
    assert _triton.masked_gate_tiling(512, 32, 1) == (32, 1)
    tiling = _triton.masked_gate_tiling
    assert tiling(512, 32, 0) == tiling(512, 32, 2) == (64, 1)
    assert _triton.masked_gate_tiling(512, 2, 1) == (16, 1)


def test_masked_tiling_ignores_capacity_past_the_call():
    """A layer's slots hold its LL capacity C, the tuner's a call's T rounded up to the slot
    block: the tiling (so the table entry a call finds) is the same for every C >= that."""
    for E, K in ((128, 8), (8, 2), (32, 4), (8, 8)):
        for t in range(1, 1025, 3):
            em, c = -(-t * K // E), reference.round_up(t, 128)
            tiled = _triton._masked_tiling(c, em)
            for cap in (c, 1024, 4096):  # (c <= 1024: every one holds the call)
                assert _triton._masked_tiling(cap, em) == tiled, (E, K, t, cap)
                for code in (0, 1, 2):
                    got, want = (_triton.masked_gate_tiling(x, em, code) for x in (cap, c))
                    assert got == want, (E, K, t, cap, code)


@pytest.mark.parametrize(
    "counts,want",
    [([0, 7, 20, 16], True), ([0, 21, 3, 1], False), ([-1, 0, 0, 0], False), ([20] * 4, True)],
)
def test_int8_masked_kernel_checks_counts(counts, want):
    """The kernel's own count check (the op asserts on it): ok = every count in [0, T]."""
    gen = torch.Generator().manual_seed(11)
    E, T, N, K = 4, 20, 16, 32
    masked_m = torch.tensor(counts, dtype=torch.int32)
    a, as_, w, ws = _int8_operands((E, T), E, N, K, gen)
    ok = torch.tensor(not want)  # the kernel must overwrite it either way
    y = _triton.masked_triton(a, w, masked_m, as_, ws, config=MASKED, ok=ok)
    assert bool(ok) is want
    # a bad count is clamped to [0, T]: rows inside the slot only, results of the clamped count
    clamped = masked_m.clamp(0, T)
    live = torch.arange(T)[None, :] < clamped[:, None]
    assert_close(y[live], reference.grouped_gemm_masked(a, w, clamped, as_, ws)[live])


# every scheme, row blocks 16 / 32 (permute alignments deep_gemm cannot take), fp8's 1x128 / 128x128
# scales stepping once per 128 channels (BLOCK_K 32 / 64: several K steps per scale group)
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("block_m,block_k", [(16, 64), (32, 32)])
def test_contiguous_every_scheme_matches_reference(scheme, block_m, block_k):
    gen = torch.Generator().manual_seed(12)
    counts, N, K = [5, 0, 33, 16], 128, 256  # (fp8: N and K multiples of the 128 blocks)
    m_idx = _contiguous_layout(counts, block_m)
    a, as_, w, ws = _operands((m_idx.numel(),), len(counts), N, K, gen, scheme)
    if scheme == "fp8":  # deep_gemm's MN-major scale layout: any strides are read as they are
        as_ = as_.t().contiguous().t()
    cfg = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=2, num_warps=4)
    y = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=block_m, config=cfg)
    want = reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws)
    live = m_idx >= 0
    assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE
    assert_close(y[live], want[live])


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_masked_every_scheme_matches_reference(scheme):
    gen = torch.Generator().manual_seed(13)
    E, T, N, K = 3, 20, 128, 256
    masked_m = torch.tensor([0, 7, 20], dtype=torch.int32)
    a, as_, w, ws = _operands((E, T), E, N, K, gen, scheme)
    cfg = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4)
    sentinel = torch.full((E, T, N), 3.0, dtype=torch.bfloat16)
    y = _triton.masked_triton(a, w, masked_m, as_, ws, 8, config=cfg, out=sentinel.clone())
    want = reference.grouped_gemm_masked(a, w, masked_m, as_, ws)
    live = torch.arange(T)[None, :] < masked_m[:, None]
    assert_close(y[live], want[live])
    assert torch.equal(y[~live], sentinel[~live])


def test_fits_keeps_row_blocks_inside_an_expert():
    """A config runs an alignment only when its BLOCK_M divides it; fp8 needs BLOCK_K | 128; the
    tiles of its pipeline fit shared memory."""
    assert _triton.fits(dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128), 1, 64)
    assert not _triton.fits(dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128), 2, 32)
    assert not _triton.fits(dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256), 1, 16)
    assert _triton.fits(dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256), 2, 16)
    assert not _triton.fits(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128), 1, 128)  # (fp8 spills)
    # fp8 past 64x128 outputs: 8 warps (64 outputs a thread) and K tiles of 64 compile unspilled
    wide = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8)
    assert _triton.fits(wide, 1, 128) and not _triton.fits(dict(wide, num_warps=4), 1, 128)
    assert not _triton.fits(dict(wide, BLOCK_K=128), 1, 128)
    assert not _triton.fits(dict(wide, BLOCK_N=256), 1, 128)
    # shared memory (sm90: 227 KiB) holds num_stages (a, w) tile pairs of the operands' bytes:
    # 3 x (128 + 256) x 128 x 2 B = 288 KiB for bf16 (OutOfResources on the H200), half for int8
    big = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_stages=3)
    assert not _triton.fits(big, 0, 128) and _triton.fits(big, 2, 128)
    assert _triton.fits(dict(big, BLOCK_K=64), 0, 128)
    # PERSISTENT programs a multiprocessor hold their pipelines together: 2 x 96 KiB for int8
    pair = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_stages=3, PERSISTENT=2)
    assert _triton.fits(pair, 2, 128) and not _triton.fits(pair, 0, 128)
    assert _triton.fits(dict(pair, PERSISTENT=1), 0, 128)
    # masked: the call's BLOCK_M sets the tiles (0: the largest, 64)
    decode = dict(BLOCK_N=64, BLOCK_K=256, num_stages=4)
    assert _triton.fits(decode, 0, 0, 16) and not _triton.fits(decode, 0, 0, 64)
    assert not _triton.fits(decode, 0) and _triton.fits(decode, 2)
    # the Gluon kernels: int8's and bf16's (not fp8's); a TMA store's staged out tile counts
    # against shared memory (bf16 3 x 64 KiB + 32 KiB fits, 4 x 64 KiB does not)
    gl = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_stages=4, GLUON=True, STORE_TMA=True)
    assert not _triton.fits(gl, 2, 128) and _triton.fits(dict(gl, STORE_TMA=False), 2, 128)
    assert not _triton.fits(dict(gl, BLOCK_N=128, num_stages=3), 1, 128)
    assert _triton.fits(dict(gl, BLOCK_N=128, num_stages=3), 0, 128)
    assert not _triton.fits(dict(gl, BLOCK_N=128, num_stages=4), 0, 128)
    # masked: a config's own BLOCK_M (the Gluon kernel's) sets its tiles, not the call's
    assert not _triton.fits(dict(gl, STORE_TMA=False, num_stages=5), 2, 0, 16)
    assert _triton.fits(dict(gl, STORE_TMA=False, BLOCK_M=64, num_stages=5), 2, 0, 16)
    # WS: a ring of num_stages and an out tile for each of its two MMA warpgroups, 2 x 5 x 32 KiB
    # + 2 x 32 KiB here
    ws = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5, GLUON=True, STORE_TMA=True,
              WS=True)  # fmt: skip
    assert _triton.fits(ws, 2, 128) and not _triton.fits(dict(ws, num_stages=6), 2, 128)
    assert _triton.fits(dict(ws, num_stages=6, STORE_TMA=False), 2, 128)
    # COOP: one ring both warpgroups read and one out tile in two halves, 3 x 48 KiB + 64 KiB
    coop = dict(ws, BLOCK_N=256, BLOCK_K=128, num_stages=3, COOP=True)
    assert _triton.fits(coop, 2, 128) and not _triton.fits(dict(coop, num_stages=4), 2, 128)
    assert _triton.fits(dict(coop, num_stages=4, STORE_TMA=False), 2, 128)
    for quant_code in (0, 1, 2):
        for row_block in (16, 32, 48, 128):
            assert _triton.candidates("contiguous", quant_code, row_block)


# GEMM1 + gate in one kernel: the bytes of our GEMM1 kernel followed by the activation stage
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize(
    "spec", ["silu", "silu:alpha=1.702,limit=7.0,up_offset=1.0", "relu2:glu=0"]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gate_kernel_is_gemm1_then_the_activation(scheme, spec, with_bias):
    from epmoe import gate as G
    from epmoe.ops import activation

    g = G.get(spec)
    gen = torch.Generator().manual_seed(14)
    E, I, K = 3, 128, 256
    m_idx = torch.cat([_contiguous_layout([5, 0, 20], 16), torch.full((16,), -1)]).int()
    a, as_, w, ws = _operands((m_idx.numel(),), E, g.width(I), K, gen, scheme)
    w = w * 4 if scheme == "bf16" else w  # (gates past the clamp limit too)
    bias = torch.randn(E, g.width(I), generator=gen) if with_bias else None
    gemm_cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1)
    y = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=16, config=gemm_cfg)
    # (int8: the kernel writes h in bf16; the op quantizes its rows after)
    h = torch.full((m_idx.numel(), I), 3.0).to(torch.bfloat16 if scheme == "int8" else a.dtype)
    hs = torch.full((m_idx.numel(), I // 128), -1.0)
    cfg = dict(BLOCK_M=16, BLOCK_N=128 if scheme == "fp8" else 64, BLOCK_K=64, GROUP_M=2)
    _triton.contiguous_gate_triton(a, w, m_idx, as_, ws, g, bias, h, hs, row_block=16, config=cfg)
    live = m_idx >= 0
    if scheme != "fp8":
        want = activation._silu_and_mul_triton(y, m_indices=m_idx, gate=spec, bias=bias)
        assert torch.equal(h[live], want[live])
        if scheme == "int8":  # the op's int8 codes and scales: the unfused pair's
            q, s = _ops.gate_triton(a, w, m_idx, as_, ws, g, bias, "row", 16, config=cfg)
            wq, wsc = activation._silu_and_mul_quant_triton(y, "int8", m_indices=m_idx,
                                                            gate=spec, bias=bias)  # fmt: skip
            assert torch.equal(q[live], wq[live]) and torch.equal(s[live], wsc[live])
    else:
        q, s = activation._silu_and_mul_quant_triton(y, "fp8", m_indices=m_idx, gate=spec,
                                                     bias=bias)  # fmt: skip
        assert torch.equal(h[live].view(torch.uint8), q[live].view(torch.uint8))
        assert torch.equal(hs[live], s[live])
    dead = (m_idx.view(-1, 16)[:, :1] < 0).expand(-1, 16).reshape(-1)  # (whole -1 blocks)
    assert dead.any() and (h[dead].float() == 3.0).all() and (hs[dead] == -1.0).all()


# GEMM1 reading its rows through permute's src_rows (permute copying none): the copy's bytes
def _gather_case(scheme, gen, width):
    """(x, x_scales, ids-permuted p, w, ws) for 12 tokens, top-3 of 3 experts, row block 16."""
    M, K, E, H = 12, 3, 3, 256
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M)])
    ids[1, 2] = -1
    x, xs, w, ws = _operands((M,), E, width, H, gen, scheme)
    if scheme == "fp8":  # (the quantize stage's scales: any strides are read as they are)
        xs = xs.t().contiguous().t()
    return x, xs, reference.permute(x, ids, E, 16, xs), w, ws


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_contiguous_gather_is_the_permuted_copy(scheme):
    gen = torch.Generator().manual_seed(15)
    x, xs, (xp, sp, m_idx, _, _, src), w, ws = _gather_case(scheme, gen, 128)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, num_warps=4)
    sp = None if xs is None else sp
    want = _triton.contiguous_triton(xp, w, m_idx, sp, ws, row_block=16, config=cfg)
    got = _triton.contiguous_triton(x, w, m_idx, xs, ws, row_block=16, config=cfg, a_rows=src)
    live = m_idx >= 0
    assert got.shape == want.shape and torch.equal(got[live], want[live])


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_gate_gather_is_the_permuted_copy(scheme):
    from epmoe import gate as G

    g = G.get("silu:alpha=1.702,limit=7.0,up_offset=1.0")
    gen = torch.Generator().manual_seed(16)
    x, xs, (xp, sp, m_idx, _, _, src), w, ws = _gather_case(scheme, gen, g.width(128))
    bias = torch.randn(3, g.width(128), generator=gen)
    cfg = dict(BLOCK_M=16, BLOCK_N=128 if scheme == "fp8" else 64, BLOCK_K=64, GROUP_M=2)
    outs = []
    for a, a_s, rows in ((xp, sp, None), (x, xs, src)):
        h = torch.zeros((m_idx.numel(), 128)).to(torch.bfloat16 if scheme == "int8" else x.dtype)
        hs = torch.zeros((m_idx.numel(), 1))
        _triton.contiguous_gate_triton(a, w, m_idx, a_s if xs is not None else None, ws, g, bias,
                                       h, hs, row_block=16, config=cfg, a_rows=rows)  # fmt: skip
        outs.append((h.view(torch.uint8) if scheme == "fp8" else h, hs))
    live = m_idx >= 0
    assert torch.equal(outs[0][0][live], outs[1][0][live])
    assert torch.equal(outs[0][1][live], outs[1][1][live])


def test_contiguous_gather_of_no_tokens_reads_nothing():
    """No tokens: every row is padding (a_rows -1, m_indices -1): no program reads a (0 rows)."""
    gen = torch.Generator().manual_seed(17)
    x, xs, w, ws = _operands((0,), 3, 64, 128, gen, "int8")
    _, _, m_idx, _, _, src = reference.permute(x, torch.zeros((0, 2), dtype=torch.long), 3, 16)
    assert m_idx.numel() == 48 and (src == -1).all()
    sentinel = torch.full((48, 64), 3.0, dtype=torch.bfloat16)
    y = _triton.contiguous_triton(x, w, m_idx, xs, ws, row_block=16, config=CONTIG,
                                  out=sentinel.clone(), a_rows=src)  # fmt: skip
    assert torch.equal(y, sentinel)


# The TMA-fed contiguous kernel (a and w through tensor descriptors; persistent: fewer programs
# than tiles, each looping over them): the pointer kernel's bytes, -1 blocks left unwritten
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("persistent", [0, 1])
def test_contiguous_tma_is_the_pointer_kernel(scheme, persistent):
    gen = torch.Generator().manual_seed(18)
    counts, N, K = [5, 0, 33, 16], 384, 256  # (N: a partial last column tile; K: 2 steps)
    m_idx = torch.cat([_contiguous_layout(counts, 16), torch.full((32,), -1)]).int()
    a, as_, w, ws = _operands((m_idx.numel(),), len(counts), N, K, gen, scheme)
    if scheme == "fp8":
        as_ = as_.t().contiguous().t()
    cfg = dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=128, GROUP_M=2, num_warps=4)
    want = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=16, config=cfg)
    sentinel = torch.full((m_idx.numel(), N), 3.0, dtype=torch.bfloat16)
    tma = dict(cfg, TMA=True, PERSISTENT=persistent)
    got = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=16, config=tma,
                                    out=sentinel.clone())  # fmt: skip
    live = m_idx >= 0
    dead = (m_idx.view(-1, 16)[:, :1] < 0).expand(-1, 16).reshape(-1)  # (whole -1 blocks)
    assert torch.equal(got[live], want[live])
    assert dead.any() and torch.equal(got[dead], sentinel[dead])
    # SWAP (the weight tile as wgmma's M, the block's rows as its N): int8 bytes, bf16 / fp8
    # float32 sums in another order within rounding
    same = torch.equal if scheme == "int8" else lambda x, y: rel_l2(x, y) < 1e-3
    for swap in (dict(cfg, BLOCK_N=128, SWAP=True), dict(tma, BLOCK_N=128, SWAP=True)):
        got = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=16, config=swap,
                                        out=sentinel.clone())  # fmt: skip
        assert same(got[live], want[live]) and torch.equal(got[dead], sentinel[dead]), swap
    if scheme != "fp8":  # (a Gluon config, int8 or bf16: the interpreter runs the Triton tiles)
        gluon = dict(tma, GLUON=True, STORE_TMA=True)
        for g in (gluon, dict(gluon, WS=True), dict(gluon, WS=True, COOP=True)):
            got = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=16, config=g)
            assert torch.equal(got[live], want[live])


def test_gluon_gate_runs_the_plain_silu_only(monkeypatch):
    """A Gluon GEMM1 + gate config keeps its Gluon keys only for bf16 and the plain SiLU without
    bias, h contiguous (its TMA store); any other call takes the Triton kernel's tile; under the
    interpreter that tile's bytes."""
    from epmoe import _launch
    from epmoe import gate as G
    from epmoe.ops.gemm import _gluon

    cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3,
               TMA=True, PERSISTENT=1, GLUON=True, STORE_TMA=True, WS=True, COOP=True)  # fmt: skip
    assert _triton.fits_gate(cfg, 0, 128) and _triton.fits_gate(dict(cfg, num_stages=4), 0, 128)
    assert not _triton.fits_gate(dict(cfg, num_stages=5), 0, 128)  # (3 x 48 KiB a stage + 32)
    assert not _triton.fits_gate(cfg, 1, 128) and not _triton.fits_gate(cfg, 2, 128)
    assert not _triton.fits_gate(dict(cfg, COOP=False), 0, 128)
    gen = torch.Generator().manual_seed(22)
    E, I, K = 2, 128, 128
    m_idx = torch.cat([_contiguous_layout([130, 3], 128), torch.full((128,), -1)]).int()
    a, _, w, _ = _operands((m_idx.numel(),), E, 2 * I, K, gen, "bf16")
    triton_keys = {k: v for k, v in cfg.items() if k not in _triton._GLUON_KEYS}
    tiles = []
    for c in (cfg, triton_keys):  # (the interpreter: the Triton kernel's tile for both)
        h = torch.full((m_idx.numel(), I), 3.0, dtype=torch.bfloat16)
        _triton.contiguous_gate_triton(a, w, m_idx, None, None, G.get("silu"), None, h,
                                       torch.zeros(m_idx.numel(), 1), row_block=128,
                                       config=c)  # fmt: skip
        tiles.append(h)
    assert torch.equal(tiles[0], tiles[1]) and (tiles[0][-128:] == 3.0).all()  # (a -1 block)
    monkeypatch.setattr(_launch, "_INTERPRET", False)  # (what a GPU launch would take)

    def runnable(spec="silu", bias=None, h=None):
        h = torch.empty((m_idx.numel(), I), dtype=torch.bfloat16) if h is None else h
        plan = _triton._gate_plan(a.dtype, m_idx.numel(), I, K, E, a.stride(), w.stride(), None,
                                  None, None if bias is None else bias.stride(), h.stride(),
                                  (0, 0), G.get(spec), 128, False, a.device)  # fmt: skip
        tensors = (a, w, a, w, m_idx, m_idx, w if bias is None else bias, h, h)
        return plan, tensors, _triton._runnable(plan, cfg, tensors)

    plan, tensors, got = runnable()
    assert got == cfg
    args = _triton._args(plan, tensors, {**plan.meta, **got})
    assert isinstance(args[7], _gluon.TensorDescriptor) and list(args[7].block_shape) == [64, 128]
    assert runnable("silu:alpha=1.702")[2] == triton_keys
    assert runnable(bias=torch.zeros(E, 2 * I))[2] == triton_keys
    assert runnable(h=torch.empty((m_idx.numel(), 2 * I), dtype=torch.bfloat16)[:, :I])[2] == \
        triton_keys  # fmt: skip
    shifted = torch.empty(m_idx.numel() * I + 1, dtype=torch.bfloat16)[1:].view(-1, I)
    assert runnable(h=shifted)[2] == triton_keys


def test_masked_tma_store_takes_whole_row_blocks_only(monkeypatch):
    """A masked Gluon config's TMA store (out as `[E * T, N]`, whole row blocks) stays only where
    no row block reaches into the next slot: T a multiple of its BLOCK_M and the slots back to
    back; elsewhere the same tiles store from registers, and an out not on a 16-byte boundary
    takes the pointer kernel."""
    from epmoe import _launch
    from epmoe.ops.gemm import _gluon

    monkeypatch.setattr(_launch, "_INTERPRET", False)  # (what a GPU launch would take)
    cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=6, TMA=True,
               PERSISTENT=1, GLUON=True, STORE_TMA=True, WS=True, COOP=True)  # fmt: skip

    def case(E, T, out=None):
        a = torch.zeros((E, T, 256), dtype=torch.int8)
        w = torch.zeros((E, 512, 256), dtype=torch.int8)
        out = torch.empty((E, T, 512), dtype=torch.bfloat16) if out is None else out
        mm = torch.zeros(E, dtype=torch.int32)
        plan = _triton._masked_plan(a.dtype, T, 512, 256, E, a.stride(), w.stride(), (0, 0),
                                    (0, 0), out.stride(), 0, False, 0, 0, a.device)  # fmt: skip
        return plan, (a, w, a, w, mm, out, mm)

    plan, tensors = case(3, 256)
    got = _triton._runnable(plan, cfg, tensors)
    assert got == cfg
    args = _triton._args(plan, tensors, {**plan.meta, **got})
    o_d = args[5]
    assert isinstance(o_d, _gluon.TensorDescriptor) and list(o_d.shape) == [3 * 256, 512]
    assert list(o_d.block_shape) == [64, 256]  # (COOP: half tiles)
    for T in (200, 64):  # (a multiple of neither / not of 128 rows)
        plan, tensors = case(3, T)
        got = _triton._runnable(plan, cfg, tensors)
        assert got == {k: v for k, v in cfg.items() if k != "STORE_TMA"}
        assert _triton._args(plan, tensors, {**plan.meta, **got})[5] is tensors[5]
    wide = torch.empty((3, 256, 1024), dtype=torch.bfloat16)[:, :, :512]  # (rows 1024 apart)
    plan, tensors = case(3, 256, wide)
    assert "STORE_TMA" not in _triton._runnable(plan, cfg, tensors)
    shifted = torch.empty(3 * 256 * 512 + 1, dtype=torch.bfloat16)[1:].view(3, 256, 512)
    plan, tensors = case(3, 256, shifted)
    assert "TMA" not in _triton._runnable(plan, cfg, tensors)


def test_contiguous_tma_falls_back_where_it_cannot_run():
    """A gather (rows of a through a_rows), or an a or out that does not start on a 16-byte
    boundary, runs the same tiles through pointers (a Gluon config too: the Triton kernel):
    the same bytes, never a misread."""
    gen = torch.Generator().manual_seed(19)
    x, xs, (xp, sp, m_idx, _, _, src), w, ws = _gather_case("int8", gen, 128)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, num_warps=4)
    live = m_idx >= 0
    want = _triton.contiguous_triton(xp, w, m_idx, sp, ws, row_block=16, config=cfg)
    shifted = torch.empty(xp.numel() + 1, dtype=xp.dtype)[1:].view(xp.shape).copy_(xp)
    assert shifted.data_ptr() % 16 != 0
    out = torch.empty(want.numel() + 1, dtype=want.dtype)[1:].view(want.shape)  # (TMA stores out)
    gluon = dict(cfg, TMA=True, GLUON=True, STORE_TMA=True)
    for tma in (dict(cfg, TMA=True, PERSISTENT=1), dict(gluon, PERSISTENT=2),
                dict(gluon, PERSISTENT=1, WS=True),
                dict(gluon, PERSISTENT=1, WS=True, COOP=True)):  # fmt: skip
        got = _triton.contiguous_triton(x, w, m_idx, xs, ws, row_block=16, config=tma, a_rows=src)
        assert torch.equal(got[live], want[live])
        got = _triton.contiguous_triton(shifted, w, m_idx, sp, ws, row_block=16, config=tma)
        assert torch.equal(got[live], want[live])
        got = _triton.contiguous_triton(xp, w, m_idx, sp, ws, row_block=16, config=tma, out=out)
        assert torch.equal(got[live], want[live])


# GEMM1 + gate fed by TMA (a and w through descriptors, gate and up rows of the same descriptor;
# persistent or a program per tile): the pointer kernel's bytes
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("spec,persistent", [("silu:alpha=1.702,limit=7.0,up_offset=1.0", 0),
                                             ("relu2:glu=0", 1)])  # fmt: skip
def test_gate_tma_is_the_pointer_kernel(scheme, spec, persistent):
    from epmoe import gate as G

    g = G.get(spec)
    gen = torch.Generator().manual_seed(20)
    E, I, K = 3, 256, 256  # (I: two column tiles of 128)
    m_idx = torch.cat([_contiguous_layout([5, 0, 20], 16), torch.full((16,), -1)]).int()
    a, as_, w, ws = _operands((m_idx.numel(),), E, g.width(I), K, gen, scheme)
    bias = torch.randn(E, g.width(I), generator=gen)
    cfg = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=2)
    outs = []
    for c in (cfg, dict(cfg, TMA=True, PERSISTENT=persistent)):
        h = torch.full((m_idx.numel(), I), 3.0).to(torch.bfloat16 if scheme == "int8" else a.dtype)
        hs = torch.full((m_idx.numel(), I // 128), -1.0)
        _triton.contiguous_gate_triton(a, w, m_idx, as_, ws, g, bias, h, hs, row_block=16,
                                       config=c)  # fmt: skip
        outs.append((h.view(torch.uint8) if scheme == "fp8" else h, hs))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    dead = (m_idx.view(-1, 16)[:, :1] < 0).expand(-1, 16).reshape(-1)  # (whole -1 blocks)
    assert (outs[1][1][dead] == -1.0).all()


# the masked kernel's variants against its pointer tile, rows past each count left unwritten:
# the weight stream through TMA (a `[E, T, K]` as `[E * T, K]`: its bytes); SWAP (the weight tile
# as wgmma's M, a few rows as its N) and the Gluon configs (int8 / bf16: their own BLOCK_M and row
# groups): int8 bytes, bf16 / fp8 float32 sums in another order (the simulator's matmul blocks
# them) within rounding
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_masked_variants_are_the_pointer_kernel(scheme):
    gen = torch.Generator().manual_seed(21)
    E, T, N, K = 3, 40, 384, 256
    masked_m = torch.tensor([0, 17, 40], dtype=torch.int32)
    a, as_, w, ws = _operands((E, T), E, N, K, gen, scheme)
    cfg = dict(BLOCK_N=256, BLOCK_K=128, num_warps=4, BLOCK_M=16, M_SPLIT=2)
    sentinel = torch.full((E, T, N), 3.0, dtype=torch.bfloat16)
    want = _triton.masked_triton(a, w, masked_m, as_, ws, 8, config=cfg, out=sentinel.clone())
    live = torch.arange(T)[None, :] < masked_m[:, None]
    same = torch.equal if scheme == "int8" else lambda x, y: rel_l2(x, y) < 1e-3
    swap = dict(cfg, BLOCK_N=128, SWAP=True)
    variants = [(dict(cfg, TMA=True), torch.equal), (swap, same), (dict(swap, TMA=True), same)]
    if scheme != "fp8":
        gluon = dict(cfg, TMA=True, GLUON=True, PERSISTENT=1, BLOCK_M=64)
        split = dict(gluon, WS=True)
        variants += [(g, same) for g in (gluon, split, dict(split, COOP=True))]
    for variant, equal in variants:
        got = _triton.masked_triton(a, w, masked_m, as_, ws, 8, config=variant,
                                    out=sentinel.clone())  # fmt: skip
        assert equal(got[live], want[live]), variant
        assert torch.equal(got[~live], sentinel[~live]), variant


# masked GEMM1 + gate: the masked GEMM1 of the same tile, then the activation stage, byte for byte
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize(
    "spec,with_bias",
    [("silu", False), ("silu:alpha=1.702,limit=7.0,up_offset=1.0", True), ("relu2:glu=0", True)],
)
def test_masked_gate_kernel_is_gemm1_then_the_activation(scheme, spec, with_bias):
    from epmoe import gate as G
    from epmoe.kernels.scales import alloc_scales
    from epmoe.ops import activation

    g = G.get(spec)
    gen = torch.Generator().manual_seed(22)
    E, T, I, K = 3, 40, 256, 256
    masked_m = torch.tensor([0, 17, 40], dtype=torch.int32)
    a, as_, w, ws = _operands((E, T), E, g.width(I), K, gen, scheme)
    w = w * 4 if scheme == "bf16" else w  # (gates past the clamp limit too)
    bias = torch.randn(E, g.width(I), generator=gen) if with_bias else None
    live = torch.arange(T)[None, :] < masked_m[:, None]
    base = dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, BLOCK_M=16, M_SPLIT=2)
    swap = dict(base, BLOCK_K=128, SWAP=True)
    for cfg in (base, swap, dict(base, TMA=True), dict(swap, TMA=True, BLOCK_M=32, M_SPLIT=1)):
        y = _triton.masked_triton(a, w, masked_m, as_, ws, 8, config=cfg)
        # (int8: the kernel writes h in bf16; the op quantizes its rows after)
        h = torch.full((E, T, I), 3.0).to(torch.bfloat16 if scheme == "int8" else a.dtype)
        # (fp8's scales in deep_gemm's MN-major layout: any strides are written as they are)
        hs = alloc_scales((E, T), I // 128, "deepgemm" if scheme == "fp8" else "row", a.device)
        hs.fill_(-1.0)
        _triton.masked_gate_triton(a, w, masked_m, as_, ws, g, bias, h, hs, 8, config=cfg)
        if scheme == "fp8":
            q, s = activation._silu_and_mul_quant_triton(y, "fp8", masked_m=masked_m, gate=spec,
                                                         bias=bias)  # fmt: skip
            assert hs.stride() != s.stride()
            assert torch.equal(h[live].view(torch.uint8), q[live].view(torch.uint8)), cfg
            assert torch.equal(hs[live], s[live]), cfg
        else:
            want = activation._silu_and_mul_triton(y, masked_m=masked_m, gate=spec, bias=bias)
            assert torch.equal(h[live], want[live]), cfg
        assert (h[~live].float() == 3.0).all() and (hs[~live] == -1.0).all(), cfg
