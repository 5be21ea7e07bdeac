"""Stage: grouped GEMM ("nt": out[r] = a[r] @ w[e].T), contiguous (HT) and masked (LL) layouts.

Contract:
- contiguous: a `[M_sum, Kd]`, w `[E, N, Kd]`, m_indices int32 `[M_sum]` (expert of the row,
  -1 = skip) -> bf16 `[M_sum, N]`. Rows with m_indices == -1 are unspecified, never read downstream.
  Optional expert_offsets int32 `[E + 1]` (permute's block starts; last = used rows) lets the
  torch._grouped_mm backend skip deriving group ends from m_indices.
- masked: a `[E, T, Kd]`, w `[E, N, Kd]`, masked_m int32 `[E]` -> bf16 `[E, T, N]`; rows
  t >= masked_m[e] are unspecified and never read. ``expected_m`` is a static hint of the typical
  rows per expert (0 = T); it picks tile shapes, never results.
- Schemes, chosen by a.dtype: bf16 (no scales); fp8 e4m3 (a_scales float32 `[.., Kd/128]` per token
  and 128 channels, w_scales float32 `[E, N/128, Kd/128]` per 128x128 block); int8 (a_scales
  float32 `[.., 1]` per token, w_scales float32 `[E, N]` per output channel, int32 accumulation).
  a_scales may have any strides. On sm90 deep_gemm wants fp8 activation scales MN-major and
  TMA-aligned (:func:`empty_fp8_act_scales` allocates that layout); other strides cost deep_gemm
  one transpose per call.

Backends on CUDA (CPU and other devices run :mod:`epmoe.reference`):
- fp8: deep_gemm (sm90, float32 scales); without it, the reference.
- bf16: deep_gemm bf16 grouped GEMMs (sm90/sm100); else torch._grouped_mm (contiguous) / torch.bmm
  (masked); else the reference.
- int8: the Triton W8A8 kernels below (int8 x int8 -> int32 on tensor cores, then per-token x
  per-channel scales, bf16 out).

CUDA-graph safe (static shapes, no host sync) once :func:`warmup` has compiled every kernel. The
contiguous layout needs every expert block to start at a multiple of :func:`contiguous_row_block`
rows: the permute ``alignment`` must be a multiple of it. The masked layout takes any T, but
deep_gemm's masked kernels need T to be a multiple of their row block (see
:func:`masked_row_block`); for any other T the op runs deep_gemm on a row-padded copy of the
operands (one extra copy of a, its scales and the output). Shape legend: ``E`` local experts,
``T`` rows per expert slot (masked), ``M_sum`` permuted rows, ``N``/``Kd`` GEMM output/reduction
dims.
"""

import functools
import math
from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from epmoe import _checks, _deps, _eager, reference
from epmoe._range import range_ok

OP = "grouped_gemm"
A_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.int8)

# The INT8 contiguous kernel maps each BLOCK_M row block to one expert; every tuned BLOCK_M divides
# this, so alignment % _INT8_ROW_BLOCK == 0 keeps every block inside one expert's rows.
_INT8_ROW_BLOCK = 128
# Masked INT8 tiles: tl.dot needs >= 16 rows; the decode-shaped configs (4 warps, long K tiles)
# spill registers past 64 rows, and LL experts rarely hold more rows than that.
_MASKED_MIN_BLOCK_M, _MASKED_MAX_BLOCK_M = 16, 64
# deep_gemm's float32-scale (1x128 / 128x128) kernels are sm90-only; sm100 casts scales to ue8m0.
_DG_FP8_ARCH = (9,)
_DG_BF16_ARCH = (9, 10)
_TMA_ALIGN_BYTES = 16  # TMA wants 16-byte aligned strides: fp8 scale columns are padded to 4 floats
# deep_gemm's masked kernels address a/out as 2-D `[E * T, *]` tensors: the row block of expert e
# starts at row e * T + i * BLOCK_M and the TMA store writes all BLOCK_M rows, so when BLOCK_M does
# not divide T the last block of expert e overwrites the first rows of expert e + 1 with rows
# computed with w[e] (fp8: zero scales read out of bounds -> zeros). Its heuristics pick BLOCK_M
# from expected_m: sm90 masked (non-W4) from {64, 128}; sm100 uses the contiguous-layout M
# alignment (128 or 256). T a multiple of these (e.g. an LL capacity of 256) needs no padding.
_DG_SM90_MASKED_BLOCK_M = 128
_DG_MASKED_BLOCK_M_OTHER = 256

# Old and new deep_gemm names of the same entry points (same positional arguments), newest first.
_DG_NAMES = {
    "fp8_contiguous": (
        "m_grouped_fp8_gemm_nt_contiguous",
        "m_grouped_fp8_fp4_gemm_nt_contiguous",
        "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
    ),
    "fp8_masked": (
        "m_grouped_fp8_gemm_nt_masked",
        "m_grouped_fp8_fp4_gemm_nt_masked",
        "fp8_m_grouped_gemm_nt_masked",
        "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
    ),
    "bf16_contiguous": ("m_grouped_bf16_gemm_nt_contiguous",),
    "bf16_masked": ("m_grouped_bf16_gemm_nt_masked", "bf16_m_grouped_gemm_nt_masked"),
    "alignment": (
        "get_mk_alignment_for_contiguous_layout",
        "get_m_alignment_for_contiguous_layout",
    ),
}


