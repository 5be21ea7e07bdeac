"""Where ``epmoe demo`` runs here: ranks, device and backends (shared by ``demo`` and ``env``).

Probes only what the choice needs (GPU count, whether deep_ep and epmoe's DeepEP backend import),
so that both commands can import it without importing each other.
"""

import importlib.util
from typing import NamedTuple, Optional

import torch

from epmoe import _deps

EXPERTS = 8  # the demo's expert count (its model shape is in epmoe.cli.demo)


class Plan(NamedTuple):
    world: int
    device: str  # "cpu" or "cuda"
    backend: str  # EPMoE backend: "local", "torch" or "deepep"
    dist_backend: str  # torch.distributed backend: "gloo" or "nccl"


def deepep_here() -> bool:
    """deep_ep imports and this epmoe build has its DeepEP backend."""
    if importlib.util.find_spec("epmoe.comm.deepep") is None:
        return False
    return _deps.available("deep_ep")


def gpu_count() -> int:
    try:
        return torch.cuda.device_count() if torch.version.cuda else 0
    except Exception:  # noqa: BLE001
        return 0


def default_plan(
    device: Optional[str] = None,
    world: Optional[int] = None,
    backend: Optional[str] = None,
    experts: int = EXPERTS,
) -> Plan:
    """Pick the ranks, device and backends the demo uses here: with two or more GPUs and deep_ep,
    one rank per GPU (as many as divide ``experts``) over DeepEP, else 2 gloo ranks on CPU."""
    ngpu = gpu_count()
    if device is None:
        device = "cuda" if ngpu >= 2 and deepep_here() else "cpu"
    if world is None:
        if device == "cuda":
            world = max((w for w in (8, 4, 2, 1) if w <= ngpu and experts % w == 0), default=1)
        else:
            world = 2
    if backend is None:
        if device == "cuda" and world >= 2 and deepep_here():
            backend = "deepep"
        else:
            backend = "torch" if world > 1 else "local"
    return Plan(world, device, backend, "nccl" if device == "cuda" else "gloo")
