"""The topk_ids addressing the permute and scatter kernels share (a @triton.jit helper)."""

import triton
import triton.language as tl  # noqa: F401 (Triton wants the language visible to jit functions)


# The kernels load topk_ids themselves (torch.compile reads a pointer passed to a jit helper whose
# result feeds a store as written, and clones it): the helper takes indices, not the pointer.
@triton.jit
def _id_offsets(t, k, M, K, stride_it, stride_ik):
    """(row and column offsets of entries (t, k) in topk_ids, valid mask: t < M and k < K). t may
    be a scalar next to a vector k (the mask is k's shape or larger); an int64 stride_it gives
    int64 row offsets."""
    valid = (t + k * 0 < M) & (k < K)
    return t * stride_it, k * stride_ik, valid
