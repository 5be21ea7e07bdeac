"""The LL (decode) masked layout: scatter tokens into `[E, C, H]` per local expert, gather back.

Shape legend: ``T`` tokens, ``K`` top-k, ``H`` hidden, ``E`` local experts, ``C`` slots per expert
(capacity), ``G`` scale groups per row.

Contract: ``xo, scales, masked_m, rows = ll_scatter(x, topk_ids, num_experts, capacity,
quant="bf16", expert_lo=0, num_global_experts=None, scale_layout="row")``

- x: bf16 `[T, H]` (any strides); with quant="bf16" also int8 / uint8 / float8_e4m3fn / int32 /
  float32, copied as raw bytes (the torch backend's HT payloads and packed metadata).
- topk_ids: int32/int64 `[T, K]` (any strides), global expert id in
  [0, num_global_experts) or -1 (num_global_experts defaults to num_experts). Entry (t, k) goes to
  local expert id - expert_lo when that lies in [0, E) (else it is another rank's: skipped).
- xo `[E, C, H]`: bf16 copies, or quantized as :func:`epmoe.reference.quantize` does (byte-exact):
  float8_e4m3fn with 1x128 per-token-group scales (G = H/128) or int8 with one scale per token
  (G = 1); scales float32 `[E, C, G]` (G = 0 for bf16), contiguous ("row") or in DeepGEMM's
  MN-major, TMA-aligned layout ("deepgemm", strides (G * round_up(C, 4), 1, round_up(C, 4))).
- masked_m int32 `[E]`: entries per expert, at most C; rows int32 `[T, K]`: e*C + slot of entry
  (t, k), or -1. Slots inside an expert follow the flat (t, k) order (deterministic).
- Rows of xo / scales at or past masked_m are unspecified (never written: no zero fill).

Contract: ``out = ll_gather(y, rows, topk_weights=None, out=None)``

- y: bf16 `[E, C, H]` (any strides; rows past masked_m never read); rows: int32/int64 `[T, K]` in
  [0, E*C) or -1; topk_weights: float32 `[T, K]` or None.
- out bf16 `[T, H]`: out[t] = sum_k w[t,k] * y.view(E*C, H)[rows[t,k]] (w = 1 when None), float32
  accumulation in k order, rounded once. With ``out`` (bf16 `[T, H]`, contiguous) the result is
  written there (``epmoe::ll_gather_out``, which mutates ``out``) and ``out`` is returned.

Both are one kernel and CUDA-graph safe (static shapes, fixed grids, no host sync, no atomics).
Bad ids (outside [0, num_global_experts) other than -1), an expert given more than C entries, and
rows outside [0, E*C) other than -1 are errors: ValueError on CPU; on CUDA a device assert inside
the kernel on direct launches (ValueError in debug mode), an async assert after the kernel under
torch.compile. A bad entry is skipped, and entries past capacity are never written, so masked_m
never exceeds C and a masked GEMM never reads out of bounds.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from epmoe import _checks, _eager, _launch, _library, reference
from epmoe._contract import Case, Choice, Contract, Let, Multiple, PositiveInt, Rule, Tensor
from epmoe._jit import (  # by name: Inductor copies @triton.jit callees
    _bad_rows,
    _int8_scale,
    _quant_fp8_groups,
    _quant_int8,
    round_float,
)

QUANTS = ("bf16", "fp8", "int8")
SCALE_LAYOUTS = ("row", "deepgemm")
_QCODE = {"bf16": 0, "fp8": 1, "int8": 2}
_QDTYPE = {"bf16": torch.bfloat16, "fp8": reference.FP8_DTYPE, "int8": torch.int8}
# quant="bf16" copies these as they are: the kernel moves same-width integers (no float semantics)
_RAW = {
    torch.bfloat16: torch.int16,
    torch.int8: torch.uint8,
    torch.uint8: torch.uint8,
    reference.FP8_DTYPE: torch.uint8,
    torch.int32: torch.int32,
    torch.float32: torch.int32,
}

# ------------------------------------------------------------------------------ launch heuristics
GROUP = 128  # fp8 channels per scale (DeepGEMM's 1x128 activation groups)
TILE = 4096  # elements per scatter program and token: 8 KiB of bf16, 32 a thread at 4 warps
INT8_SINGLE_MAX = 8192  # int8 rows up to this many elements in one program (one read for amax)
BLOCK_N = 512  # ids per step of a program's slot count (K_PAD x BLOCK_N compares in registers)
GATHER_BYTES = 4096  # output bytes per gather program: 2048 bf16 columns, 16 a thread
TMA_ALIGN = 4  # DeepGEMM pads the MN dim of float32 scales to 16 bytes


# -------------------------------------------------------------------------------------- kernels
# The kernels load topk_ids themselves (torch.compile reads a pointer passed to a jit helper whose
# result feeds a store as written, and clones it): the helpers take offsets and loaded ids.
@triton.jit
def _id_offsets(t, k, T, K, stride_it, stride_ik):
    """(row and column offsets of entries (t, k) in topk_ids, in-bounds mask: t < T and k < K).
    t may be a scalar next to a vector k."""
    inb = (t + k * 0 < T) & (k < K)
    return t.to(tl.int64) * stride_it, k * stride_ik, inb


@triton.jit
def _local_ids(v, inb, LO, E, NG):
    """(local expert of loaded ids v as int32, -1 when skipped: id -1, another rank's expert, a bad
    id, out of bounds (inb False); bad-id mask)."""
    bad = inb & ((v < -1) | (v >= NG))
    loc = v - LO
    live = inb & (v >= 0) & (v < NG) & (loc >= 0) & (loc < E)
    return tl.where(live, loc, -1).to(tl.int32), bad


@triton.jit
def _ll_scatter_kernel(
    # tensors
    x_ptr, ids_ptr, xo_ptr, s_ptr, mm_ptr, rows_ptr, ok_ptr,
    # sizes
    T, H, C, E, LO, NG, G, CHUNKS,
    # strides (elements)
    stride_xt, stride_xh, stride_it, stride_ik, stride_se, stride_sc, stride_sg,
    # meta
    K: tl.constexpr, K_PAD: tl.constexpr, QUANT: tl.constexpr, R: tl.constexpr,
    W: tl.constexpr, SINGLE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_BINS: tl.constexpr,
    ASSERT: tl.constexpr,
):  # fmt: skip
    """Programs t * CHUNKS + c (t < T): chunk c of token t's row, an [R, W] tile (fp8: R groups of
    W = 128 channels; bf16 / int8: one row piece of W), to each of its slots; a slot is the
    number of entries of the same expert before it in flat (t, k) order, counted by the program
    itself from the ids (a few KiB, read from L2), so no program waits on another. Chunk 0 also
    writes rows[t]. The last program writes masked_m and checks the ids and capacities: with
    ASSERT (a debug=True build) it asserts them, else it writes their int32 code to ok (bit 0: a
    bad id, bit 1: an expert over capacity)."""
    pid = tl.program_id(0)
    if pid >= T * CHUNKS:
        bins = tl.arange(0, NUM_BINS)
        tot = tl.zeros([NUM_BINS], dtype=tl.int32)
        n_bad = tl.zeros([BLOCK_N], dtype=tl.int32)
        for b0 in range(0, T * K_PAD, BLOCK_N):
            pos = b0 + tl.arange(0, BLOCK_N)
            ro, co, inb = _id_offsets(pos // K_PAD, pos % K_PAD, T, K, stride_it, stride_ik)
            e, bad = _local_ids(tl.load(ids_ptr + ro + co, mask=inb, other=-1), inb, LO, E, NG)
            tot += tl.histogram(tl.where(e >= 0, e, E), NUM_BINS)  # bin E: skipped entries
            n_bad += bad.to(tl.int32)
        tot = tl.where(bins < E, tot, 0)
        tl.store(mm_ptr + bins, tl.minimum(tot, C), mask=bins < E)
        bad_ids = tl.sum(n_bad, axis=0)
        over = tl.sum((tot > C).to(tl.int32), axis=0)
        if ASSERT:
            tl.device_assert(bad_ids == 0, "ll_scatter: topk_ids expected ids in [0, Et) or -1")
            tl.device_assert(over == 0, "ll_scatter: topk_ids expected at most C per expert")
        else:  # (one code: one assert after the kernel under torch.compile)
            tl.store(ok_ptr, (bad_ids > 0).to(tl.int32) + 2 * (over > 0).to(tl.int32))
    else:
        t = pid // CHUNKS
        c = pid % CHUNKS
        kk = tl.arange(0, K_PAD)
        ro_t, co_t, in_t = _id_offsets(t, kk, T, K, stride_it, stride_ik)
        v_t = tl.load(ids_ptr + ro_t + co_t, mask=in_t, other=-1)
        e, bad_own = _local_ids(v_t, in_t, LO, E, NG)
        any_live = tl.sum((e >= 0).to(tl.int32), axis=0) > 0
        # the row's load goes first (it needs the token's own ids only); tokens without a local
        # expert read nothing
        ri = tl.arange(0, R)
        groups = c * R + ri  # fp8: scale groups of the tile; bf16 / int8: the chunk (R = 1)
        cols = groups[:, None] * W + tl.arange(0, W)[None, :]
        hi = tl.where(any_live, H, 0)
        x_row = x_ptr + t.to(tl.int64) * stride_xt
        v = tl.load(x_row + cols * stride_xh, mask=cols < hi, other=0.0)
        # slot of each own entry: entries of its expert earlier in flat (t, k) order
        own = t * K_PAD + kk
        cnt = tl.zeros([K_PAD], dtype=tl.int32)
        for b0 in range(0, t * K_PAD + K_PAD, BLOCK_N):
            pos = b0 + tl.arange(0, BLOCK_N)
            ro, co, inb = _id_offsets(pos // K_PAD, pos % K_PAD, T, K, stride_it, stride_ik)
            eb, bad_b = _local_ids(tl.load(ids_ptr + ro + co, mask=inb, other=-1), inb, LO, E, NG)
            same = (eb[None, :] == e[:, None]) & (pos[None, :] < own[:, None])
            cnt += tl.sum(same.to(tl.int32), axis=1)
        kept = (e >= 0) & (cnt < C)  # past capacity: never written (an error, checked above)
        rows = tl.where(kept, e * C + cnt, -1)
        if c == 0:
            tl.store(rows_ptr + t.to(tl.int64) * K + kk, rows, mask=kk < K)
        if QUANT == 0:
            q = v
        elif QUANT == 1:
            q, s = _quant_fp8_groups(v.to(tl.float32))
        else:
            xf = v.to(tl.float32)
            if SINGLE:
                amax = tl.max(tl.abs(xf), axis=1)
            else:  # the rest of the row too (a second read, from L2): one scale per token
                m = tl.zeros([R, W], dtype=tl.float32)
                for h0 in range(0, H, W):
                    cc = h0 + cols - c * W
                    xc = tl.load(x_row + cc * stride_xh, mask=cc < hi, other=0.0)
                    m = tl.maximum(m, tl.abs(xc.to(tl.float32)))
                amax = tl.max(m, axis=1)
            s = _int8_scale(amax)
            q = _quant_int8(xf, s)
        for k in tl.static_range(K):
            r = tl.sum(tl.where(kk == k, rows, 0), axis=0)
            live = r >= 0
            r64 = r.to(tl.int64)
            tl.store(xo_ptr + r64 * H + cols, q, mask=cols < tl.where(live, H, 0))
            if QUANT != 0:  # int8: G = 1, so only chunk 0 (groups == 0) stores its scale
                s_off = (r64 // C) * stride_se + (r64 % C) * stride_sc + groups * stride_sg
                tl.store(s_ptr + s_off, s, mask=groups < tl.where(live, G, 0))


@triton.jit
def _ll_gather_kernel(
    # tensors
    y_ptr, rows_ptr, w_ptr, out_ptr, ok_ptr,
    # sizes
    H, C, NROWS,
    # strides (elements)
    stride_ye, stride_yc, stride_yh, stride_rt, stride_rk, stride_wt, stride_wk,
    # meta
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr, HAS_W: tl.constexpr,
    ASSERT: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """Program (t, c): column chunk c of out[t]. With CHECK, chunk 0 also checks t's rows: it
    clears ok on a row outside [0, E*C) other than -1, or with ASSERT (a debug=True build)
    asserts them."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):  # k ascending, as the reference sums
        r = tl.load(rows_ptr + t * stride_rt + k * stride_rk).to(tl.int64)
        live = (r >= 0) & (r < NROWS)  # out-of-range rows are reported below, never read
        r = tl.where(live, r, 0)
        src = y_ptr + (r // C) * stride_ye + (r % C) * stride_yc
        v = tl.load(src + cols * stride_yh, mask=cols < tl.where(live, H, 0), other=0.0)
        if HAS_W:
            w = tl.load(w_ptr + t * stride_wt + k * stride_wk, mask=live, other=0.0)
            acc += v.to(tl.float32) * w
        else:
            acc += v.to(tl.float32)
    tl.store(out_ptr + t * H + cols, round_float(acc, out_ptr.dtype.element_ty), mask=cols < H)
    if CHECK:
        if c == 0:
            kk = tl.arange(0, K_PAD)
            rr = tl.load(rows_ptr + t * stride_rt + kk * stride_rk, mask=kk < K, other=-1)
            msg: tl.constexpr = "ll_gather: rows expected rows in [0, E*C) or -1"
            bad = _bad_rows(rr, NROWS, ASSERT, msg)
            if not ASSERT:
                tl.store(ok_ptr + kk * 0, tl.zeros([K_PAD], dtype=tl.int1), mask=bad)


# ----------------------------------------------------------------------------- host-side helpers


def alloc_scales(lead: Tuple[int, int], groups: int, layout: str, device) -> torch.Tensor:
    """Uninitialized float32 scales `[E, C, groups]` in ``layout``: the layout of
    :func:`epmoe.ops.quantize.alloc_scales` for 3-D inputs (deepgemm: MN-major, C padded to
    TMA_ALIGN, strides (groups * padded, 1, padded)). Not a view: kernels write it directly."""
    if layout == "row" or groups == 0:
        return torch.empty((*lead, groups), dtype=torch.float32, device=device)
    padded = reference.round_up(lead[1], TMA_ALIGN)
    return torch.empty_strided(
        (lead[0], lead[1], groups), (groups * padded, 1, padded), dtype=torch.float32, device=device
    )


def scatter_tiling(H: int, quant: str) -> Tuple[int, int, int]:
    """(R, W, chunks) of the scatter: each program copies an [R, W] tile of a row."""
    if quant == "fp8":
        groups = H // GROUP
        r = min(_launch.pow2(max(groups, 1)), TILE // GROUP)
        return r, GROUP, max(_launch.cdiv(groups, r), 1)
    limit = INT8_SINGLE_MAX if quant == "int8" else TILE
    w = min(_launch.pow2(max(H, 1)), limit)
    return 1, w, max(_launch.cdiv(H, w), 1)  # (H = 0: one chunk still writes rows)


def _warps(elements: int) -> int:
    return 8 if elements > 4096 else 4


@_launch.memo
def _scatter_launch(T, K, H, C, E, expert_lo, NG, quant, x_strides, id_strides, s_strides,
                    in_kernel):  # fmt: skip
    """The scatter kernel's launch for these sizes, strides and options."""
    G = H // GROUP if quant == "fp8" else (1 if quant == "int8" else 0)
    R, W, chunks = scatter_tiling(H, quant)
    k_pad = _launch.pow2(max(K, 1))
    # no `if` on sizes (T may be symbolic under torch.compile): T = 0 still launches the
    # masked_m program
    return _launch.Prepared(
        _ll_scatter_kernel,
        (T * chunks + 1,),
        (T, H, C, E, expert_lo, NG, G, chunks, *x_strides, *id_strides, *s_strides),
        dict(
            K=K, K_PAD=k_pad, QUANT=_QCODE[quant], R=R, W=W, SINGLE=chunks == 1,
            BLOCK_N=max(BLOCK_N, k_pad), NUM_BINS=_launch.pow2(E + 1), ASSERT=in_kernel,
            num_warps=_warps(R * W), **_checks.assert_build(in_kernel),
        ),
    )  # fmt: skip


@_eager.on_input_device
def _ll_scatter_triton(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: int,
    quant: str = "bf16",
    expert_lo: int = 0,
    num_global_experts: Optional[int] = None,
    scale_layout: str = "row",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ll_scatter on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    T, K = topk_ids.shape
    H = x.shape[1]
    E, C = num_experts, capacity
    NG = num_experts if num_global_experts is None else num_global_experts
    dev = x.device
    G = H // GROUP if quant == "fp8" else (1 if quant == "int8" else 0)
    xo = torch.empty((E, C, H), dtype=_QDTYPE[quant] if quant != "bf16" else x.dtype, device=dev)
    xk, xok = x, xo
    if quant == "bf16" and x.dtype is not torch.bfloat16:  # raw copy: integer views
        xk, xok = x.view(_RAW[x.dtype]), xo.view(_RAW[x.dtype])
    s = alloc_scales((E, C), G, scale_layout, dev)
    masked_m = torch.empty((E,), dtype=torch.int32, device=dev)
    rows = torch.empty((T, K), dtype=torch.int32, device=dev)
    # Direct CUDA launches (eager, the dispatcher, graph capture of either) assert the ids and
    # capacities inside the kernel; otherwise (torch.compile, the interpreter) it writes a code
    in_kernel = _checks.assert_in_kernel(_checks.direct_launch(x))
    ok = topk_ids if in_kernel else torch.empty((1,), dtype=torch.int32, device=dev)  # (unused)
    launch = _scatter_launch(
        T, K, H, C, E, expert_lo, NG, quant, x.stride(), topk_ids.stride(), s.stride(), in_kernel
    )
    launch(xk, topk_ids, xok, s, masked_m, rows, ok)
    if not in_kernel:
        _checks.check_codes(ok, "ll_scatter", "topk_ids", (
            (f"ids in [0, {NG}) or -1", "values outside it"),
            (f"at most capacity={C} entries per expert", "an expert over capacity"),
        ))  # fmt: skip
    return xo, s, masked_m, rows


@_launch.memo
def _gather_launch(T, K, E, C, H, y_strides, row_strides, w_strides, has_w, check, in_kernel):
    """The gather kernel's launch for these sizes, strides and options."""
    block = min(_launch.pow2(max(H, 1)), GATHER_BYTES // 2)
    return _launch.Prepared(
        _ll_gather_kernel,
        (T, _launch.cdiv(H, block)),
        (H, C, E * C, *y_strides, *row_strides, *w_strides),
        dict(
            K=K, K_PAD=_launch.pow2(max(K, 1)), BLOCK_H=block, HAS_W=has_w, ASSERT=in_kernel,
            CHECK=check, num_warps=4, **_checks.assert_build(in_kernel),
        ),
    )  # fmt: skip


@_eager.on_input_device
def _ll_gather_launch(
    y: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: Optional[torch.Tensor],
    out: torch.Tensor,
    check: bool = True,
) -> None:
    """ll_gather into a contiguous bf16 ``out`` on CUDA (or CPU tensors under the interpreter);
    check=False: no row check (rows from ll_scatter in the same chain)."""
    T, K = rows.shape
    E, C, H = y.shape
    in_kernel = check and _checks.assert_in_kernel(_checks.direct_launch(y))
    flag = check and not in_kernel
    ok = torch.ones((), dtype=torch.bool, device=y.device) if flag else rows  # (unused)
    has_w = topk_weights is not None
    w = topk_weights if has_w else rows  # placeholder, never read
    launch = _gather_launch(
        T, K, E, C, H, y.stride(), rows.stride(), w.stride() if has_w else (0, 0), has_w, check,
        in_kernel,
    )  # fmt: skip
    launch(y, rows, w, out, ok)
    if flag:
        _checks.check_values(ok, "ll_gather", "rows", f"rows in [0, {E * C}) or -1")


# ------------------------------------------------------------------------------ ll_scatter op
SCATTER = Contract(
    "ll_scatter",
    "x topk_ids num_experts capacity quant expert_lo num_global_experts scale_layout",
    Tensor("x", "RAW if quant == 'bf16' else BF16", ndim=(2,)),
    Tensor("topk_ids", _checks.INDEX_DTYPES, shape=("x.shape[0]", None)),
    PositiveInt("num_experts"),
    PositiveInt("capacity"),
    Choice("quant", QUANTS),
    Choice("scale_layout", SCALE_LAYOUTS),
    Rule(
        "type(expert_lo) is int and expert_lo >= 0",
        "expert_lo",
        "a non-negative int",
        lambda a: repr(a.expert_lo),
    ),
    Let("ng", "num_experts if num_global_experts is None else num_global_experts"),
    PositiveInt("ng", "num_global_experts"),
    Rule(
        "expert_lo + num_experts <= ng",
        "num_global_experts",
        lambda a: f"at least expert_lo + num_experts = {a.expert_lo + a.num_experts}",
        lambda a: a.ng,
    ),
    Case("quant == 'fp8'", [Multiple("x.shape[1]", "x.shape[1]", GROUP, "(fp8 groups)")]),
    consts=dict(RAW=tuple(_RAW), BF16=(torch.bfloat16,)),
)


def _scatter_reference(x, topk_ids, E, C, quant, lo, NG, scale_layout):
    xo, s, masked_m, rows = reference.ll_scatter(x, topk_ids, E, C, quant, lo, NG)
    if scale_layout == "deepgemm" and s.shape[2]:
        out = alloc_scales((E, C), s.shape[2], scale_layout, s.device)
        out.copy_(s)
        s = out
    return xo, s, masked_m, rows


def _ll_scatter_impl(x, topk_ids, E, C, quant="bf16", lo=0, NG=None, scale_layout="row"):
    SCATTER.check(x, topk_ids, E, C, quant, lo, NG, scale_layout)
    if x.is_cuda:
        return _ll_scatter_triton(x, topk_ids, E, C, quant, lo, NG, scale_layout)
    return _scatter_reference(x, topk_ids, E, C, quant, lo, NG, scale_layout)


@triton_op("epmoe::ll_scatter", mutates_args=())
def _ll_scatter_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: int,
    quant: str = "bf16",
    expert_lo: int = 0,
    num_global_experts: Optional[int] = None,
    scale_layout: str = "row",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ll_scatter_impl(
        x, topk_ids, num_experts, capacity, quant, expert_lo, num_global_experts, scale_layout
    )


# CPU kernel: the same function, which takes its reference branch for CPU tensors
_ll_scatter_op.register_kernel("cpu")(_ll_scatter_impl)
_library.cpu_opaque(_ll_scatter_op)  # compiled CPU graphs call it: the same bytes as eager


def ll_scatter(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: int,
    quant: str = "bf16",
    expert_lo: int = 0,
    num_global_experts: Optional[int] = None,
    scale_layout: str = "row",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter (and quantize) tokens into the masked layout; see the module docstring.

    Args:
        x: bf16 `[T, H]` (any strides); with quant="bf16" also int8 / uint8 / float8_e4m3fn /
            int32 / float32 (raw copies, xo of x's dtype).
        topk_ids: int32/int64 `[T, K]` (any strides), global id or -1.
        num_experts: E, local experts (ids expert_lo .. expert_lo + E - 1).
        capacity: C, slots per expert.
        quant: "bf16" (a copy), "fp8" (H a multiple of 128) or "int8".
        expert_lo: the first local expert's global id.
        num_global_experts: ids must be below it (default num_experts).
        scale_layout: "row" (contiguous scales) or "deepgemm" (MN-major, TMA-aligned).
    Returns:
        (xo bf16/float8_e4m3fn/int8 (quant="bf16": x's dtype) `[E, C, H]`, scales float32
        `[E, C, G]` (G = H/128, 1 or 0), masked_m int32 `[E]`, rows int32 `[T, K]` = e*C + slot
        or -1).
    """
    args = (x, topk_ids, num_experts, capacity, quant, expert_lo, num_global_experts, scale_layout)
    if _eager.direct(x, topk_ids):
        return _eager.run(_ll_scatter_impl, *args)
    # the schema would reject a non-int before our message could say what was expected
    _checks.check_positive_int("ll_scatter", "num_experts", num_experts)
    _checks.check_positive_int("ll_scatter", "capacity", capacity)
    return _ll_scatter_op(*args)


# ------------------------------------------------------------------------------- ll_gather ops
_GATHER = (
    Tensor("y", (torch.bfloat16,), ndim=(3,)),
    Tensor("rows", _checks.INDEX_DTYPES, ndim=(2,)),
    Tensor("topk_weights", (torch.float32,), shape="rows.shape", optional=True),
)
GATHER = Contract("ll_gather", "y rows topk_weights", *_GATHER)
GATHER_OUT = Contract(
    "ll_gather",
    "y rows topk_weights out",
    *_GATHER,
    Tensor("out", (torch.bfloat16,), shape=("rows.shape[0]", "y.shape[2]")),
    Rule(
        "out.is_contiguous()", "out", "a contiguous tensor", lambda a: f"strides {a.out.stride()}"
    ),
)


def _ll_gather_cuda(y, rows, topk_weights=None, check=True):
    out = torch.empty((rows.shape[0], y.shape[2]), dtype=torch.bfloat16, device=y.device)
    _ll_gather_launch(y, rows, topk_weights, out, check)
    return out


def _ll_gather_impl(y, rows, topk_weights=None, check=True):
    GATHER.check(y, rows, topk_weights)
    if y.is_cuda:
        return _ll_gather_cuda(y, rows, topk_weights, check)
    return reference.ll_gather(y, rows, topk_weights)


def _ll_gather_out_impl(y, rows, topk_weights, out) -> None:
    GATHER_OUT.check(y, rows, topk_weights, out)
    if y.is_cuda:
        _ll_gather_launch(y, rows, topk_weights, out)
    else:
        out.copy_(reference.ll_gather(y, rows, topk_weights))


@triton_op("epmoe::ll_gather", mutates_args=())
def _ll_gather_op(
    y: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: Optional[torch.Tensor] = None,
    check: bool = True,
) -> torch.Tensor:
    return _ll_gather_impl(y, rows, topk_weights, check)


@triton_op("epmoe::ll_gather_out", mutates_args=("out",))
def _ll_gather_out_op(
    y: torch.Tensor, rows: torch.Tensor, topk_weights: Optional[torch.Tensor], out: torch.Tensor
) -> None:
    _ll_gather_out_impl(y, rows, topk_weights, out)


# CPU kernels: the same functions, which take their reference branch for CPU tensors
_ll_gather_op.register_kernel("cpu")(_ll_gather_impl)
_ll_gather_out_op.register_kernel("cpu")(_ll_gather_out_impl)
_library.cpu_opaque(_ll_gather_op)
_library.cpu_opaque(_ll_gather_out_op)


def ll_gather(
    y: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gather each token's slots back and take the (weighted) top-k sum.

    Args:
        y: bf16 `[E, C, H]` (any strides), the masked layout.
        rows: int32/int64 `[T, K]` slot e*C + c of each (t, k) or -1 (ll_scatter's rows).
        topk_weights: float32 `[T, K]`, or None for an unweighted sum.
        out: optional contiguous bf16 `[T, H]` to write into.
    Returns:
        bf16 `[T, H]` (``out`` when given), float32 accumulation.
    """
    direct = _eager.direct(y, rows, topk_weights, out)
    if out is None:
        if direct:
            return _eager.run(_ll_gather_impl, y, rows, topk_weights)
        return _ll_gather_op(y, rows, topk_weights)
    if direct:
        _eager.run(_ll_gather_out_impl, y, rows, topk_weights, out)
    else:
        _ll_gather_out_op(y, rows, topk_weights, out)
    return out


def _ll_scatter_trusted(
    x, topk_ids, num_experts, capacity, quant="bf16", expert_lo=0, num_global_experts=None,
    scale_layout="row",
):  # fmt: skip
    """The layer's entry on its direct path (eager, plain CUDA tensors checked at the layer's
    boundary): the launch without the metadata checks."""
    args = (x, topk_ids, num_experts, capacity, quant, expert_lo, num_global_experts, scale_layout)
    return _eager.run(_ll_scatter_triton, *args)


def _ll_gather_chained(y, rows, topk_weights=None):
    """ll_gather's entry for the layer's chain off the direct path (see
    epmoe.ops.unpermute.unpermute.chained): rows come from ll_scatter, no row check."""
    return _ll_gather_op(y, rows, topk_weights, False)


def _ll_gather_trusted(y, rows, topk_weights=None):
    """ll_gather's entry for the layer's direct path (see _ll_scatter_trusted)."""
    return _eager.run(_ll_gather_cuda, y, rows, topk_weights)
