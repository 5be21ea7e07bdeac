"""Stage: dispatch. Send each token to the ranks that hold its experts.

Contract (HT): ``d = ht_dispatch(x, topk_ids, topk_weights, comm_key, x_scales=None,
worst_case=False)``
- x: bf16/fp8/int8 `[T, H]`; topk_ids: int64 `[T, K]` global expert id or -1; topk_weights: float32
  `[T, K]`; x_scales: float32 `[T, S]` or None.
- d.x `[N, H]`, d.x_scales `[N, S]` | None, d.topk_ids int64 `[N, K]` LOCAL ids (-1 for experts on
  other ranks and for padding rows), d.topk_weights float32 `[N, K]`, d.expert_counts int32 `[E]`,
  d.handle (tuple of tensors for :func:`epmoe.ops.combine.ht_combine`).
- worst_case=True: N = world * (max_tokens_per_rank of the communicator, or T when unset, in which
  case every rank must pass the same T) - static, no host sync, CUDA-graph safe; unused rows have
  ids -1. worst_case=False: N is exact and data-dependent (host sync; the fake declares a dynamic
  size; not CUDA-graph safe, tagged ``cudagraph_unsafe``).

Contract (LL): ``d = ll_dispatch(x, topk_ids, comm_key, use_fp8=False)``
- x: bf16 `[T, H]` with T <= max_tokens_per_rank; topk_ids int64 `[T, K]` global ids or -1.
- d.x `[E, C, H]` (C = world * max_tokens_per_rank; float8_e4m3fn when use_fp8), d.x_scales
  `[E, C, H/128]` | None, d.masked_m int32 `[E]`, d.handle. Static shapes: CUDA-graph safe.

The communicator (``epmoe.comm``) is looked up by its int key; it cannot be an op argument.
"""

from typing import List, NamedTuple, Optional, Tuple

import torch

from epmoe import _eager
from epmoe._contract import Case, Contract, Multiple, Rule, Tensor
from epmoe.comm import _registry

_PAYLOAD = (torch.bfloat16, torch.float8_e4m3fn, torch.int8)
_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


class HTDispatchResult(NamedTuple):
    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    expert_counts: torch.Tensor
    handle: Tuple[torch.Tensor, ...]


class LLDispatchResult(NamedTuple):
    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    masked_m: torch.Tensor
    handle: Tuple[torch.Tensor, ...]


HT = Contract(
    "dispatch",
    "x topk_ids topk_weights x_scales hidden_size",
    Tensor("x", _PAYLOAD, shape=(None, "hidden_size")),
    Tensor("topk_ids", (torch.int64,), shape=("x.shape[0]", None)),
    Tensor("topk_weights", (torch.float32,), shape="topk_ids.shape"),
    Tensor("x_scales", (torch.float32,), shape=("x.shape[0]", None), optional=True),
)
LL = Contract(
    "ll_dispatch",
    "x topk_ids use_fp8 hidden_size max_tokens_per_rank",
    Tensor("x", (torch.bfloat16,), shape=(None, "hidden_size")),
    Tensor("topk_ids", (torch.int64,), shape=("x.shape[0]", None)),
    Rule("max_tokens_per_rank", "max_tokens_per_rank", "a positive int for LL mode", "None"),
    Rule(
        "x.shape[0] <= max_tokens_per_rank",
        "x",
        lambda a: f"at most max_tokens_per_rank={a.max_tokens_per_rank} tokens",
        lambda a: a.x.shape[0],
    ),
    Case("use_fp8", [Multiple("hidden_size", "x.shape[1]", 128, "(fp8 groups)")]),
)


def _check_ht(comm, x, topk_ids, topk_weights, x_scales) -> None:
    HT.check(x, topk_ids, topk_weights, x_scales, comm.hidden_size)


def _check_ll(comm, x, topk_ids, use_fp8) -> None:
    LL.check(x, topk_ids, use_fp8, comm.hidden_size, comm.max_tokens_per_rank)


