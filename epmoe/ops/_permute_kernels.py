"""Triton kernels of the permute stage: epmoe.ops.permute holds the op, its launch config and
the host-side launches."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from epmoe.kernels.ids import _id_offsets  # by name: Inductor copies @triton.jit callees

# Deterministic placement: the tokens are cut into blocks of TB whole tokens (TB * K entries);
# row(t, k) = start[e] + (entries of e in earlier blocks) + (entries of e earlier in this block).
# Kernel 1 counts per (expert, block), and the invalid ids per block. Kernel 2 turns each
# expert's counts into an exclusive prefix over blocks and writes its total (one more program
# adds up the invalid ids into the check's flag). Kernel 3 copies each token's row to its K
# destinations, computing them on the way (aligned starts from the totals, plus the block's
# prefix, plus the rank among the same expert's entries earlier in the block); its first column
# chunk also writes inv_perm and each used row's source token. Its programs past the tokens fill
# m_indices, expert_offsets and -1 as the source of every row no entry lands in. With
# DeepGEMM-layout scales, kernel 3 copies only the first column chunk and kernel 4 the other
# chunks plus the scales, per destination row block.
# No atomics and no zero fill: every word is written by exactly one program.
# Every load of a pointer argument sits in a kernel body: torch.compile reads a pointer passed to
# a jit helper whose result feeds a store as written (and clones it). The helpers take offsets,
# masks and loaded values.


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
    Program E: ok <- no invalid id in any block; with ASSERT (a debug=True build) it asserts that
    instead (this small kernel, not the copy, carries the assert's registers)."""
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
        if ASSERT:  # (ok is then a placeholder, never written)
            n_bad = tl.max(acc, axis=0)
            tl.device_assert(n_bad == 0, "permute: topk_ids expected ids in [0, E) or -1")
        else:
            tl.store(ok_ptr + lane, acc == 0, mask=lane < 1)


@triton.jit
def _fill_from(
    q, tot, aligned, start, m_idx_ptr, offsets_ptr, src_ptr, E, M_SUM,
    E_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, SPLIT: tl.constexpr,
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
        # src of the rows no entry lands in (the copy programs write the others)
        tl.store(src_ptr + r, tl.full([BLOCK_ROWS], -1, tl.int32), mask=(r >= live_end) & (r < hi))


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
    BLOCK_S: tl.constexpr, HAS_SCALES: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, SPLIT: tl.constexpr,
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
                       BLOCK_ROWS, SPLIT)  # fmt: skip
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
            tl.store(src_ptr + rows, t + kk * 0, mask=rows >= 0)  # (each used row's source)
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
    x_ptr, xs_ptr, ids_ptr, inv_ptr, out_ptr, outs_ptr, m_idx_ptr, offsets_ptr, src_ptr, ok_ptr,
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
    entries in earlier tokens, plus those earlier in the token; chunk 0 also writes inv_perm and
    the rows' source.
    Programs past M * CHUNKS: one expert's block of m_indices each (E: the unused tail); the
    first also writes expert_offsets and the id check's flag, or with ASSERT (a launch with
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
            _fill_from(q, tot, aligned, start, m_idx_ptr, offsets_ptr, src_ptr, E, M_SUM,
                       NUM_BINS, BLOCK_ROWS, 1)  # fmt: skip
        if q == 0:
            n_bad = tl.sum(bad.to(tl.int32), axis=0)
            if ASSERT:  # (ok is then a placeholder, never written)
                tl.device_assert(n_bad == 0, "permute: topk_ids expected ids in [0, E) or -1")
            else:
                tl.store(ok_ptr + bins, n_bad + bins * 0 == 0, mask=bins < 1)
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
            tl.store(src_ptr + rows, t + kk * 0, mask=rows >= 0)
        _store_rows(out_ptr, rows, v, cols, H, K, K_PAD, STORE_CACHE)
        if HAS_SCALES:  # SPC scales of the row per column chunk, to each of its rows
            so = c * SPC + tl.arange(0, BLOCK_S)
            s_hi = tl.where(h_live > 0, tl.minimum(c * SPC + SPC, S), 0)
            sv = tl.load(xs_ptr + t64 * stride_sm + so * stride_ss, mask=so < s_hi)
            for k in tl.static_range(K):
                r = tl.sum(tl.where(kk == k, rows, 0), axis=0)
                dst = outs_ptr + r.to(tl.int64) * stride_om + so * stride_os
                tl.store(dst, sv, mask=so < tl.where(r >= 0, s_hi, 0), eviction_policy=SCALE_POLICY)
