"""Stage: ll_gather (LL, decode). Gather each token's slots of the masked layout back and take
the (weighted) top-k sum.

Shape legend: ``T`` tokens, ``K`` top-k, ``H`` hidden, ``E`` local experts, ``C`` slots per expert.

Contract: ``out = ll_gather(y, rows, topk_weights=None)``; ``ll_gather_out(y, rows, topk_weights,
out)`` writes ``out`` (``epmoe::ll_gather_out`` mutates it) and returns it.

- y: bf16 `[E, C, H]` (any strides; rows past masked_m never read); rows: int32/int64 `[T, K]` in
  [0, E*C) or -1 (ll_scatter's rows); topk_weights: float32 `[T, K]` or None.
- out bf16 `[T, H]` (ll_gather_out: a given contiguous one): out[t] = sum_k w[t,k] *
  y.view(E*C, H)[rows[t,k]] (w = 1 when None), float32 accumulation in k order, rounded once.

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
from epmoe._contract import Contract, Rule, Tensor
from epmoe._stage import stage
from epmoe.kernels.gather import _ll_gather_launch

OP = "ll_gather"

# ------------------------------------------------------------------------------------------ ops
_ARGS = (
    Tensor("y", (torch.bfloat16,), ndim=(3,)),
    Tensor("rows", _checks.INDEX_DTYPES, ndim=(2,)),
    Tensor("topk_weights", (torch.float32,), shape="rows.shape", optional=True),
)
CONTRACT = Contract(OP, "y rows topk_weights", *_ARGS)
CONTRACT_OUT = Contract(
    OP,
    "y rows topk_weights out",
    *_ARGS,
    Tensor("out", (torch.bfloat16,), shape=("rows.shape[0]", "y.shape[2]")),
    Rule(
        "out.is_contiguous()", "out", "a contiguous tensor", lambda a: f"strides {a.out.stride()}"
    ),
)


def _output(y, rows, topk_weights=None, check=True):
    return torch.empty((rows.shape[0], y.shape[2]), dtype=torch.bfloat16, device=y.device)


def _ll_gather_cuda(y, rows, topk_weights=None, check=True):
    """ll_gather on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    out = _output(y, rows)
    _ll_gather_launch(y, rows, topk_weights, out, check)
    return out


def _reference(y, rows, topk_weights=None, check=True):
    return reference.ll_gather(y, rows, topk_weights)  # (checks the rows for free)


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
) -> torch.Tensor:
    """Gather each token's slots back and take the (weighted) top-k sum.

    Args:
        y: bf16 `[E, C, H]` (any strides), the masked layout.
        rows: int32/int64 `[T, K]` slot e*C + c of each (t, k) or -1 (ll_scatter's rows).
        topk_weights: float32 `[T, K]`, or None for an unweighted sum.
        check: False skips the CUDA kernel's check of the rows (rows from ll_scatter, -1 or in
            range by construction); the CPU reference always checks.
    Returns:
        bf16 `[T, H]`, float32 accumulation.
    """


def _out_fake(y, rows, topk_weights, out) -> None:
    return None


def _out_reference(y, rows, topk_weights, out) -> None:
    out.copy_(reference.ll_gather(y, rows, topk_weights))


def _out_result(_, y, rows, topk_weights, out) -> torch.Tensor:
    return out


@stage(
    contract=CONTRACT_OUT,
    fake=_out_fake,
    reference=_out_reference,
    cuda=_ll_gather_launch,
    result=_out_result,
    mutates=("out",),
)
def ll_gather_out(
    y: torch.Tensor, rows: torch.Tensor, topk_weights: Optional[torch.Tensor], out: torch.Tensor
) -> None:
    """ll_gather into ``out``.

    Args:
        y: bf16 `[E, C, H]` (any strides), the masked layout.
        rows: int32/int64 `[T, K]` slot e*C + c of each (t, k) or -1 (ll_scatter's rows).
        topk_weights: float32 `[T, K]`, or None for an unweighted sum.
        out: contiguous bf16 `[T, H]`, written.
    Returns:
        ``out``.
    """
