"""The masked layout's scatter and gather for the backends (local LL, the torch backend's
bucketing of rows per peer), on any device: the kernels of :mod:`epmoe.kernels` on CUDA, launched
directly (a backend runs inside a dispatch / combine op's kernel, on real tensors, inputs checked
there), or the pure-torch reference on CPU (the CPU kernels of epmoe::ll_scatter / ll_gather).
The contracts: :mod:`epmoe.ops.ll_scatter`, :mod:`epmoe.ops.ll_gather`.
"""

from typing import Optional

import torch

from epmoe import _eager, reference
from epmoe.kernels.gather import _ll_gather_launch
from epmoe.kernels.scatter import _ll_scatter_triton


def scatter(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: int,
    quant: str = "bf16",
    expert_lo: int = 0,
    num_global_experts: Optional[int] = None,
):
    """ll_scatter with row scales: (xo, scales, masked_m, rows)."""
    args = (x, topk_ids, num_experts, capacity, quant, expert_lo, num_global_experts)
    if x.is_cuda:
        return _eager.run(_ll_scatter_triton, *args)
    return reference.ll_scatter(*args)


def gather(
    y: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """ll_gather(y, rows, topk_weights), written into ``out`` (contiguous bf16 `[T, H]`) when
    given."""
    if not y.is_cuda:
        res = reference.ll_gather(y, rows, topk_weights)
        return res if out is None else out.copy_(res)
    if out is None:
        out = torch.empty((rows.shape[0], y.shape[2]), dtype=torch.bfloat16, device=y.device)
    _eager.run(_ll_gather_launch, y, rows, topk_weights, out)
    return out
