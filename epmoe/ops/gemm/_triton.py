"""Our Triton grouped GEMMs over expert-sorted rows, for every scheme: bf16 (float32 accumulation),
fp8 W8A8 (1x128 activation / 128x128 weight scales applied per 128-channel step, as deep_gemm does)
and int8 W8A8 (int32 accumulation, per-token x per-channel scales); bf16 out. The contiguous kernel
takes any row block (permute ``alignment``) that is a multiple of 16, the masked kernel any T.

Tile configs: the tuned table for this GPU (:mod:`epmoe.ops.gemm._tuned`) where it has the shape,
else Triton's autotuner over the candidates below (once per static key, in warmup)."""

import functools
import math
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from epmoe import _launch, quant
from epmoe import gate as _gate
from epmoe._jit import _quant_fp8_groups, round_float
from epmoe._launch import pdl
from epmoe.ops._activation_kernels import _gate_rounded
from epmoe.ops.gemm import _tuned

MIN_ROW_BLOCK = 16  # tl.dot's smallest M tile: the contiguous kernel's smallest BLOCK_M
# Masked tiles: the decode-shaped configs (4 warps, long K tiles) spill registers past 64 rows,
# and LL experts rarely hold more rows than that.
_MASKED_MIN_BLOCK_M, _MASKED_MAX_BLOCK_M = MIN_ROW_BLOCK, 64


def _even_k(args) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


@triton.jit
def _mma(acc, a, b, as_ptrs, ws_ptrs, kb, stride_ask, stride_wsk, BLOCK_K: tl.constexpr,
         QUANT: tl.constexpr, SCALE_K: tl.constexpr, SWAP: tl.constexpr = False):  # fmt: skip
    """acc plus a `[BLOCK_M, BLOCK_K]` x b `[BLOCK_K, BLOCK_N]` of K step ``kb`` (fp8: times that
    step's scale group, BLOCK_K dividing SCALE_K; int8: an int32 sum); SWAP: acc `[BLOCK_N,
    BLOCK_M]` plus bᵀ x aᵀ (a few rows as wgmma's N, the weight tile as its M of 64 or more)."""
    if SWAP:
        a, b = tl.trans(b), tl.trans(a)
    if QUANT == 1:
        g = kb * BLOCK_K // SCALE_K
        a_s = tl.load(as_ptrs + g * stride_ask)
        w_s = tl.load(ws_ptrs + g * stride_wsk)
        if SWAP:
            acc += tl.dot(a, b) * (w_s[:, None] * a_s[None, :])
        else:
            acc += tl.dot(a, b) * (a_s[:, None] * w_s[None, :])
    elif QUANT == 2:
        acc = tl.dot(a, b, acc=acc, out_dtype=tl.int32)
    else:
        acc = tl.dot(a, b, acc=acc)
    return acc


@triton.jit
def _acc0(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr):
    """The zero accumulator: int32 for int8, else float32."""
    if QUANT == 2:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _dot_k(
    a_ptrs, w_ptrs, as_ptrs, ws_ptrs, offs_k, K, stride_ak, stride_wk, stride_ask, stride_wsk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    QUANT: tl.constexpr, SCALE_K: tl.constexpr, SWAP: tl.constexpr = False,
):  # fmt: skip
    """`[BLOCK_M, BLOCK_N]` sum over K of a `[BLOCK_M, BLOCK_K]` x w `[BLOCK_K, BLOCK_N]` tiles from
    ``a_ptrs`` / ``w_ptrs`` (the K tail masked to 0 unless EVEN_K): float32 (QUANT 0 bf16; 1 fp8,
    each step times its SCALE_K-group scales at ``as_ptrs`` / ``ws_ptrs``) or int32 (2, int8);
    SWAP: summed transposed (:func:`_mma`), transposed back at the end."""
    acc = _acc0(BLOCK_N, BLOCK_M, QUANT) if SWAP else _acc0(BLOCK_M, BLOCK_N, QUANT)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0)
        acc = _mma(acc, a, b, as_ptrs, ws_ptrs, kb, stride_ask, stride_wsk, BLOCK_K, QUANT, SCALE_K,
                   SWAP)  # fmt: skip
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return tl.trans(acc) if SWAP else acc


@triton.jit
def _dot_k_tma(a_desc, w_desc, as_ptrs, ws_ptrs, row_a, row_w, K, stride_ask, stride_wsk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               QUANT: tl.constexpr, SCALE_K: tl.constexpr, SWAP: tl.constexpr = False):  # fmt: skip
    """:func:`_dot_k` of a's rows from ``row_a`` and w's (`[E * N, K]`) from ``row_w``, their
    tiles brought by TMA (rows and K past the tensors read as zeros)."""
    acc = _acc0(BLOCK_N, BLOCK_M, QUANT) if SWAP else _acc0(BLOCK_M, BLOCK_N, QUANT)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([row_a, kb * BLOCK_K])
        b = w_desc.load([row_w, kb * BLOCK_K]).T
        acc = _mma(acc, a, b, as_ptrs, ws_ptrs, kb, stride_ask, stride_wsk, BLOCK_K, QUANT, SCALE_K,
                   SWAP)  # fmt: skip
    return tl.trans(acc) if SWAP else acc


@triton.jit
def _a_rows(a_rows_ptr, offs_m, M, GATHER: tl.constexpr):
    """int64 rows of a that block rows ``offs_m`` read: themselves (tail rows past M wrap onto
    valid memory, never stored) or, with GATHER, a_rows' entries (padding's -1: row 0)."""
    rows = (offs_m % M).to(tl.int64)
    if GATHER:
        rows = tl.maximum(tl.load(a_rows_ptr + rows), 0).to(tl.int64)
    return rows


@triton.jit
def _block_mn(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program ``pid``: GROUP_M row blocks (mostly of the same
    expert) sweep the N tiles together, so weight tiles and activation rows are reused from L2."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(tl.cdiv(M, BLOCK_M) - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    return pid_m, (pid % num_pid_in_group) // group_size_m


@triton.jit
def _scaled(acc, as_ptrs, ws_ptrs, QUANT: tl.constexpr):
    """float32 of a K sum: int8's per-token x per-channel scales applied (others: as it is)."""
    if QUANT == 2:
        return acc.to(tl.float32) * tl.load(as_ptrs)[:, None] * tl.load(ws_ptrs)[None, :]
    else:
        return acc


@triton.jit
def _tile(
    a_row_ptr, w_ptr, a_scale_row_ptr, w_scale_ptr, rows, cols, offs_k, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_asm, stride_ask, stride_wsn, stride_wsk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    QUANT: tl.constexpr, SCALE_K: tl.constexpr, SWAP: tl.constexpr = False,
):  # fmt: skip
    """float32 `[BLOCK_M, BLOCK_N]` output tile of ``rows`` (of a_row_ptr) x ``cols`` (of one
    expert's w at w_ptr / w_scale_ptr), its scales applied (SWAP: :func:`_mma`'s)."""
    a_ptrs = a_row_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    as_ptrs = a_scale_row_ptr + rows * stride_asm
    ws_cols = cols // SCALE_K if QUANT == 1 else cols  # (fp8: 128-row weight blocks)
    ws_ptrs = w_scale_ptr + ws_cols * stride_wsn
    acc = _dot_k(a_ptrs, w_ptrs, as_ptrs, ws_ptrs, offs_k, K, stride_ak, stride_wk, stride_ask,
                 stride_wsk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, QUANT, SCALE_K, SWAP)  # fmt: skip
    return _scaled(acc, as_ptrs, ws_ptrs, QUANT)


@triton.jit
def _tile_tma(
    a_desc, w_desc, a_scale_row_ptr, w_scale_ptr, row_a, row_w, rows, cols, K, stride_asm,
    stride_ask, stride_wsn, stride_wsk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, QUANT: tl.constexpr, SCALE_K: tl.constexpr, SWAP: tl.constexpr = False,
):  # fmt: skip
    """:func:`_tile` with a's rows from ``row_a`` and w's from ``row_w`` of their descriptors
    (``rows`` / ``cols``: the rows and columns whose scales apply)."""
    as_ptrs = a_scale_row_ptr + rows * stride_asm
    ws_cols = cols // SCALE_K if QUANT == 1 else cols  # (fp8: 128-row weight blocks)
    ws_ptrs = w_scale_ptr + ws_cols * stride_wsn
    acc = _dot_k_tma(a_desc, w_desc, as_ptrs, ws_ptrs, row_a, row_w, K, stride_ask, stride_wsk,
                     BLOCK_M, BLOCK_N, BLOCK_K, QUANT, SCALE_K, SWAP)  # fmt: skip
    return _scaled(acc, as_ptrs, ws_ptrs, QUANT)


@triton.jit
def _store_tile(out_ptr, y, offs_m, offs_n, M, N, stride_om, stride_on):
    """y rounded to bf16 into out's rows offs_m (< M) and columns offs_n (< N)."""
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    o_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, round_float(y, tl.bfloat16), mask=o_mask)


