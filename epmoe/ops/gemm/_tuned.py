"""Measured choices, kept as data: one JSON file per GPU model in ``tuned/`` beside this module
(``tuned/nvidia_h200.json``), written on that GPU by ``scripts/tune_gemm.py``: the tile configs
of our Triton grouped GEMMs and which backend wins each GEMM problem ("entries"), and which path
and alignment wins each call size of a one-rank layer ("paths").

A file holds ``{"device": name, "triton": version, "torch": version, "date": ..., "commit": ...,
"entries": [...], "paths": [...]}``. Each entry is one GEMM problem class and its winner::

    {"layout": "contiguous" | "masked" | "gate", "scheme": "fp8", "N": 1536, "K": 2048, "E": 128,
     "block": 16,   # contiguous: the row block (permute alignment); masked: BLOCK_M
     "m": 256,      # rows (contiguous M_sum; masked expected_m) the entry was tuned at
     "config": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
                "num_warps": 4, "num_stages": 4},
     "backend": "triton" | "deep_gemm",   # which measured faster ("triton" where deep_gemm
     "us": {"triton": 41.0, "deep_gemm": 44.5},   # cannot run the problem)
     "tried": "3f9c0a1b2d"}   # the tuner's digest of the candidates it timed (not read here)

"gate" entries (GEMM1 and the gate as one kernel, N = h's channels; "backend" "triton" or
"unfused") also hold the layer's ``"gate"`` (its canonical spec, :attr:`epmoe.gate.Gate.spec`)
and ``"bias"`` (whether it has gate/up biases): a clamped SwiGLU with biases is another problem
than a plain SiLU of the same sizes. Missing: "silu", false. "masked_gate" entries are the same on
the masked layout (block: BLOCK_M, m: expected_m, as "masked" entries).

"gather" entries (the HT path's permute and GEMM1 as the layer runs them, N = GEMM1's width, K
= H; "config" {}; gate and bias as "gate" entries) say whether GEMM1 reading its rows of x
through permute's src_rows, permute copying none ("gather"), beat permute's copy then GEMM1
("copy"); only measured where GEMM1 runs on our Triton kernels.

"gemv_up" / "gemv_down" entries hold the launch config of :mod:`epmoe.ops.gemv`'s kernels
(``{"block_n": 16, "block_k": 512, "num_warps": 4}``, block_k the reduction step as launched;
backend "triton") for weights of E experts with N rows of K channels (gemv_up: N = I, h's
channels, K = w1's padded H, with the gate spec and biases as "gate" entries; gemv_down: N =
w2's padded H, K = I), block = top-K and m = the tokens per call it was tuned at: the m = 1
entry serves one-token calls, the entry of the most tokens every other call
(:func:`epmoe.ops.gemv.launch_config`; no entry: its CONFIG).

:func:`lookup` returns the config of the entry with the smallest ``m`` >= the call's rows (else
the largest): a function of static sizes only, so captured graphs stay valid. No file, or no entry
for the problem: the caller autotunes over its candidate configs instead.

Each path is one call size of a one-rank ``mode="auto"`` layer and what measured fastest there
(CUDA-graph replay of the whole layer; up to the layer's GEMV cutoff the GEMVs against LL)::

    {"scheme": "fp8", "E": 128, "H": 2048, "I": 768, "K": 8,   # the layer's sizes (top-K: K)
     "gate": "silu", "bias": false,  # its gate spec and biases (missing: "silu", false)
     "t": 32,                       # tokens per call
     "path": "gemv" | "ll" | "ht",  # GEMVs, masked layout, or contiguous at this alignment
     "alignment": 16,               # (ht only; else 0)
     "us": {"ll": 90.1, "ht@128": 120.3, "ht@16": 84.0}}

:func:`path` returns the entry with the smallest ``t`` >= the call's tokens (else the largest).
"""

import functools
import json
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

DIR = Path(__file__).resolve().with_name("tuned")
# ("gate" / "masked_gate": GEMM1 and the gate in one kernel on the contiguous / masked layout;
# "gather": GEMM1 reading its rows through src_rows;
# "gemv_up" / "gemv_down": the per-choice GEMV kernels' launch configs)
LAYOUTS = ("contiguous", "masked", "gate", "gather", "masked_gate", "gemv_up", "gemv_down")
# (entries that hold the layer's gate spec and biases)
_LAYER_KEYED = ("gate", "gather", "masked_gate", "gemv_up")


def file_name(device_name: str) -> str:
    """``tuned/`` file name of a GPU model: "NVIDIA H200" -> "nvidia_h200.json"."""
    return "".join(c if c.isalnum() else "_" for c in device_name.strip().lower()) + ".json"


def _key(layout, scheme, n, k, e, block, gate="silu", bias=False) -> Tuple:
    base = (layout, str(scheme), n, k, e, block)
    return base + (str(gate), bool(bias)) if layout in _LAYER_KEYED else base


def problem(entry: Dict) -> Tuple:
    """The problem class an entry belongs to, without its rows ("gate" and "gather" entries: with
    the gate spec and whether it has biases)."""
    return _key(entry["layout"], entry["scheme"], entry["N"], entry["K"], entry["E"],
                entry["block"], entry.get("gate", "silu"), entry.get("bias", False))  # fmt: skip


def _read(device_name: str) -> Dict:
    """The table file of GPU model ``device_name`` ({} without one)."""
    path = DIR / file_name(device_name)
    return json.loads(path.read_text()) if path.is_file() else {}


@functools.cache
def table(device_name: str) -> Dict[Tuple, List[Dict]]:
    """The tuned entries of GPU model ``device_name`` by problem class, each list sorted by
    ``m`` (empty without a file)."""
    by_problem: Dict[Tuple, List[Dict]] = {}
    for e in _read(device_name).get("entries", []):
        by_problem.setdefault(problem(e), []).append(e)
    return {k: sorted(v, key=lambda e: e["m"]) for k, v in by_problem.items()}


