"""Triton kernels of the activation stage (:mod:`epmoe.ops.activation` launches them).

Shape legend as in :mod:`epmoe.ops.activation`: a kernel sees y as `[E, T, W]` (2-D y is E = 1),
W = 2I (gate columns, then up) for a GLU gate, I without; the bias as `[E_b, W]` rows.
"""

import triton
import triton.language as tl

# jit helpers by name: Inductor copies the source of @triton.jit callees it finds in a kernel's
# globals (a module attribute such as ``_q._quant_int8`` would not be found)
from epmoe._launch import pdl
from epmoe.gate import gate_h
from epmoe.ops.quantize import _fp8_tile, _int8_scale, _quant_fp8_groups, _quant_int8, round_float


# --------------------------------------------------------------------------------- jit helpers
@triton.jit
def _row_blocks(slot, rows, NUM_SLOTS, BLOCK_M: tl.constexpr):
    """A program's row blocks: slot, slot + NUM_SLOTS, ... Returns (its first row, the rows of
    its first block `[BLOCK_M]`, the step between its blocks, the m_indices ids of a kernel
    without m_indices: 0 `[BLOCK_M]`)."""
    step = NUM_SLOTS * BLOCK_M
    ids = tl.zeros(rows.shape, dtype=tl.int32)
    start = slot * BLOCK_M
    return start, start + rows, step, ids


@triton.jit
def _live_rows(t, ids, bound, step):
    """Rows t of this loop step: (t as int64, live mask: below bound, m_indices ids not -1, rows
    of the next step)."""
    live = (t < bound) & (ids >= 0)
    return t.to(tl.int64), live, t + step


@triton.jit
def _row_experts(ids, e64):
    """The experts whose bias rows these rows add, int64: m_indices ids for a 2-D y (whose e is
    0), e for a 3-D y (ids 0). Taken before the ids of the next step are loaded over them."""
    return ids.to(tl.int64) + e64


@triton.jit
def _up_cols(c, I, GLU: tl.constexpr):
    """Columns of the up values of outputs c: after the I gate columns, or the columns themselves
    (no gate half)."""
    return c + I if GLU else c


@triton.jit
def _gate_rounded(g, u, bg, bu, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr,
                  LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr,
                  GLU: tl.constexpr, GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr,
                  FAST: tl.constexpr):  # fmt: skip
    """The gate's h (epmoe.gate.gate_h) of loaded gate / up values (g None without GLU) plus
    their loaded bias (HAS_BIAS, added in float32), rounded to y's dtype, as float32."""
    gf = g.to(tl.float32) if GLU else None
    uf = u.to(tl.float32)
    if HAS_BIAS:
        uf = uf + bu.to(tl.float32)
        if GLU:
            gf = gf + bg.to(tl.float32)
    h = gate_h(gf, uf, ACT, ALPHA, LIMIT, CLAMP_AFTER, UP_OFFSET, GLU, GATE_SOFTCAP, UP_SOFTCAP,
               FAST)  # fmt: skip
    return round_float(h, u.dtype).to(tl.float32)


# -------------------------------------------------------------------------------------- kernels
# Grid (slots, E, column chunks), as in epmoe.ops.quantize: a program handles BLOCK_M rows at a
# time, row blocks slot, slot + NUM_SLOTS, ... below the expert's bound (masked_m), skipping rows
# that m_indices marks as padding (their loads and stores are masked off: no memory traffic).
# Every load of a pointer argument sits in the kernel body: torch.compile reads a pointer passed
# to a jit helper whose result feeds a store as written (and clones it).
# m_indices of a row block are loaded one loop step ahead of their use, so their latency overlaps
# the current rows' loads (0 without m_indices).
# The gate (ACT ... GLU: epmoe.gate.Gate.meta) is constexpr: the plain SiLU-GLU compiles to the
# code it had before gates existed; without GLU no gate half is loaded; HAS_BIAS adds the bias row
# of each row's expert (m_indices for 2-D y, e for 3-D) before the gate.