def _register_ht_dispatch(name: str, worst_case: bool, tags=()):
    """The two HT dispatch ops differ only in ``worst_case`` (static N) and their tags."""

    def impl(x, topk_ids, topk_weights, x_scales, comm_key):
        comm = _registry.get(comm_key)
        _check_ht(comm, x, topk_ids, topk_weights, x_scales)
        return comm.ht_dispatch(x, topk_ids, topk_weights, x_scales, worst_case)

    @torch.library.custom_op(f"epmoe::{name}", mutates_args=(), tags=tags)
    def op(
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        x_scales: Optional[torch.Tensor],
        comm_key: int,
    ) -> List[torch.Tensor]:
        return impl(x, topk_ids, topk_weights, x_scales, comm_key)

    @op.register_fake
    def _(x, topk_ids, topk_weights, x_scales, comm_key):
        comm = _registry.get(comm_key)
        _check_ht(comm, x, topk_ids, topk_weights, x_scales)
        return comm.ht_dispatch_fake(x, topk_ids, topk_weights, x_scales, worst_case)

    return op, impl


_ht_dispatch_op, _ht_dispatch_impl = _register_ht_dispatch("ht_dispatch", worst_case=True)
_ht_dispatch_exact_op, _ht_dispatch_exact_impl = _register_ht_dispatch(
    "ht_dispatch_exact", worst_case=False, tags=_UNSAFE
)


def _ll_dispatch_impl(x, topk_ids, comm_key, use_fp8):
    comm = _registry.get(comm_key)
    _check_ll(comm, x, topk_ids, use_fp8)
    return comm.ll_dispatch(x, topk_ids, None, use_fp8)


@torch.library.custom_op("epmoe::ll_dispatch", mutates_args=())
def _ll_dispatch_op(
    x: torch.Tensor, topk_ids: torch.Tensor, comm_key: int, use_fp8: bool
) -> List[torch.Tensor]:
    return _ll_dispatch_impl(x, topk_ids, comm_key, use_fp8)


@_ll_dispatch_op.register_fake
def _(x, topk_ids, comm_key, use_fp8):
    comm = _registry.get(comm_key)
    _check_ll(comm, x, topk_ids, use_fp8)
    return comm.ll_dispatch_fake(x, topk_ids, None, use_fp8)


def ht_dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    comm_key: int,
    x_scales: Optional[torch.Tensor] = None,
    worst_case: bool = False,
) -> HTDispatchResult:
    """HT dispatch through communicator ``comm_key`` (see module docstring for shapes)."""
    if _eager.direct(x, topk_ids, topk_weights, x_scales):
        op = _ht_dispatch_impl if worst_case else _ht_dispatch_exact_impl
    else:
        op = _ht_dispatch_op if worst_case else _ht_dispatch_exact_op
    return _ht_result(op(x, topk_ids, topk_weights, x_scales, comm_key), x_scales)


def _ht_result(out, x_scales) -> HTDispatchResult:
    rx, rs, rids, rw, counts = out[:5]
    return HTDispatchResult(
        rx, rs if x_scales is not None else None, rids, rw, counts, tuple(out[5:])
    )


def ll_dispatch(
    x: torch.Tensor, topk_ids: torch.Tensor, comm_key: int, use_fp8: bool = False
) -> LLDispatchResult:
    """LL dispatch into the masked `[E, C, H]` layout (see module docstring)."""
    op = _ll_dispatch_impl if _eager.direct(x, topk_ids) else _ll_dispatch_op
    return _ll_result(op(x, topk_ids, comm_key, use_fp8), use_fp8)


def _ll_result(out, use_fp8: bool) -> LLDispatchResult:
    return LLDispatchResult(out[0], out[1] if use_fp8 else None, out[2], tuple(out[3:]))


def _ht_dispatch_trusted(x, topk_ids, topk_weights, comm_key, x_scales=None, worst_case=False):
    """The layer's entry on its direct path (eager, plain CUDA tensors checked at the layer's
    boundary or made by the stage before): the communicator without the metadata checks."""
    comm = _registry.get(comm_key)
    return _ht_result(comm.ht_dispatch(x, topk_ids, topk_weights, x_scales, worst_case), x_scales)


def _ll_dispatch_trusted(x, topk_ids, comm_key, use_fp8=False):
    """ll_dispatch's entry for the layer's direct path (see _ht_dispatch_trusted)."""
    comm = _registry.get(comm_key)
    return _ll_result(comm.ll_dispatch(x, topk_ids, None, use_fp8), use_fp8)