@triton.jit
def _contiguous_tile(
    tile, a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, m_indices_ptr, a_rows_ptr, out_ptr, M, N, K,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_asm, stride_ask,
    stride_wse, stride_wsn, stride_wsk, stride_om, stride_on,
    QUANT: tl.constexpr, SCALE_K: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    TMA: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    """The contiguous kernel's ``tile``, read and written through pointers (rows of a through
    a_rows with GATHER) or TMA descriptors; a -1 block writes nothing (SWAP: :func:`_mma`'s)."""
    pid_m, pid_n = _block_mn(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # the block's expert is its first row's: alignment % BLOCK_M == 0 puts every block in one expert
    expert = tl.load(m_indices_ptr + pid_m * BLOCK_M)  # (int32: descriptor rows are)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # tail rows/columns wrap onto valid memory (TMA: read as zeros); their results are never stored
    cols = offs_n % N
    if TMA:
        y = _tile_tma(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr + e64 * stride_wse, pid_m * BLOCK_M,
                      expert * N + pid_n * BLOCK_N, offs_m % M, cols, K, stride_asm, stride_ask,
                      stride_wsn, stride_wsk, BLOCK_M, BLOCK_N, BLOCK_K, QUANT, SCALE_K,
                      SWAP)  # fmt: skip
        # (the store clips the tile at M and N; an async store frees the registers sooner)
        out_ptr.store([pid_m * BLOCK_M, pid_n * BLOCK_N], round_float(y, tl.bfloat16))
    else:
        rows = _a_rows(a_rows_ptr, offs_m, M, GATHER)
        y = _tile(a_ptr, w_ptr + e64 * stride_we, a_scale_ptr, w_scale_ptr + e64 * stride_wse,
                  rows, cols, tl.arange(0, BLOCK_K), K, stride_am, stride_ak, stride_wn,
                  stride_wk, stride_asm, stride_ask, stride_wsn, stride_wsk, BLOCK_M, BLOCK_N,
                  BLOCK_K, EVEN_K, QUANT, SCALE_K, SWAP)  # fmt: skip
        _store_tile(out_ptr, y, offs_m, offs_n, M, N, stride_om, stride_on)


@triton.heuristics({"EVEN_K": _even_k})
@triton.jit(do_not_specialize=["M"])
def _contiguous_kernel(
    # tensors (bf16: the scale pointers are unused; a_rows_ptr: GATHER only; TMA: a_ptr, w_ptr and
    # out_ptr are tensor descriptors of a `[M, K]`, w `[E * N, K]` and out `[M, N]`)
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, m_indices_ptr, a_rows_ptr, out_ptr,
    # sizes (E only keys the autotuner)
    M, N, K, E,
    # strides
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_asm, stride_ask,
    stride_wse, stride_wsn, stride_wsk,
    stride_om, stride_on,
    # meta
    QUANT: tl.constexpr, SCALE_K: tl.constexpr, GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, TMA: tl.constexpr = False, SWAP: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl(PDL)
    # TMA: programs loop over the tiles (persistent when fewer than the tiles); else one tile each
    if TMA:
        for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N),
                          tl.num_programs(0)):  # fmt: skip
            _contiguous_tile(tile, a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, m_indices_ptr,
                             a_rows_ptr, out_ptr, M, N, K, stride_am, stride_ak, stride_we,
                             stride_wn, stride_wk, stride_asm, stride_ask, stride_wse, stride_wsn,
                             stride_wsk, stride_om, stride_on, QUANT, SCALE_K, GATHER, BLOCK_M,
                             BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, True, SWAP)  # fmt: skip
    else:
        _contiguous_tile(tl.program_id(0), a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, m_indices_ptr,
                         a_rows_ptr, out_ptr, M, N, K, stride_am, stride_ak, stride_we, stride_wn,
                         stride_wk, stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk,
                         stride_om, stride_on, QUANT, SCALE_K, GATHER, BLOCK_M, BLOCK_N, BLOCK_K,
                         GROUP_M, EVEN_K, False, SWAP)  # fmt: skip


@triton.jit
def _gate_up_step(acc_g, acc_u, a, bg, bu, as_ptrs, ws_ptrs, UP_S, kb, stride_ask, stride_wsk,
                  BLOCK_K: tl.constexpr, QUANT: tl.constexpr, SCALE_K: tl.constexpr,
                  GLU: tl.constexpr, SWAP: tl.constexpr = False):  # fmt: skip
    """:func:`_mma` of one a tile with the gate (``bg``) and up (``bu``) w tiles (the up scales
    ``UP_S`` elements past the gate's; fp8: a's step scale loaded once for both); without GLU
    only the up sum; SWAP: both sums transposed, as :func:`_mma`'s."""
    if QUANT == 1:
        g = kb * BLOCK_K // SCALE_K
        if SWAP:
            a_s = tl.load(as_ptrs + g * stride_ask)[None, :]
            at = tl.trans(a)
            acc_u += tl.dot(tl.trans(bu), at) * (tl.load(ws_ptrs + UP_S + g * stride_wsk)[:, None]
                                                 * a_s)  # fmt: skip
            if GLU:
                acc_g += tl.dot(tl.trans(bg), at) * (tl.load(ws_ptrs + g * stride_wsk)[:, None]
                                                     * a_s)  # fmt: skip
        else:
            a_s = tl.load(as_ptrs + g * stride_ask)[:, None]
            acc_u += tl.dot(a, bu) * (a_s * tl.load(ws_ptrs + UP_S + g * stride_wsk)[None, :])
            if GLU:
                acc_g += tl.dot(a, bg) * (a_s * tl.load(ws_ptrs + g * stride_wsk)[None, :])
    else:
        acc_u = _mma(acc_u, a, bu, as_ptrs, ws_ptrs, kb, stride_ask, stride_wsk, BLOCK_K, QUANT,
                     SCALE_K, SWAP)  # fmt: skip
        if GLU:
            acc_g = _mma(acc_g, a, bg, as_ptrs, ws_ptrs, kb, stride_ask, stride_wsk, BLOCK_K,
                         QUANT, SCALE_K, SWAP)  # fmt: skip
    return acc_g, acc_u


@triton.jit
def _gate_up_scaled(acc_g, acc_u, as_ptrs, ws_ptrs, UP_S, QUANT: tl.constexpr, GLU: tl.constexpr,
                    SWAP: tl.constexpr = False):  # fmt: skip
    """float32 (gate, up) of the K sums (SWAP: transposed back first): int8's per-token x
    per-channel scales applied."""
    if SWAP:
        acc_u = tl.trans(acc_u)
        acc_g = tl.trans(acc_g) if GLU else acc_g
    u = _scaled(acc_u, as_ptrs, ws_ptrs + UP_S, QUANT)
    g = _scaled(acc_g, as_ptrs, ws_ptrs, QUANT) if GLU else u
    return g, u


@triton.jit
def _dot_gate_up(
    a_ptrs, w_ptrs, as_ptrs, ws_ptrs, offs_k, K, UP, UP_S, stride_ak, stride_wk, stride_ask,
    stride_wsk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, QUANT: tl.constexpr, SCALE_K: tl.constexpr, GLU: tl.constexpr,
    SWAP: tl.constexpr = False,
):  # fmt: skip
    """:func:`_dot_k` of the gate rows at ``w_ptrs`` and the up rows ``UP`` elements (their
    scales ``UP_S``) further, one load of each a tile for both: float32 (gate, up), their scales
    applied (int8: int32 sums, then per-token x per-channel scales as :func:`_tile`); without GLU
    the up rows are at ``w_ptrs`` and the gate's sum stays 0 (unused). SWAP: summed transposed
    (:func:`_mma`)."""
    acc_g = _acc0(BLOCK_N, BLOCK_M, QUANT) if SWAP else _acc0(BLOCK_M, BLOCK_N, QUANT)
    acc_u = _acc0(BLOCK_N, BLOCK_M, QUANT) if SWAP else _acc0(BLOCK_M, BLOCK_N, QUANT)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            bu = tl.load(w_ptrs + UP)
            bg = tl.load(w_ptrs) if GLU else None
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
            bu = tl.load(w_ptrs + UP, mask=offs_k[:, None] < k_left, other=0)
            bg = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0) if GLU else None
        acc_g, acc_u = _gate_up_step(acc_g, acc_u, a, bg, bu, as_ptrs, ws_ptrs, UP_S, kb,
                                     stride_ask, stride_wsk, BLOCK_K, QUANT, SCALE_K, GLU,
                                     SWAP)  # fmt: skip
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return _gate_up_scaled(acc_g, acc_u, as_ptrs, ws_ptrs, UP_S, QUANT, GLU, SWAP)


@triton.jit
def _dot_gate_up_tma(a_desc, w_desc, as_ptrs, ws_ptrs, row_a, row_w, K, UP_ROWS, UP_S,
                     stride_ask, stride_wsk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, QUANT: tl.constexpr, SCALE_K: tl.constexpr,
                     GLU: tl.constexpr, SWAP: tl.constexpr = False):  # fmt: skip
    """:func:`_dot_gate_up` of a's rows from ``row_a`` and w's (`[E * W, K]`) gate rows from
    ``row_w``, up rows ``UP_ROWS`` further, their tiles brought by TMA."""
    acc_g = _acc0(BLOCK_N, BLOCK_M, QUANT) if SWAP else _acc0(BLOCK_M, BLOCK_N, QUANT)
    acc_u = _acc0(BLOCK_N, BLOCK_M, QUANT) if SWAP else _acc0(BLOCK_M, BLOCK_N, QUANT)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([row_a, kb * BLOCK_K])
        bu = w_desc.load([row_w + UP_ROWS, kb * BLOCK_K]).T
        bg = w_desc.load([row_w, kb * BLOCK_K]).T if GLU else None
        acc_g, acc_u = _gate_up_step(acc_g, acc_u, a, bg, bu, as_ptrs, ws_ptrs, UP_S, kb,
                                     stride_ask, stride_wsk, BLOCK_K, QUANT, SCALE_K, GLU,
                                     SWAP)  # fmt: skip
    return _gate_up_scaled(acc_g, acc_u, as_ptrs, ws_ptrs, UP_S, QUANT, GLU, SWAP)


