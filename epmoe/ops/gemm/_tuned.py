"""Measured choices, kept as data: one JSON file per GPU model in ``tuned/`` beside this module
(``tuned/nvidia_h200.json``), written on that GPU by ``scripts/tune_gemm.py``: the tile configs
of our Triton grouped GEMMs and which backend wins each GEMM problem ("entries"), and which path
and alignment wins each call size of a one-rank layer ("paths").

A file holds ``{"device": name, "triton": version, "torch": version, "date": ..., "commit": ...,
"entries": [...], "paths": [...]}``. Each entry is one GEMM problem class and its winner::

    {"layout": "contiguous" | "masked", "scheme": "fp8", "N": 1536, "K": 2048, "E": 128,
     "block": 16,   # contiguous: the row block (permute alignment); masked: BLOCK_M
     "m": 256,      # rows (contiguous M_sum; masked expected_m) the entry was tuned at
     "config": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
                "num_warps": 4, "num_stages": 4},
     "backend": "triton" | "deep_gemm",   # which measured faster ("triton" where deep_gemm
     "us": {"triton": 41.0, "deep_gemm": 44.5}}   # cannot run the problem)

:func:`lookup` returns the config of the entry with the smallest ``m`` >= the call's rows (else
the largest): a function of static sizes only, so captured graphs stay valid. No file, or no entry
for the problem: the caller autotunes over its candidate configs instead.

Each path is one call size of a one-rank ``mode="auto"`` layer above its GEMV cutoff and what
measured fastest there (CUDA-graph replay of the whole layer)::

    {"scheme": "fp8", "E": 128, "H": 2048, "I": 768, "K": 8,   # the layer's sizes (top-K: K)
     "t": 32,                       # tokens per call
     "path": "ll" | "ht",           # masked layout, or contiguous with this permute alignment
     "alignment": 16,               # (ht only; 0 for ll)
     "us": {"ll": 90.1, "ht@128": 120.3, "ht@16": 84.0}}

:func:`path` returns the entry with the smallest ``t`` >= the call's tokens (else the largest).
"""

import functools
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

DIR = Path(__file__).resolve().with_name("tuned")
LAYOUTS = ("contiguous", "masked", "gate")  # ("gate": GEMM1 and the gate in one kernel)


def file_name(device_name: str) -> str:
    """``tuned/`` file name of a GPU model: "NVIDIA H200" -> "nvidia_h200.json"."""
    return "".join(c if c.isalnum() else "_" for c in device_name.strip().lower()) + ".json"


def problem(entry: Dict) -> Tuple:
    """The problem class an entry (or a call's description) belongs to, without its rows."""
    return (entry["layout"], str(entry["scheme"]), entry["N"], entry["K"], entry["E"],
            entry["block"])  # fmt: skip


@functools.cache
def table(device_name: str) -> Dict[Tuple, List[Dict]]:
    """The tuned entries of GPU model ``device_name`` by problem class, each list sorted by
    ``m`` (empty without a file)."""
    path = DIR / file_name(device_name)
    if not path.is_file():
        return {}
    by_problem: Dict[Tuple, List[Dict]] = {}
    for e in json.loads(path.read_text())["entries"]:
        by_problem.setdefault(problem(e), []).append(e)
    return {k: sorted(v, key=lambda e: e["m"]) for k, v in by_problem.items()}


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def entry(layout, scheme, n, k, e, block, m, device) -> Optional[Dict]:
    """The entry for ``m`` rows of a problem on ``device`` (a CUDA device), or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    entries = table(_device_name(index)).get((layout, str(scheme), n, k, e, block))
    if not entries:
        return None
    return next((x for x in entries if x["m"] >= m), entries[-1])


def lookup(layout, scheme, n, k, e, block, m, device) -> Optional[Dict]:
    """The tuned Triton config (meta-parameters and num_warps / num_stages) or None."""
    x = entry(layout, scheme, n, k, e, block, m, device)
    return None if x is None else dict(x["config"])


def backend(layout, scheme, n, k, e, block, m, device) -> Optional[str]:
    """ "triton" or "deep_gemm", whichever the table measured faster; None: no entry."""
    x = entry(layout, scheme, n, k, e, block, m, device)
    return None if x is None else x["backend"]


@functools.cache
def _paths(device_name: str) -> Dict[Tuple, List[Dict]]:
    path_ = DIR / file_name(device_name)
    if not path_.is_file():
        return {}
    by_layer: Dict[Tuple, List[Dict]] = {}
    for p in json.loads(path_.read_text()).get("paths", []):
        by_layer.setdefault(layer_key(p), []).append(p)
    return {k: sorted(v, key=lambda p: p["t"]) for k, v in by_layer.items()}


def layer_key(p: Dict) -> Tuple:
    """The layer sizes a path entry belongs to."""
    return (str(p["scheme"]), p["E"], p["H"], p["I"], p["K"])


def paths(scheme, E: int, H: int, I: int, K: int, device) -> List[Dict]:  # noqa: E741
    """The path entries of a one-rank layer of these sizes on ``device``, by ``t`` ([] without)."""
    device = torch.device(device)
    if device.type != "cuda":
        return []
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _paths(_device_name(index)).get((str(scheme), E, H, I, K), [])


def has(layout, scheme, n: int, k: int, e: int, device) -> bool:
    """Whether ``device``'s table has any entry of this layout, scheme and N / K / E (any block
    and rows): callers skip a per-call lookup that cannot find one."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (layout, str(scheme), n, k, e)
    return any(p[:5] == key for p in table(_device_name(index)))
