"""Stage: combine. Return expert outputs to the ranks their tokens came from.

Contract:
- ``ht_combine(y, handle, comm_key)``: y bf16 `[N, H]` (rows already weighted by unpermute) -> bf16
  `[T, H]`, out[t] = sum over the ranks t was sent to of their row (unweighted). CUDA-graph safe
  when the handle came from a worst-case dispatch.
- ``ll_combine(y, topk_ids, topk_weights, handle, comm_key, out=None)``: y bf16 `[E, C, H]`
  (rows past masked_m never read) -> bf16 `[T, H]`,
  out[t] = sum_k topk_weights[t,k] * y[expert of (t,k), its slot]. With ``out`` (bf16 `[T, H]`,
  contiguous, e.g. a CUDA-graph runner's static output) the result is written there
  (``epmoe::ll_combine_out``, which mutates ``out``) and ``out`` is returned. CUDA-graph safe.
"""

from typing import List, Optional, Sequence

import torch

from epmoe import _eager
from epmoe._contract import Contract, Rule, Tensor
from epmoe.comm import _registry

HT = Contract(
    "combine",
    "y handle hidden_size",
    Tensor("y", (torch.bfloat16,), shape=(None, "hidden_size")),
    Rule("len(handle) != 0", "handle", "the handle returned by ht_dispatch", "[]"),
)
_LL = (
    Tensor("y", (torch.bfloat16,), shape=("num_local_experts", "ll_capacity", "hidden_size")),
    Tensor("topk_ids", (torch.int64,), device=False),
    Tensor("topk_weights", (torch.float32,), shape="topk_ids.shape", device=False),
)
_LL_PARAMS = "y topk_ids topk_weights num_local_experts ll_capacity hidden_size"
LL = Contract("ll_combine", _LL_PARAMS, *_LL)
LL_OUT = Contract(
    "ll_combine",
    _LL_PARAMS + " out",
    *_LL,
    Tensor("out", (torch.bfloat16,), shape=("topk_ids.shape[0]", "y.shape[2]")),
    Rule(
        "out.is_contiguous()", "out", "a contiguous tensor", lambda a: f"strides {a.out.stride()}"
    ),
)


def _check_ht(comm, y, handle) -> None:
    HT.check(y, handle, comm.hidden_size)


def _check_ll(comm, y, topk_ids, topk_weights, out=None) -> None:
    sizes = (comm.num_local_experts, comm.ll_capacity, comm.hidden_size)
    if out is None:
        LL.check(y, topk_ids, topk_weights, *sizes)
    else:
        LL_OUT.check(y, topk_ids, topk_weights, *sizes, out)


def _ht_combine_impl(y, handle, comm_key):
    comm = _registry.get(comm_key)
    _check_ht(comm, y, handle)
    return comm.ht_combine(y, list(handle))


@torch.library.custom_op("epmoe::ht_combine", mutates_args=())
def _ht_combine_op(y: torch.Tensor, handle: List[torch.Tensor], comm_key: int) -> torch.Tensor:
    return _ht_combine_impl(y, handle, comm_key)


@_ht_combine_op.register_fake
def _(y, handle, comm_key):
    comm = _registry.get(comm_key)
    _check_ht(comm, y, handle)
    return y.new_empty((handle[0].shape[0], y.shape[1]))


def _ll_combine_impl(y, topk_ids, topk_weights, handle, comm_key):
    comm = _registry.get(comm_key)
    _check_ll(comm, y, topk_ids, topk_weights)
    return comm.ll_combine(y, topk_ids, topk_weights, list(handle))


@torch.library.custom_op("epmoe::ll_combine", mutates_args=())
def _ll_combine_op(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: List[torch.Tensor],
    comm_key: int,
) -> torch.Tensor:
    return _ll_combine_impl(y, topk_ids, topk_weights, handle, comm_key)


@_ll_combine_op.register_fake
def _(y, topk_ids, topk_weights, handle, comm_key):
    comm = _registry.get(comm_key)
    _check_ll(comm, y, topk_ids, topk_weights)
    return y.new_empty((topk_ids.shape[0], y.shape[2]))


def _ll_combine_out_impl(y, topk_ids, topk_weights, handle, comm_key, out) -> None:
    comm = _registry.get(comm_key)
    _check_ll(comm, y, topk_ids, topk_weights, out)
    comm.ll_combine_out(out, y, topk_ids, topk_weights, list(handle))


@torch.library.custom_op("epmoe::ll_combine_out", mutates_args=("out",))
def _ll_combine_out_op(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: List[torch.Tensor],
    comm_key: int,
    out: torch.Tensor,
) -> None:
    _ll_combine_out_impl(y, topk_ids, topk_weights, handle, comm_key, out)


@_ll_combine_out_op.register_fake
def _(y, topk_ids, topk_weights, handle, comm_key, out):
    comm = _registry.get(comm_key)
    _check_ll(comm, y, topk_ids, topk_weights, out)


def ht_combine(y: torch.Tensor, handle: Sequence[torch.Tensor], comm_key: int) -> torch.Tensor:
    """Unweighted HT combine: y bf16 `[N, H]` -> bf16 `[T, H]`."""
    op = _ht_combine_impl if _eager.direct(y, *handle) else _ht_combine_op
    return op(y, list(handle), comm_key)


def ll_combine(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: Sequence[torch.Tensor],
    comm_key: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Weighted LL combine: y bf16 `[E, C, H]` -> bf16 `[T, H]`, written into ``out`` if given."""
    direct = _eager.direct(y, topk_ids, topk_weights, out, *handle)
    if out is None:
        op = _ll_combine_impl if direct else _ll_combine_op
        return op(y, topk_ids, topk_weights, list(handle), comm_key)
    op = _ll_combine_out_impl if direct else _ll_combine_out_op
    op(y, topk_ids, topk_weights, list(handle), comm_key, out)
    return out


def _ht_combine_trusted(y, handle, comm_key):
    """The layer's entry on its direct path (eager, plain CUDA tensors made by the stages
    before): the communicator without the metadata checks."""
    return _registry.get(comm_key).ht_combine(y, list(handle))


def _ll_combine_trusted(y, topk_ids, topk_weights, handle, comm_key):
    """ll_combine's entry for the layer's direct path (see _ht_combine_trusted)."""
    return _registry.get(comm_key).ll_combine(y, topk_ids, topk_weights, list(handle))