@triton.jit
def _gate_store(
    acc_g, acc_u, expert, offs_m, cols, pid_n, M, I, b_ptr, h_ptr, hs_ptr, stride_be, stride_bw,
    stride_hm, stride_hn, stride_hsm, stride_hsg, UP: tl.constexpr, QUANT: tl.constexpr,
    HAS_BIAS: tl.constexpr, FAST: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr,
    LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr, GLU: tl.constexpr,
    GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """h of a tile: the bias of the block's expert (as the activation stage adds it), then the
    gate on GEMM1's bf16 outputs (the unfused chain's bytes), stored as bf16 or, fp8, quantized
    over the tile (BLOCK_N == SCALE_K: one scale group a row) with its scales."""
    wc = cols % I
    bg, bu = None, None
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_be
        bu = tl.load(b_row + (UP + wc) * stride_bw)[None, :]
        bg = tl.load(b_row + wc * stride_bw)[None, :] if GLU else None
    g = round_float(acc_g, tl.bfloat16) if GLU else None
    h = _gate_rounded(g, round_float(acc_u, tl.bfloat16), bg, bu, HAS_BIAS, ACT, ALPHA, LIMIT,
                      CLAMP_AFTER, UP_OFFSET, GLU, GATE_SOFTCAP, UP_SOFTCAP, FAST)  # fmt: skip
    m = (offs_m[:, None] < M) & (cols[None, :] < I)
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + cols[None, :] * stride_hn
    if QUANT == 1:
        q, hs = _quant_fp8_groups(h)
        tl.store(h_ptrs, q, mask=m)
        tl.store(hs_ptr + offs_m.to(tl.int64) * stride_hsm + pid_n * stride_hsg, hs,
                 mask=offs_m < M)  # fmt: skip
    else:
        tl.store(h_ptrs, round_float(h, tl.bfloat16), mask=m)


@triton.jit
def _gate_tile(
    tile, a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, m_indices_ptr, a_rows_ptr, b_ptr, h_ptr, hs_ptr,
    M, I, K, stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_asm, stride_ask,
    stride_wse, stride_wsn, stride_wsk, stride_be, stride_bw, stride_hm, stride_hn, stride_hsm,
    stride_hsg, QUANT: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    FAST: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr,
    GLU: tl.constexpr, GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """The GEMM1 + gate kernel's ``tile``: its K sums through pointers or (TMA) descriptors,
    then :func:`_gate_store`; a -1 block writes nothing."""
    pid_m, pid_n = _block_mn(tile, M, I, BLOCK_M, BLOCK_N, GROUP_M)
    expert = tl.load(m_indices_ptr + pid_m * BLOCK_M)  # (int32: descriptor rows are)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    e64 = expert.to(tl.int64)
    up = I if GLU else 0  # (the up rows' offset in w and in the bias)
    per = SCALE_K if QUANT == 1 else 1  # (fp8: 128-row weight blocks; int8: a scale per row)
    wc = cols % I
    ws_e = w_scale_ptr + e64 * stride_wse + (wc // per) * stride_wsn
    if TMA:
        acc_g, acc_u = _dot_gate_up_tma(
            a_ptr, w_ptr, a_scale_ptr + (offs_m % M) * stride_asm, ws_e, pid_m * BLOCK_M,
            expert * (up + I) + pid_n * BLOCK_N, K, up, (up // per) * stride_wsn,
            stride_ask, stride_wsk, BLOCK_M, BLOCK_N, BLOCK_K, QUANT, SCALE_K, GLU,
        )  # fmt: skip
    else:
        rows = _a_rows(a_rows_ptr, offs_m, M, GATHER)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_e = w_ptr + e64 * stride_we + wc[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc_g, acc_u = _dot_gate_up(
            a_ptrs, w_e, a_scale_ptr + rows * stride_asm, ws_e, offs_k, K, up * stride_wn,
            (up // per) * stride_wsn, stride_ak, stride_wk, stride_ask, stride_wsk, BLOCK_M,
            BLOCK_N, BLOCK_K, EVEN_K, QUANT, SCALE_K, GLU,
        )  # fmt: skip
    _gate_store(acc_g, acc_u, e64, offs_m, cols, pid_n, M, I, b_ptr, h_ptr, hs_ptr,
                stride_be, stride_bw, stride_hm, stride_hn, stride_hsm, stride_hsg, up, QUANT,
                HAS_BIAS, FAST, ACT, ALPHA, LIMIT, CLAMP_AFTER, UP_OFFSET, GLU, GATE_SOFTCAP,
                UP_SOFTCAP)  # fmt: skip


@triton.heuristics({"EVEN_K": _even_k})
@triton.jit(do_not_specialize=["M"])
def _contiguous_gate_kernel(
    # tensors (bf16: the scale pointers are unused; no bias: b_ptr unused; a_rows_ptr: GATHER;
    # TMA: a_ptr and w_ptr are tensor descriptors of a `[M, K]` and w `[E * W, K]`)
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, m_indices_ptr, a_rows_ptr, b_ptr, h_ptr, hs_ptr,
    # sizes: I the gate's outputs (w's rows: the I gate rows, then the I up rows with GLU)
    M, I, K, E,
    # strides
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_asm, stride_ask,
    stride_wse, stride_wsn, stride_wsk, stride_be, stride_bw, stride_hm, stride_hn,
    stride_hsm, stride_hsg,
    # meta
    QUANT: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    # the gate (epmoe.gate.Gate.meta)
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr,
    UP_OFFSET: tl.constexpr, GLU: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
    UP_SOFTCAP: tl.constexpr, TMA: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl(PDL)
    # TMA: programs loop over the tiles (persistent when fewer than the tiles); else one tile each
    if TMA:
        for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(I, BLOCK_N),
                          tl.num_programs(0)):  # fmt: skip
            _gate_tile(tile, a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, m_indices_ptr, a_rows_ptr,
                       b_ptr, h_ptr, hs_ptr, M, I, K, stride_am, stride_ak, stride_we,
                       stride_wn, stride_wk, stride_asm, stride_ask, stride_wse, stride_wsn,
                       stride_wsk, stride_be, stride_bw, stride_hm, stride_hn, stride_hsm,
                       stride_hsg, QUANT, SCALE_K, HAS_BIAS, FAST, GATHER, BLOCK_M, BLOCK_N,
                       BLOCK_K, GROUP_M, EVEN_K, ACT, ALPHA, LIMIT, CLAMP_AFTER, UP_OFFSET, GLU,
                       GATE_SOFTCAP, UP_SOFTCAP, True)  # fmt: skip
    else:
        _gate_tile(tl.program_id(0), a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, m_indices_ptr,
                   a_rows_ptr, b_ptr, h_ptr, hs_ptr, M, I, K, stride_am, stride_ak, stride_we,
                   stride_wn, stride_wk, stride_asm, stride_ask, stride_wse, stride_wsn,
                   stride_wsk, stride_be, stride_bw, stride_hm, stride_hn, stride_hsm,
                   stride_hsg, QUANT, SCALE_K, HAS_BIAS, FAST, GATHER, BLOCK_M, BLOCK_N, BLOCK_K,
                   GROUP_M, EVEN_K, ACT, ALPHA, LIMIT, CLAMP_AFTER, UP_OFFSET, GLU, GATE_SOFTCAP,
                   UP_SOFTCAP, False)  # fmt: skip


@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def _masked_kernel(
    # tensors (bf16: the scale pointers are unused; TMA: a_ptr and w_ptr are tensor descriptors
    # of a `[E * T, K]` and w `[E * N, K]`)
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, masked_m_ptr, out_ptr, ok_ptr,
    # sizes (E only keys the autotuner)
    T, N, K, E,
    # strides
    stride_ae, stride_at, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_ase, stride_ast, stride_ask,
    stride_wse, stride_wsn, stride_wsk,
    stride_oe, stride_ot, stride_on,
    # meta
    QUANT: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, CHECK: tl.constexpr, E_PAD: tl.constexpr, TMA: tl.constexpr = False,
    SWAP: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl(PDL)
    # (the M_SPLIT programs of one weight tile are adjacent in launch order: they stream the same
    # weights at the same time, the later ones from L2)
    pid_s = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.program_id(2)
    if CHECK:  # the op's value check, without launches of its own: ok = all counts in [0, T]
        if pid_n + expert + pid_s == 0:
            ex = tl.arange(0, E_PAD)
            c = tl.load(masked_m_ptr + ex, mask=ex < E, other=0)
            n_bad = tl.sum(((c < 0) | (c > T)).to(tl.int32), axis=0)
            tl.store(ok_ptr + ex, (ex * 0 + n_bad) == 0, mask=ex < 1)
    # clamped to T so a bad count can never read past the expert's slot (the op also asserts it)
    count = tl.minimum(tl.load(masked_m_ptr + expert), T)
    e64 = expert.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N

    # Row blocks pid_s, pid_s + M_SPLIT, ... below the device-side count: a fixed grid (graph-safe)
    # whose programs past the count do nothing, sized by expected_m rather than by T.
    for m0 in range(pid_s * BLOCK_M, count, M_SPLIT * BLOCK_M):
        offs_t = m0 + tl.arange(0, BLOCK_M)
        # rows >= count are never read: clamp onto the last live row, never store them
        rows = tl.minimum(offs_t, count - 1).to(tl.int64)
        if TMA:  # (a `[E * T, K]`, w `[E * N, K]`; rows past the count are read, not stored)
            y = _tile_tma(a_ptr, w_ptr, a_scale_ptr + e64 * stride_ase,
                          w_scale_ptr + e64 * stride_wse, expert * T + m0,
                          expert * N + pid_n * BLOCK_N, rows, cols, K, stride_ast, stride_ask,
                          stride_wsn, stride_wsk, BLOCK_M, BLOCK_N, BLOCK_K, QUANT,
                          SCALE_K, SWAP)  # fmt: skip
        else:
            y = _tile(a_ptr + e64 * stride_ae, w_ptr + e64 * stride_we,
                      a_scale_ptr + e64 * stride_ase, w_scale_ptr + e64 * stride_wse, rows, cols,
                      tl.arange(0, BLOCK_K), K, stride_at, stride_ak, stride_wn, stride_wk,
                      stride_ast, stride_ask, stride_wsn, stride_wsk, BLOCK_M, BLOCK_N, BLOCK_K,
                      EVEN_K, QUANT, SCALE_K, SWAP)  # fmt: skip
        o_ptrs = (
            out_ptr
            + e64 * stride_oe
            + offs_t.to(tl.int64)[:, None] * stride_ot
            + offs_n[None, :] * stride_on
        )
        o_mask = (offs_t[:, None] < count) & (offs_n[None, :] < N)
        tl.store(o_ptrs, round_float(y, tl.bfloat16), mask=o_mask)


@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def _masked_gate_kernel(
    # tensors (bf16: the scale pointers are unused; no bias: b_ptr unused; TMA: a_ptr and w_ptr
    # are tensor descriptors of a `[E * T, K]` and w `[E * W, K]`)
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, masked_m_ptr, b_ptr, h_ptr, hs_ptr,
    # sizes: I the gate's outputs (w's rows: the I gate rows, then the I up rows with GLU)
    T, I, K, E,
    # strides
    stride_ae, stride_at, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_ase, stride_ast, stride_ask,
    stride_wse, stride_wsn, stride_wsk,
    stride_be, stride_bw,
    stride_he, stride_ht, stride_hn,
    stride_hse, stride_hst, stride_hsg,
    # meta
    QUANT: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    # the gate (epmoe.gate.Gate.meta)
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr,
    UP_OFFSET: tl.constexpr, GLU: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
    UP_SOFTCAP: tl.constexpr, TMA: tl.constexpr = False, SWAP: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl(PDL)
    # The masked kernel's grid and row loop (pid_s, column tile, expert), each tile's gate and up
    # sums then the GEMM1 + gate kernel's epilogue (_gate_store) on the slot's live rows.
    pid_s = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.program_id(2)
    count = tl.minimum(tl.load(masked_m_ptr + expert), T)
    e64 = expert.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    up = I if GLU else 0  # (the up rows' offset in w and in the bias)
    per = SCALE_K if QUANT == 1 else 1  # (fp8: 128-row weight blocks; int8: a scale per row)
    wc = cols % I
    ws_e = w_scale_ptr + e64 * stride_wse + (wc // per) * stride_wsn
    as_e = a_scale_ptr + e64 * stride_ase
    for m0 in range(pid_s * BLOCK_M, count, M_SPLIT * BLOCK_M):
        offs_t = m0 + tl.arange(0, BLOCK_M)
        # rows >= count are never read through pointers (clamped onto the last live row), never
        # stored
        rows = tl.minimum(offs_t, count - 1).to(tl.int64)
        if TMA:
            acc_g, acc_u = _dot_gate_up_tma(
                a_ptr, w_ptr, as_e + rows * stride_ast, ws_e, expert * T + m0,
                expert * (up + I) + pid_n * BLOCK_N, K, up, (up // per) * stride_wsn, stride_ask,
                stride_wsk, BLOCK_M, BLOCK_N, BLOCK_K, QUANT, SCALE_K, GLU, SWAP,
            )  # fmt: skip
        else:
            offs_k = tl.arange(0, BLOCK_K)
            a_e = a_ptr + e64 * stride_ae
            a_ptrs = a_e + rows[:, None] * stride_at + offs_k[None, :] * stride_ak
            w_e = w_ptr + e64 * stride_we + wc[None, :] * stride_wn + offs_k[:, None] * stride_wk
            acc_g, acc_u = _dot_gate_up(
                a_ptrs, w_e, as_e + rows * stride_ast, ws_e, offs_k, K, up * stride_wn,
                (up // per) * stride_wsn, stride_ak, stride_wk, stride_ask, stride_wsk, BLOCK_M,
                BLOCK_N, BLOCK_K, EVEN_K, QUANT, SCALE_K, GLU, SWAP,
            )  # fmt: skip
        _gate_store(acc_g, acc_u, e64, offs_t, cols, pid_n, count, I, b_ptr,
                    h_ptr + e64 * stride_he, hs_ptr + e64 * stride_hse, stride_be, stride_bw,
                    stride_ht, stride_hn, stride_hst, stride_hsg, up, QUANT, HAS_BIAS, FAST, ACT,
                    ALPHA, LIMIT, CLAMP_AFTER, UP_OFFSET, GLU, GATE_SOFTCAP,
                    UP_SOFTCAP)  # fmt: skip


_FP8_MAX_TILE = 64 * 128  # fp8 output tile elements that compile without spills on sm90
# shared memory a block may take on sm90; a GEMM kernel's pipeline holds num_stages (a, w) tile
# pairs (what Triton 3.6 asks for, checked by scripts/compile_kernels.py)
_MAX_SHARED = 232448


def _cfg(num_warps, num_stages, **kw):
    return triton.Config(kw, num_warps=num_warps, num_stages=num_stages)


def _gluon_cfg(num_warps, num_stages, block_m, block_n, block_k, persistent, store_tma=False,
               ws=False, coop=False, masked=False):  # fmt: skip
    """A Gluon (int8 / fp8 / bf16) config (``store_tma``: out staged for a TMA store, else from
    registers; ``ws``: warp-specialized, num_warps and num_stages per MMA warpgroup, of which
    there are two; ``coop``: WS with the two on the halves of each tile, one ring of num_stages;
    ``masked``: the masked kernel's, without GROUP_M, STORE_TMA only where set)."""
    if masked:
        kw = dict(STORE_TMA=True) if store_tma else {}
    else:
        kw = dict(GROUP_M=8, STORE_TMA=store_tma)
    kw = dict(kw, WS=True) if ws or coop else kw
    kw = dict(kw, COOP=True) if coop else kw
    return _cfg(num_warps, num_stages, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                TMA=True, PERSISTENT=persistent, GLUON=True, **kw)  # fmt: skip


# Hopper-sized tiles for the compute-bound prefill GEMM (<= ~200 KB shared memory; configs that do
# not fit are dropped by the autotuner), then narrower row blocks for small alignments (decode).
_CONTIGUOUS_CONFIGS = [
    _cfg(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
    _cfg(4, 5, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
    _cfg(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=256, GROUP_M=8),
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=8),
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
    _cfg(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8),
    _cfg(4, 4, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=4),
    _cfg(4, 4, BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, GROUP_M=4),
    _cfg(4, 4, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1),
    _cfg(4, 4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1),
    _cfg(4, 5, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1),
    # K tiles of 64 divide K = 2880 (gpt-oss), where 128 and 256 leave a masked tail every step
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8),
    _cfg(4, 5, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1),
    # bf16's large tiles: its 2-byte operands fit shared memory only with K tiles of 64
    _cfg(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8),
    _cfg(4, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8),
    _cfg(4, 3, BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8),
    # prefill tiles fed by TMA (the tuned table's choice only), one program per tile or
    # persistent (PERSISTENT programs per multiprocessor loop over the tiles)
    _cfg(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, TMA=True),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, TMA=True),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, TMA=True),
    _cfg(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, TMA=True, PERSISTENT=1),
    # two programs resident a multiprocessor (int8 only: 96 KB of shared memory each), each
    # running its epilogue while the other computes
    _cfg(4, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, TMA=True, PERSISTENT=2),
    # the same pair on 64-row blocks (fp8 / int8: 96 KB each), and a 64-row bf16 / int8 tile on one
    # warpgroup's widest wgmma: alignment 64 pads half the rows 128 does
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, TMA=True, PERSISTENT=2),
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, TMA=True),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, TMA=True),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, TMA=True),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, TMA=True, PERSISTENT=1),
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, TMA=True),
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, TMA=True),
    _cfg(8, 5, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, TMA=True, PERSISTENT=1),
    # 16- and 32-row blocks as wgmma's N (SWAP, as the masked kernel's): tl.dot takes mma.sync
    # below 64 rows, fp8 through float16
    _cfg(4, 4, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, SWAP=True),
    _cfg(4, 4, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=4, SWAP=True),
    _cfg(4, 4, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, TMA=True, SWAP=True),
    # (int8 only: a 128x128 tile on one warpgroup, persistent)
    _cfg(4, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, TMA=True, PERSISTENT=1),
    # int8 / bf16 through the Gluon kernel (int8: its wgmma asynchronous; num_stages = its TMA
    # stages), out staged for a TMA store or (two programs a multiprocessor) stored from registers
    _gluon_cfg(4, 4, 128, 128, 128, 1, True),
    _gluon_cfg(4, 3, 128, 128, 128, 2, False),
    _gluon_cfg(4, 4, 128, 128, 64, 2, True),
    _gluon_cfg(8, 3, 128, 256, 128, 1, True),
    _gluon_cfg(8, 4, 128, 256, 128, 1, False),
    _gluon_cfg(8, 4, 128, 256, 64, 1, True),
    _gluon_cfg(8, 6, 128, 256, 64, 1, True),
    _gluon_cfg(4, 4, 64, 128, 128, 2, False),
    _gluon_cfg(4, 4, 64, 256, 128, 1, True),
    # warp-specialized: two MMA warpgroups take tiles in turn, one's epilogue under the other's MMA
    _gluon_cfg(4, 3, 128, 128, 128, 1, False, ws=True),
    _gluon_cfg(4, 2, 128, 128, 128, 1, True, ws=True),
    _gluon_cfg(4, 5, 128, 128, 64, 1, True, ws=True),
    _gluon_cfg(4, 6, 128, 128, 64, 1, False, ws=True),
    _gluon_cfg(4, 2, 64, 256, 128, 1, True, ws=True),
    # the two MMA warpgroups on the halves of each 128x256 tile, one ring
    _gluon_cfg(4, 3, 128, 256, 128, 1, True, coop=True),
    _gluon_cfg(4, 4, 128, 256, 128, 1, False, coop=True),
    _gluon_cfg(4, 6, 128, 256, 64, 1, True, coop=True),
    # (bf16's two-byte operands: the tiles above with fewer stages, within shared memory)
    _gluon_cfg(8, 3, 128, 256, 64, 1, True),
    _gluon_cfg(4, 3, 128, 128, 64, 1, False, ws=True),
    _gluon_cfg(4, 3, 128, 256, 64, 1, True, coop=True),
    _gluon_cfg(4, 4, 128, 256, 64, 1, False, coop=True),
]
# Decode is a weight stream: narrow N tiles, long K tiles, deep pipelines keep HBM busy.
_MASKED_CONFIGS = [
    _cfg(4, 4, BLOCK_N=64, BLOCK_K=256),
    _cfg(4, 4, BLOCK_N=128, BLOCK_K=256),
    _cfg(4, 5, BLOCK_N=64, BLOCK_K=128),
    _cfg(4, 4, BLOCK_N=128, BLOCK_K=128),
    _cfg(4, 3, BLOCK_N=32, BLOCK_K=512),
    _cfg(8, 3, BLOCK_N=128, BLOCK_K=128),
    _cfg(4, 6, BLOCK_N=64, BLOCK_K=64),
    _cfg(4, 5, BLOCK_N=128, BLOCK_K=64),
    # the weight stream through TMA (the tuned table's choice only)
    _cfg(4, 4, BLOCK_N=64, BLOCK_K=256, TMA=True),
    _cfg(4, 5, BLOCK_N=64, BLOCK_K=128, TMA=True),
    _cfg(4, 4, BLOCK_N=128, BLOCK_K=128, TMA=True),
    # fewer stages, two or three programs a multiprocessor: one's epilogue and first loads under
    # the others' streams (docs/kernels.md)
    _cfg(4, 3, BLOCK_N=128, BLOCK_K=128, TMA=True),
    _cfg(4, 2, BLOCK_N=128, BLOCK_K=128, TMA=True),
    _cfg(4, 3, BLOCK_N=128, BLOCK_K=64, TMA=True),
    # a few rows a slot as wgmma's N, the weight tile as its M (SWAP): below 64 rows tl.dot takes
    # mma.sync instead, through float16 for fp8
    _cfg(4, 4, BLOCK_N=128, BLOCK_K=128, SWAP=True),
    _cfg(4, 5, BLOCK_N=64, BLOCK_K=128, SWAP=True),
    _cfg(4, 4, BLOCK_N=64, BLOCK_K=256, SWAP=True),
    _cfg(4, 5, BLOCK_N=64, BLOCK_K=128, TMA=True, SWAP=True),
    _cfg(4, 4, BLOCK_N=128, BLOCK_K=128, TMA=True, SWAP=True),
    _cfg(4, 4, BLOCK_N=64, BLOCK_K=256, TMA=True, SWAP=True),
    _cfg(4, 3, BLOCK_N=128, BLOCK_K=128, TMA=True, SWAP=True),
    # int8 through the Gluon kernel (its wgmma asynchronous), persistent over the live row blocks
    # of every slot: its own BLOCK_M, for experts of tens to hundreds of rows
    _gluon_cfg(4, 4, 64, 128, 128, 2, masked=True),
    _gluon_cfg(4, 4, 64, 256, 128, 1, masked=True),
    _gluon_cfg(4, 4, 128, 128, 128, 1, masked=True),
    _gluon_cfg(4, 3, 128, 128, 128, 2, masked=True),
    _gluon_cfg(8, 4, 128, 256, 128, 1, masked=True),
    _gluon_cfg(8, 6, 128, 256, 64, 1, masked=True),
    _gluon_cfg(4, 3, 128, 128, 128, 1, ws=True, masked=True),
    _gluon_cfg(4, 2, 64, 256, 128, 1, ws=True, masked=True),
    _gluon_cfg(4, 4, 64, 128, 128, 1, ws=True, masked=True),
    _gluon_cfg(4, 4, 128, 256, 128, 1, coop=True, masked=True),
    _gluon_cfg(4, 6, 128, 256, 64, 1, coop=True, masked=True),
    # out through a TMA store of whole row blocks (slots of a multiple of BLOCK_M rows): the
    # register epilogue's 128 column offsets a thread spill in the WS / COOP builds
    _gluon_cfg(4, 4, 64, 128, 128, 2, True, masked=True),
    _gluon_cfg(4, 5, 128, 128, 64, 1, True, ws=True, masked=True),
    _gluon_cfg(4, 3, 128, 256, 128, 1, True, coop=True, masked=True),
    _gluon_cfg(4, 6, 128, 256, 64, 1, True, coop=True, masked=True),
    # (bf16's two-byte operands)
    _gluon_cfg(4, 4, 64, 256, 64, 1, masked=True),
    _gluon_cfg(8, 4, 128, 256, 64, 1, masked=True),
    _gluon_cfg(4, 4, 128, 256, 64, 1, coop=True, masked=True),
    _gluon_cfg(4, 3, 128, 256, 64, 1, True, coop=True, masked=True),
]


# GEMM1 + gate in one kernel: two float32 (int8: int32) accumulators (gate, up) per tile; fp8 out
# wants tiles of one activation scale group (BLOCK_N = 128)
_GATE_CONFIGS = [
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8),
    _cfg(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8),
    _cfg(4, 4, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=4),
    _cfg(4, 4, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1),
    _cfg(4, 4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1),
    # fed by TMA (the tuned table's choice only; PERSISTENT as the contiguous configs)
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, TMA=True),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, TMA=True),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, TMA=True, PERSISTENT=1),
    _cfg(4, 4, BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=4, TMA=True),
    # bf16 and the plain SiLU through the Gluon kernel: COOP's two MMA warpgroups on the halves
    # of a 128-row tile, a gate and an up accumulator each (w stages of 2 x 128 rows), h through a
    # TMA store
    _gluon_cfg(4, 3, 128, 128, 64, 1, True, coop=True),
    _gluon_cfg(4, 4, 128, 128, 64, 1, True, coop=True),
]


