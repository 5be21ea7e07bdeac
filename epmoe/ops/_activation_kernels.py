"""Triton kernels of the SiLU-and-mul stage (:mod:`epmoe.ops.activation` launches them).

Shape legend as in :mod:`epmoe.ops.activation`: a kernel sees y as `[E, T, 2I]` (2-D y is E = 1),
gate columns first.
"""

import triton
import triton.language as tl

# jit helpers by name: Inductor copies the source of @triton.jit callees it finds in a kernel's
# globals (a module attribute such as ``_q._quant_int8`` would not be found)
from epmoe.ops.quantize import _fp8_tile, _int8_scale, _quant_fp8_groups, _quant_int8, round_float

_NEG_LOG2E = tl.constexpr(-1.4426950408889634)


# --------------------------------------------------------------------------------- jit helpers
@triton.jit
def _approx(x, OP: tl.constexpr):
    """One MUFU instruction per element (PTX ``OP``.approx.ftz.f32: ex2 or rcp)."""
    return tl.inline_asm_elementwise(
        OP + ".approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _silu_mul(g, u, FAST: tl.constexpr):
    """silu(g) * u in float32: g * (1 / (1 + 2^(-g log2 e))) * u on the GPU, torch's formula
    g / (1 + exp(-g)) * u under the interpreter (which runs no PTX).

    The GPU form is two MUFU instructions (ex2, rcp; flush-to-zero only touches exp(-g) < 2^-126,
    where silu(g) = g either way) instead of tl.exp's denormal handling and an IEEE division:
    fewer instructions in the issue-limited fused kernels. Results match torch to the y.dtype
    rounding, not to the float32 bit (as with any GPU exp). The interpreter's form is the only one
    on CPU tensors (FAST False).
    """
    if FAST:
        return g * _approx(1.0 + _approx(g * _NEG_LOG2E, "ex2"), "rcp") * u
    else:
        return g / (1.0 + tl.exp(-g)) * u


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
def _silu_h(g, u, FAST: tl.constexpr):
    """silu(gate) * up of loaded gate / up values, rounded to their dtype, as float32."""
    h = _silu_mul(g.to(tl.float32), u.to(tl.float32), FAST)
    return round_float(h, g.dtype).to(tl.float32)


# -------------------------------------------------------------------------------------- kernels
# Grid (slots, E, column chunks), as in epmoe.ops.quantize: a program handles BLOCK_M rows at a
# time, row blocks slot, slot + NUM_SLOTS, ... below the expert's bound (masked_m), skipping rows
# that m_indices marks as padding (their loads and stores are masked off: no memory traffic).
# Every load of a pointer argument sits in the kernel body: torch.compile reads a pointer passed
# to a jit helper whose result feeds a store as written (and clones it).
# m_indices of a row block are loaded one loop step ahead of their use, so their latency overlaps
# the current rows' loads (0 without m_indices).


@triton.jit
def _silu_mul_kernel(
    # tensors
    y_ptr, h_ptr, mm_ptr, mi_ptr,
    # sizes
    T, I, NUM_SLOTS,
    # strides (elements)
    stride_ye, stride_yt, stride_yh, stride_he, stride_ht,
    # meta
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ROWS: tl.constexpr,
    STAGES: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    e = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
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
        if HAS_ROWS:  # the next step's m_indices
            ids = tl.load(mi_ptr + nxt, mask=nxt < bound, other=-1)
        m = live[:, None] & (cols[None, :] < I)
        y_rows = (y_ptr + e64 * stride_ye + t64 * stride_yt)[:, None]
        g = tl.load(y_rows + cols[None, :] * stride_yh, mask=m, other=0.0)
        u = tl.load(y_rows + (cols[None, :] + I) * stride_yh, mask=m, other=0.0)
        h = _silu_h(g, u, FAST)
        tl.store(h_ptr + e64 * stride_he + (t64 * stride_ht)[:, None] + cols[None, :], h, mask=m)


@triton.jit
def _silu_mul_fp8_kernel(
    # tensors
    y_ptr, q_ptr, s_ptr, mm_ptr, mi_ptr,
    # sizes
    T, I, NUM_GROUPS, NUM_SLOTS,
    # strides (elements)
    stride_ye, stride_yt, stride_yh, stride_qe, stride_qt,
    stride_se, stride_st, stride_sg,
    # meta
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ROWS: tl.constexpr, STAGES: tl.constexpr,
    FAST: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    e = tl.program_id(1)
    rows, groups, inner, cols = _fp8_tile(GROUP, BLOCK_G, GROUPS_PER_PROG, BLOCK_M)
    gmask = groups < NUM_GROUPS
    bound = T  # rows of expert e: min(masked_m[e], T), or T
    if HAS_MASK:
        bound = tl.minimum(tl.load(mm_ptr + e).to(tl.int32), T)
    e64 = e.to(tl.int64)
    start, first, step, ids = _row_blocks(slot, rows, NUM_SLOTS, BLOCK_M)
    if HAS_ROWS:
        ids = tl.load(mi_ptr + first, mask=first < bound, other=-1)
    for t0 in tl.range(start, bound, step, num_stages=STAGES):
        t64, live, nxt = _live_rows(t0 + rows, ids, bound, step)
        if HAS_ROWS:  # the next step's m_indices
            ids = tl.load(mi_ptr + nxt, mask=nxt < bound, other=-1)
        live = live & gmask
        m = live[:, None] & (inner[None, :] < GROUP)
        y_rows = (y_ptr + e64 * stride_ye + t64 * stride_yt)[:, None]
        g = tl.load(y_rows + cols * stride_yh, mask=m, other=0.0)
        u = tl.load(y_rows + (cols + I) * stride_yh, mask=m, other=0.0)
        h = _silu_h(g, u, FAST)
        q, s = _quant_fp8_groups(h)
        tl.store(q_ptr + e64 * stride_qe + (t64 * stride_qt)[:, None] + cols, q, mask=m)
        tl.store(s_ptr + e64 * stride_se + t64 * stride_st + groups * stride_sg, s, mask=live)


@triton.jit
def _silu_mul_int8_kernel(
    # tensors
    y_ptr, q_ptr, s_ptr, mm_ptr, mi_ptr,
    # sizes
    T, I, NUM_SLOTS,
    # strides (elements)
    stride_ye, stride_yt, stride_yh, stride_qe, stride_qt, stride_se, stride_st,
    # meta
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, SINGLE_PASS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_ROWS: tl.constexpr, STAGES: tl.constexpr,
    FAST: tl.constexpr,
):  # fmt: skip
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
        if HAS_ROWS:  # the next step's m_indices
            ids = tl.load(mi_ptr + nxt, mask=nxt < bound, other=-1)
        y_rows = (y_ptr + e64 * stride_ye + t64 * stride_yt)[:, None]
        q_rows = (q_ptr + e64 * stride_qe + t64 * stride_qt)[:, None]
        if SINGLE_PASS:
            m = live[:, None] & (offs < I)
            g = tl.load(y_rows + offs * stride_yh, mask=m, other=0.0)
            u = tl.load(y_rows + (offs + I) * stride_yh, mask=m, other=0.0)
            h = _silu_h(g, u, FAST)
            s = _int8_scale(tl.max(tl.abs(h), axis=1))
            tl.store(q_rows + offs, _quant_int8(h, s), mask=m)
        else:
            amax = tl.zeros([BLOCK_M, BLOCK], dtype=tl.float32)
            for c0 in range(0, I, BLOCK):
                m = live[:, None] & (c0 + offs < I)
                c = c0 + offs
                g = tl.load(y_rows + c * stride_yh, mask=m, other=0.0)
                u = tl.load(y_rows + (c + I) * stride_yh, mask=m, other=0.0)
                h = _silu_h(g, u, FAST)
                amax = tl.maximum(amax, tl.abs(h))
            s = _int8_scale(tl.max(amax, axis=1))
            for c0 in range(0, I, BLOCK):
                m = live[:, None] & (c0 + offs < I)
                c = c0 + offs
                g = tl.load(y_rows + c * stride_yh, mask=m, other=0.0)
                u = tl.load(y_rows + (c + I) * stride_yh, mask=m, other=0.0)
                h = _silu_h(g, u, FAST)
                tl.store(q_rows + c0 + offs, _quant_int8(h, s), mask=m)
        tl.store(s_ptr + e64 * stride_se + t64 * stride_st, s, mask=live)