# the caches of answers drawn from the tables (ops' backend, fusion and launch choices): cleared
# with the tables by reread()
_READERS: List = []


def reader(cached):
    """Registers ``cached`` (a function with ``cache_clear``) as a reader of the tables."""
    _READERS.append(cached)
    return cached


def reread() -> None:
    """Drops the tables read so far and every answer drawn from them (a table rewritten, or DIR
    pointed elsewhere)."""
    for cached in (table, _paths, *_READERS):
        cached.cache_clear()
    _NOTED.clear()


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _gpu(device) -> Optional[str]:
    """The GPU model of ``device``, None when it is not a CUDA device (or, tracing fake CUDA
    tensors, there is no GPU)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


def entry(layout, scheme, n, k, e, block, m, device, gate="silu", bias=False) -> Optional[Dict]:
    """The entry for ``m`` rows of a problem on ``device`` (a CUDA device), or None (``gate``,
    ``bias``: the "gate" / "gather" layouts' gate spec and whether the layer has biases)."""
    gpu = _gpu(device)
    if gpu is None:
        return None
    entries = table(gpu).get(_key(layout, scheme, n, k, e, block, gate, bias))
    if not entries:
        return None
    return next((x for x in entries if x["m"] >= m), entries[-1])


def holds(layout: str, device) -> bool:
    """Whether ``device``'s table has any entry of ``layout`` (a test before a lookup's key)."""
    gpu = _gpu(device)
    return gpu is not None and any(key[0] == layout for key in table(gpu))


def lookup(layout, scheme, n, k, e, block, m, device, gate="silu", bias=False) -> Optional[Dict]:
    """The tuned Triton config (meta-parameters and num_warps / num_stages) or None."""
    x = entry(layout, scheme, n, k, e, block, m, device, gate, bias)
    return None if x is None else dict(x["config"])


def backend(layout, scheme, n, k, e, block, m, device, gate="silu", bias=False) -> Optional[str]:
    """The backend the table measured fastest ("triton", "deep_gemm", ...; "gate": "triton" or
    "unfused"; "gather": "gather" or "copy"); None: no entry."""
    x = entry(layout, scheme, n, k, e, block, m, device, gate, bias)
    return None if x is None else x["backend"]


@functools.cache
def _paths(device_name: str) -> Dict[Tuple, List[Dict]]:
    by_layer: Dict[Tuple, List[Dict]] = {}
    for p in _read(device_name).get("paths", []):
        by_layer.setdefault(layer_key(p), []).append(p)
    return {k: sorted(v, key=lambda p: p["t"]) for k, v in by_layer.items()}


def layer_key(p: Dict) -> Tuple:
    """The layer a path entry belongs to: sizes, gate spec, biases."""
    return (str(p["scheme"]), p["E"], p["H"], p["I"], p["K"], str(p.get("gate", "silu")),
            bool(p.get("bias", False)))  # fmt: skip


def paths(scheme, E: int, H: int, I: int, K: int, device, gate="silu",  # noqa: E741
          bias: bool = False) -> List[Dict]:  # fmt: skip
    """The path entries of a one-rank layer of these sizes, gate spec and biases on ``device``,
    by ``t`` ([] without)."""
    gpu = _gpu(device)
    if gpu is None:
        return []
    key = layer_key(dict(scheme=scheme, E=E, H=H, I=I, K=K, gate=gate, bias=bias))
    return _paths(gpu).get(key, [])


def has(layout, scheme, n: int, k: int, e: int, device, gate="silu", bias=False) -> bool:
    """Whether ``device``'s table has any entry of this layout, scheme and N / K / E (any block
    and rows; "gate" / "gather": of this gate spec and biases): callers skip a lookup that cannot
    find one."""
    gpu = _gpu(device)
    if gpu is None:
        return False
    key = _key(layout, scheme, n, k, e, 0, gate, bias)
    return any(p[:5] == key[:5] and p[6:] == key[6:] for p in table(gpu))


class UntunedWarning(UserWarning):
    """A layer's GEMMs have no entries in this GPU's tuned table (:func:`note_untuned`): filter it
    by this class (``warnings.filterwarnings("ignore", category=epmoe.UntunedWarning)``)."""


# (GPU model, layer, missing layouts) note_untuned has said: one warning each
_NOTED: set = set()


def note_untuned(layer: str, problems, device, hint: str, paths_missing: bool = False) -> None:
    """Warns once per GPU model, ``layer`` (its sizes, in words) and what is missing where
    ``device``'s table has no entry (any block and rows) for some of ``problems`` ((layout, scheme,
    n, k, e, gate, bias) each) or, ``paths_missing``, no path entries: those calls run untuned
    (deep_gemm where it runs, else Triton's autotuner; the GEMVs their default tiles; the rules'
    path). ``hint``: the command that tunes them."""
    gpu = _gpu(device)
    if gpu is None:
        return
    missing = list(dict.fromkeys(p[0] for p in problems if not has(*p[:5], device, *p[5:])))
    missing += ["path"] if paths_missing else []
    if missing and (gpu, layer, tuple(missing)) not in _NOTED:
        _NOTED.add((gpu, layer, tuple(missing)))
        warnings.warn(
            f"epmoe: {gpu}'s tuned table (epmoe/ops/gemm/tuned/{file_name(gpu)}) has no "
            f"{', '.join(missing)} entries for {layer}: those calls run untuned defaults, which "
            f"can be much slower than tuned ones. Tune them on this GPU: {hint}",
            UntunedWarning,
            stacklevel=3,
        )
