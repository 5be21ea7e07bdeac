"""deep_gemm's grouped GEMMs called with static shapes: contiguous as is, masked on row-padded
copies when T is not a multiple of its row block."""

import threading
from typing import Optional, Tuple

import torch

from epmoe import _deps
from epmoe.ops.gemm._select import empty_fp8_act_scales
from epmoe.ops.gemm._triton import fullest_rows

_RUNTIME_MADE = False


def _make_runtime(device: torch.device) -> None:
    """Make deep_gemm's device runtime before its first GEMM, on a thread of its own. On first use
    it allocates (and keeps) a 32 MiB cuBLASLt workspace: made by a first GEMM inside
    torch.compile's CUDA-graph warmup, that buffer would land in the graph pool (which takes every
    allocation of the warming thread, on any stream), whose check that every live allocation
    there is an output then fails the call. Under a capture it is made in place (no allocation
    off a capturing stream). Not for CPU tensors (models of deep_gemm)."""
    global _RUNTIME_MADE
    if _RUNTIME_MADE or device.type != "cuda":
        return
    make = getattr(_deps.deep_gemm(), "get_num_sms", None)  # (any runtime query makes it)
    if make is not None:
        if torch.cuda.is_current_stream_capturing():
            make()
        else:
            _on_own_thread(device, make)
    _RUNTIME_MADE = True


def _on_own_thread(device: torch.device, fn) -> None:
    """Run ``fn`` on a new thread with ``device`` current there; its exception re-raised here."""
    err = []

    def run():
        try:
            with torch.cuda.device(device):
                fn()
        except BaseException as e:  # (re-raised by the caller's thread)
            err.append(e)

    t = threading.Thread(target=run, name="epmoe-deep-gemm-runtime")
    t.start()
    t.join()
    if err:
        raise err[0]


def _deep_gemm_contiguous(fn, a, w, m_indices, a_scales, w_scales):
    """Run deep_gemm's contiguous GEMM ``fn``.

    Args:
        fn: deep_gemm's bf16 (``fn(a, w, out, m_indices)``) or fp8
            (``fn((a, a_scales), (w, w_scales), out, m_indices)``) contiguous entry point.
        a: bf16/fp8 `[M_sum, Kd]`. w: same dtype `[E, N, Kd]`. m_indices: int32 `[M_sum]`.
        a_scales: float32 `[M_sum, Kd/128]` (fp8) or None. w_scales: float32
            `[E, N/128, Kd/128]` (fp8) or None.
    Returns:
        bf16 `[M_sum, N]`; rows of -1 blocks unspecified.
    """
    _make_runtime(a.device)
    M, N = a.shape[0], w.shape[1]
    out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    a, w, m_indices = a.contiguous(), w.contiguous(), m_indices.contiguous()
    if a.dtype == torch.float8_e4m3fn:
        fn((a, a_scales), (w, w_scales.contiguous()), out, m_indices)
    else:
        fn(a, w, out, m_indices)
    return out


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
        expected_m: static hint of the mean rows per expert (0 = T); deep_gemm gets
            :func:`fullest_rows` of it: it sizes its row block by the hint, and at the mean the
            experts past it take a whole extra block (docs/kernels.md).
        block: the row block T must be a multiple of (:func:`masked_row_block`); otherwise the
            rows are padded to the next multiple of it and the output is sliced back.
    Returns:
        bf16 `[E, T, N]`, contiguous; rows t >= masked_m[e] unspecified.
    """
    _make_runtime(a.device)
    E, T, _ = a.shape
    N = w.shape[1]
    em = fullest_rows(T, expected_m)
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
