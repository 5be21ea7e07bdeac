"""The weighted top-K gather: out[t] = sum_k w[t, k] * (y_row(rows[t, k]) + bias[expert of the
row]), float32 accumulation in k order, rounded once; the kernel of unpermute (y `[R, H]`, rows of
y, the expert of a row from permute's m_indices) and ll_gather (y `[E, C, H]` of any strides, row
e*C + c: slot c of expert e, its expert e = row // C), with the row check of both. The output's
columns are the first H of y's (H may be narrower than y: a zero-padded hidden size).

Shape legend: ``T`` tokens, ``K`` top-k, ``H`` output columns, ``R`` rows y holds, ``E``
experts, ``C`` slots per expert.

Rows of -1 are skipped; rows outside [0, R) other than -1 are never read and are an error: on direct
CUDA launches a device assert inside the kernel (a debug=True build), otherwise (torch.compile, the
interpreter) the kernel clears a flag that :func:`launch` checks after it. Experts outside [0, NB)
(m_indices -1: a padding row) add no bias and are never read. One program per (token, column
chunk); CUDA-graph safe (fixed grid, no host sync, no atomics).

Arguments a variant does not use (the bias's without HAS_BIAS, m_indices with SLOTS) are passed
as None: Triton makes them constexprs, so the build without a bias is the kernel as it was before
the bias existed (same parameters, same code).
"""

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from epmoe import _checks, _launch
from epmoe._jit import _bad_rows, round_float  # by name: Inductor copies @triton.jit callees
from epmoe._launch import pdl

GATHER_BYTES = 4096  # ll_gather's output bytes per program: 2048 bf16 columns, 16 a thread


@triton.jit
def _topk_gather_kernel(
    # tensors
    y_ptr, rows_ptr, w_ptr, out_ptr, ok_ptr, b_ptr, m_ptr,
    # sizes
    H, C, R, NB,
    # strides (elements)
    stride_ye, stride_yc, stride_yh, stride_rt, stride_rk, stride_wt, stride_wk, stride_be,
    stride_bh,
    # meta
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr, SLOTS: tl.constexpr,
    HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr, ASSERT: tl.constexpr, CHECK: tl.constexpr,
    MSG: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (t, c): column chunk c of out[t] (out `[T, H]`, contiguous). Row r is y_ptr + r *
    stride_yc, or with SLOTS (the masked layout) slot r % C of expert r // C; without HAS_W every
    weight is 1. With HAS_BIAS row r adds bias row e (b_ptr `[NB, *]`), e = r // C with SLOTS,
    else m_ptr[r] (permute's m_indices). With CHECK, chunk 0 also checks t's rows: it clears ok on
    a row outside [0, R) other than -1, or with ASSERT (a debug=True build) asserts them instead,
    with message MSG (ok unused)."""
    pdl(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):  # k ascending, as the references sum
        r = tl.load(rows_ptr + t * stride_rt + k * stride_rk)
        live = (r >= 0) & (r < R)  # out-of-range rows are reported below, never read
        if SLOTS:
            r = tl.where(live, r, 0).to(tl.int64)
            src = y_ptr + (r // C) * stride_ye + (r % C) * stride_yc
        else:
            src = y_ptr + r.to(tl.int64) * stride_yc
        v = tl.load(src + cols * stride_yh, mask=cols < tl.where(live, H, 0), other=0.0)
        if HAS_BIAS:  # y + bias in float32, then weighted: the sum is rounded once, at the end
            if SLOTS:
                e = r // C
            else:  # (the row's m_indices entry; -1 on padding rows)
                e = tl.load(m_ptr + tl.where(live, r, 0).to(tl.int64), mask=live, other=-1)
            has = live & (e >= 0) & (e < NB)
            b_row = b_ptr + tl.where(has, e, 0).to(tl.int64) * stride_be
            b = tl.load(b_row + cols * stride_bh, mask=cols < tl.where(has, H, 0), other=0.0)
            v = v.to(tl.float32) + b.to(tl.float32)
        if HAS_W:
            w = tl.where(live, tl.load(w_ptr + t * stride_wt + k * stride_wk).to(tl.float32), 0.0)
            acc += v.to(tl.float32) * w
        else:
            acc += v.to(tl.float32)
    tl.store(out_ptr + t * H + cols, round_float(acc, out_ptr.dtype.element_ty), mask=cols < H)
    if CHECK:
        if c == 0:
            kk = tl.arange(0, K_PAD)
            rows = tl.load(rows_ptr + t * stride_rt + kk * stride_rk, mask=kk < K, other=-1)
            bad = _bad_rows(rows, R, ASSERT, MSG)
            if not ASSERT:
                tl.store(ok_ptr + kk * 0, tl.zeros([K_PAD], dtype=tl.int1), mask=bad)


# ----------------------------------------------------------------------------- host-side launch
def prepare(T, K, k_pad, H, C, R, block, warps, y_strides, row_strides, w_strides, slots, has_w,
            check, in_kernel, msg, bias=None) -> _launch.Prepared:  # fmt: skip
    """The gather kernel's launch: T tokens of K rows (K_PAD k_pad), block columns of out (H
    of them) per program at ``warps`` warps; y_strides (expert, row, column) (slots=False: expert
    unused); ``msg``: the device assert's message; ``bias``: None, or (NB experts, its strides
    (expert, column)). Called with (y, rows, w, out, ok), then with a bias its tensors: bias, and
    m_indices unless ``slots``. The stages' memoized plans call it."""
    if bias is None:  # (None: constexprs, not kernel parameters; see the module doc)
        nb, b_strides, absent = None, (None, None), (None, None)
    else:
        nb, b_strides, absent = bias[0], bias[1], (None,) if slots else ()
    return _launch.Prepared(
        _topk_gather_kernel,
        (T, _launch.cdiv(H, block)),
        (*absent, H, C, R, nb, *y_strides, *row_strides, *w_strides, *b_strides),
        dict(
            K=K, K_PAD=k_pad, BLOCK_H=block, SLOTS=slots, HAS_W=has_w, HAS_BIAS=bias is not None,
            ASSERT=in_kernel, CHECK=check, MSG=msg, num_warps=warps,
            **_checks.assert_build(in_kernel),
        ),
    )  # fmt: skip


