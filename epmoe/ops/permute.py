"""Stage: permute (HT). Scatter received rows into expert-contiguous, aligned blocks.

Contract: ``p = permute(x, topk_ids, num_experts=E, alignment=A, x_scales=None)``

- x: any dtype (bf16, fp8, int8) `[M, H]`; topk_ids: int32/int64 `[M, K]` local id in [0, E) or -1;
  x_scales: float32 `[M, S]` or None.
- p.x `[M_sum, H]`, M_sum = round_up(M*K + E*(A-1), A) (static in M); p.x_scales `[M_sum, S]` or None;
  p.m_indices int32 `[M_sum]` expert of each row, -1 on padding and unused rows; p.inv_perm int32 `[M, K]`
  row of (t, k) or -1; p.expert_offsets int32 `[E + 1]` block starts (multiples of A), last = used rows.
- Experts' blocks in ascending order; inside a block rows in (t, k) order (deterministic).

CUDA-graph safe. ``alignment`` is the grouped-GEMM row block (128 for deep_gemm), never the quant block.
Ids outside [0, E) other than -1 are an error (ValueError on CPU; device assert on CUDA).
"""

from typing import NamedTuple, Optional, Tuple

import torch
from torch.library import triton_op

from epmoe import _checks, reference

OP = "permute"


class PermuteResult(NamedTuple):
    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    m_indices: torch.Tensor
    inv_perm: torch.Tensor
    expert_offsets: torch.Tensor


def _validate(x, topk_ids, num_experts, alignment, x_scales) -> None:
    _checks.check_ndim(OP, "x", x, (2,))
    _checks.check_dtype(OP, "topk_ids", topk_ids, (torch.int32, torch.int64))
    _checks.check_shape(OP, "topk_ids", topk_ids, (x.shape[0], None))
    _checks.check_device(OP, "topk_ids", topk_ids, x)
    _checks.check_positive_int(OP, "num_experts", num_experts)
    _checks.check_positive_int(OP, "alignment", alignment)
    if x_scales is not None:
        _checks.check_dtype(OP, "x_scales", x_scales, (torch.float32,))
        _checks.check_shape(OP, "x_scales", x_scales, (x.shape[0], None))
        _checks.check_device(OP, "x_scales", x_scales, x)


@triton_op("epmoe::permute", mutates_args=())
def _permute_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int,
    x_scales: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(x, topk_ids, num_experts, alignment, x_scales)
    return reference.permute(x, topk_ids, num_experts, alignment, x_scales)


@_permute_op.register_kernel("cpu")
def _permute_cpu(x, topk_ids, num_experts, alignment, x_scales=None):
    _validate(x, topk_ids, num_experts, alignment, x_scales)
    return reference.permute(x, topk_ids, num_experts, alignment, x_scales)


def permute(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int = 128,
    x_scales: Optional[torch.Tensor] = None,
) -> PermuteResult:
    """Permute received rows into the contiguous grouped-GEMM layout (see module docstring).

    Args:
        x: bf16/fp8/int8 `[M, H]`. topk_ids: int32/int64 `[M, K]` local ids or -1.
        num_experts: E, local experts. alignment: A, row block of the grouped GEMM.
        x_scales: float32 `[M, S]` or None.
    Returns:
        PermuteResult(x `[M_sum, H]`, x_scales `[M_sum, S]` | None, m_indices int32 `[M_sum]`,
        inv_perm int32 `[M, K]`, expert_offsets int32 `[E + 1]`).
    """
    xp, sp, m_indices, inv_perm, offsets = _permute_op(
        x, topk_ids, num_experts, alignment, x_scales
    )
    return PermuteResult(xp, sp if x_scales is not None else None, m_indices, inv_perm, offsets)
