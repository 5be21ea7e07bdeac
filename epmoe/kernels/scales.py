"""Float32 activation scales in the row or DeepGEMM layout (quantize, activation, permute,
ll_scatter allocate them here)."""

from typing import Tuple

import torch

from epmoe import reference

TMA_ALIGN = 4  # DeepGEMM pads the MN dim of float32 scales to 16 bytes


def alloc_scales(lead: Tuple[int, ...], groups: int, layout: str, device) -> torch.Tensor:
    """Uninitialized float32 scales `[*lead, groups]` in ``layout`` ("row" or "deepgemm").

    deepgemm: MN-major with the MN dim padded to TMA_ALIGN, the layout deep_gemm's
    get_mn_major_tma_aligned_tensor returns (so it is used without a copy); the same strides as
    :func:`epmoe.ops.gemm.empty_fp8_act_scales`. Not a view, so kernels write it directly.
    """
    if layout == "row":
        return torch.empty((*lead, groups), dtype=torch.float32, device=device)
    mn = lead[-1]
    padded = reference.round_up(mn, TMA_ALIGN)
    if len(lead) == 1:
        size, stride = (mn, groups), (1, padded)
    else:
        size, stride = (lead[0], mn, groups), (groups * padded, 1, padded)
    return torch.empty_strided(size, stride, dtype=torch.float32, device=device)


def as_layout(s: torch.Tensor, layout: str) -> torch.Tensor:
    """Reference scales `[..., S]` in ``layout`` (a copy unless "row"; same logical values)."""
    if layout == "row":
        return s
    out = alloc_scales(tuple(s.shape[:-1]), s.shape[-1], layout, s.device)
    out.copy_(s)
    return out
