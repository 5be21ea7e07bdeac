"""Stage: unpermute (HT). Gather each token's expert outputs and take the top-k weighted sum, the
experts' down-projection bias added on the way.

Contract: ``out = unpermute(y, inv_perm, topk_weights, check=True, bias=None, m_indices=None,
hidden=None)``

- y: bf16/fp16/fp32 `[M_sum, H]`; inv_perm: int32/int64 `[M, K]` row or -1; topk_weights: float
  `[M, K]`.
- bias: bf16/fp16/fp32 `[E, Hb]` (Hb >= Ho, any strides) or None: expert e's down-projection
  bias, added to each of its rows before the weighting (the GEMM's epilogue, folded into the
  gather: no extra pass); m_indices: int32 `[M_sum]`, permute's expert of each row of y (-1 on
  padding rows, which add no bias), required with a bias.
- hidden: Ho, the output's columns (1 <= Ho <= H; None: H): the first Ho columns of y, for a
  hidden size zero-padded to the GEMMs' multiple.
- out[t] = sum_k [r >= 0] * topk_weights[t,k] * (y[r, :Ho] + bias[m_indices[r], :Ho]) with
  r = inv_perm[t,k], float32 accumulation in k order, `[M, Ho]` in y.dtype, rounded once. Rows of
  y not named by inv_perm are never read.

CUDA-graph safe. The weighted top-K gather of :mod:`epmoe.kernels.gather` (ll_gather's too): one
program per (token, column chunk) gathers its K rows (rows of -1 entries are never read) and writes
the sum once, rounded to nearest even. Rows outside [0, M_sum) other than -1 are an error
(ValueError on CPU; on CUDA a device assert inside the kernel, ValueError in debug mode; under
torch.compile an async assert after the kernel); they are never read. The op's ``check=False`` (the
layer's own chain: inv_perm from its permute) skips that check.
"""

from typing import Optional

import torch

from epmoe import _checks, _config, _launch, reference
from epmoe._contract import Case, Contract, Let, Rule, Tensor
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
def _unpermute_launch(M, K, R, H, elem, y_strides, inv_strides, w_strides, check, cfg, bias,
                      in_kernel):  # fmt: skip
    """The gather kernel's launch for unpermute's sizes (R rows of y, H output columns), strides
    and options (bias: None, or the bias's experts and strides)."""
    block = min(_launch.pow2(max(H, 1)), max(16, cfg.block_bytes // elem))
    # no `if` on sizes: M is unbacked after an exact-size HT dispatch under torch.compile; an
    # empty grid launches nothing
    return gather.prepare(
        M, K, _launch.pow2(K), H, 1, R, block, cfg.warps, (0, *y_strides), inv_strides, w_strides,
        False, True, check, in_kernel, "unpermute: inv_perm expected rows in [0, M_sum) or -1",
        bias,
    )  # fmt: skip


def _unpermute_triton(
    y: torch.Tensor,
    inv_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    check: bool = True,
    bias: Optional[torch.Tensor] = None,
    m_indices: Optional[torch.Tensor] = None,
    hidden: Optional[int] = None,
) -> torch.Tensor:
    """unpermute on CUDA (or CPU tensors under TRITON_INTERPRET=1): the weighted top-K gather of
    :mod:`epmoe.kernels.gather`; check=False: no row check (inv_perm from permute in the same
    chain)."""
    M, K = inv_perm.shape
    R = y.shape[0]
    out = _output(y, inv_perm, topk_weights, check, bias, m_indices, hidden)
    H = y.shape[1] if hidden is None else hidden  # (out's columns)
    has_b = bias is not None
    key = (M, K, R, H, y.element_size(), y.stride(), inv_perm.stride(), topk_weights.stride(),
           check, CONFIG, (bias.shape[0], bias.stride()) if has_b else None)  # fmt: skip
    gather.launch(_unpermute_launch, key, y, inv_perm, topk_weights, out, check, OP, "inv_perm",
                  "ids", R, (bias, m_indices) if has_b else ())  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------ op
CONTRACT = Contract(
    OP,
    "y inv_perm topk_weights bias m_indices hidden",
    Tensor("y", _checks.FLOAT_DTYPES, ndim=(2,)),
    Tensor("inv_perm", _checks.INDEX_DTYPES, ndim=(2,)),
    Tensor("topk_weights", _checks.FLOAT_DTYPES, shape="inv_perm.shape"),
    Rule(
        "hidden is None or (type(hidden) is int and 0 < hidden <= y.shape[1])",
        "hidden",
        lambda a: f"None or an int in [1, {a.y.shape[1]}] (y's columns)",
        lambda a: repr(a.hidden),
    ),
    Let("cols", "y.shape[1] if hidden is None else hidden"),
    Tensor("bias", _checks.FLOAT_DTYPES, ndim=(2,), optional=True),
    Tensor("m_indices", (torch.int32,), shape=("y.shape[0]",), optional=True),
    Case(
        "bias is not None",
        [
            Rule(
                "bias.shape[1] >= cols",
                "bias",
                lambda a: f"at least {a.cols} columns (the output's)",
                lambda a: a.bias.shape[1],
            ),
            Rule(
                "m_indices is not None",
                "m_indices",
                "permute's m_indices with a bias (the expert of each row of y)",
                "None",
            ),
        ],
    ),
)


def _output(y, inv_perm, topk_weights, check=True, bias=None, m_indices=None, hidden=None):
    cols = y.shape[1] if hidden is None else hidden
    return torch.empty((inv_perm.shape[0], cols), dtype=y.dtype, device=y.device)


def _reference(y, inv_perm, topk_weights, check=True, bias=None, m_indices=None, hidden=None):
    # (checks the rows for free)
    return reference.unpermute(y, inv_perm, topk_weights, bias, m_indices, hidden)


@stage(
    contract=CONTRACT,
    fake=_output,
    reference=_reference,
    cuda=_unpermute_triton,
    chain=dict(check=False),  # the layer's rows come from its own permute: -1 or in range
)
def unpermute(
    y: torch.Tensor,
    inv_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    check: bool = True,
    bias: Optional[torch.Tensor] = None,
    m_indices: Optional[torch.Tensor] = None,
    hidden: Optional[int] = None,
) -> torch.Tensor:
    """Weighted top-k gather-sum.

    Args:
        y: bf16/fp16/fp32 `[M_sum, H]` expert outputs in the permuted layout.
        inv_perm: int32/int64 `[M, K]` row of each (t, k), or -1.
        topk_weights: float `[M, K]`.
        check: False skips the CUDA kernel's check of the rows (inv_perm from permute, whose
            rows are -1 or in range by construction); the CPU reference always checks.
        bias: bf16/fp16/fp32 `[E, Hb]` (Hb >= the output's columns), or None: expert e's bias,
            added to each row of expert e before the weighting.
        m_indices: int32 `[M_sum]`, permute's expert of each row of y (-1: padding, no bias);
            required with a bias (ignored without one).
        hidden: the output's columns Ho, 1 <= Ho <= H (None: H): the first Ho columns of y (a
            zero-padded hidden size).
    Returns:
        y.dtype `[M, Ho]`, float32 accumulation.
    """
