"""Stage: permute (HT). Scatter received rows into expert-contiguous, aligned blocks.

Contract: ``p = permute(x, topk_ids, num_experts=E, alignment=A, x_scales=None,
scale_layout="row")``

- x: any dtype (bf16, fp8, int8) `[M, H]`; topk_ids: int32/int64 `[M, K]` local id in [0, E) or
  -1; x_scales: float32 `[M, S]` or None.
- p.x `[M_sum, H]`, M_sum = round_up(M*K + E*(A-1), A) (static in M); p.x_scales `[M_sum, S]` or
  None; p.m_indices int32 `[M_sum]` expert of each row, -1 on padding and unused rows; p.inv_perm
  int32 `[M, K]` row of (t, k) or -1; p.expert_offsets int32 `[E + 1]` block starts (multiples of
  A), last = used rows.
- scale_layout: "row" (contiguous p.x_scales) or "deepgemm" (MN-major, TMA-aligned: strides
  (1, round_up(M_sum, 4)), read by deep_gemm's fp8 GEMM without a transpose); same values.
- Experts' blocks in ascending order; inside a block rows in (t, k) order (deterministic).
- Rows of p.x / p.x_scales with m_indices == -1 are unspecified (the reference zero-fills them; the
  CUDA kernels write none of them but, with DeepGEMM-layout scales, zero scales on the padding
  rows of a row block that holds a used row: at workload W these rows are over half of M_sum).

CUDA-graph safe: one kernel up to CONFIG.small_entries entries, else three (four with
DeepGEMM-layout scales from CONFIG.scales_by_row_min_entries entries), fixed grids from shapes,
no host sync, no atomics (the row order is deterministic) and no zero fill; on sm90 each kernel
after the first starts early (programmatic dependent launch) and waits only before it reads its
predecessor's output.
Each source row is read once and written to all of its local experts. Programs waiting on the
index chain ask the L2 for rows later programs read (a hint: CONFIG.pf_*).
``alignment`` is the grouped-GEMM row block (128 for deep_gemm), never the quant block. Ids outside
[0, E) other than -1 are an error (ValueError on CPU; on CUDA a device assert inside the kernels,
ValueError in debug mode; under torch.compile an async assert after the kernels).
"""

import dataclasses
import functools
import importlib
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from epmoe import _checks, _config, _eager, _library, reference

# epmoe.ops re-exports a function named ``quantize``: import the module itself.
_q = importlib.import_module("epmoe.ops.quantize")

OP = "permute"


# ------------------------------------------------------------------------------ launch config
@dataclasses.dataclass(frozen=True)
class PermuteConfig:
    """Launch parameters of the permute kernels (design notes: docs/kernels.md)."""

    # (t, k) entries per rank block (whole tokens: block_n // K_PAD); a token's rank compares
    # its K entries with the block's
    block_n: int = 256
    block_scan: int = 1024  # blocks per step of the per-expert prefix scan (no recompile per M)
    block_rows: int = 1024  # m_indices rows per step of an expert's fill loop
    fill_split: int = 4  # programs per expert filling its m_indices (one expert may own all rows)
    copy_bytes: int = 4096  # payload bytes per copy program: 32 B a thread at 4 warps, 128-bit
    copy_warps: int = 4
    # up to this many (t, k) entries (K padded to a power of 2) one kernel does everything: one
    # launch, nothing waits on another kernel
    small_entries: int = 2048
    small_copy_bytes: int = 8192  # payload bytes per one-kernel program (fp8 at H 7168: a row)
    small_warps: int = 4
    # DeepGEMM-layout scales go per destination row block (coalesced MN-major stores, by the
    # second kernel with the column chunks past the first) from this many (t, k) entries; below
    # it the extra launch costs more than it saves
    scales_by_row_min_entries: int = 8192
    scale_tile: int = 4096  # scale values per program of the row-block scale copy
    # cache hints of the payload copy: each source row is read once, each destination row
    # written once and next read by the GEMM
    load_policy: str = "evict_first"  # tl.load eviction_policy of the source rows
    store_cache: str = ".cs"  # tl.store cache_modifier of the destination rows (streaming)
    # per-token scale stores scatter 4 bytes at a time into the MN-major layout: kept in L2 their
    # sectors fill up before they are written back
    scale_policy: str = "evict_last"
    # L2 prefetch by programs waiting at gdc_wait (direct sm90 launches): the copy kernel's
    # programs below pf_per_sm per multiprocessor ask for the chunks of programs pid + j * that,
    # j in [1, pf_waves], while HBM idles on the index chain; pf_rest_*: the same from the second
    # kernel's chunk programs while the copy kernel ends
    pf_waves: int = 2
    pf_per_sm: int = 20
    pf_rest_waves: int = 2
    pf_rest_per_sm: int = 12


CONFIG = PermuteConfig()


def override(**fields):
    """Context manager: permute launches with these CONFIG fields inside the block (sweeps,
    scripts/compile_kernels.py, tests)."""
    return _config.override(__name__, **fields)


class PermuteResult(NamedTuple):
    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    m_indices: torch.Tensor
    inv_perm: torch.Tensor
    expert_offsets: torch.Tensor


# -------------------------------------------------------------------------------------- kernels
# Deterministic placement: the tokens are cut into blocks of TB whole tokens (TB * K entries);
# row(t, k) = start[e] + (entries of e in earlier blocks) + (entries of e earlier in this block).
# Kernel 1 counts per (expert, block), and the invalid ids per block. Kernel 2 turns each
# expert's counts into an exclusive prefix over blocks and writes its total (one more program
# adds up the invalid ids into the check's flag). Kernel 3 copies each token's row to its K
# destinations, computing them on the way (aligned starts from the totals, plus the block's
# prefix, plus the rank among the same expert's entries earlier in the block); its first column
# chunk also writes inv_perm and each used row's source token. Its programs past the tokens fill
# m_indices, expert_offsets and (for DeepGEMM-layout scales) -1 as the source of every row no
# entry lands in. With DeepGEMM-layout scales, kernel 3 copies only the first column chunk and
# kernel 4 the other chunks plus the scales, per destination row block.
# No atomics and no zero fill: every word is written by exactly one program.
# Every load of a pointer argument sits in a kernel body: torch.compile reads a pointer passed to
# a jit helper whose result feeds a store as written (and clones it). The helpers take offsets,
# masks and loaded values.