# masked GEMM1 + gate: the call's BLOCK_M; fp8 wants tiles of one activation scale group (BLOCK_N =
# 128); SWAP below 64 rows (fp8's mma.sync would go through float16)
_MASKED_GATE_CONFIGS = [
    _cfg(4, 4, BLOCK_N=128, BLOCK_K=128, SWAP=True),
    _cfg(4, 5, BLOCK_N=64, BLOCK_K=128, SWAP=True),
    _cfg(4, 4, BLOCK_N=128, BLOCK_K=64),
    _cfg(8, 4, BLOCK_N=128, BLOCK_K=128),
    _cfg(4, 3, BLOCK_N=64, BLOCK_K=128),
    _cfg(8, 4, BLOCK_N=128, BLOCK_K=64),
    # fed by TMA (the tuned table's choice only)
    _cfg(4, 4, BLOCK_N=128, BLOCK_K=128, TMA=True, SWAP=True),
    _cfg(4, 5, BLOCK_N=64, BLOCK_K=128, TMA=True, SWAP=True),
    _cfg(8, 4, BLOCK_N=128, BLOCK_K=128, TMA=True),
    # fewer stages, two programs a multiprocessor (as the masked candidates'; docs/kernels.md)
    _cfg(8, 2, BLOCK_N=128, BLOCK_K=64, TMA=True),
    _cfg(4, 3, BLOCK_N=64, BLOCK_K=64, TMA=True),
    _cfg(4, 2, BLOCK_N=64, BLOCK_K=128, TMA=True),
    # fp8's 32-row tiles as wgmma's N over 8 warps (unswapped: mma.sync through float16)
    _cfg(8, 4, BLOCK_N=128, BLOCK_K=128, SWAP=True),
    _cfg(8, 4, BLOCK_N=128, BLOCK_K=128, TMA=True, SWAP=True),
    _cfg(8, 3, BLOCK_N=128, BLOCK_K=128, TMA=True, SWAP=True),
]


