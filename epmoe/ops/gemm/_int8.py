"""Triton INT8 W8A8 grouped GEMMs (int8 x int8 -> int32 on tensor cores, per-token x per-channel
scales, bf16 out): the contiguous and masked kernels, their autotune configs and launchers."""

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from epmoe import _launch
from epmoe.ops.gemm._select import _INT8_ROW_BLOCK

# Masked INT8 tiles: tl.dot needs >= 16 rows; the decode-shaped configs (4 warps, long K tiles)
# spill registers past 64 rows, and LL experts rarely hold more rows than that.
_MASKED_MIN_BLOCK_M, _MASKED_MAX_BLOCK_M = 16, 64


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


_BEST: Dict[Tuple, Tuple] = {}  # (autotuner, device, static key) -> (JITFunction, launch kwargs)


def _launch_tuned(tuned, key: Tuple, grid, tensors: Tuple, sizes: Tuple, meta: dict) -> None:
    """Launch autotuned kernel ``tuned`` on its leading ``tensors`` and the ``sizes`` (sizes and
    strides) after them: its first call per static ``key`` goes through the autotuner (tuning if
    needed); later calls launch the chosen config's JITFunction as a cached
    :class:`epmoe._launch.Prepared`, without the autotuner's and the heuristics' per-call
    re-binding (the kernels run inside an opaque op: never traced)."""
    if _launch._INTERPRET:
        tuned[grid](*tensors, *sizes, **meta)
        return
    key = (id(tuned), torch._C._cuda_getDevice(), *key)
    hit = _BEST.get(key)
    if hit is None:
        tuned[grid](*tensors, *sizes, **meta)
        _BEST[key] = _resolved(tuned, (*tensors, *sizes), meta)
        return
    full = {**meta, **hit[1]}
    _tuned_launch(key, grid(full), sizes, tuple(full.items())).untraced(*tensors)


@_launch.memo
def _tuned_launch(key: Tuple, grid: Tuple, tail: Tuple, meta: Tuple) -> _launch.Prepared:
    """The tuned config's launch for these sizes (``key``: the _BEST entry it launches)."""
    return _launch.Prepared(_BEST[key][0], grid, tail, dict(meta))


def _resolved(tuned, args: Tuple, meta: dict) -> Tuple:
    """(the jitted function under ``tuned``, its launch kwargs): the tuned config plus the values of
    the heuristics between them (ours read key-static arguments only: fixed per key)."""
    best = tuned.best_config.all_kwargs()
    fn = tuned.fn
    while isinstance(fn, triton.runtime.autotuner.Heuristics):
        named = {**dict(zip(fn.arg_names, args, strict=False)), **meta, **best}
        best = {**best, **{name: value(named) for name, value in fn.values.items()}}
        fn = fn.fn
    return fn, best


@_launch.memo  # (sizes only: the same for every call of a layer)
def _masked_tiling(t: int, expected_m: int) -> Tuple[int, int]:
    """(BLOCK_M, M_SPLIT) of the masked kernel from static sizes: tiles sized for expected_m."""
    em = max(1, min(expected_m or t, t))
    block_m = min(_MASKED_MAX_BLOCK_M, max(_MASKED_MIN_BLOCK_M, _launch.pow2(em)))
    split = max(1, min(_launch.cdiv(t, block_m), _launch.cdiv(em, block_m)))
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
        return (_launch.cdiv(M, meta["BLOCK_M"]) * _launch.cdiv(N, meta["BLOCK_N"]),)

    tensors = (a, w, a_scales, w_scales, m_indices, out)
    sizes = (
        M, N, K, E,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        a_scales.stride(0),
        w_scales.stride(0), w_scales.stride(1),
        out.stride(0), out.stride(1),
    )  # fmt: skip
    if config is None:
        key = (N, K, E, a.dtype, out.dtype)
        _launch_tuned(_int8_contiguous_tuned, key, grid, tensors, sizes, {})
    else:
        _int8_contiguous_kernel[grid](*tensors, *sizes, **config)
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
        return (_launch.cdiv(N, m["BLOCK_N"]), E, m["M_SPLIT"])

    tensors = (a, w, a_scales, w_scales, masked_m, out, ok if ok is not None else masked_m)
    sizes = (
        T, N, K, E,
        a.stride(0), a.stride(1), a.stride(2),
        w.stride(0), w.stride(1), w.stride(2),
        a_scales.stride(0), a_scales.stride(1),
        w_scales.stride(0), w_scales.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
    )  # fmt: skip
    meta.update(CHECK=ok is not None, E_PAD=_launch.pow2(E))
    if config is None:
        key = (N, K, E, meta["BLOCK_M"], a.dtype, out.dtype)
        _launch_tuned(_int8_masked_tuned, key, grid, tensors, sizes, meta)
    else:
        _int8_masked_kernel[grid](*tensors, *sizes, **meta)
    return out
