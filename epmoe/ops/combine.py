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

Ops: ``epmoe::ht_combine``, ``epmoe::ll_combine`` (:func:`_ll_combine`) and
``epmoe::ll_combine_out`` (:func:`_ll_combine_out`); :func:`ll_combine` picks one by ``out``. The
communicator (``epmoe.comm``) is looked up by its int key; its backend (local, torch.distributed,
deep_ep) is both the CPU "reference" and the CUDA implementation of a communication.
"""

from typing import List, Optional, Sequence

import torch

from epmoe._contract import Contract, Let, Rule, Tensor
from epmoe._stage import stage
from epmoe.comm import _registry

# the checks over the communicator's sizes (values the caller supplies) ...
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
# ... and the ops' contracts: the same checks, the sizes read from the communicator of comm_key
# (an unknown key: ValueError from the registry)
_COMM = dict(_comm=_registry.get)
HT_OP = Contract(
    HT.op,
    "y handle comm_key",
    Let("hidden_size", "_comm(comm_key).hidden_size"),
    *HT.steps,
    consts=_COMM,
)
_LL_SIZES = (
    Let("comm", "_comm(comm_key)"),
    Let("num_local_experts", "comm.num_local_experts"),
    Let("ll_capacity", "comm.ll_capacity"),
    Let("hidden_size", "comm.hidden_size"),
)
_LL_OP_PARAMS = "y topk_ids topk_weights handle comm_key"
LL_OP = Contract(LL.op, _LL_OP_PARAMS, *_LL_SIZES, *LL.steps, consts=_COMM)
LL_OUT_OP = Contract(LL_OUT.op, _LL_OP_PARAMS + " out", *_LL_SIZES, *LL_OUT.steps, consts=_COMM)


# ------------------------------------------------------------------------------------------ HT
def _ht_run(y, handle, comm_key):
    return _registry.get(comm_key).ht_combine(y, list(handle))


def _ht_fake(y, handle, comm_key):
    return y.new_empty((handle[0].shape[0], y.shape[1]))


@stage(contract=HT_OP, fake=_ht_fake, reference=_ht_run, cuda=_ht_run, triton=False)
def ht_combine(y: torch.Tensor, handle: List[torch.Tensor], comm_key: int) -> torch.Tensor:
    """Unweighted HT combine: y bf16 `[N, H]` -> bf16 `[T, H]`. CUDA-graph safe when the handle
    came from a worst-case dispatch.

    Args:
        y: bf16 `[N, H]` the received rows' expert outputs (already weighted by unpermute).
        handle: the tensors ``ht_dispatch`` returned (handle[0]: bool `[T, P]`).
        comm_key: the communicator's registry key.
    Returns:
        bf16 `[T, H]`, each token's rows summed over the ranks it was sent to.
    """


# ------------------------------------------------------------------------------------------ LL
def _ll_run(y, topk_ids, topk_weights, handle, comm_key):
    return _registry.get(comm_key).ll_combine(y, topk_ids, topk_weights, list(handle))


def _ll_fake(y, topk_ids, topk_weights, handle, comm_key):
    return y.new_empty((topk_ids.shape[0], y.shape[2]))


@stage(contract=LL_OP, fake=_ll_fake, reference=_ll_run, cuda=_ll_run, triton=False,
       name="ll_combine")  # fmt: skip
def _ll_combine(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: List[torch.Tensor],
    comm_key: int,
) -> torch.Tensor:
    """Weighted LL combine into a new tensor (``ll_combine(..., out=None)``)."""


def _ll_out_run(y, topk_ids, topk_weights, handle, comm_key, out) -> None:
    _registry.get(comm_key).ll_combine_out(out, y, topk_ids, topk_weights, list(handle))


def _ll_out_fake(y, topk_ids, topk_weights, handle, comm_key, out) -> None:
    return None


@stage(
    contract=LL_OUT_OP,
    fake=_ll_out_fake,
    reference=_ll_out_run,
    cuda=_ll_out_run,
    triton=False,
    mutates=("out",),
    name="ll_combine_out",
)
def _ll_combine_out(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: List[torch.Tensor],
    comm_key: int,
    out: torch.Tensor,
) -> None:
    """Weighted LL combine written into ``out`` (``ll_combine(..., out=out)``); returns None."""


def ll_combine(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: Sequence[torch.Tensor],
    comm_key: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Weighted LL combine: y bf16 `[E, C, H]` -> bf16 `[T, H]`, written into ``out`` if given.
    CUDA-graph safe.

    Args:
        y: bf16 `[E, C, H]` expert outputs in the masked layout (rows past masked_m never read).
        topk_ids: int64 `[T, K]` global ids or -1 (as given to ll_dispatch).
        topk_weights: float32 `[T, K]`.
        handle: the tensors ``ll_dispatch`` returned. comm_key: the communicator's registry key.
        out: None (``epmoe::ll_combine``, a new tensor), or bf16 `[T, H]` contiguous
            (``epmoe::ll_combine_out`` writes it).
    Returns:
        bf16 `[T, H]`: out[t] = sum_k topk_weights[t, k] * y[expert of (t, k), its slot] (``out``
        itself when given).
    """
    if out is None:
        return _ll_combine(y, topk_ids, topk_weights, handle, comm_key)
    _ll_combine_out(y, topk_ids, topk_weights, handle, comm_key, out)
    return out


def _ll_launch(y, topk_ids, topk_weights, handle, comm_key, out=None):
    """ll_combine.launch: the picked op's launch (the layer's direct path)."""
    if out is None:
        return _ll_combine.launch(y, topk_ids, topk_weights, handle, comm_key)
    _ll_combine_out.launch(y, topk_ids, topk_weights, handle, comm_key, out)
    return out


def _ll_chained(y, topk_ids, topk_weights, handle, comm_key, out=None):
    """ll_combine.chained: the picked op (the layer's chain under torch.compile)."""
    if out is None:
        return _ll_combine.chained(y, topk_ids, topk_weights, handle, comm_key)
    _ll_combine_out.chained(y, topk_ids, topk_weights, handle, comm_key, out)
    return out


ll_combine.launch, ll_combine.chained = _ll_launch, _ll_chained