def fits_masked_gate(config: Dict, quant_code: int, block_m: int) -> bool:
    """Whether ``config`` runs masked GEMM1 + gate for the scheme of kernel code ``quant_code`` at
    the call's ``block_m``: the two accumulators at most 32 (fp8) / 64 float32 a thread (sm90
    builds with more spill: ``compile_kernels.py --only "masked GEMM1 + gate" --resources``),
    fp8 tiles of one scale group, the stages within shared memory."""
    bn, bk, warps = config["BLOCK_N"], config["BLOCK_K"], config.get("num_warps", 4)
    per_thread = 2 * block_m * bn // (32 * warps)
    if quant_code == 1 and (bn != quant.FP8_GROUP or quant.FP8_GROUP % bk or per_thread > 32):
        return False
    width = 2 if quant_code == 0 else 1
    ring = config.get("num_stages", 1) * (block_m + 2 * bn) * bk * width
    return per_thread <= 64 and ring <= _MAX_SHARED


def fits_gate(config: Dict, quant_code: int, row_block: int) -> bool:
    """Whether ``config`` runs GEMM1 + gate for the scheme of kernel code ``quant_code`` (bf16 0,
    fp8 1, int8 2) at ``row_block``."""
    if row_block % config["BLOCK_M"]:
        return False
    if config.get("GLUON"):  # (bf16, COOP, h stored through TMA; a stage: a, gate and up tiles)
        bm, bn = config["BLOCK_M"], config["BLOCK_N"]
        ring = config["num_stages"] * (bm + 2 * bn) * config["BLOCK_K"] * 2
        return quant_code == 0 and bool(config.get("COOP") and config.get("STORE_TMA")) and \
            ring + bm * bn * 2 <= _MAX_SHARED  # fmt: skip
    tile = config["BLOCK_M"] * config["BLOCK_N"]
    if quant_code == 1:
        return config["BLOCK_N"] == quant.FP8_GROUP and tile <= _FP8_MAX_TILE // 2 and \
            quant.FP8_GROUP % config["BLOCK_K"] == 0  # fmt: skip
    return tile <= 64 * 128


def fits(config: Dict, quant_code: int, row_block: int = 0, block_m: int = 0) -> bool:
    """Whether tile ``config`` (BLOCK_M / BLOCK_N / BLOCK_K keys) runs the scheme of kernel code
    ``quant_code`` on expert blocks aligned to ``row_block`` rows; 0: the masked layout, whose
    BLOCK_M the call sets (``block_m``; 0: the largest it may take) unless the config does."""
    bm = config["BLOCK_M"] if row_block else \
        (config.get("BLOCK_M") or block_m or _MASKED_MAX_BLOCK_M)  # fmt: skip
    if config.get("GLUON") and quant_code == 1:
        # (no COOP, one scale group a K step, a tile within one 128-row weight block; two
        # float32 tiles live, the sum and a step's: at most 64 floats a thread each)
        per_thread = bm * config["BLOCK_N"] // (32 * config.get("num_warps", 4))
        if config.get("COOP") or quant.FP8_GROUP % config["BLOCK_N"] or per_thread > 64 or \
                quant.FP8_GROUP % config["BLOCK_K"]:  # fmt: skip
            return False
    elif quant_code == 1:
        if quant.FP8_GROUP % config["BLOCK_K"]:
            return False  # one scale group per K step
        # two float32 tiles live at once: more than 64 outputs a thread, or tiles past 64x128
        # with K tiles of 128, spill (sm90, ptxas; compile_kernels.py --resources)
        tile, threads = bm * config["BLOCK_N"], 32 * config.get("num_warps", 4)
        if tile > _FP8_MAX_TILE and (tile > 64 * threads or config["BLOCK_K"] > 64):
            return False
    if row_block % bm:
        return False
    width = 2 if quant_code == 0 else 1  # operand bytes: bf16, else fp8 / int8 codes
    tiles = (bm + config["BLOCK_N"]) * config["BLOCK_K"] * width
    # (PERSISTENT programs a multiprocessor: resident together)
    resident = max(config.get("PERSISTENT", 1), 1)
    staged = bm * config["BLOCK_N"] * 2 if config.get("STORE_TMA") else 0  # (bf16 out tile)
    ring = config.get("num_stages", 1) * tiles
    if config.get("WS") and not config.get("COOP"):  # (a ring and an out tile per MMA warpgroup)
        ring, staged = 2 * ring, 2 * staged
    return resident * (ring + staged) <= _MAX_SHARED


