"""Stage: grouped GEMM ("nt": out[r] = a[r] @ w[e].T), contiguous (HT) and masked (LL) layouts.

Contract:
- contiguous: a `[M_sum, Kd]`, w `[E, N, Kd]`, m_indices int32 `[M_sum]` (expert of the row,
  -1 = skip) -> bf16 `[M_sum, N]`. Rows with m_indices == -1 are unspecified, never read downstream.
  Optional expert_offsets int32 `[E + 1]` (permute's block starts; last = used rows) lets the
  torch._grouped_mm backend skip deriving group ends from m_indices. Optional a_rows int32
  `[M_sum]` (permute's src_rows): row r reads a[a_rows[r]] (a `[M, Kd]`, the unpermuted rows; our
  Triton kernels load them, so permute need not copy them).
- gate (:func:`grouped_gemm_gate`, contiguous layout): GEMM1 and the activation stage in one
  kernel (our Triton kernel; elsewhere the two stages): h `[M_sum, I]` and its fp8 / int8 scales,
  the bytes of the unfused pair on the same backend (int8: the kernel's bf16 h, then each row
  quantized: a row's scale needs all of it).
- masked gate (:func:`grouped_gemm_masked_gate`): the same on the masked layout, one kernel where
  this GPU's tuned table measured it faster than the two stages: h `[E, T, I]` and its scales.
- masked: a `[E, T, Kd]`, w `[E, N, Kd]`, masked_m int32 `[E]` -> bf16 `[E, T, N]`; rows
  t >= masked_m[e] are unspecified and never read. ``expected_m`` is a static hint of the mean
  rows per expert (0 = T); tiles are sized for the fullest expert about it
  (``_triton.fullest_rows``). It picks tile shapes, never results.
- Schemes, chosen by a.dtype: bf16 (no scales); fp8 e4m3 (a_scales float32 `[.., Kd/128]` per token
  and 128 channels, w_scales float32 `[E, N/128, Kd/128]` per 128x128 block); int8 (a_scales
  float32 `[.., 1]` per token, w_scales float32 `[E, N]` per output channel, int32 accumulation).
  a_scales may have any strides. On sm90 deep_gemm wants fp8 activation scales MN-major and
  TMA-aligned (:func:`empty_fp8_act_scales` allocates that layout); other strides cost deep_gemm
  one transpose per call.

Backends on CUDA (CPU and other devices run :mod:`epmoe.reference`), chosen per problem (scheme,
layout, N, Kd, E, alignment, rows: static sizes): the faster one in this GPU's tuned table
(:mod:`epmoe.ops.gemm._tuned`, measured by scripts/tune_gemm.py) where it has the problem (of
the backends it timed, the fastest installed here), else
- fp8: deep_gemm (sm90, float32 scales, 128-row blocks); else our Triton kernels (sm89+).
- bf16: deep_gemm bf16 grouped GEMMs (sm90/sm100, 128-row blocks); else torch._grouped_mm
  (contiguous) / our Triton kernels; else torch.bmm (masked).
- int8: our Triton W8A8 kernels (int8 x int8 -> int32 on tensor cores, then per-token x
  per-channel scales, bf16 out).
Our Triton kernels (``_triton``) run every scheme at any alignment that is a multiple of 16.

CUDA-graph safe (static shapes, no host sync) once :func:`warmup` has compiled every kernel. The
contiguous layout needs every expert block to start at a multiple of the ``alignment`` the op is
told (default :func:`contiguous_row_block`; at least :func:`smallest_row_block`): the permute
``alignment``. The masked layout takes any T, but
deep_gemm's masked kernels need T to be a multiple of their row block (see
:func:`masked_row_block`); for any other T the op runs deep_gemm on a row-padded copy of the
operands (one extra copy of a, its scales and the output). Shape legend: ``E`` local experts,
``T`` rows per expert slot (masked), ``M_sum`` permuted rows, ``N``/``Kd`` GEMM output/reduction
dims.

Modules: ``_select`` (scheme, backend choice, deep_gemm entry points, row blocks), ``_validate``
(the input contracts), ``_triton`` (our Triton kernels, their configs and launchers), ``_tuned``
(the tuned table),
``_deepgemm`` (deep_gemm calls, masked row padding), ``_ops`` (the two stages
:func:`grouped_gemm_contiguous` and :func:`grouped_gemm_masked`, declared once with
:func:`epmoe._stage.stage`, their CUDA dispatch, and :func:`grouped_gemm`, which picks one),
``_weights`` (:func:`prepare_weights`, :func:`warmup`). Only the public API is exported here:
import or patch a private name in the module that defines it (``_ops._backend``,
``_triton._masked_kernel``).
"""

from epmoe.ops.gemm._ops import (
    grouped_gemm,
    grouped_gemm_contiguous,
    grouped_gemm_gate,
    grouped_gemm_masked,
    grouped_gemm_masked_gate,
)
from epmoe.ops.gemm._select import (
    contiguous_row_block,
    empty_fp8_act_scales,
    fuses_gate,
    fuses_masked_gate,
    gathers,
    masked_row_block,
    scheme_of,
    smallest_row_block,
)
from epmoe.ops.gemm._weights import prepare_weights, warmup

__all__ = [
    "contiguous_row_block",
    "empty_fp8_act_scales",
    "fuses_gate",
    "fuses_masked_gate",
    "gathers",
    "grouped_gemm",
    "grouped_gemm_contiguous",
    "grouped_gemm_gate",
    "grouped_gemm_masked",
    "grouped_gemm_masked_gate",
    "masked_row_block",
    "prepare_weights",
    "scheme_of",
    "smallest_row_block",
    "warmup",
]