def launch(plan: Callable, key: tuple, y, rows, w, out, check: bool, op: str, arg: str,
           what: str, R, extra: tuple = ()) -> None:  # fmt: skip
    """Launches ``plan(*key, in_kernel)`` (a memoized :func:`prepare`) on (y, rows, w, out, ok,
    *extra) (extra: the bias's tensors) and checks the rows (the error: ``op: arg expected what
    in [0, R) or -1``); check=False: no row check (rows from the chain's own permute or
    ll_scatter). Direct CUDA launches (eager, the dispatcher, graph capture of either) assert the
    rows inside the kernel: one launch, nothing after it; otherwise (torch.compile, the
    interpreter) the kernel clears the flag ok on a bad row, checked here."""
    in_kernel = check and _checks.assert_in_kernel(_checks.direct_launch(y))
    flag = check and not in_kernel
    ok = torch.ones((), dtype=torch.bool, device=y.device) if flag else rows  # (unused)
    plan(*key, in_kernel)(y, rows, w, out, ok, *extra)
    if flag:
        _checks.check_values(ok, op, arg, f"{what} in [0, {R}) or -1")


# ------------------------------------------------------------------ ll_gather (the masked layout)
@_launch.memo
def _ll_gather_plan(T, K, E, C, H, y_strides, row_strides, w_strides, has_w, check, b_strides,
                    in_kernel):  # fmt: skip
    """ll_gather's launch for these sizes, strides and options (b_strides: the bias's, or None)."""
    block = min(_launch.pow2(max(H, 1)), GATHER_BYTES // 2)
    return prepare(
        T, K, _launch.pow2(max(K, 1)), H, C, E * C, block, 4, y_strides, row_strides, w_strides,
        True, has_w, check, in_kernel, "ll_gather: rows expected rows in [0, E*C) or -1",
        None if b_strides is None else (E, b_strides),
    )  # fmt: skip


def _ll_gather_launch(
    y: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: Optional[torch.Tensor],
    out: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    check: bool = True,
) -> None:
    """ll_gather into a contiguous bf16 ``out`` `[T, Ho]` on CUDA (or CPU tensors under the
    interpreter), ll_gather_out's CUDA kernel: y bf16 `[E, C, H]` (any strides; its first Ho <= H
    columns read), rows int32/int64 `[T, K]` e*C + c or -1, topk_weights float32 `[T, K]` or None
    (unweighted), bias bf16/fp16/fp32 `[E, Hb >= Ho]` (any strides) or None; check=False: no row
    check (rows from ll_scatter in the same chain)."""
    T, K = rows.shape
    E, C, _ = y.shape
    H = out.shape[1]  # (a padded hidden: the first H columns of y)
    has_w = topk_weights is not None
    w = topk_weights if has_w else rows  # placeholder, never read
    key = (T, K, E, C, H, y.stride(), rows.stride(), w.stride() if has_w else (0, 0), has_w, check,
           None if bias is None else bias.stride())  # fmt: skip
    extra = () if bias is None else (bias,)
    launch(_ll_gather_plan, key, y, rows, w, out, check, "ll_gather", "rows", "rows", E * C, extra)