def fits_layout(layout: str, config: Dict, quant_code: int, block: int) -> bool:
    """Whether ``config`` runs ``layout``'s kernel ("contiguous" / "gate": expert blocks of
    ``block`` rows; "masked" / "masked_gate": BLOCK_M = ``block``) for the scheme of kernel code
    ``quant_code``: :func:`fits`, :func:`fits_gate` or :func:`fits_masked_gate`."""
    if layout == "gate":
        return fits_gate(config, quant_code, block)
    if layout == "masked_gate":
        return fits_masked_gate(config, quant_code, block)
    return fits(config, quant_code, block) if layout == "contiguous" else \
        fits(config, quant_code, 0, block)  # fmt: skip


def _layout_configs(layout: str) -> List["triton.Config"]:
    """Every candidate config of ``layout``'s kernel (the module's lists, read at the call)."""
    return {"contiguous": _CONTIGUOUS_CONFIGS, "gate": _GATE_CONFIGS, "masked": _MASKED_CONFIGS,
            "masked_gate": _MASKED_GATE_CONFIGS}[layout]  # fmt: skip


def candidates(layout: str, quant_code: int, block: int) -> List["triton.Config"]:
    """The candidate configs of ``layout``'s kernel that fit ``block`` (:func:`fits_layout`)."""
    return [c for c in _layout_configs(layout)
            if fits_layout(layout, c.all_kwargs(), quant_code, block)]  # fmt: skip


@_launch.memo
def _tuner(layout: str, quant_code: int, row_block: int):
    """Triton's autotuner over the :func:`candidates` of ``layout`` ("contiguous", "gate",
    "masked", "masked_gate") at ``row_block`` (masked: the call's BLOCK_M). Its keys are static
    dims only (never token counts): it tunes once per weight shape, in warmup()."""
    fn, key = {
        "contiguous": (_contiguous_kernel, ["N", "K", "E"]),
        "gate": (_contiguous_gate_kernel, ["I", "K", "E"]),
        "masked": (_masked_kernel, ["N", "K", "E", "BLOCK_M"]),
        "masked_gate": (_masked_gate_kernel, ["I", "K", "E", "BLOCK_M"]),
    }[layout]  # fmt: skip
    # (TMA configs take descriptors the autotuner cannot build: the tuned table picks those)
    keep = [c for c in candidates(layout, quant_code, row_block) if not c.kwargs.get("TMA")]
    return triton.autotune(keep or _layout_configs(layout)[-1:], key=key)(fn)


class _Plan:
    """One GEMM call's static launch: its layout and scheme, the tuned table's key of it, the
    grid (a function of the meta-parameters), the trailing sizes / strides and the constexprs;
    ``tma``: whether a and w can be read through TMA descriptors (no gather, rows of 16-byte
    multiples; contiguous: out written through one too); ``prepared`` holds the chosen config's
    launch per device and feed (TMA or pointers), made on the first such call."""

    __slots__ = ("layout", "code", "row_block", "table", "grid", "sizes", "meta", "tma",
                 "prepared")  # fmt: skip

    def __init__(self, layout, code, row_block, table, grid, sizes, meta, tma=False):
        self.layout, self.code, self.row_block, self.table = layout, code, row_block, table
        self.grid, self.sizes, self.meta, self.tma = grid, sizes, meta, tma
        self.prepared: Dict[Tuple[int, bool], _launch.Prepared] = {}


# config keys the host reads (the kernel never sees them): programs per multiprocessor of a
# persistent TMA launch (0: one program per tile)
_HOST_KEYS = ("PERSISTENT",)
# keys that only a TMA launch takes (GLUON: the Gluon kernel instead of the Triton one), dropped
# with TMA where a call cannot take it
_GLUON_KEYS = ("GLUON", "STORE_TMA", "WS", "COOP")
_TMA_KEYS = ("TMA", *_GLUON_KEYS, *_HOST_KEYS)


def _launch_plan(plan: _Plan, tensors: Tuple, config: Optional[Dict] = None) -> None:
    """Launch ``plan`` on its leading ``tensors``. ``config`` given (tests): that config. Else the
    first call per device takes the tuned table's config for the call's problem or, without one,
    goes through Triton's autotuner (tuning once per static key); later calls launch the chosen
    config's JITFunction as a cached :class:`epmoe._launch.Prepared`, without the autotuner's and
    the heuristics' per-call re-binding (the kernels run inside an opaque op: never traced)."""
    if config is not None:
        config = _runnable(plan, config, tensors)
        meta = {**plan.meta, **config}
        kernel = dict(contiguous=_contiguous_kernel, masked=_masked_kernel,
                      gate=_contiguous_gate_kernel,
                      masked_gate=_masked_gate_kernel)[plan.layout]  # fmt: skip
        kernel = _gluon_kernel(plan.layout) if meta.get("GLUON") else kernel
        kernel[plan.grid(meta)](*_args(plan, tensors, meta), *plan.sizes, **_kernel_meta(meta))
        return
    if not _launch._INTERPRET:
        # one launch per device and feed: a call whose a or w is not 16-byte aligned takes the
        # same tiles through pointers, cached beside the TMA launch rather than instead of it
        key = (torch._C._cuda_getDevice(), plan.tma and _aligned(plan, tensors))
        prepared = plan.prepared.get(key)
        if prepared is not None:
            prepared.untraced(*(_args(plan, tensors, prepared.meta) if key[1] else tensors))
            return
        config = _tuned.lookup(*plan.table)
    tuned = _tuner(plan.layout, plan.code, plan.row_block)
    if config is None:  # (the autotuner's run launches the kernel too)
        tuned[plan.grid](*tensors, *plan.sizes, **plan.meta)
        if not _launch._INTERPRET:
            plan.prepared[key] = _prepared(tuned.fn, plan, tensors, tuned.best_config.all_kwargs())
        return
    prepared = _prepared(tuned.fn, plan, tensors, _runnable(plan, config, tensors))
    if not _launch._INTERPRET:
        plan.prepared[key] = prepared
    prepared.untraced(*_args(plan, tensors, prepared.meta))


def _runnable(plan: _Plan, config: Dict, tensors: Tuple) -> Dict:
    """``config``, without TMA where the plan or these tensors cannot take it (the same tiles
    through pointers), on the Triton kernel under the interpreter."""
    if config.get("TMA") and not (plan.tma and _aligned(plan, tensors)):
        return {k: v for k, v in config.items() if k not in _TMA_KEYS}
    if config.get("GLUON") and _launch._INTERPRET:  # (no Gluon there: the Triton kernel's tiles)
        return {k: v for k, v in config.items() if k not in _GLUON_KEYS}
    if plan.layout == "masked" and config.get("STORE_TMA") and not _slots_stored_whole(
            tensors[5], config.get("BLOCK_M", plan.row_block)):  # fmt: skip
        return {k: v for k, v in config.items() if k != "STORE_TMA"}  # (from registers)
    if plan.layout == "gate" and config.get("GLUON") and not _gluon_gates(plan, tensors[7]):
        return {k: v for k, v in config.items() if k not in _GLUON_KEYS}  # (Triton's tile)
    return config


_SILU_META = _gate.get("silu").meta()


def _gluon_gates(plan: _Plan, h: torch.Tensor) -> bool:
    """The Gluon GEMM1 + gate runs the call: bf16, the plain SiLU without bias, h `[M, I]`
    contiguous and 16-byte aligned (its TMA store)."""
    meta = plan.meta
    plain = all(meta[k] == v for k, v in _SILU_META.items()) and not meta["HAS_BIAS"]
    stored = h.is_contiguous() and (h.shape[1] * 2) % 16 == 0 and h.data_ptr() % 16 == 0
    return plain and meta["QUANT"] == 0 and stored


def _slots_stored_whole(out: torch.Tensor, block_m: int) -> bool:
    """The masked out `[E, T, N]` takes a TMA store of whole row blocks: slots back to back, T a
    multiple of block_m (a block never reaches into the next slot)."""
    E, T, N = out.shape
    return T % block_m == 0 and out.stride() == (T * N, N, 1) and (N * 2) % 16 == 0


def _aligned(plan: _Plan, tensors: Tuple) -> bool:
    """a, w and out (the gate kernels': not out) start at 16-byte boundaries (TMA's requirement;
    their strides are the plan's)."""
    ok = tensors[0].data_ptr() % 16 == 0 and tensors[1].data_ptr() % 16 == 0
    if not ok or plan.layout in ("gate", "masked_gate"):
        return ok
    return tensors[-1 if plan.layout == "contiguous" else 5].data_ptr() % 16 == 0


