"""Raw-library baselines: deep_gemm, torch._grouped_mm and deep_ep called directly, the way their
own READMEs call them. The benchmarks time our ops against these, and the GPU tests check our ops
against them, so both call the libraries the same way.

Import from a benchmark module as ``import _baselines`` (``benchmarks/`` is on sys.path), from a
test as ``from benchmarks._baselines import ...`` (the repository root is on sys.path, as for
``tests.*``). Standard library, torch and epmoe only at import: deep_ep is imported on first call.
"""

import torch

from epmoe.ops.gemm._select import _dg_functions


# ---------------------------------------------------------------------------------- grouped GEMM
def raw_deep_gemm_contiguous(scheme, a, a_scales, w, w_scales, m_indices, out):
    """deep_gemm's contiguous grouped GEMM called directly into ``out`` (bf16 `[M_sum, N]`)."""
    fn = _dg_functions()[f"{scheme}_contiguous"]
    if scheme == "fp8":
        fn((a, a_scales), (w, w_scales), out, m_indices)
    else:
        fn(a, w, out, m_indices)
    return out


def raw_deep_gemm_masked(scheme, a, a_scales, w, w_scales, masked_m, expected_m, out):
    """deep_gemm's masked grouped GEMM called directly into ``out`` (bf16 `[E, T, N]`)."""
    fn = _dg_functions()[f"{scheme}_masked"]
    if scheme == "fp8":
        fn((a, a_scales), (w, w_scales), out, masked_m, expected_m)
    else:
        fn(a, w, out, masked_m, expected_m)
    return out


def raw_grouped_mm(a, w, expert_offsets):
    """torch._grouped_mm on the contiguous layout (groups end at expert_offsets[1:])."""
    return torch._grouped_mm(a, w.transpose(1, 2), offs=expert_offsets[1:])


# --------------------------------------------------------------------------------------- deep_ep
def _idx(ids: torch.Tensor) -> torch.Tensor:
    import deep_ep

    dt = getattr(deep_ep, "topk_idx_t", torch.int64)
    return ids.to(dt if isinstance(dt, torch.dtype) else torch.int64).contiguous()


def raw_ht_dispatch(buf, config, x, scales, ids, w, num_experts, num_worst_tokens=0):
    """deep_ep HT dispatch as its README calls it: get_dispatch_layout + dispatch.
    Returns (recv_x or (recv_x, recv_scales), recv_ids, recv_weights, counts list, handle)."""
    ids = _idx(ids)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, num_experts)
    out = buf.dispatch(
        x if scales is None else (x, scales),
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=ids,
        topk_weights=w,
        num_worst_tokens=num_worst_tokens,
        config=config,
    )
    return out[:5]


def raw_ht_combine(buf, config, y, handle):
    """deep_ep HT combine (unweighted) with deep_ep's own handle tuple -> bf16 `[T, H]`."""
    return buf.combine(y, handle, config=config)[0]


def raw_ll_dispatch(buf, x, ids, max_tokens, num_experts, use_fp8):
    """deep_ep LL dispatch -> (recv_x or (recv_x, scales), recv_count, handle)."""
    out = buf.low_latency_dispatch(x, _idx(ids), max_tokens, num_experts, use_fp8=use_fp8)
    return out[:3]


def raw_ll_combine(buf, y, ids, w, handle, out=None):
    """deep_ep LL combine (weighted) -> bf16 `[T, H]`."""
    return buf.low_latency_combine(y, _idx(ids), w, handle, out=out)[0]