@triton.jit
def _id_offsets(t, k, M, K, stride_it, stride_ik):
    """(row and column offsets of entries (t, k) in topk_ids, valid mask: t < M and k < K)."""
    valid = (t + k * 0 < M) & (k < K)  # (t may be a scalar: the mask is k's shape or larger)
    return t * stride_it, k * stride_ik, valid


@triton.jit
def _classify(e, valid, E):
    """(expert of loaded ids e as int32: -1 for -1, invalid ids and entries not valid; invalid
    mask)"""
    ok = valid & (e >= 0) & (e < E)
    bad = valid & ((e < -1) | (e >= E))
    return tl.where(ok, e, -1).to(tl.int32), bad


@triton.jit
def _aligned_from(tot, ALIGN):
    """(tot, aligned block sizes, aligned block starts) of per-expert totals tot (0 past E)."""
    aligned = (tot + ALIGN - 1) // ALIGN * ALIGN
    return tot, aligned, tl.cumsum(aligned, axis=0) - aligned


@triton.jit
def _count_tokens_kernel(
    ids_ptr, counts_ptr, bad_ptr,
    M, K, stride_it, stride_ik, E, NB,
    TB: tl.constexpr, K_PAD: tl.constexpr, NUM_BINS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """counts[e, b] <- entries of expert e in token block b; bad[b] <- its invalid ids."""
    if PDL:  # (this first kernel of the chain is itself launched in stream order)
        gdc_launch_dependents()
    b = tl.program_id(0)
    t = (b * TB + tl.arange(0, TB))[:, None]
    ro, co, valid = _id_offsets(t, tl.arange(0, K_PAD)[None, :], M, K, stride_it, stride_ik)
    e, bad = _classify(tl.load(ids_ptr + ro + co, mask=valid, other=-1), valid, E)
    e = tl.reshape(e, [TB * K_PAD])
    hist = tl.histogram(tl.where(e >= 0, e, E), NUM_BINS)  # bin E: the -1 entries (ignored)
    bins = tl.arange(0, NUM_BINS)
    tl.store(counts_ptr + bins * NB + b, hist, mask=bins < E)
    n_bad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
    tl.store(bad_ptr + b + bins, n_bad + bins * 0, mask=bins < 1)


@triton.jit
def _scan_kernel(
    counts_ptr, bad_ptr, totals_ptr, ok_ptr, E, NB,
    BLOCK: tl.constexpr, PDL: tl.constexpr, ASSERT: tl.constexpr,
):  # fmt: skip
    """Programs [0, E): counts[e, b] <- entries of e in blocks < b; totals[e] <- all of them.
    Program E: ok <- no invalid id in any block; with ASSERT (a debug=True build) it also asserts
    ok (this small kernel, not the copy, carries the assert's registers)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # counts and bad come from the count kernel
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)  # (every lane holds the running sum)
    if pid < E:
        row = counts_ptr + pid.to(tl.int64) * NB
        for b0 in range(0, NB, BLOCK):
            offs = b0 + lane
            c = tl.load(row + offs, mask=offs < NB, other=0)
            tl.store(row + offs, tl.cumsum(c, axis=0) - c + acc, mask=offs < NB)
            acc += tl.sum(c, axis=0)
        tl.store(totals_ptr + pid + lane, acc, mask=lane < 1)
    else:
        for b0 in range(0, NB, BLOCK):
            offs = b0 + lane
            acc += tl.sum(tl.load(bad_ptr + offs, mask=offs < NB, other=0), axis=0)
        tl.store(ok_ptr + lane, acc == 0, mask=lane < 1)
        if ASSERT:
            n_bad = tl.max(acc, axis=0)
            tl.device_assert(n_bad == 0, "permute: topk_ids expected ids in [0, E) or -1")


@triton.jit
def _fill_from(
    q, tot, aligned, start, m_idx_ptr, offsets_ptr, src_ptr, E, M_SUM,
    E_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, SPLIT: tl.constexpr,
    WRITE_SRC: tl.constexpr,
):  # fmt: skip
    """Every SPLIT-th chunk (from q % SPLIT) of expert q // SPLIT's aligned block (E: the unused
    tail), from the per-expert totals, aligned sizes and starts ([E_PAD], 0 past E): m_indices =
    the expert on its first tot[e] rows, -1 on the padding (and src = -1 there); q == 0 also
    writes expert_offsets."""
    ex = tl.arange(0, E_PAD)
    fe = q // SPLIT  # the expert this program fills (E: the unused tail)
    j = q % SPLIT
    used = tl.sum(aligned, axis=0)
    if q == 0:
        tl.store(offsets_ptr + ex, start, mask=ex < E)
        tl.store(offsets_ptr + E + ex, used + ex * 0, mask=ex < 1)
    lo = tl.where(fe < E, tl.sum(tl.where(ex == fe, start, 0), axis=0), used)
    hi = tl.where(fe < E, lo + tl.sum(tl.where(ex == fe, aligned, 0), axis=0), M_SUM)
    live_end = tl.where(fe < E, lo + tl.sum(tl.where(ex == fe, tot, 0), axis=0), used)
    val = tl.where(fe < E, fe, -1)
    rows = tl.arange(0, BLOCK_ROWS)
    for r0 in range(lo + j * BLOCK_ROWS, hi, SPLIT * BLOCK_ROWS):
        r = r0 + rows
        tl.store(m_idx_ptr + r, tl.where(r < live_end, val, -1), mask=r < hi)
        if WRITE_SRC:  # rows no entry lands in (the copy programs write the others)
            tl.store(src_ptr + r, tl.full([BLOCK_ROWS], -1, tl.int32),
                     mask=(r >= live_end) & (r < hi))  # fmt: skip


@triton.jit
def _block_rank(e, eb, t, b, K_PAD: tl.constexpr, TB: tl.constexpr):
    """Rank of each of token t's entries (experts e, int32 [K_PAD], -1 for none) among the entries
    of the same expert earlier in t's block b (experts eb, [TB, K_PAD]), int32 [K_PAD]."""
    kk = tl.arange(0, K_PAD)
    # the block's entries, flattened (token-major); own entries sit at (t - b * TB) * K_PAD + k
    eb = tl.reshape(eb, [TB * K_PAD])
    pos = tl.arange(0, TB * K_PAD)
    own = (t - b * TB) * K_PAD + kk
    earlier = (eb[None, :] == e[:, None]) & (pos[None, :] < own[:, None])
    return tl.sum(earlier.to(tl.int32), axis=1)