_SCHEME_DTYPE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def scheme_of(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8", torch.int8: "int8"}[dtype]


# ------------------------------------------------------------------------------- backend selection
@functools.cache
def _dg_functions() -> dict:
    """deep_gemm entry points by role (None where this version has none); resolved once."""
    dg = _deps.deep_gemm()
    fns = {}
    for role, names in _DG_NAMES.items():
        fns[role] = next((getattr(dg, n) for n in names if hasattr(dg, n)), None)
    return fns


@functools.cache
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cap(device: torch.device) -> Tuple[int, int]:
    device = torch.device(device)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _dg_role(role: str, device: torch.device) -> bool:
    """True when deep_gemm's entry point ``role`` exists and runs our scale format on ``device``."""
    if not _deps.available("deep_gemm"):
        return False
    arch = _DG_FP8_ARCH if role.startswith("fp8") else _DG_BF16_ARCH
    return _cap(device)[0] in arch and _dg_functions()[role] is not None


def _grouped_mm_ok(device: torch.device, n: int, k: int) -> bool:
    # torch._grouped_mm: sm90+, 16-byte aligned rows of a and of w.T.
    return hasattr(torch, "_grouped_mm") and _cap(device)[0] >= 9 and n % 8 == 0 and k % 8 == 0


def _backend(scheme: str, layout: str, device: torch.device, n: int, k: int) -> str:
    """The implementation of ``scheme`` x ``layout`` ("contiguous"/"masked") on a CUDA device."""
    if scheme == "int8":
        return "triton"
    # fp8 shapes are validated multiples of 128; bf16 goes to deep_gemm on its 64-wide tiles only
    dg_shape_ok = scheme == "fp8" or (n % 64 == 0 and k % 64 == 0)
    if dg_shape_ok and _dg_role(f"{scheme}_{layout}", device):
        return "deep_gemm"
    if scheme == "bf16":
        if layout == "masked":
            return "bmm"
        if _grouped_mm_ok(device, n, k):
            return "grouped_mm"
    return "reference"


def contiguous_row_block(scheme: str, device: torch.device) -> int:
    """Rows each expert block of the contiguous layout must be aligned to on ``device``.

    CPU (the reference) has no constraint: 1. CUDA: deep_gemm's
    ``get_mk_alignment_for_contiguous_layout()`` (128 today) for fp8/bf16 when deep_gemm runs them,
    the INT8 Triton kernel's largest BLOCK_M (128) for int8, 1 for torch._grouped_mm and the
    reference.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    _checks.check_choice(OP, "scheme", scheme, reference.QUANT_SCHEMES)
    if scheme == "int8":
        return _INT8_ROW_BLOCK
    if _dg_role(f"{scheme}_contiguous", device):
        get = _dg_functions()["alignment"]
        return int(get()) if get is not None else 128
    return 1


def masked_row_block(scheme: str, device: torch.device) -> int:
    """Rows T (per expert slot) of the masked layout must be a multiple of to avoid a padding copy.

    1 on CPU and wherever deep_gemm does not run ``scheme``'s masked GEMM (INT8 Triton, bmm, the
    reference: any T is used as is). With deep_gemm: the largest row block its masked kernels can
    pick on the device (128 on sm90, 256 elsewhere); for T not a multiple of it the op copies a
    (and fp8 scales) into a `[E, T_pad, Kd]` buffer and the output back to `[E, T, N]`.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    _checks.check_choice(OP, "scheme", scheme, reference.QUANT_SCHEMES)
    if scheme == "int8" or not _dg_role(f"{scheme}_masked", device):
        return 1
    if _cap(device)[0] == 9:
        return _DG_SM90_MASKED_BLOCK_M
    get = _dg_functions()["alignment"]
    return math.lcm(_DG_MASKED_BLOCK_M_OTHER, int(get()) if get is not None else 1)


def empty_fp8_act_scales(lead: Sequence[int], groups: int, device) -> torch.Tensor:
    """Uninitialized float32 activation scales `[*lead, groups]` in deep_gemm's sm90 layout.

    MN-major (the row index is contiguous) with the row count padded to 4 floats (16-byte TMA
    alignment): deep_gemm then uses them as they are. ``lead`` is `(M,)` or `(E, T)`.
    """
    lead = tuple(int(s) for s in lead)
    rows = lead[-1]
    pad = _TMA_ALIGN_BYTES // 4
    rows_aligned = (rows + pad - 1) // pad * pad
    if len(lead) == 1:
        size, stride = (rows, groups), (1, rows_aligned)
    elif len(lead) == 2:
        size, stride = (lead[0], rows, groups), (rows_aligned * groups, 1, rows_aligned)
    else:
        raise _checks.fail("empty_fp8_act_scales", "lead", "(M,) or (E, T)", lead)
    return torch.empty_strided(size, stride, dtype=torch.float32, device=device)


