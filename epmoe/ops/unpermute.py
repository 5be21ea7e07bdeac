"""Stage: unpermute (HT). Gather each token's expert outputs and take the top-k weighted sum.

Contract: ``out = unpermute(y, inv_perm, topk_weights)``

- y: bf16/fp16/fp32 `[M_sum, H]`; inv_perm: int32/int64 `[M, K]` row or -1; topk_weights: float
  `[M, K]`.
- out[t] = sum_k [inv_perm[t,k] >= 0] * topk_weights[t,k] * y[inv_perm[t,k]], float32 accumulation,
  `[M, H]` in y.dtype. Rows of y not named by inv_perm are never read.

CUDA-graph safe. One program per (token, column chunk) gathers its K rows (rows of -1 entries are
never read) and writes the sum once, rounded to nearest even. Rows outside [0, M_sum) other than
-1 are an error (ValueError on CPU; on CUDA a device assert inside the kernel, ValueError in
debug mode; under torch.compile an async assert after the kernel); they are never read. The op's
``check=False`` (the layer's own chain: inv_perm from its permute) skips that check.
"""

import torch
import triton
import triton.language as tl

from epmoe import _checks, _config, _launch, reference
from epmoe._contract import Contract, Tensor
from epmoe._jit import _bad_rows, round_float  # by name: Inductor copies @triton.jit callees
from epmoe._stage import stage

OP = "unpermute"


# ------------------------------------------------------------------------------ launch config
@_config.frozen
class UnpermuteConfig:
    """Launch parameters of the unpermute kernel (design notes: docs/kernels.md)."""

    block_bytes: int = 4096  # output bytes per program: bf16 -> 2048 columns, 16 fp32 a thread
    warps: int = 4


CONFIG = UnpermuteConfig()


def override(**fields):
    """Context manager: unpermute launches with these CONFIG fields inside the block (sweeps,
    scripts/compile_kernels.py, tests)."""
    return _config.override(__name__, **fields)


# -------------------------------------------------------------------------------------- kernels
@triton.jit
def _unpermute_kernel(
    # tensors
    y_ptr, inv_ptr, w_ptr, out_ptr, ok_ptr,
    # sizes
    H, R,
    # strides (elements)
    stride_ym, stride_yh, stride_it, stride_ik, stride_wt, stride_wk,
    # meta
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr, ASSERT: tl.constexpr,
    CHECK: tl.constexpr,
):  # fmt: skip
    """Program (t, c): column chunk c of out[t]. With CHECK, chunk 0 also checks t's rows: it
    clears ok on a row outside [0, R) other than -1, or with ASSERT (a debug=True build) asserts
    them instead (ok unused)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):  # k ascending, as the reference sums
        r = tl.load(inv_ptr + t * stride_it + k * stride_ik)
        live = (r >= 0) & (r < R)  # out-of-range rows are reported below, never read
        w = tl.where(live, tl.load(w_ptr + t * stride_wt + k * stride_wk).to(tl.float32), 0.0)
        v = tl.load(
            y_ptr + r.to(tl.int64) * stride_ym + cols * stride_yh,
            mask=cols < tl.where(live, H, 0),
            other=0.0,
        )
        acc += v.to(tl.float32) * w
    tl.store(out_ptr + t * H + cols, round_float(acc, out_ptr.dtype.element_ty), mask=cols < H)
    if CHECK:
        if c == 0:
            kk = tl.arange(0, K_PAD)
            rows = tl.load(inv_ptr + t * stride_it + kk * stride_ik, mask=kk < K, other=-1)
            msg: tl.constexpr = "unpermute: inv_perm expected rows in [0, M_sum) or -1"
            bad = _bad_rows(rows, R, ASSERT, msg)
            if not ASSERT:
                tl.store(ok_ptr + kk * 0, tl.zeros([K_PAD], dtype=tl.int1), mask=bad)


# ----------------------------------------------------------------------------- host-side launch
@_launch.memo
def _unpermute_launch(M, K, R, H, elem, y_strides, inv_strides, w_strides, check, in_kernel,
                      cfg):  # fmt: skip
    """The unpermute kernel's launch for these sizes (R rows of y), strides and options."""
    block = min(_launch.pow2(max(H, 1)), max(16, cfg.block_bytes // elem))
    # no `if` on sizes: M is unbacked after an exact-size HT dispatch under torch.compile; an
    # empty grid launches nothing
    return _launch.Prepared(
        _unpermute_kernel,
        (M, _launch.cdiv(H, block)),
        (H, R, *y_strides, *inv_strides, *w_strides),
        dict(
            K=K, K_PAD=_launch.pow2(K), BLOCK_H=block, ASSERT=in_kernel, CHECK=check,
            num_warps=cfg.warps, **_checks.assert_build(in_kernel),
        ),
    )  # fmt: skip


def _unpermute_triton(
    y: torch.Tensor, inv_perm: torch.Tensor, topk_weights: torch.Tensor, check: bool = True
) -> torch.Tensor:
    """unpermute on CUDA (or CPU tensors under TRITON_INTERPRET=1); check=False: no row check
    (inv_perm from permute in the same chain)."""
    M, K = inv_perm.shape
    R, H = y.shape
    out = _output(y, inv_perm, topk_weights)
    # Direct CUDA launches (eager, the dispatcher, graph capture of either) assert the rows inside
    # the kernel: one launch, nothing after it; otherwise (torch.compile, the interpreter) the
    # kernel clears the flag on a bad row
    in_kernel = check and _checks.assert_in_kernel(_checks.direct_launch(y))
    flag = check and not in_kernel
    ok = torch.ones((), dtype=torch.bool, device=y.device) if flag else inv_perm  # (unused)
    launch = _unpermute_launch(
        M, K, R, H, y.element_size(), y.stride(), inv_perm.stride(), topk_weights.stride(), check,
        in_kernel, CONFIG,
    )  # fmt: skip
    launch(y, inv_perm, topk_weights, out, ok)
    if flag:
        _checks.check_values(ok, OP, "inv_perm", f"ids in [0, {R}) or -1")
    return out


# ------------------------------------------------------------------------------------------ op
CONTRACT = Contract(
    OP,
    "y inv_perm topk_weights",
    Tensor("y", _checks.FLOAT_DTYPES, ndim=(2,)),
    Tensor("inv_perm", _checks.INDEX_DTYPES, ndim=(2,)),
    Tensor("topk_weights", _checks.FLOAT_DTYPES, shape="inv_perm.shape"),
)


def _output(y, inv_perm, topk_weights, check=True):
    return torch.empty((inv_perm.shape[0], y.shape[1]), dtype=y.dtype, device=y.device)


def _reference(y, inv_perm, topk_weights, check=True):
    return reference.unpermute(y, inv_perm, topk_weights)  # (checks the rows for free)


@stage(
    contract=CONTRACT,
    fake=_output,
    reference=_reference,
    cuda=_unpermute_triton,
    chain=dict(check=False),  # the layer's rows come from its own permute: -1 or in range
)
def unpermute(
    y: torch.Tensor, inv_perm: torch.Tensor, topk_weights: torch.Tensor, check: bool = True
) -> torch.Tensor:
    """Weighted top-k gather-sum.

    Args:
        y: bf16/fp16/fp32 `[M_sum, H]` expert outputs in the permuted layout.
        inv_perm: int32/int64 `[M, K]` row of each (t, k), or -1.
        topk_weights: float `[M, K]`.
        check: False skips the CUDA kernel's check of the rows (inv_perm from permute, whose
            rows are -1 or in range by construction); the CPU reference always checks.
    Returns:
        y.dtype `[M, H]`, float32 accumulation.
    """