@triton.jit
def _store_rows(out_ptr, rows, v, cols, H, K: tl.constexpr, K_PAD: tl.constexpr,
                STORE_CACHE: tl.constexpr):  # fmt: skip
    """v (one column chunk of a source row, at cols) to each destination row in rows (-1: none)."""
    kk = tl.arange(0, K_PAD)
    for k in tl.static_range(K):
        r = tl.sum(tl.where(kk == k, rows, 0), axis=0)
        dst = out_ptr + r.to(tl.int64) * H + cols
        tl.store(dst, v, mask=cols < tl.where(r >= 0, H, 0), cache_modifier=STORE_CACHE)


@triton.jit
def _chunk_cols(e, c, H, BLOCK_H: tl.constexpr):
    """(columns of column chunk c, the row's live width) of a token with experts e: tokens without
    a local entry (routed only to other ranks, padding rows of a worst-case dispatch) are never
    read (live width 0)."""
    h_live = tl.where(tl.max(e, axis=0) >= 0, H, 0)
    cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
    return cols, h_live


@triton.jit
def _prefetch_l2(ptr, nbytes, on):
    """Asks the L2 for the nbytes at ptr (scalars) when on (int32 != 0): cp.async.bulk.prefetch,
    sm90, issued by thread 0 of the program; a hint, nothing waits on it. ptr 16-byte aligned,
    nbytes a multiple of 16. (Rows of tokens without a local entry may be asked for too: the
    kernels still never read them.)"""
    lane = tl.full([1], 0, tl.int32)  # (one-element tensors: the asm takes tensors)
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        .reg .b32 tid;
        mov.u32 tid, %tid.x;
        setp.eq.u32 p, tid, 0;
        setp.ne.and.b32 p, $2, 0, p;
        @p cp.async.bulk.prefetch.L2.global [$1], $3;
        mov.b32 $0, 0;
        }""",
        constraints="=r,l,r,r",
        args=[ptr + lane, on + lane, nbytes + lane],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_waves(x_ptr, i, M, H, stride_xm, PER_TOKEN, FIRST, BLOCK_H: tl.constexpr,
                    WAVES: tl.constexpr, DIST):  # fmt: skip
    """Program i below DIST of a kernel whose program q copies chunk FIRST + q % PER_TOKEN of
    token q // PER_TOKEN (BLOCK_H columns): _prefetch_l2 of the chunks of programs i + j * DIST,
    j in [1, WAVES], while i waits at gdc_wait."""
    esz = x_ptr.dtype.element_ty.primitive_bitwidth // 8
    for j in tl.static_range(1, WAVES + 1):
        q = i + j * DIST
        t = q // PER_TOKEN
        c0 = (FIRST + q % PER_TOKEN) * BLOCK_H
        n = (tl.minimum(c0 + BLOCK_H, H) - c0) * esz
        on = ((i < DIST) & (t < M)).to(tl.int32)
        _prefetch_l2(x_ptr + t.to(tl.int64) * stride_xm + c0, n, on)


@triton.jit
def _place_copy_kernel(
    # tensors
    x_ptr, xs_ptr, ids_ptr, counts_ptr, totals_ptr, inv_ptr, src_ptr, out_ptr, outs_ptr,
    m_idx_ptr, offsets_ptr,
    # sizes
    M, H, S, SPC, E, NB, ALIGN, M_SUM, CHUNKS,
    # strides (elements)
    stride_it, stride_ik, stride_xm, stride_xh, stride_sm, stride_ss, stride_om, stride_os,
    # meta
    K: tl.constexpr, K_PAD: tl.constexpr, TB: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_SCALES: tl.constexpr, WRITE_SRC: tl.constexpr,
    E_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, SPLIT: tl.constexpr,
    LOAD_POLICY: tl.constexpr, STORE_CACHE: tl.constexpr, SCALE_POLICY: tl.constexpr,
    PDL: tl.constexpr, PF_SCALES: tl.constexpr, PF_WAVES: tl.constexpr, PF_DIST,
):  # fmt: skip
    """Programs t * CHUNKS + c (t < M): column chunk c of token t's row to its destinations (a
    token's chunks in neighbouring programs). Programs past M * CHUNKS: the m_indices fill
    (_fill_from), one chunk of it per program."""
    if PDL:
        gdc_launch_dependents()
    t = tl.program_id(0) // CHUNKS
    c = tl.program_id(0) % CHUNKS
    if t >= M:
        q = (t - M) * CHUNKS + c
        if q < (E + 1) * SPLIT:
            if PDL:
                gdc_wait()  # totals come from the scan kernel
            ex = tl.arange(0, E_PAD)
            tot, aligned, start = _aligned_from(tl.load(totals_ptr + ex, mask=ex < E, other=0),
                                                ALIGN)  # fmt: skip
            _fill_from(q, tot, aligned, start, m_idx_ptr, offsets_ptr, src_ptr, E, M_SUM, E_PAD,
                       BLOCK_ROWS, SPLIT, WRITE_SRC)  # fmt: skip
    else:
        b = t // TB
        kk = tl.arange(0, K_PAD)
        # token t's experts (-1 for none) and those of its block's entries, then each entry's rank
        ro, co, valid = _id_offsets(t, kk, M, K, stride_it, stride_ik)
        e, _ = _classify(tl.load(ids_ptr + ro + co, mask=valid, other=-1), valid, E)
        tb = b * TB + tl.arange(0, TB)[:, None]
        ro_b, co_b, valid_b = _id_offsets(tb, kk[None, :], M, K, stride_it, stride_ik)
        eb, _ = _classify(tl.load(ids_ptr + ro_b + co_b, mask=valid_b, other=-1), valid_b, E)
        rank = _block_rank(e, eb, t, b, K_PAD, TB)
        # everything up to gdc_wait depends on the inputs alone (ids, rows, scales), so with PDL
        # these loads overlap the scan; without it the row's load still goes before the counts'
        cols, h_live = _chunk_cols(e, c, H, BLOCK_H)
        v = tl.load(x_ptr + t.to(tl.int64) * stride_xm + cols * stride_xh, mask=cols < h_live,
                    eviction_policy=LOAD_POLICY)  # fmt: skip
        t64 = t.to(tl.int64)
        if HAS_SCALES:  # the row's scales, SPC of them per column chunk (spread over its programs)
            so = c * SPC + tl.arange(0, BLOCK_S)
            s_hi = tl.minimum(c * SPC + SPC, S)
            sv = tl.load(
                xs_ptr + t64 * stride_sm + so * stride_ss, mask=so < tl.where(h_live > 0, s_hi, 0)
            )
        if PF_SCALES:  # (the second kernel's scale rows gather these)
            _prefetch_l2(xs_ptr + t64 * stride_sm, S * 4, (h_live > 0).to(tl.int32))
        if PF_WAVES > 0:
            _prefetch_waves(x_ptr, tl.program_id(0), M, H, stride_xm, CHUNKS, 0, BLOCK_H,
                            PF_WAVES, PF_DIST)  # fmt: skip
        if PDL:
            gdc_wait()  # counts (scanned) and totals come from the scan kernel
        # destination rows (-1 for none): aligned expert start + the expert's entries in earlier
        # blocks + rank
        live = e >= 0
        ex = tl.arange(0, E_PAD)
        _, _, start = _aligned_from(tl.load(totals_ptr + ex, mask=ex < E, other=0), ALIGN)
        base = tl.sum(tl.where(ex[None, :] == e[:, None], start[None, :], 0), axis=1)
        first = tl.load(counts_ptr + e.to(tl.int64) * NB + b, mask=live, other=0)
        rows = tl.where(live, base + first + rank, -1)
        if c == 0:
            tl.store(inv_ptr + t64 * K + kk, rows, mask=kk < K)
            if WRITE_SRC:  # source token of each used row, for the destination-driven scale copy
                tl.store(src_ptr + rows, t + kk * 0, mask=rows >= 0)
        _store_rows(out_ptr, rows, v, cols, H, K, K_PAD, STORE_CACHE)
        if HAS_SCALES:
            for k in tl.static_range(K):
                r = tl.sum(tl.where(kk == k, rows, 0), axis=0)
                s_dst = outs_ptr + r.to(tl.int64) * stride_om + so * stride_os
                tl.store(s_dst, sv, mask=so < tl.where(r >= 0, s_hi, 0),
                         eviction_policy=SCALE_POLICY)  # fmt: skip


@triton.jit
def _rest_scales_kernel(
    # tensors
    xs_ptr, src_ptr, outs_ptr, x_ptr, ids_ptr, inv_ptr, out_ptr,
    # sizes
    S, M_SUM, M, H, E, N_REST, N_SCALE, STRIDE,
    # strides (elements)
    stride_sm, stride_ss, stride_om, stride_os, stride_it, stride_ik, stride_xm, stride_xh,
    # meta
    K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LOAD_POLICY: tl.constexpr, STORE_CACHE: tl.constexpr, PDL: tl.constexpr,
    VEC: tl.constexpr, S_C: tl.constexpr, PF_WAVES: tl.constexpr, PF_DIST,
):  # fmt: skip
    """Two kinds of programs after the copy kernel (which wrote src, inv_perm and chunk 0 of
    every row when N_REST > 0, all chunks otherwise):
    - scale rows, N_SCALE of them (every STRIDE-th program, from the STRIDE - 1-th): the scales
      of BLOCK_R consecutive destination rows, gathered from their source tokens (src: -1 on rows
      no entry lands in). The stores are contiguous (down the rows in DeepGEMM's MN-major
      layout), where a per-source copy scatters one 4-byte store per (row, group). VEC (S_C = S,
      dense 16-byte aligned rows both sides, stride_om 1): 16-byte accesses; a block with a live
      row writes all of its rows (0 on the padding rows, whose scales are unspecified) so that
      the stores' mask is the same down the rows, and a block without one writes nothing. Else
      only the live rows are written;
    - the other M * N_REST: column chunk 1 + i % N_REST of token i // N_REST's row to the rows the
      copy kernel put in inv_perm. They keep the bandwidth up while the scale rows wait on their
      gathers."""
    pid = tl.program_id(0)
    if (pid % STRIDE == STRIDE - 1) & (pid // STRIDE < N_SCALE):
        if PDL:
            gdc_wait()  # src comes from the copy kernel
        blk = pid // STRIDE
        r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
        src = tl.load(src_ptr + r, mask=r < M_SUM, other=-1)
        live = src >= 0
        so = tl.arange(0, BLOCK_S)
        if VEC:
            if tl.max(src, axis=0) >= 0:
                base = tl.multiple_of(src.to(tl.int64) * stride_sm, 4)
                m = live[:, None] & (so < S_C)[None, :]
                v = tl.load(xs_ptr + base[:, None] + so[None, :], mask=m, other=0.0)
                tl.store(outs_ptr + r.to(tl.int64)[:, None] + so[None, :] * stride_os, v,
                         mask=(r < M_SUM)[:, None] & (so < S_C)[None, :])  # fmt: skip
        else:
            m = live[:, None] & (so[None, :] < S)
            v = tl.load(xs_ptr + src.to(tl.int64)[:, None] * stride_sm + so[None, :] * stride_ss,
                        mask=m)  # fmt: skip
            tl.store(outs_ptr + r.to(tl.int64)[:, None] * stride_om + so[None, :] * stride_os, v,
                     mask=m)  # fmt: skip
    else:
        i = pid - tl.minimum((pid + 1) // STRIDE, N_SCALE)  # scale programs before pid
        t = i // N_REST
        kk = tl.arange(0, K_PAD)
        ro, co, valid = _id_offsets(t, kk, M, K, stride_it, stride_ik)
        e, _ = _classify(tl.load(ids_ptr + ro + co, mask=valid, other=-1), valid, E)
        cols, h_live = _chunk_cols(e, 1 + i % N_REST, H, BLOCK_H)
        chunk = tl.load(x_ptr + t.to(tl.int64) * stride_xm + cols * stride_xh, mask=cols < h_live,
                        eviction_policy=LOAD_POLICY)  # fmt: skip
        if PF_WAVES > 0:  # (as the copy kernel's: later waves' chunks while the copy kernel ends)
            _prefetch_waves(x_ptr, i, M, H, stride_xm, N_REST, 1, BLOCK_H, PF_WAVES, PF_DIST)
        if PDL:
            gdc_wait()  # inv_perm comes from the copy kernel
        rows = tl.load(inv_ptr + t.to(tl.int64) * K + kk, mask=kk < K, other=-1)
        _store_rows(out_ptr, rows, chunk, cols, H, K, K_PAD, STORE_CACHE)


@triton.jit
def _small_permute_kernel(
    # tensors
    x_ptr, xs_ptr, ids_ptr, inv_ptr, out_ptr, outs_ptr, m_idx_ptr, offsets_ptr, ok_ptr,
    # sizes
    M, H, S, SPC, E, ALIGN, M_SUM, CHUNKS,
    # strides (elements)
    stride_it, stride_ik, stride_xm, stride_xh, stride_sm, stride_ss, stride_om, stride_os,
    # meta
    K: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr, NUM_BINS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SCALES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, LOAD_POLICY: tl.constexpr, STORE_CACHE: tl.constexpr,
    SCALE_POLICY: tl.constexpr, ASSERT: tl.constexpr,
):  # fmt: skip
    """The whole permute in one kernel, for few entries (M * K_PAD <= N_PAD): every program
    counts all of them itself (a few KiB of ids, read from L2), so nothing waits on another
    program or kernel. Programs t * CHUNKS + c (t < M): column chunk c of token t's row (and its
    scales) to its rows, whose place is the aligned start of the expert, plus the expert's
    entries in earlier tokens, plus those earlier in the token; chunk 0 also writes inv_perm.
    Programs past M * CHUNKS: one expert's block of m_indices each (E: the unused tail); the
    first also writes expert_offsets and the id check's flag, and with ASSERT (a launch with
    debug=True, which compiles device asserts in) asserts it: no separate check kernel after this
    one."""
    pid = tl.program_id(0)
    t = pid // CHUNKS
    c = pid % CHUNKS
    kk = tl.arange(0, K_PAD)
    ro, co, valid = _id_offsets(t, kk, M, K, stride_it, stride_ik)
    e, _ = _classify(tl.load(ids_ptr + ro + co, mask=valid, other=-1), valid, E)
    # the row's load goes first: it needs the token's own ids only (nothing read past M)
    cols, h_live = _chunk_cols(e, c, H, BLOCK_H)
    v = tl.load(x_ptr + t.to(tl.int64) * stride_xm + cols * stride_xh, mask=cols < h_live,
                eviction_policy=LOAD_POLICY)  # fmt: skip
    pos = tl.arange(0, N_PAD)
    ro_a, co_a, valid_a = _id_offsets(pos // K_PAD, pos % K_PAD, M, K, stride_it, stride_ik)
    ea, bad = _classify(tl.load(ids_ptr + ro_a + co_a, mask=valid_a, other=-1), valid_a, E)
    binned = tl.where(ea >= 0, ea, E)  # bin E: -1, invalid ids and padding (ignored)
    bins = tl.arange(0, NUM_BINS)
    tot = tl.where(bins < E, tl.histogram(binned, NUM_BINS), 0)
    tot, aligned, start = _aligned_from(tot, ALIGN)
    if t >= M:
        q = pid - M * CHUNKS
        if q <= E:
            _fill_from(q, tot, aligned, start, m_idx_ptr, offsets_ptr, offsets_ptr, E, M_SUM,
                       NUM_BINS, BLOCK_ROWS, 1, False)  # fmt: skip
        if q == 0:
            n_bad = tl.sum(bad.to(tl.int32), axis=0)
            tl.store(ok_ptr + bins, n_bad + bins * 0 == 0, mask=bins < 1)
            if ASSERT:
                tl.device_assert(n_bad == 0, "permute: topk_ids expected ids in [0, E) or -1")
    else:
        before = tl.histogram(tl.where(pos < t * K_PAD, binned, E), NUM_BINS)
        live = e >= 0
        ei = tl.where(live, e, 0)
        same = (e[None, :] == e[:, None]) & (kk[None, :] < kk[:, None])
        rank = tl.sum(same.to(tl.int32), axis=1)
        rows = tl.gather(start, ei, axis=0) + tl.gather(before, ei, axis=0) + rank
        rows = tl.where(live, rows, -1)
        t64 = t.to(tl.int64)
        if c == 0:
            tl.store(inv_ptr + t64 * K + kk, rows, mask=kk < K)
        _store_rows(out_ptr, rows, v, cols, H, K, K_PAD, STORE_CACHE)
        if HAS_SCALES:  # SPC scales of the row per column chunk, to each of its rows
            so = c * SPC + tl.arange(0, BLOCK_S)
            s_hi = tl.where(h_live > 0, tl.minimum(c * SPC + SPC, S), 0)
            sv = tl.load(xs_ptr + t64 * stride_sm + so * stride_ss, mask=so < s_hi)
            for k in tl.static_range(K):
                r = tl.sum(tl.where(kk == k, rows, 0), axis=0)
                dst = outs_ptr + r.to(tl.int64) * stride_om + so * stride_os
                tl.store(dst, sv, mask=so < tl.where(r >= 0, s_hi, 0), eviction_policy=SCALE_POLICY)


# ----------------------------------------------------------------------------- host-side launch
def _at_least(n, lo: int) -> bool:
    """n >= lo. A symbolic n (torch.compile) is guarded on when backed; an unbacked one (exact-size
    HT dispatch) gives False instead of a data-dependent error (either answer is correct)."""
    if isinstance(n, int):
        return n >= lo
    return torch.fx.experimental.symbolic_shapes.guard_or_false(n >= lo)


def _at_most(n, hi: int) -> bool:
    """n <= hi, like _at_least (an unbacked n gives False)."""
    if isinstance(n, int):
        return n <= hi
    return torch.fx.experimental.symbolic_shapes.guard_or_false(n <= hi)


def _by_row(S: int, scale_layout: str, n, cfg: PermuteConfig) -> bool:
    """DeepGEMM-layout scales go per destination row block from cfg.scales_by_row_min_entries
    entries (an unbacked n under torch.compile takes the per-token path: see _at_least)."""
    return S > 0 and scale_layout == "deepgemm" and _at_least(n, cfg.scales_by_row_min_entries)


def _aligned16(t: torch.Tensor) -> bool:
    """t's rows start on 16-byte boundaries and are dense."""
    size = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0


