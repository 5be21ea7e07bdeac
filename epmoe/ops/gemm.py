"""Stage: grouped GEMM ("nt": out[r] = a[r] @ w[e].T), contiguous (HT) and masked (LL) layouts.

Contract:
- contiguous: a `[M_sum, Kd]`, w `[E, N, Kd]`, m_indices int32 `[M_sum]` (expert of the row, -1 = skip)
  -> bf16 `[M_sum, N]`. Rows with m_indices == -1 are unspecified and never read downstream.
- masked: a `[E, T, Kd]`, w `[E, N, Kd]`, masked_m int32 `[E]` -> bf16 `[E, T, N]`; rows
  t >= masked_m[e] are unspecified. ``expected_m`` is a static hint of the typical rows per expert.
- Schemes, chosen by a.dtype: bf16 (no scales); fp8 e4m3 (a_scales float32 `[.., Kd/128]` per token and
  128 channels, w_scales float32 `[E, N/128, Kd/128]` per 128x128 block); int8 (a_scales float32 `[.., 1]`
  per token, w_scales float32 `[E, N]` per output channel, int32 accumulation).

CUDA-graph safe (static shapes). The contiguous layout needs each expert block to start at a multiple of
:func:`contiguous_row_block` rows: the permute ``alignment`` must be a multiple of it.
"""

from typing import Optional

import torch

from epmoe import _checks, reference

OP = "grouped_gemm"
A_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.int8)


def scheme_of(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8", torch.int8: "int8"}[dtype]


def contiguous_row_block(scheme: str, device: torch.device) -> int:
    """Rows each expert block of the contiguous layout must be aligned to on ``device``.

    The reference has no constraint (1); GPU backends need their M tile (deep_gemm: 128).
    """
    if torch.device(device).type != "cuda":
        return 1
    return 128


def _validate(a, w, a_scales, w_scales, masked: bool) -> None:
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


def _validate_contiguous(a, w, m_indices, a_scales, w_scales) -> None:
    _validate(a, w, a_scales, w_scales, masked=False)
    _checks.check_dtype(OP, "m_indices", m_indices, (torch.int32,))
    _checks.check_shape(OP, "m_indices", m_indices, (a.shape[0],))
    _checks.check_device(OP, "m_indices", m_indices, a)


def _validate_masked(a, w, masked_m, a_scales, w_scales) -> None:
    _validate(a, w, a_scales, w_scales, masked=True)
    _checks.check_dtype(OP, "masked_m", masked_m, (torch.int32,))
    _checks.check_shape(OP, "masked_m", masked_m, (w.shape[0],))
    _checks.check_device(OP, "masked_m", masked_m, a)


@torch.library.custom_op("epmoe::grouped_gemm_contiguous", mutates_args=())
def _contiguous_op(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _validate_contiguous(a, w, m_indices, a_scales, w_scales)
    _checks.check_ids(m_indices, w.shape[0], OP, "m_indices")
    return reference.grouped_gemm_contiguous(a, w, m_indices, a_scales, w_scales)


@_contiguous_op.register_fake
def _contiguous_fake(a, w, m_indices, a_scales=None, w_scales=None):
    _validate_contiguous(a, w, m_indices, a_scales, w_scales)
    return a.new_empty((a.shape[0], w.shape[1]), dtype=torch.bfloat16)


@torch.library.custom_op("epmoe::grouped_gemm_masked", mutates_args=())
def _masked_op(
    a: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    expected_m: int = 0,
) -> torch.Tensor:
    _validate_masked(a, w, masked_m, a_scales, w_scales)
    ok = ((masked_m >= 0) & (masked_m <= a.shape[1])).all()
    _checks.check_values(ok, OP, "masked_m", f"counts in [0, {a.shape[1]}]")
    return reference.grouped_gemm_masked(a, w, masked_m, a_scales, w_scales)


@_masked_op.register_fake
def _masked_fake(a, w, masked_m, a_scales=None, w_scales=None, expected_m=0):
    _validate_masked(a, w, masked_m, a_scales, w_scales)
    return a.new_empty((a.shape[0], a.shape[1], w.shape[1]), dtype=torch.bfloat16)


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: Optional[torch.Tensor] = None,
    masked_m: Optional[torch.Tensor] = None,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    expected_m: Optional[int] = None,
) -> torch.Tensor:
    """Grouped GEMM out = a @ w[e].T; pass exactly one of ``m_indices`` (contiguous) or ``masked_m``.

    Args:
        a: bf16/fp8/int8 `[M_sum, Kd]` (contiguous) or `[E, T, Kd]` (masked).
        w: same dtype `[E, N, Kd]`.
        m_indices: int32 `[M_sum]` expert per row, -1 to skip.
        masked_m: int32 `[E]` live rows per expert.
        a_scales, w_scales: float32 scales for fp8/int8 (see module docstring).
        expected_m: static hint of rows per expert for the masked layout (default T).
    Returns:
        bf16 `[M_sum, N]` or `[E, T, N]`.
    """
    if (m_indices is None) == (masked_m is None):
        raise _checks.fail(OP, "m_indices/masked_m", "exactly one of them", "both or neither")
    if m_indices is not None:
        return _contiguous_op(a, w, m_indices, a_scales, w_scales)
    return _masked_op(a, w, masked_m, a_scales, w_scales, int(expected_m or 0))