def _args(plan: _Plan, tensors: Tuple, meta: Dict) -> Tuple:
    """The kernel's leading arguments: ``tensors``, with a `[M, K]` (masked: `[E, T, K]`, as
    `[E * T, K]`) and w `[E, N, K]` (as `[E * N, K]`) as TMA descriptors of the config's tiles
    when it takes TMA, and the contiguous layout's out `[M, N]` too."""
    if not meta.get("TMA"):
        return tensors
    a, w = tensors[0], tensors[1]
    bm, bk, k = meta["BLOCK_M"], meta["BLOCK_K"], a.shape[-1]
    if meta.get("GLUON"):
        rows = bm // 2 if meta.get("COOP") else bm  # (COOP stores half tiles)
        if plan.layout == "gate":  # (h `[M, I]` stored through a descriptor)
            a_d, w_d, o_d = _gluon_module().descriptors(a, w, tensors[7], bm, meta["BLOCK_N"], bk,
                                                        True, rows)  # fmt: skip
            return (a_d, w_d, *tensors[2:7], o_d, tensors[8])
        if plan.layout != "contiguous":  # (masked: out `[E, T, N]` as `[E * T, N]`)
            out, store = tensors[5], meta.get("STORE_TMA", False)
            out = out.view(-1, out.shape[-1]) if store else out
            a_d, w_d, o_d = _gluon_module().descriptors(a, w, out, bm, meta["BLOCK_N"], bk, store,
                                                        rows)  # fmt: skip
            return (a_d, w_d, *tensors[2:5], o_d, tensors[6])
        a_d, w_d, o_d = _gluon_module().descriptors(a, w, tensors[-1], bm, meta["BLOCK_N"], bk,
                                                    meta["STORE_TMA"], rows)  # fmt: skip
        return (a_d, w_d, *tensors[2:-1], o_d)
    a_d = TensorDescriptor(a, [a.numel() // k, k], [a.stride(-2), 1], [bm, bk])
    w_d = TensorDescriptor(w, [w.shape[0] * w.shape[1], w.shape[2]], [w.stride(1), 1],
                           [meta["BLOCK_N"], bk])  # fmt: skip
    if plan.layout != "contiguous":
        return (a_d, w_d, *tensors[2:])
    out = tensors[-1]
    o_d = TensorDescriptor(out, list(out.shape), [out.stride(0), 1], [bm, meta["BLOCK_N"]])
    return (a_d, w_d, *tensors[2:-1], o_d)


def _kernel_meta(meta: Dict) -> Dict:
    out = {k: v for k, v in meta.items() if k not in _HOST_KEYS}
    if meta.get("GLUON"):  # (its pipeline depth is a constexpr: Gluon does not pipeline)
        out["STAGES"] = meta["num_stages"]
    return out


def _gluon_module():
    from epmoe.ops.gemm import _gluon  # (Gluon imported only where a tuned config takes it)

    return _gluon


def _gluon_kernel(layout: str):
    g = _gluon_module()
    return dict(contiguous=g._contiguous_gluon_kernel, masked=g._masked_gluon_kernel,
                gate=g._gate_gluon_kernel)[layout]  # fmt: skip


def _prepared(fn, plan: _Plan, tensors: Tuple, config: Dict) -> _launch.Prepared:
    """The launch of ``config`` (plus the values of the heuristics under the autotuner ``fn``:
    ours read key-static arguments only, fixed per plan; a Gluon config: its kernel)."""
    meta = {**plan.meta, **config}
    grid = plan.grid(meta)
    fn = _gluon_kernel(plan.layout) if meta.get("GLUON") else fn
    meta = _kernel_meta(meta)
    while isinstance(fn, triton.runtime.autotuner.Heuristics):
        named = {**dict(zip(fn.arg_names, (*tensors, *plan.sizes), strict=False)), **meta}
        meta = {**meta, **{name: value(named) for name, value in fn.values.items()}}
        fn = fn.fn
    return _launch.Prepared(fn, grid, plan.sizes, meta)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the interpreter: 4)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _mean_rows(t: int, expected_m: int) -> int:
    """A masked call's mean rows per expert: the hint ``expected_m`` (0: t) within [1, t]."""
    return max(1, min(expected_m or t, t))


def fullest_rows(t: int, expected_m: int) -> int:
    """Rows the fullest expert of a masked call holds about, from static sizes: uniform routing
    spreads the counts like a Poisson law of mean ``expected_m`` (0: t), the max over the experts
    about 2.5 sqrt(mean) above it; at most the slot's ``t`` rows."""
    em = _mean_rows(t, expected_m)
    return min(t, em + math.ceil(2.5 * math.sqrt(em)))


@_launch.memo  # (sizes only: the same for every call of a layer)
def _masked_tiling(t: int, expected_m: int, max_block_m: int = _MASKED_MAX_BLOCK_M
                   ) -> Tuple[int, int]:  # fmt: skip
    """(BLOCK_M, M_SPLIT) of the masked kernel from static sizes. The row tile holds nearly every
    expert's count (:func:`fullest_rows`), not just the mean: a count past the tile costs its
    program a second pass over the expert's weights, the whole cost of a decode GEMM
    (docs/kernels.md). At most ``max_block_m`` rows a tile."""
    block_m = min(max_block_m, max(_MASKED_MIN_BLOCK_M, _launch.pow2(fullest_rows(t, expected_m))))
    split = max(1, min(_launch.cdiv(t, block_m), _launch.cdiv(_mean_rows(t, expected_m), block_m)))
    return block_m, split


def contiguous_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    row_block: int = 128,
    config: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
    a_rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the contiguous kernel (also on CPU tensors under TRITON_INTERPRET=1).

    Args:
        a: bf16/fp8/int8 `[M_sum, Kd]` (with a_rows: `[M, Kd]`). w: same dtype `[E, N, Kd]`.
            m_indices: int32 `[M_sum]`, contiguous. a_scales / w_scales: float32 as in
            :mod:`epmoe.ops.gemm` (None for bf16).
        row_block: expert blocks start at multiples of it (permute's alignment; a multiple of
            MIN_ROW_BLOCK): BLOCK_M divides it.
        config: explicit meta-parameters (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps,
            optionally num_stages); None = the tuned table's, else autotuned.
        out: bf16 `[M_sum, N]` to write into (tests); None allocates it.
        a_rows: int32 `[M_sum]` the row of a (and a_scales) each row reads, -1 on padding; None:
            row r reads a[r].
    Returns:
        bf16 `[M_sum, N]`; rows of -1 blocks are left unwritten.
    """
    M, K = m_indices.shape[0], a.shape[1]
    E, N = w.shape[0], w.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    m_indices = m_indices.contiguous()
    rows = m_indices if a_rows is None else a_rows.contiguous()  # (placeholder: an input)
    a_s, w_s = (w, w) if a_scales is None else (a_scales, w_scales)
    plan = _contiguous_plan(
        a.dtype, M, N, K, E, a.stride(), w.stride(), _stride(a_scales), _stride(w_scales),
        out.stride(), row_block, a_rows is not None, a.device,
    )  # fmt: skip
    _launch_plan(plan, (a, w, a_s, w_s, m_indices, rows, out), config)
    return out


def _stride(t: Optional[torch.Tensor]) -> Optional[Tuple[int, ...]]:
    return None if t is None else t.stride()


def _scale_strides(a_s, w_s, lead: int) -> Tuple[int, ...]:
    """The scale strides the kernels take: a's ``lead`` + 1 and w's 3 (zeros for bf16's absent
    scales, never read; int8's w scales `[E, N]` have no K stride)."""
    if a_s is None:
        return (0,) * (lead + 1) + (0, 0, 0)
    return (*a_s, *w_s, *(0,) * (3 - len(w_s)))


def _constexprs(dtype: torch.dtype) -> Dict:
    return dict(QUANT=quant.of_dtype(dtype).kernel_code, SCALE_K=quant.FP8_GROUP)


@_tuned.reader  # (its launch holds the table's config: re-planned on a re-read)
@_launch.memo
def _contiguous_plan(dtype, M, N, K, E, sa, sw, sas, sws, so, row_block, gather, device) -> _Plan:
    """The contiguous kernel's launch plan for these sizes, strides and row block (``gather``:
    rows of a through a_rows)."""
    meta = dict(_constexprs(dtype), GATHER=gather)
    sizes = (M, N, K, E, *sa, *sw, *_scale_strides(sas, sws, 1), *so)
    table = ("contiguous", quant.of_dtype(dtype), N, K, E, row_block, M, device)
    # (TMA stores out too: bf16 rows of 16-byte multiples)
    tma = _tma_ok(dtype, sa, sw, N, gather) and so[1] == 1 and (so[0] * 2) % 16 == 0
    return _Plan("contiguous", meta["QUANT"], row_block, table, _tile_grid(M, N, device), sizes,
                 meta, tma)  # fmt: skip


def _tile_grid(M: int, N: int, device):
    """The grid of a contiguous launch over ``M`` x ``N`` outputs: a program per tile, or
    PERSISTENT programs per multiprocessor (fewer when there are fewer tiles)."""

    def grid(m):
        n = _launch.cdiv(M, m["BLOCK_M"]) * _launch.cdiv(N, m["BLOCK_N"])
        per_sm = m.get("PERSISTENT", 0)
        return (min(n, per_sm * _multiprocessors(device)) if per_sm else n,)

    return grid


def _tma_ok(dtype, sa, sw, rows: int, gather: bool) -> bool:
    """Whether a (strides ``sa``) and w (``sw``, ``rows`` rows an expert) can be read through TMA:
    no gather, unit last strides, the others of 16-byte multiples, w's experts back to back."""
    width = dtype.itemsize
    return not gather and sa[1] == 1 and sw[2] == 1 and sw[0] == rows * sw[1] and \
        (sa[0] * width) % 16 == 0 and (sw[1] * width) % 16 == 0  # fmt: skip


def masked_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    expected_m: int = 0,
    config: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
    ok: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the masked kernel (also on CPU tensors under TRITON_INTERPRET=1).

    Args:
        a: bf16/fp8/int8 `[E, T, Kd]`. w: same dtype `[E, N, Kd]`. masked_m: int32 `[E]` live
            rows per expert. a_scales / w_scales: float32 as in :mod:`epmoe.ops.gemm` (None for
            bf16).
        expected_m: static hint of rows per expert (0 = T): picks BLOCK_M and the grid's M split.
        config: explicit meta-parameters (BLOCK_N, BLOCK_K, num_warps[, num_stages], optionally
            BLOCK_M and M_SPLIT); None = the tuned table's, else autotuned BLOCK_N/BLOCK_K.
        out: bf16 `[E, T, N]` to write into (tests); None allocates it.
        ok: bool `[]` the kernel sets to "every count in [0, T]" (the op's value check, no launch
            of its own); None skips the check.
    Returns:
        bf16 `[E, T, N]`; rows t >= masked_m[e] unspecified: left unwritten, but for those of a
        live row block stored whole (a Gluon config's TMA store).
    """
    E, T, K = a.shape
    N = w.shape[1]
    if out is None:
        out = torch.empty((E, T, N), dtype=torch.bfloat16, device=a.device)
    if E == 0 or T == 0 or N == 0:
        return out
    masked_m = masked_m.contiguous()
    a_s, w_s = (w, w) if a_scales is None else (a_scales, w_scales)
    block_m = split = 0
    if config is not None:
        block_m, split = config.get("BLOCK_M", 0), config.get("M_SPLIT", 0)
        config = {k: v for k, v in config.items() if k not in ("BLOCK_M", "M_SPLIT")}
    plan = _masked_plan(
        a.dtype, T, N, K, E, a.stride(), w.stride(), _stride(a_scales), _stride(w_scales),
        out.stride(), expected_m, ok is not None, block_m, split, a.device,
    )  # fmt: skip
    tensors = (a, w, a_s, w_s, masked_m, out, ok if ok is not None else masked_m)
    _launch_plan(plan, tensors, config)
    return out


@_tuned.reader  # (its launch holds the table's config: re-planned on a re-read)
@_launch.memo
def _masked_plan(dtype, T, N, K, E, sa, sw, sas, sws, so, expected_m, check, block_m, split,
                 device) -> _Plan:  # fmt: skip
    """The masked kernel's launch plan (BLOCK_M / M_SPLIT from expected_m unless given)."""
    tiling = _masked_tiling(T, expected_m)
    block_m, split = block_m or tiling[0], split or tiling[1]
    meta = dict(_constexprs(dtype), BLOCK_M=block_m, M_SPLIT=split, CHECK=check,
                E_PAD=_launch.pow2(E))  # fmt: skip
    sizes = (T, N, K, E, *sa, *sw, *_scale_strides(sas, sws, 2), *so)

    def grid(m):
        if m.get("GLUON"):  # (persistent over the live tiles: at most every slot row's)
            n = E * _launch.cdiv(T, m["BLOCK_M"]) * _launch.cdiv(N, m["BLOCK_N"])
            return (min(n, m["PERSISTENT"] * _multiprocessors(device)),)
        return (m["M_SPLIT"], _launch.cdiv(N, m["BLOCK_N"]), E)

    table = ("masked", quant.of_dtype(dtype), N, K, E, block_m, expected_m or T, device)
    tma = sa[0] == T * sa[1] and _tma_ok(dtype, sa[1:], sw, N, False)  # (slots back to back)
    return _Plan("masked", meta["QUANT"], block_m, table, grid, sizes, meta, tma)


def contiguous_gate_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: torch.Tensor,
    a_scales: Optional[torch.Tensor],
    w_scales: Optional[torch.Tensor],
    gate,
    bias: Optional[torch.Tensor],
    h: torch.Tensor,
    h_scales: torch.Tensor,
    row_block: int = 128,
    config: Optional[dict] = None,
    a_rows: Optional[torch.Tensor] = None,
) -> None:
    """Launch GEMM1 + gate in one kernel (also on CPU tensors under TRITON_INTERPRET=1): h =
    gate(bf16(a @ w[e].T) + bias[e]) rounded to bf16, quantized per 128 channels for fp8 (int8
    operands: h bf16, quantized per row by the caller: a row's scale needs all of it).

    Args:
        a: bf16/fp8/int8 `[M_sum, Kd]` (with a_rows: `[M, Kd]`). w: same dtype `[E, W, Kd]`
            (W = 2I: gate rows, then up; I without a gate half). m_indices: int32 `[M_sum]`,
            contiguous. a_scales / w_scales: float32 as in :mod:`epmoe.ops.gemm` (None: bf16).
        gate: a :class:`epmoe.gate.Gate`. bias: float `[E, W]` or None.
        h: bf16 / fp8 (fp8 a) `[M_sum, I]`, written. h_scales: float32 `[M_sum, I / 128]` (fp8;
            any strides), written; unused otherwise.
        row_block, a_rows: as in :func:`contiguous_triton`. config: explicit meta-parameters
            (tests); None = the tuned table's, else autotuned.
    Rows of -1 blocks are left unwritten.
    """
    M, K = m_indices.shape[0], a.shape[1]
    E, I = w.shape[0], h.shape[1]
    if M == 0 or I == 0:
        return
    m_indices = m_indices.contiguous()
    a_s, w_s = (w, w) if a_scales is None else (a_scales, w_scales)
    hs = h_scales if h_scales.dim() == 2 and h_scales.shape[1] else h
    plan = _gate_plan(
        a.dtype, M, I, K, E, a.stride(), w.stride(), _stride(a_scales), _stride(w_scales),
        _stride(bias), h.stride(), hs.stride() if hs is not h else (0, 0), gate, row_block,
        a_rows is not None, a.device,
    )  # fmt: skip
    b = bias if bias is not None else w
    rows = m_indices if a_rows is None else a_rows.contiguous()  # (placeholder: an input)
    _launch_plan(plan, (a, w, a_s, w_s, m_indices, rows, b, h, hs), config)


@_tuned.reader  # (its launch holds the table's config: re-planned on a re-read)
@_launch.memo
def _gate_plan(dtype, M, I, K, E, sa, sw, sas, sws, sb, sh, shs, gate, row_block,  # noqa: E741
               gather, device) -> _Plan:  # fmt: skip
    """The GEMM1 + gate kernel's launch plan (``gate``: an epmoe.gate.Gate; ``sb`` None: no
    bias; ``gather``: rows of a through a_rows)."""
    meta = dict(_constexprs(dtype), HAS_BIAS=sb is not None, FAST=not _launch._INTERPRET,
                GATHER=gather, **gate.meta())  # fmt: skip
    sizes = (M, I, K, E, *sa, *sw, *_scale_strides(sas, sws, 1), *(sb or (0, 0)), *sh, *shs)
    scheme, has_bias = quant.of_dtype(dtype), sb is not None
    table = ("gate", scheme, I, K, E, row_block, M, device, gate.spec, has_bias)
    tma = _tma_ok(dtype, sa, sw, I * (2 if meta["GLU"] else 1), gather)
    return _Plan("gate", meta["QUANT"], row_block, table, _tile_grid(M, I, device), sizes, meta,
                 tma)  # fmt: skip


def masked_gate_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    a_scales: Optional[torch.Tensor],
    w_scales: Optional[torch.Tensor],
    gate,
    bias: Optional[torch.Tensor],
    h: torch.Tensor,
    h_scales: torch.Tensor,
    expected_m: int = 0,
    config: Optional[dict] = None,
) -> None:
    """Launch masked GEMM1 + gate in one kernel (also on CPU tensors under TRITON_INTERPRET=1):
    h[e, t] = gate(bf16(a[e, t] @ w[e].T) + bias[e]) for t < masked_m[e], as
    :func:`contiguous_gate_triton` on the masked layout.

    Args:
        a: bf16/fp8/int8 `[E, T, Kd]`. w: same dtype `[E, W, Kd]` (W = 2I: gate rows, then up; I
            without a gate half). masked_m: int32 `[E]` live rows per expert, in [0, T].
            a_scales / w_scales: float32 as in :mod:`epmoe.ops.gemm` (None: bf16).
        gate: a :class:`epmoe.gate.Gate`. bias: float `[E, W]` or None.
        h: bf16 / fp8 (fp8 a) `[E, T, I]`, written. h_scales: float32 `[E, T, I / 128]` (fp8; any
            strides), written; unused otherwise.
        expected_m: as in :func:`masked_triton`. config: explicit meta-parameters (tests,
            optionally BLOCK_M and M_SPLIT); None = the tuned table's, else autotuned.
    Rows t >= masked_m[e] are left unwritten.
    """
    E, T, K = a.shape
    I = h.shape[2]  # noqa: E741
    if E == 0 or T == 0 or I == 0:
        return
    masked_m = masked_m.contiguous()
    a_s, w_s = (w, w) if a_scales is None else (a_scales, w_scales)
    hs = h_scales if h_scales.dim() == 3 and h_scales.shape[2] else h
    block_m = split = 0
    if config is not None:
        block_m, split = config.get("BLOCK_M", 0), config.get("M_SPLIT", 0)
        config = {k: v for k, v in config.items() if k not in ("BLOCK_M", "M_SPLIT")}
    plan = _masked_gate_plan(
        a.dtype, T, I, K, E, a.stride(), w.stride(), _stride(a_scales), _stride(w_scales),
        _stride(bias), h.stride(), hs.stride() if hs is not h else (0, 0, 0), gate, expected_m,
        block_m, split, a.device,
    )  # fmt: skip
    b = bias if bias is not None else w
    _launch_plan(plan, (a, w, a_s, w_s, masked_m, b, h, hs), config)


def masked_gate_tiling(t: int, expected_m: int, quant_code: int) -> Tuple[int, int]:
    """(BLOCK_M, M_SPLIT) of masked GEMM1 + gate: the masked kernel's, fp8 at most 32 rows a tile
    (its two float32 sums of 64 rows spill: :func:`fits_masked_gate`); the rows past it take a
    second pass over the weights, from L2."""
    return _masked_tiling(t, expected_m, 32 if quant_code == 1 else _MASKED_MAX_BLOCK_M)


@_tuned.reader  # (its launch holds the table's config: re-planned on a re-read)
@_launch.memo
def _masked_gate_plan(dtype, T, I, K, E, sa, sw, sas, sws, sb, sh, shs, gate,  # noqa: E741
                      expected_m, block_m, split, device) -> _Plan:  # fmt: skip
    """The masked GEMM1 + gate kernel's launch plan (BLOCK_M / M_SPLIT from expected_m unless
    given, :func:`masked_gate_tiling`; ``gate``: an epmoe.gate.Gate; ``sb`` None: no bias)."""
    tiling = masked_gate_tiling(T, expected_m, quant.of_dtype(dtype).kernel_code)
    block_m, split = block_m or tiling[0], split or tiling[1]
    meta = dict(_constexprs(dtype), HAS_BIAS=sb is not None, FAST=not _launch._INTERPRET,
                BLOCK_M=block_m, M_SPLIT=split, **gate.meta())  # fmt: skip
    sizes = (T, I, K, E, *sa, *sw, *_scale_strides(sas, sws, 2), *(sb or (0, 0)), *sh, *shs)
    scheme, has_bias = quant.of_dtype(dtype), sb is not None
    table = ("masked_gate", scheme, I, K, E, block_m, expected_m or T, device, gate.spec, has_bias)
    width = I * (2 if meta["GLU"] else 1)
    tma = sa[0] == T * sa[1] and _tma_ok(dtype, sa[1:], sw, width, False)  # (slots back to back)

    def grid(m):
        return (m["M_SPLIT"], _launch.cdiv(I, m["BLOCK_N"]), E)

    return _Plan("masked_gate", meta["QUANT"], block_m, table, grid, sizes, meta, tma)