# ------------------------------------------------------------------------------------- validation
def _valid(a, w, a_scales, w_scales, masked: bool, rows=None, offsets=None) -> bool:
    """The common all-good case (CUDA operands) in one pass: every eager call pays for validation
    (the full checks below cost ~9 µs of host time). Each tensor attribute read costs ~0.2 µs, so
    this reads each once: shapes kept as locals, devices as ints (get_device), dtypes compared by
    identity. ``rows``: masked_m (masked) or m_indices, int32; ``offsets``: expert_offsets or
    None. Any False falls through to the full checks, which say what is wrong."""
    try:
        dt = a.dtype
        if dt not in A_DTYPES or w.dtype is not dt or not a.is_cuda:
            return False
        # plain tensors without grad (see _eager.calm; a Parameter w takes the registered op)
        if (
            type(a) is not torch.Tensor
            or type(w) is not torch.Tensor
            or a.requires_grad
            or w.requires_grad
        ):
            return False
        dev = a.get_device()
        ash, wsh = a.shape, w.shape
        if len(ash) != (3 if masked else 2) or len(wsh) != 3 or w.get_device() != dev:
            return False
        kd, e, n = ash[-1], wsh[0], wsh[1]
        if wsh[2] != kd or (masked and ash[0] != e):
            return False
        if rows is not None and not _checks.plain_on(
            rows, _checks.INT32, dev, (e,) if masked else ash[:1]
        ):
            return False
        if offsets is not None and not _checks.plain_on(offsets, _checks.INT32, dev, (e + 1,)):
            return False
        if dt is torch.bfloat16:
            return a_scales is None and w_scales is None
        if (
            type(a_scales) is not torch.Tensor
            or type(w_scales) is not torch.Tensor
            or a_scales.requires_grad
            or w_scales.requires_grad
            or a_scales.dtype is not torch.float32
            or w_scales.dtype is not torch.float32
            or a_scales.get_device() != dev
            or w_scales.get_device() != dev
        ):
            return False
        ssh = a_scales.shape
        if dt is torch.int8:
            return ssh[:-1] == ash[:-1] and ssh[-1] == 1 and w_scales.shape == (e, n)
        return (
            kd % 128 == 0
            and n % 128 == 0
            and ssh[:-1] == ash[:-1]
            and ssh[-1] == kd // 128
            and w_scales.shape == (e, n // 128, kd // 128)
        )
    except (AttributeError, TypeError, IndexError):
        return False


def _validate(a, w, a_scales, w_scales, masked: bool) -> None:
    if _valid(a, w, a_scales, w_scales, masked):
        return
    _checks.check_dtype(OP, "a", a, A_DTYPES)
    _checks.check_ndim(OP, "a", a, (3,) if masked else (2,))
    _checks.check_dtype(OP, "w", w, (a.dtype,))
    _checks.check_ndim(OP, "w", w, (3,))
    _checks.check_device(OP, "w", w, a)
    Kd = a.shape[-1]
    E, N = w.shape[0], w.shape[1]
    if w.shape[2] != Kd:
        raise _checks.fail(OP, "w", f"shape [E, N, {Kd}] (K of a)", list(w.shape))
    if masked and a.shape[0] != E:
        raise _checks.fail(OP, "a", f"shape [{E}, T, {Kd}] (E of w)", list(a.shape))
    scheme = scheme_of(a.dtype)
    lead = tuple(a.shape[:-1])
    if scheme == "bf16":
        for name, t in (("a_scales", a_scales), ("w_scales", w_scales)):
            if t is not None:
                raise _checks.fail(OP, name, "None for bf16 operands", "a tensor")
        return
    if a_scales is None or w_scales is None:
        raise _checks.fail(OP, "a_scales/w_scales", f"tensors for {scheme} operands", "None")
    _checks.check_dtype(OP, "a_scales", a_scales, (torch.float32,))
    _checks.check_dtype(OP, "w_scales", w_scales, (torch.float32,))
    _checks.check_device(OP, "a_scales", a_scales, a)
    _checks.check_device(OP, "w_scales", w_scales, a)
    if scheme == "fp8":
        _checks.check_multiple(OP, "K", Kd, 128, "(fp8 scale blocks)")
        _checks.check_multiple(OP, "N", N, 128, "(fp8 weight blocks)")
        _checks.check_shape(OP, "a_scales", a_scales, lead + (Kd // 128,))
        _checks.check_shape(OP, "w_scales", w_scales, (E, N // 128, Kd // 128))
    else:
        _checks.check_shape(OP, "a_scales", a_scales, lead + (1,))
        _checks.check_shape(OP, "w_scales", w_scales, (E, N))


def _validate_contiguous(a, w, m_indices, a_scales, w_scales, expert_offsets=None) -> None:
    if m_indices is not None and _valid(a, w, a_scales, w_scales, False, m_indices, expert_offsets):
        return
    _validate(a, w, a_scales, w_scales, masked=False)
    _checks.check_dtype(OP, "m_indices", m_indices, (torch.int32,))
    _checks.check_shape(OP, "m_indices", m_indices, (a.shape[0],))
    _checks.check_device(OP, "m_indices", m_indices, a)
    if expert_offsets is not None:
        _checks.check_dtype(OP, "expert_offsets", expert_offsets, (torch.int32,))
        _checks.check_shape(OP, "expert_offsets", expert_offsets, (w.shape[0] + 1,))
        _checks.check_device(OP, "expert_offsets", expert_offsets, a)


def _validate_masked(a, w, masked_m, a_scales, w_scales) -> None:
    if masked_m is not None and _valid(a, w, a_scales, w_scales, True, masked_m):
        return
    _validate(a, w, a_scales, w_scales, masked=True)
    _checks.check_dtype(OP, "masked_m", masked_m, (torch.int32,))
    _checks.check_shape(OP, "masked_m", masked_m, (w.shape[0],))
    _checks.check_device(OP, "masked_m", masked_m, a)


def _check_counts(masked_m: torch.Tensor, t: int) -> None:
    ok = range_ok(masked_m, 0, t + 1)
    _checks.check_values(ok, OP, "masked_m", f"counts in [0, {t}]")


# ------------------------------------------------------------------------------- Triton INT8 W8A8
def _even_k(args) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


@triton.jit
def _int8_dot_k(
    a_ptrs, w_ptrs, offs_k, K, stride_ak, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """int32 `[BLOCK_M, BLOCK_N]` sum over K of a `[BLOCK_M, BLOCK_K]` tiles x w `[BLOCK_K,
    BLOCK_N]` tiles, starting at ``a_ptrs`` / ``w_ptrs`` and stepping BLOCK_K along K (the K tail
    masked to 0 unless EVEN_K)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0)
        acc = tl.dot(a, b, acc=acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.heuristics({"EVEN_K": _even_k})
@triton.jit(do_not_specialize=["M"])
def _int8_contiguous_kernel(
    # tensors
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, m_indices_ptr, out_ptr,
    # sizes (E only keys the autotuner)
    M, N, K, E,
    # strides
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_asm,
    stride_wse, stride_wsn,
    stride_om, stride_on,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row blocks (mostly of the same expert) sweep the N tiles together: weight tiles and
    # activation rows are reused from L2.
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    # the block's expert is its first row's: alignment % BLOCK_M == 0 puts every block in one expert
    expert = tl.load(m_indices_ptr + pid_m * BLOCK_M).to(tl.int64)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # tail rows/columns wrap onto valid memory; their results are never stored
    rows = (offs_m % M).to(tl.int64)
    cols = offs_n % N
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk

    acc = _int8_dot_k(a_ptrs, w_ptrs, offs_k, K, stride_ak, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K,
                      EVEN_K)  # fmt: skip

    a_s = tl.load(a_scale_ptr + rows * stride_asm)
    w_s = tl.load(w_scale_ptr + expert * stride_wse + cols * stride_wsn)
    y = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    o_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, y.to(tl.bfloat16), mask=o_mask)


@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def _int8_masked_kernel(
    # tensors
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, masked_m_ptr, out_ptr, ok_ptr,
    # sizes (E only keys the autotuner)
    T, N, K, E,
    # strides
    stride_ae, stride_at, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_ase, stride_ast,
    stride_wse, stride_wsn,
    stride_oe, stride_ot, stride_on,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, CHECK: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    expert = tl.program_id(1)
    pid_s = tl.program_id(2)
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
    offs_k = tl.arange(0, BLOCK_K)
    cols = offs_n % N
    a_base = a_ptr + e64 * stride_ae
    w_base = w_ptr + e64 * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    w_s = tl.load(w_scale_ptr + e64 * stride_wse + cols * stride_wsn)

    # Row blocks pid_s, pid_s + M_SPLIT, ... below the device-side count: a fixed grid (graph-safe)
    # whose programs past the count do nothing, sized by expected_m rather than by T.
    for m0 in range(pid_s * BLOCK_M, count, M_SPLIT * BLOCK_M):
        offs_t = m0 + tl.arange(0, BLOCK_M)
        # rows >= count are never read: clamp onto the last live row, never store them
        rows = tl.minimum(offs_t, count - 1).to(tl.int64)
        a_ptrs = a_base + rows[:, None] * stride_at + offs_k[None, :] * stride_ak
        acc = _int8_dot_k(a_ptrs, w_base, offs_k, K, stride_ak, stride_wk, BLOCK_M, BLOCK_N,
                          BLOCK_K, EVEN_K)  # fmt: skip
        a_s = tl.load(a_scale_ptr + e64 * stride_ase + rows * stride_ast)
        y = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]
        o_ptrs = (
            out_ptr
            + e64 * stride_oe
            + offs_t.to(tl.int64)[:, None] * stride_ot
            + offs_n[None, :] * stride_on
        )
        o_mask = (offs_t[:, None] < count) & (offs_n[None, :] < N)
        tl.store(o_ptrs, y.to(tl.bfloat16), mask=o_mask)


def _cfg(num_warps, num_stages, **kw):
    return triton.Config(kw, num_warps=num_warps, num_stages=num_stages)


# Hopper-sized tiles for the compute-bound prefill GEMM (int8 wgmma, <= ~200 KB shared memory);
# configs that do not fit are dropped by the autotuner. Every BLOCK_M divides _INT8_ROW_BLOCK.
_CONTIGUOUS_CONFIGS = [
    _cfg(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
    _cfg(4, 5, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
    _cfg(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=256, GROUP_M=8),
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=8),
]
# Decode is a weight stream: narrow N tiles, long K tiles, deep pipelines keep HBM busy.
_MASKED_CONFIGS = [
    _cfg(4, 4, BLOCK_N=64, BLOCK_K=256),
    _cfg(4, 4, BLOCK_N=128, BLOCK_K=256),
    _cfg(4, 5, BLOCK_N=64, BLOCK_K=128),
    _cfg(4, 4, BLOCK_N=128, BLOCK_K=128),
    _cfg(4, 3, BLOCK_N=32, BLOCK_K=512),
    _cfg(8, 3, BLOCK_N=128, BLOCK_K=128),
]
assert all(_INT8_ROW_BLOCK % c.kwargs["BLOCK_M"] == 0 for c in _CONTIGUOUS_CONFIGS)

# Autotuning keys are static dims only (never token counts): tune once per weight shape in warmup().
_int8_contiguous_tuned = triton.autotune(_CONTIGUOUS_CONFIGS, key=["N", "K", "E"])(
    _int8_contiguous_kernel
)
_int8_masked_tuned = triton.autotune(_MASKED_CONFIGS, key=["N", "K", "E", "BLOCK_M"])(
    _int8_masked_kernel
)


def _masked_tiling(t: int, expected_m: int) -> Tuple[int, int]:
    """(BLOCK_M, M_SPLIT) of the masked kernel from static sizes: tiles sized for expected_m."""
    em = max(1, min(expected_m or t, t))
    block_m = min(_MASKED_MAX_BLOCK_M, max(_MASKED_MIN_BLOCK_M, triton.next_power_of_2(em)))
    split = max(1, min(triton.cdiv(t, block_m), triton.cdiv(em, block_m)))
    return block_m, split


def _int8_contiguous_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: torch.Tensor,
    a_scales: torch.Tensor,
    w_scales: torch.Tensor,
    config: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the INT8 contiguous kernel (also on CPU tensors under TRITON_INTERPRET=1).

    Args:
        a: int8 `[M_sum, Kd]`. w: int8 `[E, N, Kd]`. m_indices: int32 `[M_sum]`, contiguous.
        a_scales: float32 `[M_sum, 1]`. w_scales: float32 `[E, N]`.
        config: explicit meta-parameters (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps,
            optionally num_stages); None = autotuned. Expert blocks must be aligned to BLOCK_M rows.
        out: bf16 `[M_sum, N]` to write into (tests); None allocates it.
    Returns:
        bf16 `[M_sum, N]`; rows of -1 blocks are left unwritten.
    """
    M, K = a.shape
    E, N = w.shape[0], w.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    m_indices = m_indices.contiguous()

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    kernel = _int8_contiguous_tuned if config is None else _int8_contiguous_kernel
    kernel[grid](
        a, w, a_scales, w_scales, m_indices, out,
        M, N, K, E,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        a_scales.stride(0),
        w_scales.stride(0), w_scales.stride(1),
        out.stride(0), out.stride(1),
        **(config or {}),
    )  # fmt: skip
    return out


def _int8_masked_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    a_scales: torch.Tensor,
    w_scales: torch.Tensor,
    expected_m: int = 0,
    config: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
    ok: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the INT8 masked kernel (also on CPU tensors under TRITON_INTERPRET=1).

    Args:
        a: int8 `[E, T, Kd]`. w: int8 `[E, N, Kd]`. masked_m: int32 `[E]` live rows per expert.
        a_scales: float32 `[E, T, 1]`. w_scales: float32 `[E, N]`.
        expected_m: static hint of rows per expert (0 = T): picks BLOCK_M and the grid's M split.
        config: explicit meta-parameters (BLOCK_N, BLOCK_K, num_warps[, num_stages], optionally
            BLOCK_M and M_SPLIT); None = autotuned BLOCK_N/BLOCK_K.
        out: bf16 `[E, T, N]` to write into (tests); None allocates it.
        ok: bool `[]` the kernel sets to "every count in [0, T]" (the op's value check, no launch
            of its own); None skips the check.
    Returns:
        bf16 `[E, T, N]`; rows t >= masked_m[e] are left unwritten.
    """
    E, T, K = a.shape
    N = w.shape[1]
    if out is None:
        out = torch.empty((E, T, N), dtype=torch.bfloat16, device=a.device)
    if E == 0 or T == 0 or N == 0:
        return out
    masked_m = masked_m.contiguous()
    block_m, split = _masked_tiling(T, expected_m)
    meta = dict(config or {})
    meta.setdefault("BLOCK_M", block_m)
    meta.setdefault("M_SPLIT", split)

    def grid(m):
        return (triton.cdiv(N, m["BLOCK_N"]), E, m["M_SPLIT"])

    kernel = _int8_masked_tuned if config is None else _int8_masked_kernel
    kernel[grid](
        a, w, a_scales, w_scales, masked_m, out, ok if ok is not None else masked_m,
        T, N, K, E,
        a.stride(0), a.stride(1), a.stride(2),
        w.stride(0), w.stride(1), w.stride(2),
        a_scales.stride(0), a_scales.stride(1),
        w_scales.stride(0), w_scales.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        CHECK=ok is not None, E_PAD=triton.next_power_of_2(E), **meta,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------- CUDA backends
def _group_ends(m_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 `[E]` cumulative end row of each expert's rows (torch._grouped_mm ``offs``), sync-free.

    Padding (-1) rows between experts land in the next expert's group: their output is unspecified.
    """
    rows = torch.arange(1, m_indices.numel() + 1, device=m_indices.device, dtype=torch.int32)
    valid = m_indices >= 0
    ends = torch.zeros(num_experts, dtype=torch.int32, device=m_indices.device)
    ends.scatter_reduce_(
        0, m_indices.clamp(min=0).long(), torch.where(valid, rows, 0), reduce="amax"
    )
    return torch.cummax(ends, 0).values


def _contiguous_cuda_impl(a, w, m_indices, a_scales, w_scales, expert_offsets):
    scheme = scheme_of(a.dtype)
    M, K = a.shape
    E, N = w.shape[0], w.shape[1]
    backend = _backend(scheme, "contiguous", a.device, N, K)
    if backend == "triton":
        return _int8_contiguous_triton(a, w, m_indices, a_scales, w_scales)
    if backend == "reference" or M == 0:
        return reference.grouped_gemm_contiguous(a, w, m_indices, a_scales, w_scales)
    if backend == "grouped_mm":
        if expert_offsets is None:
            offs = _group_ends(m_indices, E)
        else:
            offs = expert_offsets[1:].contiguous()
        return torch._grouped_mm(a.contiguous(), w.transpose(1, 2), offs=offs)
    out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    fn = _dg_functions()[f"{scheme}_contiguous"]
    a, w, m_indices = a.contiguous(), w.contiguous(), m_indices.contiguous()
    if scheme == "fp8":
        fn((a, a_scales), (w, w_scales.contiguous()), out, m_indices)
    else:
        fn(a, w, out, m_indices)
    return out


def _masked_cuda_impl(a, w, masked_m, a_scales, w_scales, expected_m, trusted=False):
    scheme = scheme_of(a.dtype)
    E, T, K = a.shape
    N = w.shape[1]
    backend = _backend(scheme, "masked", a.device, N, K)
    if backend == "triton":  # the kernel itself checks the counts
        ok = torch.empty((), dtype=torch.bool, device=a.device)
        out = _int8_masked_triton(a, w, masked_m, a_scales, w_scales, expected_m, ok=ok)
        _checks.check_values(ok, OP, "masked_m", f"counts in [0, {T}]")
        return out
    if not trusted:
        _check_counts(masked_m, T)
    if backend == "reference" or T == 0:
        return reference.grouped_gemm_masked(a, w, masked_m, a_scales, w_scales)
    if backend == "bmm":
        return torch.bmm(a, w.transpose(1, 2))
    fn = _dg_functions()[f"{scheme}_masked"]
    block = masked_row_block(scheme, a.device)
    return _deep_gemm_masked(fn, a, w, masked_m, a_scales, w_scales, expected_m, block)


def _pad_masked_rows(
    a: torch.Tensor, a_scales: Optional[torch.Tensor], t_pad: int
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Copy a `[E, T, Kd]` (and fp8 scales `[E, T, G]`) into `[E, t_pad, *]` buffers.

    The pad rows stay uninitialized: they lie past every count (masked_m <= T), so deep_gemm only
    computes them as the tail of a row block, into output rows that are sliced away. The scales
    come out MN-major and TMA-aligned (:func:`empty_fp8_act_scales`), the layout deep_gemm reads
    without a transpose.
    """
    E, T, K = a.shape
    a_p = a.new_empty((E, t_pad, K))
    a_p[:, :T].copy_(a)
    if a_scales is None:
        return a_p, None
    s_p = empty_fp8_act_scales((E, t_pad), a_scales.shape[-1], a.device)
    s_p[:, :T].copy_(a_scales)
    return a_p, s_p


def _deep_gemm_masked(fn, a, w, masked_m, a_scales, w_scales, expected_m: int, block: int):
    """Run deep_gemm's masked GEMM ``fn`` correctly for any T (static shapes, no host sync).

    Args:
        fn: deep_gemm's bf16 (``fn(a, w, out, masked_m, expected_m)``) or fp8
            (``fn((a, a_scales), (w, w_scales), out, masked_m, expected_m)``) masked entry point.
        a: bf16/fp8 `[E, T, Kd]`. w: same dtype `[E, N, Kd]`. masked_m: int32 `[E]`, <= T.
        a_scales: float32 `[E, T, Kd/128]` (fp8) or None. w_scales: float32
            `[E, N/128, Kd/128]` (fp8) or None.
        expected_m: static hint (0 = T), clamped to [1, T].
        block: the row block T must be a multiple of (:func:`masked_row_block`); otherwise the
            rows are padded to the next multiple of it and the output is sliced back.
    Returns:
        bf16 `[E, T, N]`, contiguous; rows t >= masked_m[e] unspecified.
    """
    E, T, _ = a.shape
    N = w.shape[1]
    em = max(1, min(expected_m or T, T))
    a, w, masked_m = a.contiguous(), w.contiguous(), masked_m.contiguous()
    t_pad = -(-T // block) * block
    if t_pad != T:
        a, a_scales = _pad_masked_rows(a, a_scales, t_pad)
    out = torch.empty((E, t_pad, N), dtype=torch.bfloat16, device=a.device)
    if a.dtype == torch.float8_e4m3fn:
        fn((a, a_scales), (w, w_scales.contiguous()), out, masked_m, em)
    else:
        fn(a, w, out, masked_m, em)
    return out if t_pad == T else out[:, :T].contiguous()


# -------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("epmoe::grouped_gemm_contiguous", mutates_args=())
def _contiguous_op(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    expert_offsets: Optional[torch.Tensor] = None,
    trusted: bool = False,
) -> torch.Tensor:
    _validate_contiguous(a, w, m_indices, a_scales, w_scales, expert_offsets)
    _checks.check_ids(m_indices, w.shape[0], OP, "m_indices")
    return reference.grouped_gemm_contiguous(a, w, m_indices, a_scales, w_scales)


@_contiguous_op.register_fake
def _contiguous_fake(
    a, w, m_indices, a_scales=None, w_scales=None, expert_offsets=None, trusted=False
):
    _validate_contiguous(a, w, m_indices, a_scales, w_scales, expert_offsets)
    return a.new_empty((a.shape[0], w.shape[1]), dtype=torch.bfloat16)


@_contiguous_op.register_kernel("cpu")
def _contiguous_cpu(
    a, w, m_indices, a_scales=None, w_scales=None, expert_offsets=None, trusted=False
):
    _validate_contiguous(a, w, m_indices, a_scales, w_scales, expert_offsets)
    _checks.check_ids(m_indices, w.shape[0], OP, "m_indices")
    return reference.grouped_gemm_contiguous(a, w, m_indices, a_scales, w_scales)


@_contiguous_op.register_kernel("cuda")
def _contiguous_cuda(
    a, w, m_indices, a_scales=None, w_scales=None, expert_offsets=None, trusted=False
):
    _validate_contiguous(a, w, m_indices, a_scales, w_scales, expert_offsets)
    if not trusted:
        _checks.check_ids(m_indices, w.shape[0], OP, "m_indices")
    with _eager.on_device(a):  # Triton and deep_gemm launch on the current device
        return _contiguous_cuda_impl(a, w, m_indices, a_scales, w_scales, expert_offsets)


@torch.library.custom_op("epmoe::grouped_gemm_masked", mutates_args=())
def _masked_op(
    a: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    expected_m: int = 0,
    trusted: bool = False,
) -> torch.Tensor:
    _validate_masked(a, w, masked_m, a_scales, w_scales)
    _check_counts(masked_m, a.shape[1])
    return reference.grouped_gemm_masked(a, w, masked_m, a_scales, w_scales)


@_masked_op.register_fake
def _masked_fake(a, w, masked_m, a_scales=None, w_scales=None, expected_m=0, trusted=False):
    _validate_masked(a, w, masked_m, a_scales, w_scales)
    return a.new_empty((a.shape[0], a.shape[1], w.shape[1]), dtype=torch.bfloat16)


@_masked_op.register_kernel("cpu")
def _masked_cpu(a, w, masked_m, a_scales=None, w_scales=None, expected_m=0, trusted=False):
    _validate_masked(a, w, masked_m, a_scales, w_scales)
    _check_counts(masked_m, a.shape[1])
    return reference.grouped_gemm_masked(a, w, masked_m, a_scales, w_scales)


@_masked_op.register_kernel("cuda")
def _masked_cuda(a, w, masked_m, a_scales=None, w_scales=None, expected_m=0, trusted=False):
    _validate_masked(a, w, masked_m, a_scales, w_scales)
    with _eager.on_device(a):  # (checks masked_m: the int8 kernel does it in its own launch)
        return _masked_cuda_impl(a, w, masked_m, a_scales, w_scales, expected_m, trusted)


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: Optional[torch.Tensor] = None,
    masked_m: Optional[torch.Tensor] = None,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    expected_m: Optional[int] = None,
    expert_offsets: Optional[torch.Tensor] = None,
    trusted: bool = False,
) -> torch.Tensor:
    """Grouped GEMM out = a @ w[e].T; pass exactly one of ``m_indices`` (contiguous), ``masked_m``.

    Args:
        a: bf16/fp8/int8 `[M_sum, Kd]` (contiguous) or `[E, T, Kd]` (masked).
        w: same dtype `[E, N, Kd]` (as returned by :func:`prepare_weights`).
        m_indices: int32 `[M_sum]` expert per row, -1 to skip; expert blocks start at multiples of
            :func:`contiguous_row_block`.
        masked_m: int32 `[E]` live rows per expert (on the device; rows past it are never read).
            Any T works; with deep_gemm, T a multiple of :func:`masked_row_block` saves a copy.
        a_scales, w_scales: float32 scales for fp8/int8 (see module docstring).
        expected_m: static hint of rows per expert for the masked layout (default T).
        expert_offsets: optional int32 `[E + 1]` expert block starts of the contiguous layout
            (permute's ``expert_offsets``); only the torch._grouped_mm backend uses it.
        trusted: m_indices / masked_m come from permute / ll_scatter, whose values are in range
            by construction: the CUDA backends skip their device-side value check (the layer's
            own chain). The CPU reference always checks.
    Returns:
        bf16 `[M_sum, N]` or `[E, T, N]`. CUDA-graph safe after :func:`warmup`.
    """
    if (m_indices is None) == (masked_m is None):
        raise _checks.fail(OP, "m_indices/masked_m", "exactly one of them", "both or neither")
    if m_indices is not None:
        direct = _eager.direct(a, w, m_indices, a_scales, w_scales, expert_offsets)
        run = _contiguous_cuda if direct else _contiguous_op
        return run(a, w, m_indices, a_scales, w_scales, expert_offsets, trusted)
    em = int(expected_m or 0)
    if _eager.calm() and _valid(a, w, a_scales, w_scales, True, masked_m):
        with _eager.on_device(a):  # the usual eager call, validated in one pass
            return _masked_cuda_impl(a, w, masked_m, a_scales, w_scales, em, trusted)
    run = _masked_cuda if _eager.direct(a, w, masked_m, a_scales, w_scales) else _masked_op
    return run(a, w, masked_m, a_scales, w_scales, em, trusted)


# ------------------------------------------------------------------------------- weights / warmup
def prepare_weights(
    w_q: torch.Tensor, w_s: Optional[torch.Tensor], scheme: str, device
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Expert weights in the layout the ``device`` backend reads without any per-call transform.

    Every backend reads the layout :func:`epmoe.reference.quantize_weights` produces, so this is the
    identity up to device placement and contiguity: weights `[E, N, Kd]` K-major (deep_gemm's
    ``nt`` B operand, torch._grouped_mm's column-major w.T, the INT8 kernel's K-major tiles);
    fp8 scales float32 `[E, N/128, Kd/128]` contiguous (what deep_gemm's sm90 kernels take as is);
    int8 scales float32 `[E, N]`. Nothing is repacked, so the shapes stay the logical ones; callers
    still take N and Kd from their configured sizes (as :func:`warmup` does).

    Args:
        w_q: bf16/fp8/int8 `[E, N, Kd]`. w_s: float32 scales or None (bf16). scheme: "bf16", "fp8",
            "int8". device: where the layer runs.
    Returns:
        (weights, scales) accepted by :func:`grouped_gemm`.
    """
    _checks.check_choice("prepare_weights", "scheme", scheme, reference.QUANT_SCHEMES)
    want = _SCHEME_DTYPE[scheme]
    _checks.check_dtype("prepare_weights", "w_q", w_q, (want,))
    _checks.check_ndim("prepare_weights", "w_q", w_q, (3,))
    w_q = w_q.to(device).contiguous()
    if w_s is not None:
        w_s = w_s.to(device=device, dtype=torch.float32).contiguous()
    return w_q, w_s


def _dummy_weights(scheme, E, N, K, device):
    w = torch.zeros((E, N, K), dtype=_SCHEME_DTYPE[scheme], device=device)
    if scheme == "fp8":
        return w, torch.ones((E, N // 128, K // 128), dtype=torch.float32, device=device)
    if scheme == "int8":
        return w, torch.ones((E, N), dtype=torch.float32, device=device)
    return w, None


def _dummy_acts(scheme, lead, K, device, mn_major):
    a = torch.zeros((*lead, K), dtype=_SCHEME_DTYPE[scheme], device=device)
    if scheme == "bf16":
        return a, None
    if scheme == "int8":
        return a, torch.ones((*lead, 1), dtype=torch.float32, device=device)
    s = (
        empty_fp8_act_scales(lead, K // 128, device)
        if mn_major
        else torch.empty((*lead, K // 128), dtype=torch.float32, device=device)
    )
    return a, s.fill_(1.0)


def _balanced_m_indices(m: int, E: int, row_block: int, device) -> torch.Tensor:
    """int32 `[m]`: rows over all experts in ``row_block``-aligned blocks, in expert order."""
    block = max(1, row_block)
    per = max(block, math.ceil(m / E / block) * block)
    return (torch.arange(m, device=device) // per).clamp(max=E - 1).to(torch.int32)


def warmup(
    scheme: str,
    num_experts: int,
    n: int,
    k: int,
    device,
    contiguous_m: Sequence[int] = (),
    masked_t: Optional[int] = None,
    expected_m: Optional[int] = None,
    w: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
) -> None:
    """Compile (and autotune) every kernel one GEMM of a layer will launch, outside graph capture.

    deep_gemm JIT-compiles per (N, K, E) and per heuristic choice, which depends on M (contiguous)
    and expected_m (masked); the INT8 Triton kernels autotune per (N, K, E) (and BLOCK_M, masked).
    Call once per weight of the layer before capturing CUDA graphs or serving.

    Args:
        scheme: "bf16", "fp8" or "int8". num_experts: E (local). n, k: the GEMM's logical N and Kd
            from the layer's configured sizes (GEMM1: 2I, H; GEMM2: H, I).
        device: the CUDA device (CPU: nothing to do).
        contiguous_m: M_sum sizes of the contiguous layout to compile for (HT: the worst-case M_sum
            of graph capture, plus typical prefill sizes; the first one drives INT8 autotuning, so
            put the largest first).
        masked_t: T of the masked layout (LL: rows per expert slot), or None when LL is unused;
            the same T as the forward pass (it decides whether deep_gemm runs on a padded copy).
        expected_m: the masked layout's static hint, exactly as the forward pass passes it.
        w, w_scales: the layer's prepared weights (avoids allocating dummies of the same size).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return
    _checks.check_choice("warmup", "scheme", scheme, reference.QUANT_SCHEMES)
    E, N, K = num_experts, n, k
    if w is None:
        w, w_scales = _dummy_weights(scheme, E, N, K, device)
    else:
        _checks.check_shape("warmup", "w", w, (E, N, K))
    row_block = contiguous_row_block(scheme, device)
    layouts = (True, False) if scheme == "fp8" else (True,)  # fp8: also deep_gemm's scale transpose
    for m in contiguous_m:
        m = int(m)
        if m <= 0:
            continue
        m_idx = _balanced_m_indices(m, E, row_block, device)
        for mn_major in layouts:
            a, a_s = _dummy_acts(scheme, (m,), K, device, mn_major)
            grouped_gemm(a, w, m_indices=m_idx, a_scales=a_s, w_scales=w_scales)
    if masked_t is not None and int(masked_t) > 0:
        T = int(masked_t)
        em = max(1, min(int(expected_m or T), T))
        counts = torch.full((E,), em, dtype=torch.int32, device=device)
        for mn_major in layouts:
            a, a_s = _dummy_acts(scheme, (E, T), K, device, mn_major)
            grouped_gemm(a, w, masked_m=counts, a_scales=a_s, w_scales=w_scales, expected_m=em)
    torch.cuda.synchronize(device)
