"""Stage: unpermute (HT). Gather each token's expert outputs and take the top-k weighted sum.

Contract: ``out = unpermute(y, inv_perm, topk_weights)``

- y: bf16/fp16/fp32 `[M_sum, H]`; inv_perm: int32/int64 `[M, K]` row or -1; topk_weights: float
  `[M, K]`.
- out[t] = sum_k [inv_perm[t,k] >= 0] * topk_weights[t,k] * y[inv_perm[t,k]], float32 accumulation,
  `[M, H]` in y.dtype. Rows of y not named by inv_perm are never read.

CUDA-graph safe. The weighted top-K gather of :mod:`epmoe.kernels.gather` (ll_gather's too): one
program per (token, column chunk) gathers its K rows (rows of -1 entries are never read) and writes
the sum once, rounded to nearest even. Rows outside [0, M_sum) other than -1 are an error
(ValueError on CPU; on CUDA a device assert inside the kernel, ValueError in debug mode; under
torch.compile an async assert after the kernel); they are never read. The op's ``check=False`` (the
layer's own chain: inv_perm from its permute) skips that check.
"""

import torch

from epmoe import _checks, _config, _launch, reference
from epmoe._contract import Contract, Tensor
from epmoe._stage import stage
from epmoe.kernels import gather

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


# ----------------------------------------------------------------------------- host-side launch
@_launch.memo
def _unpermute_launch(M, K, R, H, elem, y_strides, inv_strides, w_strides, check, cfg,
                      in_kernel):  # fmt: skip
    """The gather kernel's launch for unpermute's sizes (R rows of y), strides and options."""
    block = min(_launch.pow2(max(H, 1)), max(16, cfg.block_bytes // elem))
    # no `if` on sizes: M is unbacked after an exact-size HT dispatch under torch.compile; an
    # empty grid launches nothing
    return gather.prepare(
        M, K, _launch.pow2(K), H, 1, R, block, cfg.warps, (0, *y_strides), inv_strides, w_strides,
        False, True, check, in_kernel, "unpermute: inv_perm expected rows in [0, M_sum) or -1",
    )  # fmt: skip


def _unpermute_triton(
    y: torch.Tensor, inv_perm: torch.Tensor, topk_weights: torch.Tensor, check: bool = True
) -> torch.Tensor:
    """unpermute on CUDA (or CPU tensors under TRITON_INTERPRET=1): the weighted top-K gather of
    :mod:`epmoe.kernels.gather`; check=False: no row check (inv_perm from permute in the same
    chain)."""
    M, K = inv_perm.shape
    R, H = y.shape
    out = _output(y, inv_perm, topk_weights)
    key = (M, K, R, H, y.element_size(), y.stride(), inv_perm.stride(), topk_weights.stride(),
           check, CONFIG)  # fmt: skip
    gather.launch(_unpermute_launch, key, y, inv_perm, topk_weights, out, check, OP, "inv_perm",
                  "ids", R)  # fmt: skip
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
