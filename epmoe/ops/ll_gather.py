"""Stage: ll_gather (LL, decode). Gather each token's slots of the masked layout back and take
the (weighted) top-k sum, the experts' down-projection bias added on the way.

Shape legend: ``T`` tokens, ``K`` top-k, ``H`` y's columns, ``Ho`` output columns (<= H),
``E`` local experts, ``C`` slots per expert.

Contract: ``out = ll_gather(y, rows, topk_weights=None, check=True, bias=None, hidden=None)``;
``ll_gather_out(y, rows, topk_weights, out, bias=None)`` writes ``out`` (``epmoe::ll_gather_out``
mutates it) and returns it.

- y: bf16 `[E, C, H]` (any strides; rows past masked_m never read); rows: int32/int64 `[T, K]` in
  [0, E*C) or -1 (ll_scatter's rows); topk_weights: float32 `[T, K]` or None.
- bias: bf16/fp16/fp32 `[E, Hb]` (Hb >= Ho, any strides) or None: expert e's down-projection
  bias, added to each of its rows before the weighting (the GEMM's epilogue, folded into the
  gather: no extra pass). The expert of row r is r // C.
- hidden: Ho, the output's columns (1 <= Ho <= H; None: H): the first Ho columns of y, for a
  hidden size zero-padded to the GEMMs' multiple (ll_gather_out: out's columns).
- out bf16 `[T, Ho]` (ll_gather_out: a given contiguous one): out[t] = sum_k w[t,k] *
  (y.view(E*C, H)[r, :Ho] + bias[r // C, :Ho]) with r = rows[t,k] (w = 1 when None, bias 0 when
  None), float32 accumulation in k order, rounded once.

One kernel, the weighted top-K gather unpermute also runs (:mod:`epmoe.kernels.gather`);
CUDA-graph safe (static shapes, fixed grid, no host sync, no atomics). Rows outside [0, E*C) other
than -1 are an error (ValueError on CPU; on CUDA a device assert inside the kernel on direct
launches, ValueError in debug mode; an async assert after the kernel under torch.compile); they
are never read. ll_gather's ``check=False`` (the layer's own chain: rows from its ll_scatter)
skips that check.
"""

from typing import Optional

import torch

from epmoe import _checks, reference
from epmoe._contract import Case, Contract, Let, Rule, Tensor
from epmoe._stage import stage
from epmoe.kernels.gather import _ll_gather_launch

OP = "ll_gather"

# ------------------------------------------------------------------------------------------ ops
_ARGS = (
    Tensor("y", (torch.bfloat16,), ndim=(3,)),
    Tensor("rows", _checks.INDEX_DTYPES, ndim=(2,)),
    Tensor("topk_weights", (torch.float32,), shape="rows.shape", optional=True),
)
# (after Let("cols", ...): the output's columns)
_BIAS = (
    Tensor("bias", _checks.FLOAT_DTYPES, shape=("y.shape[0]", None), optional=True),
    Case(
        "bias is not None",
        [
            Rule(
                "bias.shape[1] >= cols",
                "bias",
                lambda a: f"at least {a.cols} columns (the output's)",
                lambda a: a.bias.shape[1],
            )
        ],
    ),
)
CONTRACT = Contract(
    OP,
    "y rows topk_weights bias hidden",
    *_ARGS,
    Rule(
        "hidden is None or (type(hidden) is int and 0 < hidden <= y.shape[2])",
        "hidden",
        lambda a: f"None or an int in [1, {a.y.shape[2]}] (y's columns)",
        lambda a: repr(a.hidden),
    ),
    Let("cols", "y.shape[2] if hidden is None else hidden"),
    *_BIAS,
)
CONTRACT_OUT = Contract(
    OP,
    "y rows topk_weights out bias",
    *_ARGS,
    Tensor("out", (torch.bfloat16,), shape=("rows.shape[0]", None)),
    Rule(
        "out.shape[1] == y.shape[2] or 0 < out.shape[1] < y.shape[2]",
        "out",
        lambda a: f"[{a.rows.shape[0]}, Ho] with 1 <= Ho <= {a.y.shape[2]} (y's columns)",
        lambda a: list(a.out.shape),
    ),
    Rule(
        "out.is_contiguous()", "out", "a contiguous tensor", lambda a: f"strides {a.out.stride()}"
    ),
    Let("cols", "out.shape[1]"),
    *_BIAS,
)


def _output(y, rows, topk_weights=None, check=True, bias=None, hidden=None):
    cols = y.shape[2] if hidden is None else hidden
    return torch.empty((rows.shape[0], cols), dtype=torch.bfloat16, device=y.device)


def _ll_gather_cuda(y, rows, topk_weights=None, check=True, bias=None, hidden=None):
    """ll_gather on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    out = _output(y, rows, None, True, None, hidden)
    _ll_gather_launch(y, rows, topk_weights, out, bias, check)
    return out


def _reference(y, rows, topk_weights=None, check=True, bias=None, hidden=None):
    return reference.ll_gather(y, rows, topk_weights, bias, hidden)  # (checks the rows for free)


@stage(
    contract=CONTRACT,
    fake=_output,
    reference=_reference,
    cuda=_ll_gather_cuda,
    chain=dict(check=False),  # the layer's rows come from its own ll_scatter: -1 or in range
)
def ll_gather(
    y: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: Optional[torch.Tensor] = None,
    check: bool = True,
    bias: Optional[torch.Tensor] = None,
    hidden: Optional[int] = None,
) -> torch.Tensor:
    """Gather each token's slots back and take the (weighted) top-k sum.

    Args:
        y: bf16 `[E, C, H]` (any strides), the masked layout.
        rows: int32/int64 `[T, K]` slot e*C + c of each (t, k) or -1 (ll_scatter's rows).
        topk_weights: float32 `[T, K]`, or None for an unweighted sum.
        check: False skips the CUDA kernel's check of the rows (rows from ll_scatter, -1 or in
            range by construction); the CPU reference always checks.
        bias: bf16/fp16/fp32 `[E, Hb]` (Hb >= the output's columns), or None: expert e's bias,
            added to each row of expert e before the weighting.
        hidden: the output's columns Ho, 1 <= Ho <= H (None: H): the first Ho columns of y (a
            zero-padded hidden size).
    Returns:
        bf16 `[T, Ho]`, float32 accumulation.
    """


def _out_fake(y, rows, topk_weights, out, bias=None) -> None:
    return None


def _out_reference(y, rows, topk_weights, out, bias=None) -> None:
    out.copy_(reference.ll_gather(y, rows, topk_weights, bias, out.shape[1]))


def _out_result(_, y, rows, topk_weights, out, bias=None) -> torch.Tensor:
    return out


@stage(
    contract=CONTRACT_OUT,
    fake=_out_fake,
    reference=_out_reference,
    cuda=_ll_gather_launch,  # (its trailing check=True: rows checked)
    result=_out_result,
    mutates=("out",),
)
def ll_gather_out(
    y: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: Optional[torch.Tensor],
    out: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> None:
    """ll_gather into ``out``.

    Args:
        y: bf16 `[E, C, H]` (any strides), the masked layout.
        rows: int32/int64 `[T, K]` slot e*C + c of each (t, k) or -1 (ll_scatter's rows).
        topk_weights: float32 `[T, K]`, or None for an unweighted sum.
        out: contiguous bf16 `[T, Ho]`, 1 <= Ho <= H (or Ho = H = 0), written: the first Ho
            columns.
        bias: bf16/fp16/fp32 `[E, Hb]` (Hb >= Ho), or None: expert e's bias, added to each row
            of expert e before the weighting.
    Returns:
        ``out``.
    """
