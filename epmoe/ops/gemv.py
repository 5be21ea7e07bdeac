"""Stage: per-choice expert GEMVs, the few-token decode path on one rank.

With a handful of tokens, every (token, choice) row multiplies its own expert's weights: no
permute, no masked layout, no grid sized for all experts. Two kernels run the whole expert MLP,
quantization of the activations fused where the scheme asks for it. Each choice reads its
expert's weights once, so for T * K well below the expert count the weight stream is the floor
(a grouped GEMM's row tiles would be almost empty); two choices of one expert read it twice.

Shape legend: ``T`` tokens, ``K`` top-k, ``H`` hidden, ``I`` intermediate, ``E`` local experts.

Contract: ``h = gemv_gate_up(x, topk_ids, w1, w1_scales=None)``

- x: bf16 `[T, H]`; topk_ids: int32/int64 `[T, K]`, local expert in [0, E) or -1 (skipped).
- w1 `[E, 2I, H]` (gate rows, then up rows) as :func:`epmoe.ops.gemm.prepare_weights` keeps it:
  bf16 (w1_scales None), float8_e4m3fn with float32 `[E, 2I/128, H/128]` block scales (H and I
  multiples of 128), or int8 with float32 `[E, 2I]` per-channel scales.
- h bf16 `[T, K, I]`: silu(g) * u rounded to bf16, where g, u are the bf16-rounded products of x
  (quantized exactly as :func:`epmoe.ops.quantize` does for the scheme: fp8 per 128 channels,
  int8 per token) with the expert's gate and up rows, float32 accumulation (int8: int32), as the
  chain quantize -> grouped GEMM -> silu_and_mul computes them. Rows of -1 choices are zero.

Contract: ``out = gemv_down(h, topk_ids, topk_weights, w2, w2_scales=None)``

- h: bf16 `[T, K, I]`; topk_ids as above; topk_weights float `[T, K]`; w2 `[E, H, I]` of the same
  schemes (fp8 scales `[E, H/128, I/128]`, int8 `[E, H]`).
- out bf16 `[T, H]` = sum_k w[t,k] * bf16(h^[t,k] . W2[e]^T) over live choices, float32 in k order,
  rounded once; h^ is h quantized as silu_and_mul_quant quantizes it (fp8 per 128 channels, int8
  per row), so the pair computes what quantize -> GEMM -> silu_and_mul_quant -> GEMM -> unpermute
  computes, up to the GEMMs' summation order.

Both are one launch and CUDA-graph safe (static shapes and grids, no host sync, no atomics). Ids
outside [0, E) other than -1 are an error: ValueError on CPU; on CUDA a device assert inside the
kernel on direct launches (ValueError in debug mode), an async assert after it under
torch.compile; a bad id is never read through. ``check=False`` (the layer's gemv_down, whose ids
gemv_gate_up checked) skips the check.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from epmoe import _checks, _config, _launch, reference
from epmoe._contract import Case, Contract, Multiple, Rule, Shape, Tensor
from epmoe._jit import _int8_scale, _quant_fp8_groups, _quant_int8, round_float
from epmoe._stage import stage
from epmoe.ops._activation_kernels import _silu_h  # by name: Inductor copies @triton.jit callees

OP_UP, OP_DOWN = "gemv_gate_up", "gemv_down"
_QCODE = {torch.bfloat16: 0, reference.FP8_DTYPE: 1, torch.int8: 2}
_SCHEME = {0: "bf16", 1: "fp8", 2: "int8"}
_ACC = tl.constexpr((tl.float32, tl.float32, tl.int32))  # accumulator dtype by scheme code
_FAST_MATH = not _launch._INTERPRET  # MUFU SiLU on the GPU (see _activation_kernels._silu_mul)
GROUP = 128  # fp8 channels per activation scale and per weight block


# ------------------------------------------------------------------------------ launch config
@_config.frozen
class GemvConfig:
    """Launch parameters of the two GEMV kernels, (block_n, block_k, warps) per scheme, for calls
    of several tokens and (``*_one``) of one token: output columns per program (fp8: a divisor of
    128, so a program's rows share their weight scales), reduction step (fp8: a multiple of 128),
    warps. From the sweep at one and four tokens on Qwen3-30B-A3B's and DeepSeek-V3's experts
    (design notes: docs/kernels.md)."""

    up_bf16: Tuple[int, int, int] = (16, 512, 4)
    up_fp8: Tuple[int, int, int] = (16, 512, 4)
    up_int8: Tuple[int, int, int] = (32, 512, 4)
    down_bf16: Tuple[int, int, int] = (8, 128, 8)
    down_fp8: Tuple[int, int, int] = (8, 256, 4)
    down_int8: Tuple[int, int, int] = (16, 128, 4)
    up_bf16_one: Tuple[int, int, int] = (16, 512, 4)
    up_fp8_one: Tuple[int, int, int] = (8, 1024, 4)  # one token: fewer, longer rows in flight
    up_int8_one: Tuple[int, int, int] = (16, 1024, 4)
    down_bf16_one: Tuple[int, int, int] = (8, 128, 8)
    down_fp8_one: Tuple[int, int, int] = (8, 256, 4)
    down_int8_one: Tuple[int, int, int] = (8, 256, 8)
    check_ids: int = 1024  # ids per step of the check program


CONFIG = GemvConfig()


def field_name(kernel: str, scheme: str, tokens: int) -> str:
    """The GemvConfig field of ``kernel`` ("up" / "down") for a call of ``tokens`` tokens."""
    # (a SymInt is never 1: torch.compile specializes sizes 0 and 1, and an unbacked size takes
    # the several-token config, whatever its value)
    one = type(tokens) is int and tokens == 1
    return f"{kernel}_{scheme}" + ("_one" if one else "")


def config_field(kernel: str, scheme: str, tokens: int) -> Tuple[int, int, int]:
    return getattr(CONFIG, field_name(kernel, scheme, tokens))


def override(**fields):
    """Context manager: the GEMV kernels launch with these CONFIG fields inside the block."""
    return _config.override(__name__, **fields)


# -------------------------------------------------------------------------------------- kernels
@triton.jit
def _bad_ids(v, inb, E):
    """1 where loaded ids ``v`` (in bounds where ``inb``) lie outside [0, E) other than -1."""
    return (inb & ((v < -1) | (v >= E))).to(tl.int32)


@triton.jit
def _report(ok_ptr, bad, ASSERT: tl.constexpr, MSG: tl.constexpr):
    """The check program's verdict on ``bad`` bad ids: asserted (ASSERT, a debug=True build) or
    written to the flag."""
    if ASSERT:
        tl.device_assert(bad == 0, MSG)
    else:
        tl.store(ok_ptr, bad == 0)


@triton.jit
def _dot_rows(xv, w, QUANT: tl.constexpr):
    """Row sums of w `[BLOCK_N, BLOCK_K]` times the activation chunk xv `[1, BLOCK_K]` (codes for
    fp8 / int8): float32, int32 for int8 (exact)."""
    if QUANT == 2:
        return tl.sum(w.to(tl.int32) * xv.to(tl.int32), axis=1)
    else:
        return tl.sum(w.to(tl.float32) * xv.to(tl.float32), axis=1)


@triton.jit
def _dot_groups(q, w):
    """float32 `[R, G]`: sum over the last axis of w `[R, G, 128]` times codes q `[G, 128]`."""
    return tl.sum(w.to(tl.float32) * q.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _gemv_gate_up_kernel(
    # tensors
    x_ptr, ids_ptr, w_ptr, ws_ptr, h_ptr, ok_ptr,
    # sizes
    T, H, I, E,
    # strides (elements)
    stride_xt, stride_xh, stride_it, stride_ik, stride_we, stride_wn, stride_wh,
    stride_se, stride_sn, stride_sh,
    # meta
    K: tl.constexpr, QUANT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHECK_IDS: tl.constexpr, CHECK: tl.constexpr, ASSERT: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """Program (c, n): columns [n * BLOCK_N, +BLOCK_N) of h for choice c = t * K + k; with CHECK
    program (T * K, 0) checks every id (asserts them with ASSERT, else writes ok)."""
    pid = tl.program_id(0)
    nb = tl.program_id(1)
    if pid >= T * K:  # only launched with CHECK (the store only exists in that build)
        if CHECK and nb == 0:
            n_bad = tl.zeros([CHECK_IDS], dtype=tl.int32)
            for b0 in range(0, T * K, CHECK_IDS):
                pos = b0 + tl.arange(0, CHECK_IDS)
                inb = pos < T * K
                v = tl.load(
                    ids_ptr + (pos // K).to(tl.int64) * stride_it + (pos % K) * stride_ik,
                    mask=inb,
                    other=-1,
                )
                n_bad += _bad_ids(v, inb, E)
            msg: tl.constexpr = "gemv_gate_up: topk_ids expected ids in [0, E) or -1"
            _report(ok_ptr, tl.sum(n_bad, axis=0), ASSERT, msg)
    else:
        t = (pid // K).to(tl.int64)
        e = tl.load(ids_ptr + t * stride_it + (pid % K) * stride_ik)
        live = (e >= 0) & (e < E)
        e64 = tl.where(live, e, 0).to(tl.int64)
        hi = tl.where(live, H, 0)  # a skipped (or bad) choice reads nothing: h = silu(0) * 0
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        rk = tl.arange(0, BLOCK_K)
        x_row = x_ptr + t * stride_xt
        wg = w_ptr + e64 * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        wu = wg + I * stride_wn
        if QUANT == 1:  # fp8: x quantized per 128 channels, weights per 128x128 block
            # a step covers G groups of 128 channels: x `[G, 128]`, weights `[BLOCK_N, G, 128]`
            G: tl.constexpr = BLOCK_K // 128
            acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
            gi = tl.arange(0, G)
            c2 = gi[:, None] * 128 + tl.arange(0, 128)[None, :]  # [G, 128]
            sg = ws_ptr + e64 * stride_se + ((nb * BLOCK_N) // 128) * stride_sn
            su = sg + (I // 128) * stride_sn
            for k0 in range(0, H, BLOCK_K):
                kk = k0 + c2
                xv = tl.load(x_row + kk * stride_xh, mask=kk < hi, other=0.0)
                q, s = _quant_fp8_groups(xv.to(tl.float32))
                blk = k0 // 128 + gi
                g_ok = blk * 128 < hi
                s_g = tl.load(sg + blk * stride_sh, mask=g_ok, other=0.0) * s
                s_u = tl.load(su + blk * stride_sh, mask=g_ok, other=0.0) * s
                m = n_ok[:, None, None] & (kk < hi)[None, :, :]
                w_off = kk[None, :, :] * stride_wh
                pg = _dot_groups(q, tl.load(wg[:, :, None] + w_off, mask=m, other=0.0))
                pu = _dot_groups(q, tl.load(wu[:, :, None] + w_off, mask=m, other=0.0))
                acc_g += tl.sum(pg * s_g[None, :], axis=1)
                acc_u += tl.sum(pu * s_u[None, :], axis=1)
        else:  # bf16; int8: x quantized per token (its amax over the whole row first, from L2)
            if QUANT == 2:
                amax = tl.zeros([BLOCK_K], dtype=tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    kk = k0 + rk
                    xv = tl.load(x_row + kk * stride_xh, mask=kk < hi, other=0.0)
                    amax = tl.maximum(amax, tl.abs(xv.to(tl.float32)))
                s = _int8_scale(tl.max(amax, axis=0)[None])
            acc_g = tl.zeros([BLOCK_N], dtype=_ACC[QUANT])
            acc_u = tl.zeros([BLOCK_N], dtype=_ACC[QUANT])
            for k0 in range(0, H, BLOCK_K):
                kk = k0 + rk
                m = n_ok[:, None] & (kk < hi)[None, :]
                xv = tl.load(x_row + kk * stride_xh, mask=kk < hi, other=0.0)
                if QUANT == 2:
                    xv = _quant_int8(xv.to(tl.float32)[None, :], s)
                else:
                    xv = xv[None, :]
                acc_g += _dot_rows(
                    xv, tl.load(wg + kk[None, :] * stride_wh, mask=m, other=0), QUANT
                )
                acc_u += _dot_rows(
                    xv, tl.load(wu + kk[None, :] * stride_wh, mask=m, other=0), QUANT
                )
            if QUANT == 2:
                cs = ws_ptr + e64 * stride_se + offs_n * stride_sn
                acc_g = acc_g.to(tl.float32) * s * tl.load(cs, mask=n_ok, other=0.0)
                acc_u = acc_u.to(tl.float32) * s * tl.load(cs + I * stride_sn, mask=n_ok, other=0.0)
        g = round_float(acc_g, tl.bfloat16)
        u = round_float(acc_u, tl.bfloat16)
        h = _silu_h(g, u, FAST)
        tl.store(h_ptr + pid.to(tl.int64) * I + offs_n, h.to(tl.bfloat16), mask=n_ok)


@triton.jit
def _gemv_down_kernel(
    # tensors
    h_ptr, ids_ptr, tw_ptr, w_ptr, ws_ptr, out_ptr, ok_ptr,
    # sizes
    T, H, I, E,
    # strides (elements)
    stride_it, stride_ik, stride_tt, stride_tk, stride_we, stride_wn, stride_wi,
    stride_se, stride_sn, stride_si,
    # meta
    K: tl.constexpr, K_PAD: tl.constexpr, QUANT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, CHECK_IDS: tl.constexpr, CHECK: tl.constexpr, ASSERT: tl.constexpr,
):  # fmt: skip
    """Program (t, n): columns [n * BLOCK_N, +BLOCK_N) of out[t]. Each step loads the weight
    tiles of all K choices at once (`[K_PAD, BLOCK_N, BLOCK_K]`, one expert per row), so a token's
    K weight streams are in flight together; the K results are summed in k order. With CHECK
    program (T, 0) checks every id."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    if t >= T:  # only launched with CHECK (the store only exists in that build)
        if CHECK and nb == 0:
            n_bad = tl.zeros([CHECK_IDS], dtype=tl.int32)
            for b0 in range(0, T * K, CHECK_IDS):
                pos = b0 + tl.arange(0, CHECK_IDS)
                inb = pos < T * K
                v = tl.load(
                    ids_ptr + (pos // K).to(tl.int64) * stride_it + (pos % K) * stride_ik,
                    mask=inb,
                    other=-1,
                )
                n_bad += _bad_ids(v, inb, E)
            msg: tl.constexpr = "gemv_down: topk_ids expected ids in [0, E) or -1"
            _report(ok_ptr, tl.sum(n_bad, axis=0), ASSERT, msg)
    else:
        t64 = t.to(tl.int64)
        kk = tl.arange(0, K_PAD)
        e = tl.load(ids_ptr + t64 * stride_it + kk * stride_ik, mask=kk < K, other=-1)
        live = (kk < K) & (e >= 0) & (e < E)
        e64 = tl.where(live, e, 0).to(tl.int64)
        hi = tl.where(live, I, 0)[:, None]  # [K_PAD, 1]: skipped choices read nothing
        wt = tl.load(tw_ptr + t64 * stride_tt + kk * stride_tk, mask=kk < K, other=0.0)
        wt = tl.where(live, wt.to(tl.float32), 0.0)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        h_rows = h_ptr + (t64 * K + kk)[:, None] * I  # [K_PAD, 1]
        w_rows = (w_ptr + e64[:, None, None] * stride_we
                  + offs_n.to(tl.int64)[None, :, None] * stride_wn)  # fmt: skip
        if QUANT == 1:  # h quantized per 128 channels: G groups per step, scales applied to h
            G: tl.constexpr = BLOCK_K // 128
            ri = tl.arange(0, BLOCK_K)[None, :]
            s_rows = ws_ptr + e64[:, None] * stride_se + ((nb * BLOCK_N) // 128) * stride_sn
            acc = tl.zeros([K_PAD, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                ii = k0 + ri  # [1, BLOCK_K]
                hv = tl.load(h_rows + ii, mask=ii < hi, other=0.0)
                q, s = _quant_fp8_groups(tl.reshape(hv.to(tl.float32), (K_PAD * G, 128)))
                gi = tl.arange(0, G)[None, :]
                s_w = tl.load(
                    s_rows + (k0 // 128 + gi) * stride_si, mask=k0 + gi * 128 < hi, other=0.0
                )
                scale = tl.reshape(s, (K_PAD, G)) * s_w  # [K_PAD, G]
                hq = tl.reshape(q.to(tl.float32), (K_PAD, G, 128)) * scale[:, :, None]
                m = (ii < hi)[:, None, :] & n_ok[None, :, None]
                wv = tl.load(w_rows + ii[:, None, :] * stride_wi, mask=m, other=0.0)
                acc += tl.sum(wv.to(tl.float32) * tl.reshape(hq, (K_PAD, BLOCK_K))[:, None, :], 2)
        else:  # bf16; int8: h quantized per row (its amax first, from L2), int32 products
            ri = tl.arange(0, BLOCK_K)[None, :]
            if QUANT == 2:
                amax = tl.zeros([K_PAD, BLOCK_K], dtype=tl.float32)
                for k0 in range(0, I, BLOCK_K):
                    hv = tl.load(h_rows + k0 + ri, mask=k0 + ri < hi, other=0.0)
                    amax = tl.maximum(amax, tl.abs(hv.to(tl.float32)))
                s = _int8_scale(tl.max(amax, axis=1))  # [K_PAD]
            acc = tl.zeros([K_PAD, BLOCK_N], dtype=_ACC[QUANT])
            for k0 in range(0, I, BLOCK_K):
                ii = k0 + ri
                hv = tl.load(h_rows + ii, mask=ii < hi, other=0.0)
                if QUANT == 2:
                    hv = _quant_int8(hv.to(tl.float32), s)
                m = (ii < hi)[:, None, :] & n_ok[None, :, None]
                wv = tl.load(w_rows + ii[:, None, :] * stride_wi, mask=m, other=0)
                acc += tl.sum(wv.to(_ACC[QUANT]) * hv.to(_ACC[QUANT])[:, None, :], axis=2)
            if QUANT == 2:
                s_w = tl.load(
                    ws_ptr + e64[:, None] * stride_se + offs_n[None, :] * stride_sn,
                    mask=n_ok[None, :],
                    other=0.0,
                )
                acc = acc.to(tl.float32) * s[:, None] * s_w
        y = round_float(acc, tl.bfloat16).to(tl.float32) * wt[:, None]  # [K_PAD, BLOCK_N]
        out = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(K):  # k ascending, as unpermute sums (row k picked exactly)
            out += tl.sum(tl.where(kk[:, None] == k, y, 0.0), axis=0)
        tl.store(out_ptr + t64 * H + offs_n, round_float(out, tl.bfloat16), mask=n_ok)


# ----------------------------------------------------------------------------- host-side launch
def _check_setup(t: torch.Tensor, check: bool):
    """(in-kernel assert?, flag tensor or None): direct CUDA launches assert in the kernel;
    otherwise the check program writes a flag that an async assert reads."""
    in_kernel = check and _checks.assert_in_kernel(_checks.direct_launch(t))
    flag = check and not in_kernel
    ok = torch.empty((1,), dtype=torch.bool, device=t.device) if flag else None
    return in_kernel, ok


@_launch.memo
def _up_launch(T, H, I, E, K, quant, x_st, id_st, w_st, s_st, check, in_kernel, cfg):
    """The gate/up GEMV kernel's launch for these sizes, strides and options."""
    block_n, block_k, warps = config_field("up", _SCHEME[quant], T)
    return _launch.Prepared(
        _gemv_gate_up_kernel,
        (T * K + (1 if check else 0), _launch.cdiv(I, block_n)),
        (T, H, I, E, *x_st, *id_st, *w_st, *s_st),
        dict(
            K=K, QUANT=quant, BLOCK_N=block_n, BLOCK_K=block_k, CHECK_IDS=cfg.check_ids,
            CHECK=check, ASSERT=in_kernel, FAST=_FAST_MATH, num_warps=warps,
            **_checks.assert_build(in_kernel),
        ),
    )  # fmt: skip


@_launch.memo
def _down_launch(T, H, I, E, K, quant, id_st, tw_st, w_st, s_st, check, in_kernel, cfg):
    """The down GEMV kernel's launch for these sizes, strides and options."""
    block_n, block_k, warps = config_field("down", _SCHEME[quant], T)
    return _launch.Prepared(
        _gemv_down_kernel,
        (T + (1 if check else 0), _launch.cdiv(H, block_n)),
        (T, H, I, E, *id_st, *tw_st, *w_st, *s_st),
        dict(
            K=K, K_PAD=_launch.pow2(K), QUANT=quant, BLOCK_N=block_n, BLOCK_K=block_k,
            CHECK_IDS=cfg.check_ids, CHECK=check, ASSERT=in_kernel, num_warps=warps,
            **_checks.assert_build(in_kernel),
        ),
    )  # fmt: skip


def _scale_strides(s: Optional[torch.Tensor]) -> Tuple[int, int, int]:
    return (0, 0, 0) if s is None else (*s.stride(), 0)[:3]


def _up_output(x, topk_ids, w1, w1_scales=None, check=True):
    """h bf16 `[T, K, I]`, allocated (the CUDA launch fills it; the fake returns it)."""
    shape = (x.shape[0], topk_ids.shape[1], w1.shape[1] // 2)
    return torch.empty(shape, dtype=torch.bfloat16, device=x.device)


def _down_output(h, topk_ids, topk_weights, w2, w2_scales=None, check=True):
    """out bf16 `[T, H]`, allocated (the CUDA launch fills it; the fake returns it)."""
    return torch.empty((h.shape[0], w2.shape[1]), dtype=torch.bfloat16, device=h.device)


def _gemv_gate_up_triton(x, topk_ids, w1, w1_scales=None, check: bool = True):
    """gemv_gate_up on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E, I = w1.shape[0], w1.shape[1] // 2
    h = _up_output(x, topk_ids, w1)
    in_kernel, ok = _check_setup(x, check)
    launch = _up_launch(
        T, H, I, E, K, _QCODE[w1.dtype], x.stride(), topk_ids.stride(), w1.stride(),
        _scale_strides(w1_scales), check, in_kernel, CONFIG,
    )  # fmt: skip
    ws = w1_scales if w1_scales is not None else w1
    launch(x, topk_ids, w1, ws, h, ok if ok is not None else topk_ids)
    if ok is not None:
        _checks.check_values(ok, OP_UP, "topk_ids", f"ids in [0, {E}) or -1")
    return h


def _gemv_down_triton(h, topk_ids, topk_weights, w2, w2_scales=None, check: bool = True):
    """gemv_down on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    T, K, I = h.shape
    E, H = w2.shape[0], w2.shape[1]
    out = _down_output(h, topk_ids, topk_weights, w2)
    h = h.contiguous()
    in_kernel, ok = _check_setup(h, check)
    launch = _down_launch(
        T, H, I, E, K, _QCODE[w2.dtype], topk_ids.stride(), topk_weights.stride(), w2.stride(),
        _scale_strides(w2_scales), check, in_kernel, CONFIG,
    )  # fmt: skip
    ws = w2_scales if w2_scales is not None else w2
    launch(h, topk_ids, topk_weights, w2, ws, out, ok if ok is not None else topk_ids)
    if ok is not None:
        _checks.check_values(ok, OP_DOWN, "topk_ids", f"ids in [0, {E}) or -1")
    return out


# ------------------------------------------------------------------------------------------ ops
_WEIGHT_DTYPES = tuple(_QCODE)
_F32 = (torch.float32,)


def _weight_steps(w: str, s: str, k_dim: str, fp8_dims):
    """w `[E, *, k_dim]` of a weight scheme and its scales (see the module contract);
    ``fp8_dims``: (label, expression) of the sizes fp8 needs in whole 128-blocks."""
    fp8 = [Multiple(label, expr, GROUP, "for fp8 (128-channel blocks)") for label, expr in fp8_dims]
    return (
        Tensor(w, _WEIGHT_DTYPES, shape=(None, None, k_dim)),
        Case(
            f"{w}.dtype is BF16",
            [Rule(f"{s} is None", s, "None for bf16 weights", "a tensor")],
            [
                Rule(f"{s} is not None", s, "a float32 tensor for fp8 / int8 weights", "None"),
                Tensor(s, _F32),
                Case(
                    f"{w}.dtype is FP8",
                    [*fp8, Shape(s, f"({w}.shape[0], {w}.shape[1] // 128, {w}.shape[2] // 128)")],
                    [Shape(s, f"({w}.shape[0], {w}.shape[1])")],
                ),
            ],
        ),
    )


_CONSTS = dict(BF16=torch.bfloat16, FP8=reference.FP8_DTYPE)
UP = Contract(
    OP_UP,
    "x topk_ids w1 w1_scales",
    Tensor("x", (torch.bfloat16,), ndim=(2,)),
    Tensor("topk_ids", _checks.INDEX_DTYPES, shape=("x.shape[0]", None)),
    Tensor("w1", _WEIGHT_DTYPES, ndim=(3,)),
    Rule(
        "w1.shape[1] % 2 == 0",
        "w1",
        "shape [E, 2I, H] (an even row count: gate rows, then up rows)",
        lambda a: list(a.w1.shape),
    ),
    *_weight_steps(
        "w1", "w1_scales", "x.shape[1]", (("H", "w1.shape[2]"), ("I", "w1.shape[1] // 2"))
    ),
    consts=_CONSTS,
)
DOWN = Contract(
    OP_DOWN,
    "h topk_ids topk_weights w2 w2_scales",
    Tensor("h", (torch.bfloat16,), ndim=(3,)),
    Tensor("topk_ids", _checks.INDEX_DTYPES, shape=("h.shape[0]", "h.shape[1]")),
    Tensor("topk_weights", _checks.FLOAT_DTYPES, shape="topk_ids.shape"),
    *_weight_steps("w2", "w2_scales", "h.shape[2]", (("H", "w2.shape[1]"), ("I", "w2.shape[2]"))),
    consts=_CONSTS,
)


def _up_reference(x, topk_ids, w1, w1_scales=None, check=True):
    if check:
        _checks.check_ids(topk_ids, w1.shape[0], OP_UP, "topk_ids")
    return reference.gemv_gate_up(x, topk_ids, w1, w1_scales)


def _down_reference(h, topk_ids, topk_weights, w2, w2_scales=None, check=True):
    if check:
        _checks.check_ids(topk_ids, w2.shape[0], OP_DOWN, "topk_ids")
    return reference.gemv_down(h, topk_ids, topk_weights, w2, w2_scales)


@stage(contract=UP, fake=_up_output, reference=_up_reference, cuda=_gemv_gate_up_triton)
def gemv_gate_up(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w1_scales: Optional[torch.Tensor] = None,
    check: bool = True,
) -> torch.Tensor:
    """SiLU-gated first expert projection of every (token, choice), activations quantized inside.

    Args:
        x: bf16 `[T, H]`.
        topk_ids: int32/int64 `[T, K]` local expert or -1.
        w1: bf16 / float8_e4m3fn / int8 `[E, 2I, H]`, gate rows first (prepare_weights' layout).
        w1_scales: None (bf16), float32 `[E, 2I/128, H/128]` (fp8) or `[E, 2I]` (int8).
        check: False skips the check of the ids (the kernel then reads a bad id as a skipped
            choice); the CPU reference checks them only when True.
    Returns:
        bf16 `[T, K, I]`; rows of -1 choices are zero. CUDA-graph safe.
    """


@stage(
    contract=DOWN,
    fake=_down_output,
    reference=_down_reference,
    cuda=_gemv_down_triton,
    chain=dict(check=False),  # the layer's ids: gemv_gate_up checked them
)
def gemv_down(
    h: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: Optional[torch.Tensor] = None,
    check: bool = True,
) -> torch.Tensor:
    """Second expert projection of every (token, choice) and the weighted top-k sum.

    Args:
        h: bf16 `[T, K, I]` (gemv_gate_up's output).
        topk_ids: int32/int64 `[T, K]` local expert or -1.
        topk_weights: float `[T, K]`.
        w2: bf16 / float8_e4m3fn / int8 `[E, H, I]`.
        w2_scales: None (bf16), float32 `[E, H/128, I/128]` (fp8) or `[E, H]` (int8).
        check: False skips the check of the ids (gemv_gate_up's ids, checked there; the kernel
            then reads a bad id as a skipped choice); the CPU reference checks them only when True.
    Returns:
        bf16 `[T, H]`, float32 accumulation over k. CUDA-graph safe.
    """
