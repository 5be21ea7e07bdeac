"""Stage: per-choice expert GEMVs, the few-token decode path on one rank.

With a handful of tokens, every (token, choice) row multiplies its own expert's weights: no
permute, no masked layout, no grid sized for all experts. Two kernels run the whole expert MLP,
quantization of the activations fused where the scheme asks for it. Each choice reads its
expert's weights once, so for T * K well below the expert count the weight stream is the floor
(a grouped GEMM's row tiles would be almost empty); two choices of one expert read it twice.

Shape legend: ``T`` tokens, ``K`` top-k, ``H`` hidden, ``I`` intermediate, ``E`` local experts,
``W`` GEMM1 rows (2I with a gate half, else I), ``Hw`` / ``Hp`` the weights' (padded) hidden size.

Contract: ``h = gemv_gate_up(x, topk_ids, w1, w1_scales=None, check=True, gate="silu",
bias=None)``

- x: bf16 `[T, H]`, H <= Hp (x is zero-extended to the weights' H: weights padded with zeros at
  load); topk_ids: int32/int64 `[T, K]`, local expert in [0, E) or -1 (skipped).
- gate: a :mod:`epmoe.gate` spec string ("silu", "silu:alpha=1.702,limit=7,up_offset=1",
  "gelu_tanh", "relu2:glu=0", ...).
- w1 `[E, W, Hp]` (gate rows, then up rows; only up rows without glu) as
  :func:`epmoe.ops.gemm.prepare_weights` keeps it: bf16 (w1_scales None), float8_e4m3fn with
  float32 `[E, W/128, Hp/128]` block scales (Hp and I multiples of 128), or int8 with float32
  `[E, W]` per-channel scales.
- bias: None or bf16/fp16/fp32 `[E, W]` (gate then up halves), added in float32 to g, u.
- h bf16 `[T, K, I]`: gate(g + b_g, u + b_u) (:meth:`epmoe.gate.Gate.reference`) rounded to bf16
  once, where g, u are the bf16-rounded products of x (quantized exactly as
  :func:`epmoe.ops.quantize` does for the scheme: fp8 per 128 channels, int8 per token) with the
  expert's gate and up rows, float32 accumulation (int8: int32), as the chain quantize -> grouped
  GEMM -> activation computes them. Rows of -1 choices are zero.

Contract: ``out = gemv_down(h, topk_ids, topk_weights, w2, w2_scales=None, check=True, bias=None,
hidden=None)``

- h: bf16 `[T, K, I]`; topk_ids as above; topk_weights float `[T, K]`; w2 `[E, Hw, I]` of the
  same schemes (fp8 scales `[E, Hw/128, I/128]`, int8 `[E, Hw]`); bias None or bf16/fp16/fp32
  `[E, Hw]`; hidden None (Hw) or an int in [1, Hw]: the output's columns.
- out bf16 `[T, hidden]` = sum_k w[t,k] * (bf16(h^[t,k] . W2[e]^T) + bias[e]) over live choices,
  float32 in k order, rounded once, its first ``hidden`` columns; h^ is h quantized as
  silu_and_mul_quant quantizes it (fp8 per 128 channels, int8 per row), so the pair computes
  what quantize -> GEMM -> activation_quant -> GEMM -> unpermute computes, up to the GEMMs'
  summation order. Bias rows of -1 choices are never read.

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

from epmoe import _checks, _config, _launch, quant, reference
from epmoe import gate as _gate
from epmoe._contract import Case, Contract, Let, Multiple, Rule, Shape, Tensor
from epmoe._jit import _int8_scale, _quant_fp8_groups, _quant_int8, round_float
from epmoe._launch import pdl
from epmoe._stage import stage
from epmoe.gate import gate_h  # by name: Inductor copies the @triton.jit callees it finds
from epmoe.ops.gemm import _tuned

OP_UP, OP_DOWN = "gemv_gate_up", "gemv_down"
_ACC = tl.constexpr((tl.float32, tl.float32, tl.int32))  # accumulator dtype by scheme code
_FAST_MATH = not _launch._INTERPRET  # MUFU activations on the GPU (see epmoe.gate._sigmoid_mul)
GROUP = quant.FP8_GROUP  # fp8 channels per activation scale and per weight block


# ------------------------------------------------------------------------------ launch config
@_config.frozen
class GemvConfig:
    """Launch parameters of the two GEMV kernels per scheme where the GPU's tuned table has no
    entry for the call's sizes (``tuned``: a table entry wins; :func:`launch_config`), for calls of
    several tokens and (``*_one``) of one token: gate/up (block_n, block_k, warps), down (block_n,
    block_k, warps, top_k): output columns per program (fp8: a divisor of 128, so a program's rows
    share their weight scales), reduction step (fp8: a multiple of 128), warps; a down block_k is
    the step at top_k choices a token, and fewer (K_PAD < top_k) take block_k x top_k / K_PAD, the
    same [K_PAD, block_n, block_k] step tile (``down_block_k``). From the sweep at one and four
    tokens on Qwen3-30B-A3B's and DeepSeek-V3's experts (top-8) and at one and two on Mixtral's
    (top-2); int8's top_k also from gpt-oss-20b's layer (top-4) (design notes: docs/kernels.md)."""

    up_bf16: Tuple[int, int, int] = (16, 512, 4)
    up_fp8: Tuple[int, int, int] = (16, 512, 4)
    up_int8: Tuple[int, int, int] = (32, 512, 4)
    down_bf16: Tuple[int, int, int, int] = (8, 128, 8, 8)
    down_fp8: Tuple[int, int, int, int] = (8, 256, 4, 8)
    # (top_k 4: gpt-oss's top-4 int8 ran slower at twice the step)
    down_int8: Tuple[int, int, int, int] = (16, 128, 4, 4)
    up_bf16_one: Tuple[int, int, int] = (16, 512, 4)
    up_fp8_one: Tuple[int, int, int] = (8, 1024, 4)  # one token: fewer, longer rows in flight
    up_int8_one: Tuple[int, int, int] = (16, 1024, 4)
    down_bf16_one: Tuple[int, int, int, int] = (8, 128, 8, 8)
    down_fp8_one: Tuple[int, int, int, int] = (8, 256, 4, 8)
    down_int8_one: Tuple[int, int, int, int] = (8, 256, 8, 8)
    check_ids: int = 1024  # ids per step of the check program
    tuned: bool = True  # (False: every launch takes these fields; ``override`` sets it)


CONFIG = GemvConfig()
# the tuned table's "gemv_up" / "gemv_down" entries: m = 1 serves one-token calls, the entry of
# the most tokens every other call (a SymInt T included, so compiled and eager launch alike)
_SEVERAL = 1 << 30


def _one(tokens) -> bool:
    """Whether a call of ``tokens`` tokens takes the one-token config (a SymInt is never 1:
    torch.compile specializes sizes 0 and 1, and an unbacked size takes the several-token config,
    whatever its value)."""
    return type(tokens) is int and tokens == 1


def field_name(kernel: str, scheme: str, tokens: int) -> str:
    """The GemvConfig field of ``kernel`` ("up" / "down") for a call of ``tokens`` tokens."""
    return f"{kernel}_{scheme}" + ("_one" if _one(tokens) else "")


def config_field(kernel: str, scheme: str, tokens: int) -> Tuple[int, ...]:
    return getattr(CONFIG, field_name(kernel, scheme, tokens))


def launch_config(kernel: str, scheme: str, tokens: int, n: int, k: int, e: int, top_k: int,
                  device, gate="silu", bias=False) -> Tuple[int, int, int]:  # fmt: skip
    """(block_n, block_k, warps) of a ``kernel`` ("up" / "down") launch of ``tokens`` tokens with
    ``top_k`` choices each on weights of ``e`` experts with ``n`` rows of ``k`` channels (up: n = I,
    h's channels; the layer's gate spec and biases): the entry of ``device``'s tuned table where it
    has one (unless an override is in force), else CONFIG's field (down: block_k by
    :func:`down_block_k`)."""
    layout = f"gemv_{kernel}"
    if CONFIG.tuned and _tuned.holds(layout, device):
        # (weights' sizes and top-k: static in a compiled model, SymInts in opcheck's dynamic
        # pass; int() specializes them there, so compiled and eager launch alike)
        n, k, e, top_k = int(n), int(k), int(e), int(top_k)
        m = 1 if _one(tokens) else _SEVERAL
        found = _tuned.lookup(layout, scheme, n, k, e, top_k, m, device, gate, bias)
        if found is not None:
            return found["block_n"], found["block_k"], found["num_warps"]
    if kernel == "up":
        return config_field(kernel, scheme, tokens)
    block_n, block_k, warps, at_k = config_field(kernel, scheme, tokens)
    return block_n, down_block_k(block_k, at_k, _launch.pow2(top_k), k), warps


def down_block_k(block_k: int, top_k: int, k_pad: int, inter: int) -> int:
    """The down kernel's reduction step for a config's (``block_k``, ``top_k``) at ``k_pad`` (K
    rounded up to a power of two) choices a token and rows of ``inter`` channels: block_k x top_k /
    k_pad (fewer choices, the same step tile: top-2 streamed a quarter of the bytes a step,
    latency bound), at most the row rounded up to a power of two, never below ``block_k``."""
    longer = block_k * max(top_k // k_pad, 1)
    return min(longer, max(_launch.pow2(inter), block_k))


# the tuner's candidates (scripts/tune_gemm.py, the "gemv_up" / "gemv_down" entries): (block_n,
# block_k as launched, warps); down steps up to 2048 channels (a top-2 token's step tile is a
# quarter of a top-8 one's)
UP_CANDIDATES = tuple((n, k, w) for n in (8, 16, 32) for k in (512, 1024) for w in (4, 8))
DOWN_CANDIDATES = tuple(
    (n, k, w) for n in (8, 16) for k in (128, 256, 512, 1024, 2048) for w in (4, 8)
)
_STEP_ELEMENTS = 32768  # the largest [K_PAD, block_n, block_k] down step (register spills past)


def fits(kernel: str, scheme: str, config: Tuple[int, int, int], k: int, top_k: int) -> bool:
    """Whether a (block_n, block_k, warps) ``config`` of :data:`UP_CANDIDATES` /
    :data:`DOWN_CANDIDATES` is one to try for ``kernel`` ("up" / "down") in ``scheme`` over rows of
    ``k`` channels at ``top_k`` choices a token: fp8 blocks within one weight scale, a step at most
    the row rounded up to a power of two (or the kernel's shortest candidate step), a down step
    tile of at most _STEP_ELEMENTS."""
    block_n, block_k, _ = config
    if scheme == "fp8" and (GROUP % block_n or block_k % GROUP):
        return False
    shortest = min(c[1] for c in (UP_CANDIDATES if kernel == "up" else DOWN_CANDIDATES))
    if block_k > max(_launch.pow2(k), shortest):
        return False
    return kernel == "up" or _launch.pow2(top_k) * block_n * block_k <= _STEP_ELEMENTS


def override(**fields):
    """Context manager: the GEMV kernels launch with these CONFIG fields inside the block (and
    no tuned table entry: ``tuned`` False unless given)."""
    return _config.override(__name__, **{"tuned": False, **fields})


# -------------------------------------------------------------------------------------- kernels
# Every tl.load of a pointer argument sits in a kernel body: torch.compile reads a pointer passed
# to a jit helper whose result feeds a store as written (tests/compile/test_kernel_mutations.py).
# The helpers take offsets, masks and loaded values.
@triton.jit
def _id_offsets(b0, n, K: tl.constexpr, stride_it, stride_ik, CHECK_IDS: tl.constexpr):
    """The check program's step: offsets in topk_ids of the flat ids [b0, +CHECK_IDS), and which
    of them exist (below n = T * K)."""
    pos = b0 + tl.arange(0, CHECK_IDS)
    inb = pos < n
    return (pos // K).to(tl.int64) * stride_it, (pos % K) * stride_ik, inb


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
def _as_bf16(acc):
    """float32 sums rounded to bf16 (what a GEMM writes), as float32."""
    return round_float(acc, tl.bfloat16).to(tl.float32)


@triton.jit
def _row_codes(xv, s, QUANT: tl.constexpr):
    """The loaded chunk xv `[BLOCK_K]` as _dot_rows takes it: int8 codes of scale s, or bf16."""
    if QUANT == 2:
        return _quant_int8(xv.to(tl.float32)[None, :], s)
    else:
        return xv[None, :]


@triton.jit
def _cols(nb, BLOCK_N: tl.constexpr, n):
    """A program's output columns [nb * BLOCK_N, +BLOCK_N) and which exist (below n)."""
    offs = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs, offs < n


@triton.jit
def _choice(e, E, n):
    """A loaded id e: (live: in [0, E); the expert, int64, 0 unless live; n channels to read if
    live, else 0: a skipped or bad id reads nothing)."""
    live = (e >= 0) & (e < E)
    return live, tl.where(live, e, 0).to(tl.int64), tl.where(live, n, 0)


@triton.jit
def _row_masks(k0, rk, hi, n_ok, stride_wh):
    """A gate/up bf16 / int8 step's channels kk `[BLOCK_K]`, the weight tiles' mask `[BLOCK_N,
    BLOCK_K]` and channel offsets (channels from ``hi`` on read nothing)."""
    kk = k0 + rk
    return kk, n_ok[:, None] & (kk < hi)[None, :], kk[None, :] * stride_wh


@triton.jit
def _down_masks(ii, hi, n_ok, stride_wi):
    """A down step's weight tiles' mask `[K_PAD, BLOCK_N, BLOCK_K]` and channel offsets, for
    channels ii `[1, BLOCK_K]` (hi `[K_PAD, 1]`: channels each choice reads)."""
    return (ii < hi)[:, None, :] & n_ok[None, :, None], ii[:, None, :] * stride_wi


@triton.jit
def _fp8_scale_offsets(k0, hi, stride_si, G: tl.constexpr):
    """A down fp8 step's weight-scale offsets `[1, G]` and which blocks hold channels (hi
    `[K_PAD, 1]`: channels each choice reads) `[K_PAD, G]`."""
    gi = tl.arange(0, G)[None, :]
    return (k0 // 128 + gi) * stride_si, k0 + gi * 128 < hi


@triton.jit
def _fp8_channels(k0, BLOCK_K: tl.constexpr):
    """A gate/up fp8 step's channels `[G, 128]`: G = BLOCK_K / 128 groups of 128 from k0."""
    return k0 + tl.arange(0, BLOCK_K // 128)[:, None] * 128 + tl.arange(0, 128)[None, :]


@triton.jit
def _fp8_masks(k0, kk, hi, n_ok, stride_wh, BLOCK_K: tl.constexpr):
    """A gate/up fp8 step's weight blocks `[G]` and which hold channels, the weight tiles' mask
    `[BLOCK_N, G, 128]` and channel offsets (channels kk from ``hi`` on read nothing)."""
    blk = k0 // 128 + tl.arange(0, BLOCK_K // 128)
    return (
        blk,
        blk * 128 < hi,
        n_ok[:, None, None] & (kk < hi)[None, :, :],
        kk[None, :, :] * stride_wh,
    )


@triton.jit
def _dot_groups(q, w):
    """float32 `[R, G]`: sum over the last axis of w `[R, G, 128]` times codes q `[G, 128]`."""
    return tl.sum(w.to(tl.float32) * q.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _fp8_scaled(q, s, s_w, K_PAD: tl.constexpr, G: tl.constexpr):
    """float32 `[K_PAD, G * 128]`: codes q `[K_PAD * G, 128]` of K_PAD rows times one scale per
    group, its own (s `[K_PAD * G]`) times the weight block's (s_w `[K_PAD, G]`)."""
    scale = tl.reshape(s, (K_PAD, G)) * s_w  # [K_PAD, G]
    hq = tl.reshape(q.to(tl.float32), (K_PAD, G, 128)) * scale[:, :, None]
    return tl.reshape(hq, (K_PAD, G * 128))


@triton.jit
def _gemv_gate_up_kernel(
    # tensors, then sizes
    x_ptr, ids_ptr, w_ptr, ws_ptr, b_ptr, h_ptr, ok_ptr,
    T, H, I, E,
    # strides (elements)
    stride_xt, stride_xh, stride_it, stride_ik, stride_we, stride_wn, stride_wh,
    stride_se, stride_sn, stride_sh, stride_be, stride_bn,
    # meta
    K: tl.constexpr, QUANT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHECK_IDS: tl.constexpr, CHECK: tl.constexpr, ASSERT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr,
    UP_OFFSET: tl.constexpr, GLU: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
    UP_SOFTCAP: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (c, n): columns [n * BLOCK_N, +BLOCK_N) of h for choice c = t * K + k, over x's H
    channels (GLU: gate rows, then up rows); with CHECK program (T * K, 0) checks every id."""
    pdl(PDL)
    pid, nb = tl.program_id(0), tl.program_id(1)
    if pid >= T * K:  # only launched with CHECK (the store only exists in that build)
        if CHECK and nb == 0:
            n_bad = tl.zeros([CHECK_IDS], dtype=tl.int32)
            for b0 in range(0, T * K, CHECK_IDS):
                o_t, o_k, inb = _id_offsets(b0, T * K, K, stride_it, stride_ik, CHECK_IDS)
                n_bad += _bad_ids(tl.load(ids_ptr + o_t + o_k, mask=inb, other=-1), inb, E)
            msg: tl.constexpr = "gemv_gate_up: topk_ids expected ids in [0, E) or -1"
            _report(ok_ptr, tl.sum(n_bad, axis=0), ASSERT, msg)
    else:
        t = (pid // K).to(tl.int64)
        e = tl.load(ids_ptr + t * stride_it + (pid % K) * stride_ik)
        live, e64, hi = _choice(e, E, H)  # (a skipped choice's h: gate(0, 0) = 0)
        offs_n, n_ok = _cols(nb, BLOCK_N, I)
        up = I if GLU else 0  # the up rows' first
        x_row = x_ptr + t * stride_xt
        wg = w_ptr + e64 * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        wu = wg + up * stride_wn
        acc_g, acc_u = tl.zeros([BLOCK_N], dtype=_ACC[QUANT]), tl.zeros([BLOCK_N], _ACC[QUANT])
        if QUANT == 1:  # fp8: x quantized per 128 channels, weights per 128x128 block
            sg = ws_ptr + e64 * stride_se + ((nb * BLOCK_N) // 128) * stride_sn
            su = sg + (up // 128) * stride_sn
            for k0 in range(0, H, BLOCK_K):
                kk = _fp8_channels(k0, BLOCK_K)
                xv = tl.load(x_row + kk * stride_xh, mask=kk < hi, other=0.0)
                q, s = _quant_fp8_groups(xv.to(tl.float32))
                blk, g_ok, m, w_off = _fp8_masks(k0, kk, hi, n_ok, stride_wh, BLOCK_K)
                s_g = tl.load(sg + blk * stride_sh, mask=g_ok, other=0.0) * s if GLU else None
                s_u = tl.load(su + blk * stride_sh, mask=g_ok, other=0.0) * s
                if GLU:
                    pg = _dot_groups(q, tl.load(wg[:, :, None] + w_off, mask=m, other=0.0))
                pu = _dot_groups(q, tl.load(wu[:, :, None] + w_off, mask=m, other=0.0))
                if GLU:
                    acc_g += tl.sum(pg * s_g[None, :], axis=1)
                acc_u += tl.sum(pu * s_u[None, :], axis=1)
        else:  # bf16; int8: x quantized per token (its amax over the whole row first, from L2)
            rk = tl.arange(0, BLOCK_K)
            s = 1.0
            if QUANT == 2:
                amax = tl.zeros([BLOCK_K], dtype=tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    xv = tl.load(x_row + (k0 + rk) * stride_xh, mask=k0 + rk < hi, other=0.0)
                    amax = tl.maximum(amax, tl.abs(xv.to(tl.float32)))
                s = _int8_scale(tl.max(amax, axis=0)[None])
            for k0 in range(0, H, BLOCK_K):
                kk, m, w_off = _row_masks(k0, rk, hi, n_ok, stride_wh)
                xv = _row_codes(tl.load(x_row + kk * stride_xh, mask=kk < hi, other=0.0), s, QUANT)
                if GLU:
                    acc_g += _dot_rows(xv, tl.load(wg + w_off, mask=m, other=0), QUANT)
                acc_u += _dot_rows(xv, tl.load(wu + w_off, mask=m, other=0), QUANT)
            if QUANT == 2:
                cs = ws_ptr + e64 * stride_se + offs_n * stride_sn
                acc_g = acc_g.to(tl.float32) * s * tl.load(cs, mask=n_ok, other=0.0)
                acc_u = acc_u.to(tl.float32) * s * tl.load(cs + up * stride_sn, mask=n_ok, other=0)
        g, u = _as_bf16(acc_g), _as_bf16(acc_u)
        if HAS_BIAS:  # (a skipped choice reads none: its h stays 0)
            b_row, b_ok = b_ptr + e64 * stride_be + offs_n * stride_bn, offs_n < live * I
            u += tl.load(b_row + up * stride_bn, mask=b_ok, other=0.0).to(tl.float32)
            if GLU:
                g += tl.load(b_row, mask=b_ok, other=0.0).to(tl.float32)
        h = gate_h(g, u, ACT, ALPHA, LIMIT, CLAMP_AFTER, UP_OFFSET, GLU, GATE_SOFTCAP, UP_SOFTCAP,
                   FAST)  # fmt: skip
        tl.store(h_ptr + pid.to(tl.int64) * I + offs_n, round_float(h, tl.bfloat16), mask=n_ok)


@triton.jit
def _gemv_down_kernel(
    # tensors
    h_ptr, ids_ptr, tw_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, ok_ptr,
    # sizes
    T, H, I, E,
    # strides (elements)
    stride_it, stride_ik, stride_tt, stride_tk, stride_we, stride_wn, stride_wi,
    stride_se, stride_sn, stride_si, stride_be, stride_bn,
    # meta
    K: tl.constexpr, K_PAD: tl.constexpr, QUANT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, CHECK_IDS: tl.constexpr, CHECK: tl.constexpr, ASSERT: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (t, n): columns [n * BLOCK_N, +BLOCK_N) of out[t]. A step loads the weight tiles
    of all K choices (`[K_PAD, BLOCK_N, BLOCK_K]`): a token's K weight streams in flight together;
    the K results are summed in k order. With CHECK program (T, 0) checks every id."""
    pdl(PDL)
    t, nb = tl.program_id(0), tl.program_id(1)
    if t >= T:  # only launched with CHECK (the store only exists in that build)
        if CHECK and nb == 0:
            n_bad = tl.zeros([CHECK_IDS], dtype=tl.int32)
            for b0 in range(0, T * K, CHECK_IDS):
                o_t, o_k, inb = _id_offsets(b0, T * K, K, stride_it, stride_ik, CHECK_IDS)
                n_bad += _bad_ids(tl.load(ids_ptr + o_t + o_k, mask=inb, other=-1), inb, E)
            msg: tl.constexpr = "gemv_down: topk_ids expected ids in [0, E) or -1"
            _report(ok_ptr, tl.sum(n_bad, axis=0), ASSERT, msg)
    else:
        t64 = t.to(tl.int64)
        kk = tl.arange(0, K_PAD)
        e = tl.load(ids_ptr + t64 * stride_it + kk * stride_ik, mask=kk < K, other=-1)
        live, e64, hi = _choice(e, E, I)  # (choices past K: id -1)
        hi = hi[:, None]  # [K_PAD, 1]
        wt = tl.load(tw_ptr + t64 * stride_tt + kk * stride_tk, mask=kk < K, other=0.0)
        wt = tl.where(live, wt.to(tl.float32), 0.0)
        offs_n, n_ok = _cols(nb, BLOCK_N, H)
        h_rows = h_ptr + (t64 * K + kk)[:, None] * I  # [K_PAD, 1]
        w_rows = (w_ptr + e64[:, None, None] * stride_we
                  + offs_n.to(tl.int64)[None, :, None] * stride_wn)  # fmt: skip
        ri = tl.arange(0, BLOCK_K)[None, :]
        acc = tl.zeros([K_PAD, BLOCK_N], dtype=_ACC[QUANT])
        if QUANT == 1:  # h quantized per 128 channels: G groups per step, scales applied to h
            s_rows = ws_ptr + e64[:, None] * stride_se + ((nb * BLOCK_N) // 128) * stride_sn
            G: tl.constexpr = BLOCK_K // 128
            for k0 in range(0, I, BLOCK_K):
                ii = k0 + ri  # [1, BLOCK_K]
                hv = tl.load(h_rows + ii, mask=ii < hi, other=0.0)
                q, s = _quant_fp8_groups(tl.reshape(hv.to(tl.float32), (K_PAD * G, 128)))
                s_off, s_ok = _fp8_scale_offsets(k0, hi, stride_si, G)
                hq = _fp8_scaled(q, s, tl.load(s_rows + s_off, mask=s_ok, other=0.0), K_PAD, G)
                m, w_off = _down_masks(ii, hi, n_ok, stride_wi)
                wv = tl.load(w_rows + w_off, mask=m, other=0.0)
                acc += tl.sum(wv.to(tl.float32) * hq[:, None, :], 2)
        else:  # bf16; int8: h quantized per row (its amax first, from L2), int32 products
            if QUANT == 2:
                amax = tl.zeros([K_PAD, BLOCK_K], dtype=tl.float32)
                for k0 in range(0, I, BLOCK_K):
                    hv = tl.load(h_rows + k0 + ri, mask=k0 + ri < hi, other=0.0)
                    amax = tl.maximum(amax, tl.abs(hv.to(tl.float32)))
                s = _int8_scale(tl.max(amax, axis=1))  # [K_PAD]
            for k0 in range(0, I, BLOCK_K):
                ii = k0 + ri
                hv = tl.load(h_rows + ii, mask=ii < hi, other=0.0)
                if QUANT == 2:
                    hv = _quant_int8(hv.to(tl.float32), s)
                m, w_off = _down_masks(ii, hi, n_ok, stride_wi)
                wv = tl.load(w_rows + w_off, mask=m, other=0)
                acc += tl.sum(wv.to(_ACC[QUANT]) * hv.to(_ACC[QUANT])[:, None, :], axis=2)
            if QUANT == 2:
                cs = ws_ptr + e64[:, None] * stride_se + offs_n[None, :] * stride_sn
                s_w = tl.load(cs, mask=n_ok[None, :], other=0.0)
                acc = acc.to(tl.float32) * s[:, None] * s_w
        y = _as_bf16(acc)  # [K_PAD, BLOCK_N]
        if HAS_BIAS:  # (rows of skipped choices are never read)
            b_rows = b_ptr + e64[:, None] * stride_be + offs_n[None, :] * stride_bn
            y += tl.load(b_rows, mask=live[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        y = y * wt[:, None]
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


@_tuned.reader
@_launch.memo
def _up_launch(T, H, I, E, K, dtype, gate, bias, x_st, id_st, w_st, s_st, b_st, check, in_kernel,
               cfg, hp, device):  # fmt: skip
    """The gate/up GEMV kernel's launch for these sizes (``hp``: w1's padded H), weight dtype,
    strides, options and device (``gate``: the spec, a cheaper key than the Gate; ``dtype``: than
    the scheme)."""
    scheme = quant.of_dtype(dtype)
    block_n, block_k, warps = launch_config("up", scheme.name, T, I, hp, E, K, device, gate, bias)
    return _launch.Prepared(
        _gemv_gate_up_kernel,
        (T * K + (1 if check else 0), _launch.cdiv(I, block_n)),
        (T, H, I, E, *x_st, *id_st, *w_st, *s_st, *b_st),
        dict(
            K=K, QUANT=scheme.kernel_code, BLOCK_N=block_n, BLOCK_K=block_k,
            CHECK_IDS=cfg.check_ids, CHECK=check, ASSERT=in_kernel, HAS_BIAS=bias,
            **_gate.parse(gate).meta(), FAST=_FAST_MATH, num_warps=warps,
            **_checks.assert_build(in_kernel),
        ),
    )  # fmt: skip


@_tuned.reader
@_launch.memo
def _down_launch(T, H, I, E, K, dtype, bias, id_st, tw_st, w_st, s_st, b_st, check, in_kernel,
                 cfg, w_rows, device):  # fmt: skip
    """The down GEMV kernel's launch for these sizes (H: the output's columns, ``w_rows``: w2's
    padded H), weight dtype, strides, options and device."""
    scheme = quant.of_dtype(dtype)
    block_n, block_k, warps = launch_config("down", scheme.name, T, w_rows, I, E, K, device)
    k_pad = _launch.pow2(K)
    return _launch.Prepared(
        _gemv_down_kernel,
        (T + (1 if check else 0), _launch.cdiv(H, block_n)),
        (T, H, I, E, *id_st, *tw_st, *w_st, *s_st, *b_st),
        dict(
            K=K, K_PAD=k_pad, QUANT=scheme.kernel_code, BLOCK_N=block_n,
            BLOCK_K=block_k, CHECK_IDS=cfg.check_ids, CHECK=check,
            ASSERT=in_kernel, HAS_BIAS=bias, num_warps=warps, **_checks.assert_build(in_kernel),
        ),
    )  # fmt: skip


def _scale_strides(s: Optional[torch.Tensor]) -> Tuple[int, int, int]:
    return (0, 0, 0) if s is None else (*s.stride(), 0)[:3]


def _bias_strides(b: Optional[torch.Tensor]) -> Tuple[int, int]:
    return (0, 0) if b is None else b.stride()


def _inter(w1: torch.Tensor, gate: str) -> int:
    """I: the columns of h (w1's rows, halved with a gate half; the default without a parse)."""
    return w1.shape[1] // 2 if gate == "silu" else _gate.parse(gate, OP_UP).inter(w1.shape[1])


def _up_output(x, topk_ids, w1, w1_scales=None, check=True, gate="silu", bias=None):
    """h bf16 `[T, K, I]`, allocated (the CUDA launch fills it; the fake returns it)."""
    shape = (x.shape[0], topk_ids.shape[1], _inter(w1, gate))
    return torch.empty(shape, dtype=torch.bfloat16, device=x.device)


def _down_output(h, topk_ids, topk_weights, w2, w2_scales=None, check=True, bias=None,
                 hidden=None):  # fmt: skip
    """out bf16 `[T, hidden]`, allocated (the CUDA launch fills it; the fake returns it)."""
    cols = w2.shape[1] if hidden is None else hidden
    return torch.empty((h.shape[0], cols), dtype=torch.bfloat16, device=h.device)


def _gemv_gate_up_triton(x, topk_ids, w1, w1_scales=None, check: bool = True, gate: str = "silu",
                         bias=None):  # fmt: skip
    """gemv_gate_up on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E, I = w1.shape[0], _inter(w1, gate)
    h = torch.empty((T, K, I), dtype=torch.bfloat16, device=x.device)
    in_kernel, ok = _check_setup(x, check)
    launch = _up_launch(
        T, H, I, E, K, w1.dtype, gate, bias is not None,
        x.stride(), topk_ids.stride(), w1.stride(), _scale_strides(w1_scales), _bias_strides(bias),
        check, in_kernel, CONFIG, w1.shape[2], x.device,
    )  # fmt: skip
    ws = w1_scales if w1_scales is not None else w1
    b = bias if bias is not None else x
    launch(x, topk_ids, w1, ws, b, h, ok if ok is not None else topk_ids)
    if ok is not None:
        _checks.check_values(ok, OP_UP, "topk_ids", f"ids in [0, {E}) or -1")
    return h


def _gemv_down_triton(h, topk_ids, topk_weights, w2, w2_scales=None, check: bool = True,
                      bias=None, hidden=None):  # fmt: skip
    """gemv_down on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    T, K, I = h.shape
    E, H = w2.shape[0], w2.shape[1] if hidden is None else hidden
    out = torch.empty((T, H), dtype=torch.bfloat16, device=h.device)
    h = h.contiguous()
    in_kernel, ok = _check_setup(h, check)
    launch = _down_launch(
        T, H, I, E, K, w2.dtype, bias is not None, topk_ids.stride(),
        topk_weights.stride(), w2.stride(), _scale_strides(w2_scales), _bias_strides(bias), check,
        in_kernel, CONFIG, w2.shape[1], h.device,
    )  # fmt: skip
    ws = w2_scales if w2_scales is not None else w2
    b = bias if bias is not None else h
    launch(h, topk_ids, topk_weights, w2, ws, b, out, ok if ok is not None else topk_ids)
    if ok is not None:
        _checks.check_values(ok, OP_DOWN, "topk_ids", f"ids in [0, {E}) or -1")
    return out


# ------------------------------------------------------------------------------------------ ops
_WEIGHT_DTYPES = tuple(s.act_dtype for s in quant.SCHEMES.values())
_F32 = (torch.float32,)


def _weight_steps(w: str, s: str, k_dim: Optional[str], fp8_dims):
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


def _gate_or_none(spec) -> Optional[_gate.Gate]:
    """The Gate of a spec, None for a bad one (the contract's rule then reports it)."""
    try:
        return _gate.parse(spec, OP_UP)
    except (ValueError, TypeError):  # (TypeError: an unhashable spec)
        return None


_CONSTS = dict(
    BF16=torch.bfloat16, FP8=reference.FP8_DTYPE, _gate_of=_gate_or_none, SILU=_gate.SILU
)
UP = Contract(
    OP_UP,
    "x topk_ids w1 w1_scales gate bias",
    Tensor("x", (torch.bfloat16,), ndim=(2,)),
    Tensor("topk_ids", _checks.INDEX_DTYPES, shape=("x.shape[0]", None)),
    Let("g", "SILU if gate == 'silu' else _gate_of(gate)"),  # (the default: one compare)
    Rule("g is not None", "gate", _gate.SPEC_EXPECTED, lambda a: repr(a.gate)),
    Tensor("w1", _WEIGHT_DTYPES, ndim=(3,)),
    Rule(
        "not g.glu or w1.shape[1] % 2 == 0",
        "w1",
        "shape [E, 2I, H] (an even row count: gate rows, then up rows)",
        lambda a: list(a.w1.shape),
    ),
    Rule(
        "x.shape[1] <= w1.shape[2]",
        "x",
        lambda a: f"at most {a.w1.shape[2]} columns (w1's H)",
        lambda a: a.x.shape[1],
    ),
    *_weight_steps(
        "w1",
        "w1_scales",
        None,
        (("H", "w1.shape[2]"), ("I", "w1.shape[1] // 2 if g.glu else w1.shape[1]")),
    ),
    Tensor("bias", _checks.FLOAT_DTYPES, shape=("w1.shape[0]", "w1.shape[1]"), optional=True),
    consts=_CONSTS,
)
DOWN = Contract(
    OP_DOWN,
    "h topk_ids topk_weights w2 w2_scales bias hidden",
    Tensor("h", (torch.bfloat16,), ndim=(3,)),
    Tensor("topk_ids", _checks.INDEX_DTYPES, shape=("h.shape[0]", "h.shape[1]")),
    Tensor("topk_weights", _checks.FLOAT_DTYPES, shape="topk_ids.shape"),
    *_weight_steps("w2", "w2_scales", "h.shape[2]", (("H", "w2.shape[1]"), ("I", "w2.shape[2]"))),
    Tensor("bias", _checks.FLOAT_DTYPES, shape=("w2.shape[0]", "w2.shape[1]"), optional=True),
    Rule(
        "hidden is None or (type(hidden) is int and 1 <= hidden <= w2.shape[1])",
        "hidden",
        lambda a: f"None or an int in [1, {a.w2.shape[1]}] (w2's H)",
        lambda a: repr(a.hidden),
    ),
    consts=_CONSTS,
)


def _up_reference(x, topk_ids, w1, w1_scales=None, check=True, gate="silu", bias=None):
    if check:
        _checks.check_ids(topk_ids, w1.shape[0], OP_UP, "topk_ids")
    return reference.gemv_gate_up(x, topk_ids, w1, w1_scales, gate, bias)


def _down_reference(h, topk_ids, topk_weights, w2, w2_scales=None, check=True, bias=None,
                    hidden=None):  # fmt: skip
    if check:
        _checks.check_ids(topk_ids, w2.shape[0], OP_DOWN, "topk_ids")
    return reference.gemv_down(h, topk_ids, topk_weights, w2, w2_scales, bias, hidden)


@stage(contract=UP, fake=_up_output, reference=_up_reference, cuda=_gemv_gate_up_triton)
def gemv_gate_up(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w1_scales: Optional[torch.Tensor] = None,
    check: bool = True,
    gate: str = "silu",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gated first expert projection of every (token, choice), activations quantized inside.

    Args:
        x: bf16 `[T, H]`, H <= w1.shape[2] (zero-extended to the weights' padded H).
        topk_ids: int32/int64 `[T, K]` local expert or -1.
        w1: bf16 / float8_e4m3fn / int8 `[E, W, Hp]`: W = 2I, gate rows first (prepare_weights'
            layout), or W = I (up rows) for a gate without glu.
        w1_scales: None (bf16), float32 `[E, W/128, Hp/128]` (fp8) or `[E, W]` (int8).
        check: False skips the check of the ids (the kernel then reads a bad id as a skipped
            choice); the CPU reference checks them only when True.
        gate: the gate's :mod:`epmoe.gate` spec ("silu", "silu:alpha=1.702,limit=7,up_offset=1",
            "gelu_tanh", "relu2:glu=0", ...).
        bias: None or bf16/fp16/fp32 `[E, W]`, added in float32 to the bf16-rounded g, u.
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
    bias: Optional[torch.Tensor] = None,
    hidden: Optional[int] = None,
) -> torch.Tensor:
    """Second expert projection of every (token, choice) and the weighted top-k sum.

    Args:
        h: bf16 `[T, K, I]` (gemv_gate_up's output).
        topk_ids: int32/int64 `[T, K]` local expert or -1.
        topk_weights: float `[T, K]`.
        w2: bf16 / float8_e4m3fn / int8 `[E, Hw, I]` (Hw: the hidden size, padded or not).
        w2_scales: None (bf16), float32 `[E, Hw/128, I/128]` (fp8) or `[E, Hw]` (int8).
        check: False skips the check of the ids (gemv_gate_up's ids, checked there; the kernel
            then reads a bad id as a skipped choice); the CPU reference checks them only when True.
        bias: None or bf16/fp16/fp32 `[E, Hw]`, added in float32 to each choice's bf16 product.
        hidden: the output's columns, None (Hw) or 1 <= hidden <= Hw (padded weights' H).
    Returns:
        bf16 `[T, hidden]`, float32 accumulation over k. CUDA-graph safe.
    """
