"""The masked-layout (LL) scatter: tokens into `[E, C, H]` slots per local expert, quantized on
the way (ll_scatter's kernel; the torch backend buckets rows per peer with it).

Shape legend: ``T`` tokens, ``K`` top-k, ``H`` hidden, ``Wd`` the layout's columns (>= H: a
zero-padded hidden), ``E`` local experts, ``C`` slots per expert (capacity), ``G`` scale groups
per row. The contract: :mod:`epmoe.ops.ll_scatter`.

The kernel is chosen by the scheme's properties (:class:`epmoe.quant.QuantScheme`), never its
name: no codes (a copy), scales per ``act_group`` channels (fp8's 1x128 groups), one scale per
row (int8). Arguments a variant does not use (Wd when the layout is as wide as x) are passed as
None: Triton makes them constexprs, so that build is the kernel as it was before (same
parameters, same code).
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from epmoe import _checks, _launch, reference
from epmoe import quant as _quant
from epmoe._jit import (  # by name: Inductor copies @triton.jit callees
    _int8_scale,
    _quant_fp8_groups,
    _quant_int8,
)
from epmoe._launch import pdl
from epmoe.kernels.ids import _id_offsets
from epmoe.kernels.scales import alloc_scales

# quant="bf16" copies these as they are: the kernel moves same-width integers (no float semantics)
RAW = {
    torch.bfloat16: torch.int16,
    torch.int8: torch.uint8,
    torch.uint8: torch.uint8,
    reference.FP8_DTYPE: torch.uint8,
    torch.int32: torch.int32,
    torch.float32: torch.int32,
}

# ------------------------------------------------------------------------------ launch heuristics
TILE = 4096  # elements per scatter program and token: 8 KiB of bf16, 32 a thread at 4 warps
INT8_SINGLE_MAX = 8192  # int8 rows up to this many elements in one program (one read for amax)
BLOCK_N = 256  # ids per step of a program's slot count (K_PAD x BLOCK_N counts in registers)
HIST_N = 512  # ids per step of the masked_m program's histogram
# Past two blocks of SCAN_IDS ids (T x K_PAD > 8192) a program's slot count would scan up to
# T x K_PAD ids (T² x K work in all): a count kernel first writes per-expert counts of blocks of
# SCAN_IDS ids, and each program adds its block's prefix of them (BLOCK_B blocks a step) to a scan
# of its own block only. At two blocks the extra launch costs more than the scan saves
# (docs/kernels.md)
SCAN_IDS = 4096
BLOCK_B = 64


# -------------------------------------------------------------------------------------- kernels
# The kernels load topk_ids themselves (torch.compile reads a pointer passed to a jit helper whose
# result feeds a store as written, and clones it): the helpers take offsets and loaded ids, and
# pointers only of the tensors they write.
@triton.jit
def _local_ids(v, inb, LO, E, NG):
    """(local expert of loaded ids v as int32, -1 when skipped: id -1, another rank's expert, a bad
    id, out of bounds (inb False); bad-id mask)."""
    bad = inb & ((v < -1) | (v >= NG))
    loc = v - LO
    live = inb & (v >= 0) & (v < NG) & (loc >= 0) & (loc < E)
    return tl.where(live, loc, -1).to(tl.int32), bad


@triton.jit
def _finish_counts(tot, n_bad, mm_ptr, ok_ptr, E, C, NUM_BINS: tl.constexpr, ASSERT: tl.constexpr):
    """The masked_m program's end: writes masked_m = min(tot, C) (tot: entries per bin, bin E and
    above skipped) and checks the ids and capacities: with ASSERT (a debug=True build) asserts
    them, else writes their int32 code to ok (bit 0: a bad id, bit 1: an expert over capacity)."""
    bins = tl.arange(0, NUM_BINS)
    tot = tl.where(bins < E, tot, 0)
    tl.store(mm_ptr + bins, tl.minimum(tot, C), mask=bins < E)
    bad_ids = tl.sum(n_bad, axis=0)
    over = tl.sum((tot > C).to(tl.int32), axis=0)
    if ASSERT:
        tl.device_assert(bad_ids == 0, "ll_scatter: topk_ids expected ids in [0, Et) or -1")
        tl.device_assert(over == 0, "ll_scatter: topk_ids expected at most C per expert")
    else:  # (one code: one assert after the kernel under torch.compile)
        tl.store(ok_ptr, (bad_ids > 0).to(tl.int32) + 2 * (over > 0).to(tl.int32))


@triton.jit
def _flat_ids(b0, N: tl.constexpr, T, K, K_PAD: tl.constexpr, sit, stride_ik):
    """(flat (t, k) positions b0 + [0, N) of topk_ids, their row and column offsets, in-bounds
    mask)."""
    pos = b0 + tl.arange(0, N)
    ro, co, inb = _id_offsets(pos // K_PAD, pos % K_PAD, T, K, sit, stride_ik)
    return pos, ro, co, inb


@triton.jit
def _bins(v, inb, LO, E, NG, NUM_BINS: tl.constexpr):
    """(entries per local expert among loaded ids v, bin E and above the skipped ones; int32 bad-id
    flags)."""
    e, bad = _local_ids(v, inb, LO, E, NG)
    return tl.histogram(tl.where(e >= 0, e, E), NUM_BINS), bad.to(tl.int32)


@triton.jit
def _quantize_tile(v, amax, QUANT: tl.constexpr):
    """(codes, scales) of a token's tile v: itself (QUANT 0; scales unused), fp8 per 128-group,
    int8 with the row's amax (a tile of the whole row, or the row's amax from its second read)."""
    if QUANT == 0:
        return v, 0.0
    elif QUANT == 1:
        return _quant_fp8_groups(v.to(tl.float32))
    else:
        s = _int8_scale(amax)
        return _quant_int8(v.to(tl.float32), s), s


@triton.jit
def _block_counts_kernel(
    ids_ptr, cnt_ptr, T, K, E, LO, NG, stride_it, stride_ik,
    TB: tl.constexpr, K_PAD: tl.constexpr, HIST_N: tl.constexpr, NUM_BINS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """cnt[b, e] (int32 `[NB, E]`) <- entries of local expert e among tokens [b * TB, (b + 1) * TB)
    (the scatter's blocked slot count)."""
    pdl(PDL)
    b = tl.program_id(0)
    sit = tl.cast(stride_it, tl.int64)  # (int64 row offsets)
    tot = tl.zeros([NUM_BINS], dtype=tl.int32)
    p1 = (b + 1) * TB * K_PAD
    for b0 in range(b * TB * K_PAD, p1, HIST_N):
        pos, ro, co, inb = _flat_ids(b0, HIST_N, T, K, K_PAD, sit, stride_ik)
        inb = inb & (pos < p1)  # (the block's ids only)
        tot += _bins(tl.load(ids_ptr + ro + co, mask=inb, other=-1), inb, LO, E, NG, NUM_BINS)[0]
    bins = tl.arange(0, NUM_BINS)
    tl.store(cnt_ptr + b.to(tl.int64) * E + bins, tot, mask=bins < E)


@triton.jit
def _store_slots(xo_ptr, s_ptr, q, s, rows, kk, cols, groups, H, C, G, stride_se, stride_sc,
                 stride_sg, K: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    """Stores a token's tile q (and its scales s) to each of its slots rows (-1: none), rows of
    H columns (the layout's)."""
    for k in tl.static_range(K):
        r = tl.sum(tl.where(kk == k, rows, 0), axis=0)
        live = r >= 0
        r64 = r.to(tl.int64)
        tl.store(xo_ptr + r64 * H + cols, q, mask=cols < tl.where(live, H, 0))
        if QUANT != 0:  # int8: G = 1, so only chunk 0 (groups == 0) stores its scale
            s_off = (r64 // C) * stride_se + (r64 % C) * stride_sc + groups * stride_sg
            tl.store(s_ptr + s_off, s, mask=groups < tl.where(live, G, 0))


# A slot is the number of entries of the same expert before it in flat (t, k) order, counted by
# each program from the ids (read from L2), so no program waits on another: from the start, or
# (TB > 0, past 2 x SCAN_IDS ids) from its block of TB tokens plus the counts of the blocks before
# (cnt, _block_counts_kernel's). Program 0 reads all T x K ids, the longest scan: it starts first.
# Tiles: fp8 R groups of W = 128 channels, bf16 / int8 one row piece of W. PAD: slots WD wide
# (x's H columns, then zeros).
@triton.jit
def _ll_scatter_kernel(
    # tensors
    x_ptr, ids_ptr, xo_ptr, s_ptr, mm_ptr, rows_ptr, ok_ptr, cnt_ptr,
    # sizes
    T, H, C, E, LO, NG, G, CHUNKS, WD,
    # strides (elements)
    stride_xt, stride_xh, stride_it, stride_ik, stride_se, stride_sc, stride_sg,
    # meta
    K: tl.constexpr, K_PAD: tl.constexpr, QUANT: tl.constexpr, R: tl.constexpr,
    W: tl.constexpr, SINGLE: tl.constexpr, BLOCK_N: tl.constexpr, HIST_N: tl.constexpr,
    NUM_BINS: tl.constexpr, ASSERT: tl.constexpr, PAD: tl.constexpr, TB: tl.constexpr,
    BLOCK_B: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program 0: masked_m and the id / capacity checks (_finish_counts). Program 1 + t * CHUNKS +
    c (t < T): chunk c of token t's row, an [R, W] tile, to each of its slots (chunk 0 also writes
    rows[t]). See the comment above."""
    pdl(PDL)
    pid = tl.program_id(0) - 1
    sit = tl.cast(stride_it, tl.int64)  # (int64 row offsets)
    if pid < 0:
        tot = tl.zeros([NUM_BINS], dtype=tl.int32)
        n_bad = tl.zeros([HIST_N], dtype=tl.int32)
        for b0 in range(0, T * K_PAD, HIST_N):
            _, ro, co, inb = _flat_ids(b0, HIST_N, T, K, K_PAD, sit, stride_ik)
            h, bad = _bins(tl.load(ids_ptr + ro + co, mask=inb, other=-1), inb, LO, E, NG, NUM_BINS)
            tot += h
            n_bad += bad
        _finish_counts(tot, n_bad, mm_ptr, ok_ptr, E, C, NUM_BINS, ASSERT)
    else:
        t = pid // CHUNKS
        c = pid % CHUNKS
        kk = tl.arange(0, K_PAD)
        ro_t, co_t, in_t = _id_offsets(t, kk, T, K, sit, stride_ik)
        v_t = tl.load(ids_ptr + ro_t + co_t, mask=in_t, other=-1)
        e, bad_own = _local_ids(v_t, in_t, LO, E, NG)
        any_live = tl.sum((e >= 0).to(tl.int32), axis=0) > 0
        # the row's load goes first (it needs the token's own ids only); tokens without a local
        # expert read nothing
        groups = c * R + tl.arange(0, R)  # fp8: the tile's scale groups; else the chunk (R = 1)
        cols = groups[:, None] * W + tl.arange(0, W)[None, :]
        hi = tl.where(any_live, H, 0)
        x_row = x_ptr + t.to(tl.int64) * stride_xt
        v = tl.load(x_row + cols * stride_xh, mask=cols < hi, other=0.0)
        # slot of each own entry: cnt's counts of the blocks before token t's (TB > 0), plus equal
        # raw ids earlier in flat (t, k) order from its block's start (a non-local own entry
        # matches nothing: -2; unread positions load -3), summed element-wise, reduced once
        own = t * K_PAD + kk
        end = t * K_PAD + K_PAD  # (the program's own entries end its scan)
        match = tl.where(e >= 0, v_t, -2)
        base = tl.zeros([K_PAD], dtype=tl.int32)
        blk = 0
        if TB > 0:  # (cnt is int32 counts only then)
            blk = t // TB
            for b0 in range(0, blk, BLOCK_B):
                bb = (b0 + tl.arange(0, BLOCK_B))[None, :]
                m = (bb < blk) & (e[:, None] >= 0)
                base += tl.sum(tl.load(cnt_ptr + bb * E + e[:, None], mask=m, other=0), axis=1)
        hits = tl.zeros([K_PAD, BLOCK_N], dtype=tl.int32)
        # unrolled by 4: this scan is the program's critical path
        for b0 in tl.range(blk * TB * K_PAD, end, BLOCK_N, loop_unroll_factor=4):
            pos, ro, co, inb = _flat_ids(b0, BLOCK_N, T, K, K_PAD, sit, stride_ik)
            vb = tl.load(ids_ptr + ro + co, mask=inb & (pos < end), other=-3)
            hits += ((vb[None, :] == match[:, None]) & (pos[None, :] < own[:, None])).to(tl.int32)
        cnt = base + tl.sum(hits, axis=1)
        kept = (e >= 0) & (cnt < C)  # past capacity: never written (an error, checked above)
        rows = tl.where(kept, e * C + cnt, -1)
        tl.store(rows_ptr + t.to(tl.int64) * K + kk, rows, mask=kk < tl.where(c == 0, K, 0))
        amax = tl.max(tl.abs(v.to(tl.float32)), axis=1)  # (int8's scale; unused otherwise)
        if QUANT == 2 and not SINGLE:  # the rest of the row too (a second read, from L2)
            m = tl.zeros([R, W], dtype=tl.float32)
            for h0 in range(0, H, W):
                cc = h0 + cols - c * W
                xc = tl.load(x_row + cc * stride_xh, mask=cc < hi, other=0.0)
                m = tl.maximum(m, tl.abs(xc.to(tl.float32)))
            amax = tl.max(m, axis=1)
        q, s = _quantize_tile(v, amax, QUANT)
        _store_slots(xo_ptr, s_ptr, q, s, rows, kk, cols, groups, WD if PAD else H, C, G,
                     stride_se, stride_sc, stride_sg, K, QUANT)  # fmt: skip


# ----------------------------------------------------------------------------- host-side launch
def scatter_tiling(H: int, quant) -> Tuple[int, int, int]:
    """(R, W, chunks) of the scatter of rows of H columns (the layout's) for ``quant`` (a name or
    a scheme): each program copies an [R, W] tile of a row."""
    qs = _quant.get(quant, "ll_scatter")
    if qs.act_group is not None:  # R whole groups a tile: one scale each
        groups = H // qs.act_group
        r = min(_launch.pow2(max(groups, 1)), TILE // qs.act_group)
        return r, qs.act_group, max(_launch.cdiv(groups, r), 1)
    # one scale per row (int8): the whole row in one tile when it fits (one read for its amax)
    limit = INT8_SINGLE_MAX if qs.quantized else TILE
    w = min(_launch.pow2(max(H, 1)), limit)
    return 1, w, max(_launch.cdiv(H, w), 1)  # (H = 0: one chunk still writes rows)


def _warps(elements: int) -> int:
    return 8 if elements > 4096 else 4


@_launch.memo
def _scatter_launch(T, K, H, C, E, expert_lo, NG, quant, x_strides, id_strides, s_strides,
                    width, in_kernel):  # fmt: skip
    """(the block count launch or None, the scatter kernel's launch, its blocks or 0) for these
    sizes, strides and options (width: the layout's columns when wider than x, else None)."""
    qs = _quant.get(quant, "ll_scatter")
    wd = H if width is None else width
    G = qs.act_scale_cols(wd)
    R, W, chunks = scatter_tiling(wd, qs)
    k_pad = _launch.pow2(max(K, 1))
    bins, hist_n = _launch.pow2(E + 1), max(HIST_N, k_pad)
    # blocked slot counts past 2 x SCAN_IDS ids (an unbacked T under torch.compile: not blocked, a
    # longer scan); tb: tokens a block. No other `if` on sizes (T may be symbolic): T = 0 still
    # launches the masked_m program
    tb = max(SCAN_IDS // k_pad, 1) if _launch.at_least(T * k_pad, 2 * SCAN_IDS + 1) else 0
    counts, nb = None, _launch.cdiv(T, tb) if tb else 0
    if tb:
        counts = _launch.Prepared(
            _block_counts_kernel, (nb,), (T, K, E, expert_lo, NG, *id_strides),
            dict(TB=tb, K_PAD=k_pad, HIST_N=hist_n, NUM_BINS=bins, num_warps=4),
        )  # fmt: skip
    scatter = _launch.Prepared(
        _ll_scatter_kernel,
        (T * chunks + 1,),
        (T, H, C, E, expert_lo, NG, G, chunks, width, *x_strides, *id_strides, *s_strides),
        dict(
            K=K, K_PAD=k_pad, QUANT=qs.kernel_code, R=R, W=W, SINGLE=chunks == 1,
            BLOCK_N=max(BLOCK_N, k_pad), HIST_N=hist_n, NUM_BINS=bins, ASSERT=in_kernel,
            PAD=width is not None, TB=tb, BLOCK_B=BLOCK_B, num_warps=_warps(R * W),
            **_checks.assert_build(in_kernel),
        ),
    )  # fmt: skip
    return counts, scatter, nb


def outputs(x, topk_ids, num_experts, capacity, quant="bf16", expert_lo=0,
            num_global_experts=None, scale_layout="row", width=None):  # fmt: skip
    """ll_scatter's 4 outputs (xo, scales, masked_m, rows), allocated: the launch fills them, the
    op's fake returns them."""
    T, K = topk_ids.shape
    wd = x.shape[1] if width is None else width
    E, C, dev = num_experts, capacity, x.device
    qs = _quant.get(quant, "ll_scatter")
    G = qs.act_scale_cols(wd)
    return (
        torch.empty((E, C, wd), dtype=qs.act_dtype if qs.quantized else x.dtype, device=dev),
        alloc_scales((E, C), G, scale_layout if G else "row", dev),
        torch.empty((E,), dtype=torch.int32, device=dev),
        torch.empty((T, K), dtype=torch.int32, device=dev),
    )


def _ll_scatter_triton(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: int,
    quant: str = "bf16",
    expert_lo: int = 0,
    num_global_experts: Optional[int] = None,
    scale_layout: str = "row",
    width: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ll_scatter on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    T, K = topk_ids.shape
    H = x.shape[1]
    E, C = num_experts, capacity
    NG = num_experts if num_global_experts is None else num_global_experts
    xo, s, masked_m, rows = outputs(x, topk_ids, E, C, quant, expert_lo, NG, scale_layout, width)
    xk, xok = x, xo
    if xo.dtype is x.dtype and x.dtype is not torch.bfloat16:  # no codes, not bf16: raw bytes
        xk, xok = x.view(RAW[x.dtype]), xo.view(RAW[x.dtype])
    # Direct CUDA launches (eager, the dispatcher, graph capture of either) assert the ids and
    # capacities inside the kernel (ok unused); otherwise (torch.compile, the interpreter) it
    # writes a code to ok
    in_kernel = _checks.assert_in_kernel(_checks.direct_launch(x))
    ok = (
        topk_ids if in_kernel else torch.empty((1,), dtype=torch.int32, device=x.device)
    )  # (unused)
    counts, scatter, nb = _scatter_launch(
        T, K, H, C, E, expert_lo, NG, quant, x.stride(), topk_ids.stride(), s.stride(),
        None if width is None or width == H else width, in_kernel,  # (xo's columns when wider)
    )  # fmt: skip
    cnt = topk_ids  # (unused unless blocked; read only: no written tensor passed twice)
    if counts is not None:
        cnt = torch.empty((nb, E), dtype=torch.int32, device=x.device)
        counts(topk_ids, cnt)
    scatter(xk, topk_ids, xok, s, masked_m, rows, ok, cnt)
    if not in_kernel:
        _checks.check_codes(ok, "ll_scatter", "topk_ids", (
            (f"ids in [0, {NG}) or -1", "values outside it"),
            (f"at most capacity={C} entries per expert", "an expert over capacity"),
        ))  # fmt: skip
    return xo, s, masked_m, rows
