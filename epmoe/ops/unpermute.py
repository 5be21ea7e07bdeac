"""Stage: unpermute (HT). Gather each token's expert outputs and take the top-k weighted sum.

Contract: ``out = unpermute(y, inv_perm, topk_weights)``

- y: bf16/fp16/fp32 `[M_sum, H]`; inv_perm: int32/int64 `[M, K]` row or -1; topk_weights: float `[M, K]`.
- out[t] = sum_k [inv_perm[t,k] >= 0] * topk_weights[t,k] * y[inv_perm[t,k]], float32 accumulation,
  `[M, H]` in y.dtype. Rows of y not named by inv_perm are never read.

CUDA-graph safe.
"""

import torch
from torch.library import triton_op

from epmoe import _checks, reference

OP = "unpermute"


def _validate(y, inv_perm, topk_weights) -> None:
    _checks.check_dtype(OP, "y", y, _checks.FLOAT_DTYPES)
    _checks.check_ndim(OP, "y", y, (2,))
    _checks.check_dtype(OP, "inv_perm", inv_perm, (torch.int32, torch.int64))
    _checks.check_ndim(OP, "inv_perm", inv_perm, (2,))
    _checks.check_dtype(OP, "topk_weights", topk_weights, _checks.FLOAT_DTYPES)
    _checks.check_shape(OP, "topk_weights", topk_weights, tuple(inv_perm.shape))
    _checks.check_device(OP, "inv_perm", inv_perm, y)
    _checks.check_device(OP, "topk_weights", topk_weights, y)


@triton_op("epmoe::unpermute", mutates_args=())
def _unpermute_op(y: torch.Tensor, inv_perm: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    _validate(y, inv_perm, topk_weights)
    return reference.unpermute(y, inv_perm, topk_weights)


@_unpermute_op.register_kernel("cpu")
def _unpermute_cpu(y, inv_perm, topk_weights):
    _validate(y, inv_perm, topk_weights)
    return reference.unpermute(y, inv_perm, topk_weights)


def unpermute(y: torch.Tensor, inv_perm: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Weighted top-k gather-sum. y `[M_sum, H]`, inv_perm int `[M, K]`, weights `[M, K]` -> `[M, H]`."""
    return _unpermute_op(y, inv_perm, topk_weights)