@triton.jit
def _silu_mul_kernel(
    # tensors
    y_ptr, h_ptr, mm_ptr, mi_ptr, b_ptr,
    # sizes
    T, I, NUM_SLOTS,
    # strides (elements)
    stride_ye, stride_yt, stride_yh, stride_he, stride_ht, stride_be, stride_bw,
    # meta
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ROWS: tl.constexpr,
    STAGES: tl.constexpr, FAST: tl.constexpr, HAS_BIAS: tl.constexpr,
    # the gate
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr,
    UP_OFFSET: tl.constexpr, GLU: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
    UP_SOFTCAP: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl(PDL)
    slot = tl.program_id(0)
    e = tl.program_id(1)
    cols = (tl.program_id(2) * BLOCK + tl.arange(0, BLOCK))[None, :]
    bound = T  # rows of expert e: min(masked_m[e], T), or T
    if HAS_MASK:
        bound = tl.minimum(tl.load(mm_ptr + e).to(tl.int32), T)
    e64 = e.to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    start, first, step, ids = _row_blocks(slot, rows, NUM_SLOTS, BLOCK_M)
    if HAS_ROWS:
        ids = tl.load(mi_ptr + first, mask=first < bound, other=-1)
    for t0 in tl.range(start, bound, step, num_stages=STAGES):
        t64, live, nxt = _live_rows(t0 + rows, ids, bound, step)
        if HAS_BIAS:
            b_rows = (b_ptr + _row_experts(ids, e64) * stride_be)[:, None]
        if HAS_ROWS:  # the next step's m_indices
            ids = tl.load(mi_ptr + nxt, mask=nxt < bound, other=-1)
        m = live[:, None] & (cols < I)
        y_rows = (y_ptr + e64 * stride_ye + t64 * stride_yt)[:, None]
        up = _up_cols(cols, I, GLU)
        g = tl.load(y_rows + cols * stride_yh, mask=m, other=0.0) if GLU else None
        u = tl.load(y_rows + up * stride_yh, mask=m, other=0.0)
        bg, bu = None, None
        if HAS_BIAS:
            bg = tl.load(b_rows + cols * stride_bw, mask=m, other=0.0) if GLU else None
            bu = tl.load(b_rows + up * stride_bw, mask=m, other=0.0)
        h = _gate_rounded(g, u, bg, bu, HAS_BIAS, ACT, ALPHA, LIMIT, CLAMP_AFTER, UP_OFFSET, GLU,
                          GATE_SOFTCAP, UP_SOFTCAP, FAST)  # fmt: skip
        tl.store(h_ptr + e64 * stride_he + (t64 * stride_ht)[:, None] + cols, h, mask=m)


@triton.jit
def _silu_mul_fp8_kernel(
    # tensors
    y_ptr, q_ptr, s_ptr, mm_ptr, mi_ptr, b_ptr,
    # sizes
    T, I, NUM_GROUPS, NUM_SLOTS,
    # strides (elements)
    stride_ye, stride_yt, stride_yh, stride_qe, stride_qt,
    stride_se, stride_st, stride_sg, stride_be, stride_bw,
    # meta
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ROWS: tl.constexpr, STAGES: tl.constexpr,
    FAST: tl.constexpr, HAS_BIAS: tl.constexpr,
    # the gate
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr,
    UP_OFFSET: tl.constexpr, GLU: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
    UP_SOFTCAP: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl(PDL)
    slot = tl.program_id(0)
    e = tl.program_id(1)
    rows, groups, inner, cols = _fp8_tile(GROUP, BLOCK_G, GROUPS_PER_PROG, BLOCK_M)
    gmask = groups < NUM_GROUPS
    bound = T  # rows of expert e: min(masked_m[e], T), or T
    if HAS_MASK:
        bound = tl.minimum(tl.load(mm_ptr + e).to(tl.int32), T)
    e64 = e.to(tl.int64)
    up = _up_cols(cols, I, GLU)
    start, first, step, ids = _row_blocks(slot, rows, NUM_SLOTS, BLOCK_M)
    if HAS_ROWS:
        ids = tl.load(mi_ptr + first, mask=first < bound, other=-1)
    for t0 in tl.range(start, bound, step, num_stages=STAGES):
        t64, live, nxt = _live_rows(t0 + rows, ids, bound, step)
        if HAS_BIAS:
            b_rows = (b_ptr + _row_experts(ids, e64) * stride_be)[:, None]
        if HAS_ROWS:  # the next step's m_indices
            ids = tl.load(mi_ptr + nxt, mask=nxt < bound, other=-1)
        live = live & gmask
        m = live[:, None] & (inner[None, :] < GROUP)
        y_rows = (y_ptr + e64 * stride_ye + t64 * stride_yt)[:, None]
        g = tl.load(y_rows + cols * stride_yh, mask=m, other=0.0) if GLU else None
        u = tl.load(y_rows + up * stride_yh, mask=m, other=0.0)
        bg, bu = None, None
        if HAS_BIAS:
            bg = tl.load(b_rows + cols * stride_bw, mask=m, other=0.0) if GLU else None
            bu = tl.load(b_rows + up * stride_bw, mask=m, other=0.0)
        h = _gate_rounded(g, u, bg, bu, HAS_BIAS, ACT, ALPHA, LIMIT, CLAMP_AFTER, UP_OFFSET, GLU,
                          GATE_SOFTCAP, UP_SOFTCAP, FAST)  # fmt: skip
        q, s = _quant_fp8_groups(h)
        tl.store(q_ptr + e64 * stride_qe + (t64 * stride_qt)[:, None] + cols, q, mask=m)
        tl.store(s_ptr + e64 * stride_se + t64 * stride_st + groups * stride_sg, s, mask=live)


@triton.jit
def _silu_mul_int8_kernel(
    # tensors
    y_ptr, q_ptr, s_ptr, mm_ptr, mi_ptr, b_ptr,
    # sizes
    T, I, NUM_SLOTS,
    # strides (elements)
    stride_ye, stride_yt, stride_yh, stride_qe, stride_qt, stride_se, stride_st,
    stride_be, stride_bw,
    # meta
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, SINGLE_PASS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_ROWS: tl.constexpr, STAGES: tl.constexpr,
    FAST: tl.constexpr, HAS_BIAS: tl.constexpr,
    # the gate
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr,
    UP_OFFSET: tl.constexpr, GLU: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
    UP_SOFTCAP: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl(PDL)
    slot = tl.program_id(0)
    e = tl.program_id(1)
    offs = tl.arange(0, BLOCK)[None, :]
    bound = T  # rows of expert e: min(masked_m[e], T), or T
    if HAS_MASK:
        bound = tl.minimum(tl.load(mm_ptr + e).to(tl.int32), T)
    e64 = e.to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    start, first, step, ids = _row_blocks(slot, rows, NUM_SLOTS, BLOCK_M)
    if HAS_ROWS:
        ids = tl.load(mi_ptr + first, mask=first < bound, other=-1)
    for t0 in tl.range(start, bound, step, num_stages=STAGES):
        t64, live, nxt = _live_rows(t0 + rows, ids, bound, step)
        if HAS_BIAS:
            b_rows = (b_ptr + _row_experts(ids, e64) * stride_be)[:, None]
        if HAS_ROWS:  # the next step's m_indices
            ids = tl.load(mi_ptr + nxt, mask=nxt < bound, other=-1)
        y_rows = (y_ptr + e64 * stride_ye + t64 * stride_yt)[:, None]
        q_rows = (q_ptr + e64 * stride_qe + t64 * stride_qt)[:, None]
        if SINGLE_PASS:
            m = live[:, None] & (offs < I)
            up = _up_cols(offs, I, GLU)
            g = tl.load(y_rows + offs * stride_yh, mask=m, other=0.0) if GLU else None
            u = tl.load(y_rows + up * stride_yh, mask=m, other=0.0)
            bg, bu = None, None
            if HAS_BIAS:
                bg = tl.load(b_rows + offs * stride_bw, mask=m, other=0.0) if GLU else None
                bu = tl.load(b_rows + up * stride_bw, mask=m, other=0.0)
            h = _gate_rounded(g, u, bg, bu, HAS_BIAS, ACT, ALPHA, LIMIT, CLAMP_AFTER, UP_OFFSET,
                              GLU, GATE_SOFTCAP, UP_SOFTCAP, FAST)  # fmt: skip
            s = _int8_scale(tl.max(tl.abs(h), axis=1))
            tl.store(q_rows + offs, _quant_int8(h, s), mask=m)
        else:
            amax = tl.zeros([BLOCK_M, BLOCK], dtype=tl.float32)
            for p in tl.static_range(2):  # the row's amax, then its codes (h computed twice)
                for c0 in range(0, I, BLOCK):
                    m = live[:, None] & (c0 + offs < I)
                    c = c0 + offs
                    up = _up_cols(c, I, GLU)
                    g = tl.load(y_rows + c * stride_yh, mask=m, other=0.0) if GLU else None
                    u = tl.load(y_rows + up * stride_yh, mask=m, other=0.0)
                    bg, bu = None, None
                    if HAS_BIAS:
                        bg = tl.load(b_rows + c * stride_bw, mask=m, other=0.0) if GLU else None
                        bu = tl.load(b_rows + up * stride_bw, mask=m, other=0.0)
                    h = _gate_rounded(g, u, bg, bu, HAS_BIAS, ACT, ALPHA, LIMIT, CLAMP_AFTER,
                                      UP_OFFSET, GLU, GATE_SOFTCAP, UP_SOFTCAP, FAST)  # fmt: skip
                    if p == 0:
                        amax = tl.maximum(amax, tl.abs(h))
                    else:
                        tl.store(q_rows + c0 + offs, _quant_int8(h, s), mask=m)
                if p == 0:
                    s = _int8_scale(tl.max(amax, axis=1))
        tl.store(s_ptr + e64 * stride_se + t64 * stride_st, s, mask=live)