def _launch_rest(x, x_scales, topk_ids, inv_perm, src, x_out, s_out, E: int, block_h: int,
                 n_rest: int, scales: bool, pdl: dict, cfg: PermuteConfig) -> None:  # fmt: skip
    """Launches _rest_scales_kernel: column chunks 1..n_rest of every token's row (block_h
    columns each) to its rows in inv_perm, and with ``scales`` the row-block scale copy from the
    rows' source tokens src, its programs spread among the chunk copies (so that the
    latency-bound gathers overlap payload traffic). (Also used alone, its inputs given, by
    scripts/stage_sweep.py.)"""
    M, K = topk_ids.shape
    H = x.shape[1]
    m_sum, S = s_out.shape
    block_s = triton.next_power_of_2(S)
    block_r = max(1, cfg.scale_tile // block_s)
    n_scale = triton.cdiv(m_sum, block_r) if scales else 0
    stride = (M * n_rest + n_scale) // n_scale if n_scale else 1
    _q._kernel(_rest_scales_kernel)[(M * n_rest + n_scale,)](
        x_scales, src, s_out, x, topk_ids, inv_perm, x_out,
        S, m_sum, M, H, E, max(n_rest, 1), n_scale, stride,
        x_scales.stride(0), x_scales.stride(1), s_out.stride(0), s_out.stride(1),
        topk_ids.stride(0), topk_ids.stride(1), x.stride(0), x.stride(1),
        K=K, BLOCK_R=block_r, BLOCK_S=block_s, K_PAD=triton.next_power_of_2(K), BLOCK_H=block_h,
        LOAD_POLICY=cfg.load_policy, STORE_CACHE=cfg.store_cache, num_warps=4, **pdl,
        **_scale_vec(x_scales, s_out),
        **_rest_prefetch(x, pdl.get("PDL", False), block_h, cfg),
    )  # fmt: skip


def _rest_prefetch(x, on: bool, block_h: int, cfg: PermuteConfig) -> dict:
    """The second kernel's L2-prefetch constexprs (cfg.pf_rest_*; as the copy kernel's): on for
    direct launches with PDL (sm90) and 16-byte aligned rows."""
    waves = cfg.pf_rest_waves if on and _pf_ok(x, block_h) else 0
    return dict(PF_WAVES=waves, PF_DIST=_pf_dist(x, cfg.pf_rest_per_sm, waves))


def _scale_vec(x_scales: torch.Tensor, s_out: torch.Tensor) -> dict:
    """The row-block scale copy's VEC / S_C constexprs (see _rest_scales_kernel): 16-byte
    accesses for dense 16-byte aligned scale rows (not under torch.compile, whose fake tensors
    have no address)."""
    on = (
        not _checks._tracing(x_scales)
        and _aligned16(x_scales)
        and s_out.stride(0) == 1
        and s_out.stride(1) % 4 == 0
        and s_out.data_ptr() % 16 == 0
    )
    return dict(VEC=bool(on), S_C=x_scales.shape[1] if on else 0)


def _pf_ok(x, block_h: int) -> bool:
    """The bulk prefetch can take x's column chunks of block_h (16-byte aligned, multiples of
    16 bytes)."""
    size = x.element_size()
    return _aligned16(x) and (x.shape[1] * size) % 16 == 0 and (block_h * size) % 16 == 0


def _scales_ok(x_scales) -> bool:
    """The bulk prefetch can take x_scales' rows (16-byte aligned, multiples of 16 bytes)."""
    return _aligned16(x_scales) and (x_scales.shape[1] * 4) % 16 == 0


def _prefetch_meta(x, x_scales, on: bool, by_row: bool, block_h: int, cfg: PermuteConfig) -> dict:
    """The copy kernel's L2-prefetch constexprs: all off unless ``on`` (a direct launch with PDL,
    so sm90) and the bulk prefetch can take the pieces (16-byte aligned, multiples of 16)."""
    # (``on`` first: under torch.compile the tensors are fake and have no address)
    waves = cfg.pf_waves if on and _pf_ok(x, block_h) else 0
    scales_ok = on and x_scales is not None and _scales_ok(x_scales)
    return dict(
        PF_SCALES=bool(on and scales_ok and by_row),  # (each token's scales, for the 2nd kernel)
        PF_WAVES=waves,
        PF_DIST=_pf_dist(x, cfg.pf_per_sm, waves),
    )


def _pf_dist(x, per_sm: int, waves: int) -> int:
    """PF_DIST: per_sm programs per multiprocessor of x's device (1, unused, without waves)."""
    return max(1, per_sm * _sm_count(x.get_device())) if waves else 1


@functools.cache
def _sm_count(index: int) -> int:
    """Multiprocessors of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@_eager.on_input_device
def _permute_triton(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int,
    x_scales: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
    config: Optional[PermuteConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """permute on CUDA (or CPU tensors under TRITON_INTERPRET=1); returns the op's 5 tensors.

    Rows of x / x_scales that no (t, k) maps to (alignment padding, the unused tail) are left
    unwritten. Invalid ids are dropped by the kernels and reported through _checks.check_values.
    ``config``: the launch parameters (default: CONFIG).
    """
    cfg = CONFIG if config is None else config
    M, K = topk_ids.shape
    H = x.shape[1]
    E, A = num_experts, alignment
    dev = x.device
    m_sum = reference.permuted_rows(M, K, E, A)
    S = x_scales.shape[1] if x_scales is not None else 0
    k_pad = triton.next_power_of_2(K)
    tb = max(1, cfg.block_n // k_pad)  # whole tokens per block
    nb = triton.cdiv(M, tb)

    x_out = torch.empty((m_sum, H), dtype=x.dtype, device=dev)
    s_out = _q.alloc_scales((m_sum,), S, scale_layout, dev)
    m_indices = torch.empty((m_sum,), dtype=torch.int32, device=dev)
    inv_perm = torch.empty((M, K), dtype=torch.int32, device=dev)
    offsets = torch.empty((E + 1,), dtype=torch.int32, device=dev)
    ok = torch.empty((), dtype=torch.bool, device=dev)
    by_row = _by_row(S, scale_layout, M * K, cfg)
    block_h = min(triton.next_power_of_2(max(H, 1)), max(16, cfg.copy_bytes // x.element_size()))
    xs = x_scales if x_scales is not None else x
    ssm, sss = x_scales.stride() if x_scales is not None else (0, 0)
    chunks = max(triton.cdiv(H, block_h), 1)  # (H = 0: one chunk still writes inv_perm)
    spc = triton.cdiv(S, chunks)  # scales per column chunk
    sit, sik = topk_ids.stride()
    direct = _checks.direct_launch(x)
    if not by_row and _at_most(M * k_pad, cfg.small_entries):
        in_kernel = _checks.assert_in_kernel(direct)
        block_h = min(
            triton.next_power_of_2(max(H, 1)), max(16, cfg.small_copy_bytes // x.element_size())
        )
        chunks = max(triton.cdiv(H, block_h), 1)
        spc = triton.cdiv(S, chunks)
        _q._kernel(_small_permute_kernel)[(M * chunks + E + 1,)](
            x, xs, topk_ids, inv_perm, x_out, s_out, m_indices, offsets, ok,
            M, H, S, spc, E, A, m_sum, chunks,
            sit, sik, x.stride(0), x.stride(1), ssm, sss, s_out.stride(0), s_out.stride(1),
            K=K, K_PAD=k_pad, N_PAD=triton.next_power_of_2(max(cfg.small_entries, 1)),
            NUM_BINS=triton.next_power_of_2(E + 1), BLOCK_H=block_h,
            BLOCK_S=triton.next_power_of_2(max(spc, 1)), HAS_SCALES=S > 0,
            BLOCK_ROWS=cfg.block_rows, LOAD_POLICY=cfg.load_policy, STORE_CACHE=cfg.store_cache,
            SCALE_POLICY=cfg.scale_policy, ASSERT=in_kernel, num_warps=cfg.small_warps,
            **_checks.assert_build(in_kernel),
        )  # fmt: skip
        if not in_kernel:
            _checks.check_values(ok, OP, "topk_ids", f"ids in [0, {E}) or -1")
        return x_out, s_out, m_indices, inv_perm, offsets
    # counts[e, b]: entries of expert e in block b, then those in blocks < b; bad[b]: invalid ids
    # of block b; totals[e]. sym_max, and no `if` on sizes below: M may be an unbacked size
    # (exact-size HT dispatch under torch.compile); a launch with an empty grid is a no-op
    nb1 = torch.sym_max(nb, 1)
    counts = torch.empty((E, nb1), dtype=torch.int32, device=dev)
    bad = torch.empty((nb1,), dtype=torch.int32, device=dev)
    totals = torch.empty((E,), dtype=torch.int32, device=dev)
    # source token of each row (-1: none) for the row-block scale copy; when unused a placeholder
    # the kernels never touch (not an alias of a buffer a kernel writes: torch.compile's
    # functionalization would see a mutated alias)
    src = torch.empty((m_sum,), dtype=torch.int32, device=dev) if by_row else bad

    # PDL: the kernels after the first are launched with launch_pdl, only by direct launches (the
    # interpreter and wrap_triton's higher-order op see neither the option nor gdc_wait). The
    # first one is launched in stream order: it may not start before the work ahead of permute
    # (the producer of x and topk_ids, the last user of the memory it is given) is done
    use_pdl = direct
    pdl = dict(PDL=True, launch_pdl=True) if use_pdl else dict(PDL=False)
    _q._kernel(_count_tokens_kernel)[(nb,)](
        topk_ids, counts, bad, M, K, sit, sik, E, nb,
        TB=tb, K_PAD=k_pad, NUM_BINS=triton.next_power_of_2(E + 1), PDL=use_pdl, num_warps=4,
    )  # fmt: skip
    # the id check: asserted by the scan kernel itself on direct CUDA launches (else below)
    in_kernel = _checks.assert_in_kernel(direct)
    _q._kernel(_scan_kernel)[(E + 1,)](
        counts, bad, totals, ok, E, nb, BLOCK=cfg.block_scan, ASSERT=in_kernel, num_warps=4,
        **pdl, **_checks.assert_build(in_kernel),
    )  # fmt: skip
    # with row-block scales split off the column chunks past the first to the scale kernel
    chunks_a = 1 if by_row else chunks
    fills = triton.cdiv((E + 1) * cfg.fill_split, chunks_a)  # fill programs' rows after tokens'
    _q._kernel(_place_copy_kernel)[((M + fills) * chunks_a,)](
        x, xs, topk_ids, counts, totals, inv_perm, src, x_out, s_out, m_indices, offsets,
        M, H, S, spc, E, nb, A, m_sum, chunks_a,
        sit, sik, x.stride(0), x.stride(1), ssm, sss, s_out.stride(0), s_out.stride(1),
        K=K, K_PAD=k_pad, TB=tb, BLOCK_H=block_h, BLOCK_S=triton.next_power_of_2(max(spc, 1)),
        HAS_SCALES=S > 0 and not by_row, WRITE_SRC=by_row, E_PAD=triton.next_power_of_2(E),
        BLOCK_ROWS=cfg.block_rows, SPLIT=cfg.fill_split, LOAD_POLICY=cfg.load_policy,
        STORE_CACHE=cfg.store_cache, SCALE_POLICY=cfg.scale_policy, num_warps=cfg.copy_warps,
        **pdl, **_prefetch_meta(x, x_scales, use_pdl, by_row, block_h, cfg),
    )  # fmt: skip
    if by_row:
        _launch_rest(x, x_scales, topk_ids, inv_perm, src, x_out, s_out, E, block_h,
                     chunks - chunks_a, True, pdl, cfg)  # fmt: skip
    if not in_kernel:
        _checks.check_values(ok, OP, "topk_ids", f"ids in [0, {E}) or -1")
    return x_out, s_out, m_indices, inv_perm, offsets


# ------------------------------------------------------------------------------------------ op
def _valid(x, topk_ids, num_experts, alignment, x_scales, scale_layout) -> bool:
    """The common all-good case (CUDA tensors) in one expression: every eager call pays for
    validation, and each tensor attribute read costs host time, so devices are compared as ints
    (get_device) and dtypes by identity. Any False falls through to the checks below,
    which say what is wrong."""
    try:
        xs, ids = x.shape, topk_ids.shape
        dev = x.get_device()
        return (
            type(x) is torch.Tensor  # (plain tensors without grad: see _eager.calm)
            and type(topk_ids) is torch.Tensor
            and not x.requires_grad
            and type(num_experts) is int
            and num_experts > 0
            and type(alignment) is int
            and alignment > 0
            and scale_layout in _q.SCALE_LAYOUTS
            and x.is_cuda
            and len(xs) == 2
            and len(ids) == 2
            and ids[0] == xs[0]
            and topk_ids.dtype in _checks.INDEX_DTYPES
            and topk_ids.get_device() == dev
            and (
                x_scales is None
                or (
                    type(x_scales) is torch.Tensor
                    and not x_scales.requires_grad
                    and x_scales.dtype is torch.float32
                    and x_scales.dim() == 2
                    and x_scales.shape[0] == xs[0]
                    and x_scales.get_device() == dev
                )
            )
        )
    except (AttributeError, TypeError, IndexError):
        return False


def _validate(x, topk_ids, num_experts, alignment, x_scales, scale_layout="row") -> None:
    if _valid(x, topk_ids, num_experts, alignment, x_scales, scale_layout):
        return
    _checks.check_ndim(OP, "x", x, (2,))
    _checks.check_choice(OP, "scale_layout", scale_layout, _q.SCALE_LAYOUTS)
    _checks.check_dtype(OP, "topk_ids", topk_ids, _checks.INDEX_DTYPES)
    _checks.check_shape(OP, "topk_ids", topk_ids, (x.shape[0], None))
    _checks.check_device(OP, "topk_ids", topk_ids, x)
    _checks.check_positive_int(OP, "num_experts", num_experts)
    _checks.check_positive_int(OP, "alignment", alignment)
    if x_scales is not None:
        _checks.check_dtype(OP, "x_scales", x_scales, (torch.float32,))
        _checks.check_shape(OP, "x_scales", x_scales, (x.shape[0], None))
        _checks.check_device(OP, "x_scales", x_scales, x)


def _permute_impl(x, topk_ids, num_experts, alignment, x_scales=None, scale_layout="row"):
    _validate(x, topk_ids, num_experts, alignment, x_scales, scale_layout)
    if x.is_cuda:
        return _permute_triton(x, topk_ids, num_experts, alignment, x_scales, scale_layout)
    return _reference(x, topk_ids, num_experts, alignment, x_scales, scale_layout)


@triton_op("epmoe::permute", mutates_args=())
def _permute_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int,
    x_scales: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _permute_impl(x, topk_ids, num_experts, alignment, x_scales, scale_layout)


# CPU kernel: the same function, which takes its reference branch for CPU tensors
_permute_op.register_kernel("cpu")(_permute_impl)
_library.cpu_opaque(_permute_op)  # compiled CPU graphs call it: the same bytes as eager


def _reference(x, topk_ids, num_experts, alignment, x_scales, scale_layout):
    xp, sp, m_indices, inv_perm, offsets = reference.permute(
        x, topk_ids, num_experts, alignment, x_scales
    )
    return xp, _q.as_layout(sp, scale_layout), m_indices, inv_perm, offsets


def permute(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int = 128,
    x_scales: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
) -> PermuteResult:
    """Permute received rows into the contiguous grouped-GEMM layout (see module docstring).

    Args:
        x: bf16/fp8/int8 `[M, H]`. topk_ids: int32/int64 `[M, K]` local ids or -1.
        num_experts: E, local experts. alignment: A, row block of the grouped GEMM.
        x_scales: float32 `[M, S]` or None.
        scale_layout: layout of the permuted scales: "row" (contiguous) or "deepgemm" (MN-major,
            TMA-aligned, what deep_gemm's fp8 GEMM reads without a transpose).
    Returns:
        PermuteResult(x `[M_sum, H]`, x_scales `[M_sum, S]` | None, m_indices int32 `[M_sum]`,
        inv_perm int32 `[M, K]`, expert_offsets int32 `[E + 1]`).
    """
    args = (x, topk_ids, num_experts, alignment, x_scales, scale_layout)
    if _eager.calm() and _valid(*args):  # the usual eager call, validated in one pass
        xp, sp, m_indices, inv_perm, offsets = _eager.run(_permute_triton, *args)
    elif _eager.direct(x, topk_ids, x_scales):  # (the full checks say what is wrong)
        xp, sp, m_indices, inv_perm, offsets = _eager.run(_permute_impl, *args)
    else:
        # the schema would reject a non-int before our message could say what was expected
        _checks.check_positive_int(OP, "num_experts", num_experts)
        _checks.check_positive_int(OP, "alignment", alignment)
        xp, sp, m_indices, inv_perm, offsets = _permute_op(*args)
    return PermuteResult(xp, sp if x_scales is not None else None, m_indices, inv_perm, offsets)
