"""Communication backends for dispatch/combine: local (one rank), torch.distributed, deep_ep.

``create(backend, group, ...)`` builds a communicator, registers it and returns it (``comm.key`` is
the int the ops take). ``backend="auto"`` picks local for a group of one, else deep_ep on CUDA when
it imports, else torch.
"""

import torch

from epmoe import _checks
from epmoe.comm import _registry
from epmoe.comm.base import Communicator
from epmoe.comm.local import LocalComm
from epmoe.comm.torch_dist import TorchComm

BACKENDS = ("auto", "local", "torch", "deepep")


def resolve_backend(backend: str, group, device) -> str:
    _checks.check_choice("EPMoE", "backend", backend, BACKENDS)
    if backend != "auto":
        return backend
    world = 1
    if group is not None and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size(group)
    if world == 1:
        return "local"
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        from epmoe import _deps

        if _deps.available("deep_ep"):
            return "deepep"
    return "torch"


def create(
    backend: str,
    group,
    num_experts: int,
    hidden_size: int,
    max_tokens_per_rank=None,
    device=None,
    **backend_kwargs,
) -> Communicator:
    name = resolve_backend(backend, group, device)
    if name == "local":
        if group is not None and torch.distributed.get_world_size(group) != 1:
            raise _checks.fail(
                "EPMoE", "backend", "'torch' or 'deepep' for a group of >1 ranks", "'local'"
            )
        comm = LocalComm(num_experts, hidden_size, max_tokens_per_rank)
    elif name == "torch":
        comm = TorchComm(group, num_experts, hidden_size, max_tokens_per_rank)
    else:
        from epmoe.comm.deepep import DeepEPComm  # lazy: imports deep_ep

        comm = DeepEPComm(group, num_experts, hidden_size, max_tokens_per_rank, **backend_kwargs)
    comm.key = _registry.register(comm)
    return comm


def get(key: int) -> Communicator:
    return _registry.get(key)


__all__ = ["BACKENDS", "Communicator", "LocalComm", "TorchComm", "create", "get", "resolve_backend"]
