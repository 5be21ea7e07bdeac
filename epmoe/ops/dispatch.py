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

Ops: ``epmoe::ht_dispatch`` (worst case, :func:`_ht_worst`), ``epmoe::ht_dispatch_exact``
(:func:`_ht_exact`; the fake declares N with ``torch.library.get_ctx().new_dynamic_size()``, through
the communicator's ``ht_dispatch_fake``) and ``epmoe::ll_dispatch``; :func:`ht_dispatch` picks one
of the two HT ops by ``worst_case``. The communicator (``epmoe.comm``) is looked up by its int key
(it cannot be an op argument); its backend (local, torch.distributed, deep_ep) is both the CPU
"reference" and the CUDA implementation of a communication.
"""

from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from epmoe._contract import Case, Contract, Let, Multiple, Rule, Tensor
from epmoe._stage import stage
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


# the checks over the communicator's sizes (``hidden_size``, ...: values the caller supplies) ...
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
# ... and the ops' contracts: the same checks, the sizes read from the communicator of comm_key
# (an unknown key: ValueError from the registry)
HT_OP = Contract(
    HT.op,
    "x topk_ids topk_weights comm_key x_scales",
    Let("hidden_size", "_comm(comm_key).hidden_size"),
    *HT.steps,
    consts=dict(_comm=_registry.get),
)
LL_OP = Contract(
    LL.op,
    "x topk_ids comm_key use_fp8",
    Let("comm", "_comm(comm_key)"),
    Let("hidden_size", "comm.hidden_size"),
    Let("max_tokens_per_rank", "comm.max_tokens_per_rank"),
    *LL.steps,
    consts=dict(_comm=_registry.get),
)


# ------------------------------------------------------------------------------------------ HT
def _ht_result(out, x, topk_ids, topk_weights, comm_key, x_scales) -> HTDispatchResult:
    rx, rs, rids, rw, counts = out[:5]
    return HTDispatchResult(
        rx, rs if x_scales is not None else None, rids, rw, counts, tuple(out[5:])
    )


def _ht_op(name: str, worst_case: bool, tags=()) -> Callable:
    """Declare one of the two HT dispatch ops: the static worst-case N (no host sync, CUDA-graph
    safe) or the exact, data-dependent N (a host sync; the fake's N from
    torch.library.get_ctx().new_dynamic_size(), in the communicator's fake)."""

    def run(x, topk_ids, topk_weights, comm_key, x_scales=None):
        comm = _registry.get(comm_key)
        return comm.ht_dispatch(x, topk_ids, topk_weights, x_scales, worst_case)

    def fake(x, topk_ids, topk_weights, comm_key, x_scales=None):
        comm = _registry.get(comm_key)
        return comm.ht_dispatch_fake(x, topk_ids, topk_weights, x_scales, worst_case)

    def signature(
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        comm_key: int,
        x_scales: Optional[torch.Tensor] = None,
    ) -> List[torch.Tensor]:
        """``ht_dispatch(..., worst_case)``'s op (its arguments and result, see there)."""

    return stage(
        contract=HT_OP,
        fake=fake,
        reference=run,  # (a communication's reference is its torch backend)
        cuda=run,
        triton=False,
        result=_ht_result,
        tags=tags,
        name=name,
    )(signature)


_ht_worst = _ht_op("ht_dispatch", True)
_ht_exact = _ht_op("ht_dispatch_exact", False, _UNSAFE)


def ht_dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    comm_key: int,
    x_scales: Optional[torch.Tensor] = None,
    worst_case: bool = False,
) -> HTDispatchResult:
    """HT dispatch through communicator ``comm_key`` (see module docstring for shapes).

    Args:
        x: bf16/fp8/int8 `[T, H]`. topk_ids: int64 `[T, K]` global expert ids or -1.
        topk_weights: float32 `[T, K]`. comm_key: the communicator's registry key.
        x_scales: float32 `[T, S]` or None.
        worst_case: True: ``epmoe::ht_dispatch``, static N = world * (max_tokens_per_rank, or T
            when unset), CUDA-graph safe; False: ``epmoe::ht_dispatch_exact``, exact N (host sync).
    Returns:
        HTDispatchResult(x `[N, H]`, x_scales `[N, S]` | None, topk_ids int64 `[N, K]` local ids or
        -1, topk_weights float32 `[N, K]`, expert_counts int32 `[E]`, handle).
    """
    fn = _ht_worst if worst_case else _ht_exact
    return fn(x, topk_ids, topk_weights, comm_key, x_scales)


def _ht_launch(x, topk_ids, topk_weights, comm_key, x_scales=None, worst_case=False):
    """ht_dispatch.launch: the picked op's launch (the layer's direct path)."""
    fn = _ht_worst.launch if worst_case else _ht_exact.launch
    return fn(x, topk_ids, topk_weights, comm_key, x_scales)


def _ht_chained(x, topk_ids, topk_weights, comm_key, x_scales=None, worst_case=False):
    """ht_dispatch.chained: the picked op (the layer's chain under torch.compile)."""
    fn = _ht_worst.chained if worst_case else _ht_exact.chained
    return fn(x, topk_ids, topk_weights, comm_key, x_scales)


ht_dispatch.launch, ht_dispatch.chained = _ht_launch, _ht_chained


# ------------------------------------------------------------------------------------------ LL
def _ll_run(x, topk_ids, comm_key, use_fp8=False):
    return _registry.get(comm_key).ll_dispatch(x, topk_ids, None, use_fp8)


def _ll_fake(x, topk_ids, comm_key, use_fp8=False):
    return _registry.get(comm_key).ll_dispatch_fake(x, topk_ids, None, use_fp8)


def _ll_result(out, x, topk_ids, comm_key, use_fp8) -> LLDispatchResult:
    return LLDispatchResult(out[0], out[1] if use_fp8 else None, out[2], tuple(out[3:]))


@stage(
    contract=LL_OP,
    fake=_ll_fake,
    reference=_ll_run,
    cuda=_ll_run,
    triton=False,
    result=_ll_result,
)
def ll_dispatch(
    x: torch.Tensor, topk_ids: torch.Tensor, comm_key: int, use_fp8: bool = False
) -> List[torch.Tensor]:
    """LL dispatch into the masked `[E, C, H]` layout (see module docstring). CUDA-graph safe.

    Args:
        x: bf16 `[T, H]`, T <= max_tokens_per_rank. topk_ids: int64 `[T, K]` global ids or -1.
        comm_key: the communicator's registry key.
        use_fp8: quantize the payload to float8_e4m3fn (H a multiple of 128).
    Returns:
        LLDispatchResult(x `[E, C, H]`, x_scales float32 `[E, C, H/128]` | None, masked_m int32
        `[E]`, handle).
    """
