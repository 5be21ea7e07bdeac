"""Tune the grouped GEMMs on this GPU model: writes (merges into) the tuned table
``epmoe/ops/gemm/tuned/<gpu>.json`` that :mod:`epmoe.ops.gemm._tuned` reads (its docstring has the
format). Run it once per GPU model and again after a Triton upgrade; commit the written file.

    PYTHONPATH=. python scripts/tune_gemm.py [--shapes qwen3-30b-a3b,W] [--schemes bf16,fp8,int8]
        [--layer H I E K [--gate SPEC] [--bias]]
        [--row-blocks 16,32,64,128] [--tokens 8,32,128,512,2048,4096,16384]
        [--layouts contiguous,masked] [--paths | --paths-only] [--resume | --stale] [--list]
        [--budget-s 3000] [--iters 30] [--out PATH] [--dry-run]

GEMM entries: per shape (``benchmarks/_configs.py``, its ``local_experts``: E; or ``--layer``: a
model of one's own, its hidden and intermediate sizes, experts on the GPU and top-K, with the
experts' gate spec and biases; without ``--shapes``, that layer only), scheme and GEMM of
the layer (GEMM1: N = the gate's width of I, K = H; GEMM2: N = H, K = I; fp8 at the sizes the layer
pads to, multiples of 128), on random operands in the layer's layouts (fp8 activation scales in
deep_gemm's MN-major layout) and a seeded uniform top-K routing of T tokens:

- contiguous, per row block (the permute alignment) and T: M = ``permuted_rows(T, K, E, block)``
  rows with the m_indices (and expert offsets) the reference permute builds from that routing;
- masked (T up to LL_MAX_TOKENS, the LL sizes): slots of C = T rounded up to 128 rows, the routing's
  counts, expected_m = ceil(T*K/E); entry block = the kernel's BLOCK_M at (C, expected_m); without
  --tokens, also one T of each BLOCK_M the default sizes miss (:func:`every_tile`);
- gate, as contiguous: GEMM1 and the config's gate (and biases) as one kernel
  (``grouped_gemm_gate``; int8: its bf16 h, then the quantize stage on h's rows) against
  "unfused", GEMM1 on the backend the layer picks then the activation stage; N = I (h's
  channels). The layer fuses where "triton" won. The pair's GEMM1 is timed alone too
  ("unfused:gemm1", in the log only: what the activation stage adds).
- masked_gate (``--layouts masked_gate``, after the others, reading their entries as the layer
  does), as masked GEMM1: the same on the masked layout (``grouped_gemm_masked_gate``) against
  masked GEMM1 on the table's backend then the activation stage.
- gather (``--layouts gather``, after the others, reading their entries as the layer does), per
  row block and T where GEMM1 runs on our Triton kernels: the HT path's permute and GEMM1 (fused
  with the gate where the table says so) on x of T tokens: "copy" (permute copies the rows) against
  "gather" (permute makes the index outputs only, GEMM1 reads x's rows through src_rows); N = w1's
  rows, K = H. The layer gathers where "gather" won.
- gemv_up / gemv_down: the per-choice GEMV kernels (``epmoe.ops.gemv``) at one token and at
  several (GEMV_TOKENS, at most the layer's GEMV cutoff), every launch config of its candidates
  that fits (``gemv.fits``) pinned by ``gemv.override``, timed on GEMV_ROUTINGS routings (the
  sum; several tokens: of m tokens and of the cutoff's, the most the entry serves), the output
  checked against that of the module's default config (CHECK_TOL, relative L2); the entry keeps
  the default unless beaten by more than GEMV_MARGIN. N / K as GEMM1 + gate's (N = I) and
  GEMM2's, block = top-K, m = the tokens.

Every candidate Triton config that fits the problem (``_triton.fits``) is launched explicitly, and
every other backend that runs it (``_select._runs``: deep_gemm; torch._grouped_mm for contiguous
bf16) on the same operands. The entry keeps the fastest Triton config, the fastest backend and the
best µs of each; a config that fails to compile or to launch is skipped (its error in the log),
and so is one whose output is wrong: after its timing each contiguous / masked candidate runs once
more into a NaN-filled buffer, and a sample of live rows (CHECK_ROWS of each of CHECK_EXPERTS
experts) must match dequantized float32 math within CHECK_TOL (relative L2); bf16 GEMM1 + gate
candidates without bias likewise, their h against the gate of GEMM1's bf16-rounded rows.

Path entries (``--paths``): per shape and scheme, each T of ``--tokens``: the whole one-rank
layer (local backend, same weights, the same routing for every variant, ``warmup([T])`` first) as
mode "ll" (max_tokens_per_rank = T; T up to LL_MAX_TOKENS) and, up to the shape's GEMV cutoff
(``epmoe.layer.gemv_max_tokens``), as "auto" on the GEMVs, above it as mode "ht" at each alignment
of PATH_ALIGNMENTS (above LL_MAX_TOKENS: HT_ALIGNMENTS, the entry then picks HT's alignment only;
up to the cutoff each variant on GEMV_ROUTINGS routings, its time the sum),
reading the GEMM entries of this run (and of the file) as the layer does; the fastest becomes the
path entry (over the rule's path, the GEMVs up to the cutoff and else LL, only by more than
PATH_MARGIN).

Timing: ``benchmarks/_timing.time_cuda``, the project's timer: one call captured in a CUDA graph,
replayed ``--iters`` times, each replay after an L2 flush and between two CUDA events; the median.
Its flush reads a 512 MiB buffer: a write flush would leave dirty lines whose write-back lands in
the timed call (~10 us, more than a decode-sized GEMM takes).

The file is rewritten after each shape x scheme (a run cut by its timeout keeps what it measured);
entries and paths of the same key (problem + m, layer + t) are replaced, the rest kept, all sorted.
``--budget-s`` stops the run cleanly between measurements; ``--resume`` skips the problems and path
sizes the file already has (a long tuning in several sessions). Each GEMM entry records ``"tried"``,
a digest of the candidate configs it timed (:func:`tried`); ``--stale`` tunes only the problems
without an entry or whose entry timed another candidate list than today's (entries from before the
digest count as stale), and the path sizes the file lacks: a refresh after candidates are added, in
as many budgeted runs as it takes (then ``--paths-only``). ``--list`` prints the problems a run
would tune (after ``--resume`` / ``--stale``) and tunes nothing, no GPU needed (the table:
``--out``, else this GPU's). Each GEMM problem logs every measurement that ran, fastest first, then
its entry; a summary table goes to stdout; ``--dry-run`` prints the merged file instead of writing
it.
"""

import argparse
import contextlib
import datetime
import functools
import hashlib
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Collection, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch
import triton

REPO = Path(__file__).resolve().parents[1]
for _p in (str(REPO), str(REPO / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _configs  # noqa: E402
import _timing  # noqa: E402

import epmoe  # noqa: E402
from epmoe import gate as _gate  # noqa: E402
from epmoe import quant, reference  # noqa: E402
from epmoe.layer import AUTO_LL_MAX_TOKENS, gemv_max_tokens  # noqa: E402
from epmoe.ops import activation, gemm, gemv  # noqa: E402
from epmoe.ops.gemm import _ops, _select, _triton, _tuned  # noqa: E402
from epmoe.ops.gemm._deepgemm import _deep_gemm_contiguous, _deep_gemm_masked  # noqa: E402

SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b", "W", "gpt-oss-20b")
SCHEMES = ("bf16", "fp8", "int8")
ROW_BLOCKS = (16, 32, 64, 128)
TOKENS = (8, 32, 128, 512, 2048, 4096, 16384)
LL_MAX_TOKENS = AUTO_LL_MAX_TOKENS  # the largest call "auto" sends to LL: masked and path T
MASKED_SLOT = 128  # the one-rank LL slot rows are a multiple of (deep_gemm's sm90 masked block)
# GEMV entries' calls: one token, and several (the entry of the most tokens serves 2 and up to the
# layer's GEMV cutoff): four, or the cutoff where that is less (Mixtral's top-2 of 8: two), timed
# at the cutoff too (Qwen3's eight)
GEMV_TOKENS = (1, 4)
# routings a GEMV candidate is timed on (its time: the sum): which experts a call's choices share
# moves a config's time by more than configs differ
GEMV_ROUTINGS = 3
# a GEMV entry keeps the module's default config unless a candidate beats it by more: a routing
# the tuner did not time can rank configs otherwise (with the layer's launch timed, the layer's
# 7-routing medians agreed down to 3%: docs/kernels.md, the H100 results)
GEMV_MARGIN = 0.03
PATH_ALIGNMENTS = (128, 64, 32, 16)
# above the LL sizes: blocks of 16-32 rows force tiles of as many rows, 2-4x slower there
HT_ALIGNMENTS = (128, 64)
# HT replaces LL (the path without a table) only when faster by more: whole-layer timings move
# 3-5% between runs, so a smaller win is noise
PATH_MARGIN = 0.03
# (masked: no torch.bmm: it computes every slot row, so its time follows the layer's capacity,
# which the entry's key (the counts) does not hold)
OTHER_BACKENDS = {"contiguous": ("deep_gemm", "grouped_mm"), "masked": ("deep_gemm",),
                  "gate": ("unfused",)}  # fmt: skip
# gate / masked_gate problems: the unfused pair's GEMM1 timed alone too, a log line that says how
# much of the pair the activation stage takes (no entry's backend: the pair is the layer's)
UNFUSED_GEMM1 = "unfused:gemm1"
ITERS = 30  # replays per measurement (median)
SEED = 0
# each candidate's output, checked on a sample of live rows against dequantized float32 math (the
# tests' GEMM_VS_QUANT_AWARE): a fast config that computes something else never wins
CHECK_TOL, CHECK_EXPERTS, CHECK_ROWS = 1e-2, 8, 4
W_STD = 0.02  # path layers' bf16 weights: O(1) outputs, as the benchmarks build them
_FATAL = ("illegal memory access", "device-side assert", "unspecified launch failure",
          "illegal instruction", "misaligned address")  # fmt: skip


class Problem(NamedTuple):
    """One GEMM problem to tune: the entry's key (the first seven fields) and how to build it."""

    layout: str  # "contiguous" | "masked" | "gate" | "gather" | "masked_gate" | "gemv_*"
    scheme: str
    N: int
    K: int
    E: int
    block: int  # contiguous: the row block; masked: the kernel's BLOCK_M; GEMVs: top-K
    m: int  # contiguous: M_sum; masked: expected_m; GEMVs: tokens
    tokens: int  # T of the routing
    rows: int  # rows of a: contiguous M_sum, masked the slot capacity C
    top_k: int
    # "gate" / "gather" / "masked_gate" / GEMV problems: the layer's gate and whether it has biases
    gate: str = "silu"
    bias: bool = False


class Measured(NamedTuple):
    """One backend (and Triton config) timed on a problem."""

    backend: str
    config: Optional[Dict]  # Triton's meta-parameters and num_warps / num_stages; None otherwise
    us: Optional[float]  # None: it did not run (``error`` says why)
    error: str = ""


class OutOfTime(Exception):
    """The run's --budget-s is spent."""


class Fatal(Exception):
    """The CUDA context is gone: nothing later can run."""


class WrongOutput(Exception):
    """A config or backend ran but its output is not the GEMM's (:func:`output_check`)."""


# ------------------------------------------------------------------------------------ the problems
def gemm_sizes(cfg, scheme) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """((N, K) of GEMM1, (N, K) of GEMM2) of a one-rank layer of ``cfg`` in ``scheme``, at the sizes
    the layer runs (fp8: H and I padded to multiples of 128)."""
    of = quant.get(scheme).size_multiple
    H, I = reference.round_up(cfg.hidden, of), reference.round_up(cfg.intermediate, of)  # noqa: E741
    return (_gate.get(cfg.gate).width(I), H), (H, I)


def contiguous_problems(cfg, scheme: str, row_blocks: Iterable[int],
                        tokens: Iterable[int]) -> Iterator[Problem]:  # fmt: skip
    """The contiguous problems of both GEMMs: per row block rb and T, M = permuted_rows(T, K, E,
    rb)."""
    E, K, seen = cfg.local_experts, cfg.top_k, set()
    for n, k in gemm_sizes(cfg, scheme):
        for rb in row_blocks:
            for t in tokens:
                m = reference.permuted_rows(t, K, E, rb)
                p = Problem("contiguous", scheme, n, k, E, rb, m, t, m, K)
                if p[:7] not in seen:
                    seen.add(p[:7])
                    yield p


def _masked_tile(layout: str, scheme: str, t: int, K: int, E: int) -> Tuple[int, int, int]:
    """(C, expected_m, BLOCK_M) of a one-rank LL call of ``t`` tokens on ``layout``'s kernel."""
    c, em = reference.round_up(t, MASKED_SLOT), max(1, -(-t * K // E))
    if layout == "masked_gate":
        return c, em, _triton.masked_gate_tiling(c, em, quant.get(scheme).kernel_code)[0]
    return c, em, _triton._masked_tiling(c, em)[0]


def every_tile(cfg, scheme: str, tokens: Iterable[int], layout: str = "masked",
               max_tokens: int = LL_MAX_TOKENS) -> List[int]:  # fmt: skip
    """``tokens`` and, for each row tile (BLOCK_M) of ``layout`` that a call of at most
    ``max_tokens`` tokens gets but none of them does, the most tokens that get it: the table keys
    its entries by the tile, and a tile without one runs the untuned default (deep_gemm, else
    Triton's autotuner)."""
    E, K = cfg.local_experts, cfg.top_k
    tokens = list(tokens)
    have = {_masked_tile(layout, scheme, t, K, E)[2] for t in tokens if t <= max_tokens}
    most: Dict[int, int] = {}
    for t in range(1, max_tokens + 1):
        most[_masked_tile(layout, scheme, t, K, E)[2]] = t
    return tokens + sorted(t for block, t in most.items() if block not in have)


def masked_problems(cfg, scheme: str, tokens: Iterable[int],
                    max_tokens: int = LL_MAX_TOKENS) -> Iterator[Problem]:  # fmt: skip
    """The masked problems of both GEMMs for each T <= ``max_tokens``: slots of C = T rounded up to
    MASKED_SLOT rows, expected_m = ceil(T*K/E), block = the kernel's BLOCK_M there."""
    E, K, seen = cfg.local_experts, cfg.top_k, set()
    for n, k in gemm_sizes(cfg, scheme):
        for t in tokens:
            if t > max_tokens:
                continue
            c, em, block_m = _masked_tile("masked", scheme, t, K, E)
            p = Problem("masked", scheme, n, k, E, block_m, em, t, c, K)
            if p[:7] not in seen:
                seen.add(p[:7])
                yield p


def masked_gate_problems(cfg, scheme: str, tokens: Iterable[int],
                         max_tokens: int = LL_MAX_TOKENS) -> Iterator[Problem]:  # fmt: skip
    """Masked GEMM1 and the gate as one kernel, per T as GEMM1's masked problems: N = I (h's
    channels), K = H, the config's gate and biases."""
    (width, k), _ = gemm_sizes(cfg, scheme)
    spec = _gate.get(cfg.gate).spec
    n, E, K, seen = _gate.get(spec).inter(width), cfg.local_experts, cfg.top_k, set()
    for t in tokens:
        if t > max_tokens:
            continue
        c, em, block_m = _masked_tile("masked_gate", scheme, t, K, E)
        p = Problem("masked_gate", scheme, n, k, E, block_m, em, t, c, K, spec, bool(cfg.bias))
        if p[:7] not in seen:
            seen.add(p[:7])
            yield p


def gemv_problems(cfg, scheme: str, layouts: Collection[str]) -> Iterator[Problem]:
    """The GEMV kernels' problems of ``layouts`` at each of GEMV_TOKENS up to the layer's GEMV
    cutoff: "gemv_up" (N = I, h's channels, K = H, the config's gate and biases), "gemv_down" (N =
    H, K = I), at the sizes the layer pads to, block = top-K; ``tokens``: the most the entry
    serves (one; several: the cutoff)."""
    (width, h), (n2, i) = gemm_sizes(cfg, scheme)
    spec = _gate.get(cfg.gate).spec
    E, K, bias = cfg.local_experts, cfg.top_k, bool(cfg.bias)
    cutoff = gemv_cutoff(cfg, scheme)
    for t in sorted({min(t, cutoff) for t in GEMV_TOKENS if cutoff}):
        most = 1 if t == 1 else cutoff
        if "gemv_up" in layouts:
            yield Problem("gemv_up", scheme, _gate.get(spec).inter(width), h, E, K, t, most, t,
                          K, spec, bias)  # fmt: skip
        if "gemv_down" in layouts:
            yield Problem("gemv_down", scheme, n2, i, E, K, t, most, t, K, bias=bias)


def gate_problems(cfg, scheme: str, row_blocks: Iterable[int],
                  tokens: Iterable[int]) -> Iterator[Problem]:  # fmt: skip
    """GEMM1 and the gate as one kernel (int8: then the quantize stage on h's rows), per row
    block and T as the contiguous problems: N = I (h's channels), K = H, the config's gate and
    biases."""
    return _gemm1_problems("gate", cfg, scheme, row_blocks, tokens)


def gather_problems(cfg, scheme: str, row_blocks: Iterable[int],
                    tokens: Iterable[int]) -> Iterator[Problem]:  # fmt: skip
    """The HT path's permute and GEMM1, copying or gathering the rows, per row block and T as the
    contiguous problems: N = w1's rows (the gate's width), K = H, the config's gate and biases."""
    return _gemm1_problems("gather", cfg, scheme, row_blocks, tokens)


def _gemm1_problems(layout: str, cfg, scheme: str, row_blocks: Iterable[int],
                    tokens: Iterable[int]) -> Iterator[Problem]:  # fmt: skip
    """GEMM1's problems of a layer-keyed ``layout`` ("gate": N = h's channels; "gather": N = w1's
    rows), per row block and T, with the config's gate spec and biases."""
    (width, k), _ = gemm_sizes(cfg, scheme)
    spec = _gate.get(cfg.gate).spec
    n = _gate.get(spec).inter(width) if layout == "gate" else width
    E, K, seen = cfg.local_experts, cfg.top_k, set()
    for rb in row_blocks:
        for t in tokens:
            m = reference.permuted_rows(t, K, E, rb)
            p = Problem(layout, scheme, n, k, E, rb, m, t, m, K, spec, bool(cfg.bias))
            if p[:7] not in seen:
                seen.add(p[:7])
                yield p


def config_dict(config: "triton.Config") -> Dict:
    """A candidate as the table stores it: meta-parameters, num_warps, num_stages."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def candidates(layout: str, scheme: str, block: int) -> List[Dict]:
    """The candidate Triton configs that run ``scheme`` on this layout (contiguous: expert blocks
    of ``block`` rows; masked: BLOCK_M = ``block``)."""
    code = quant.get(scheme).kernel_code
    return [config_dict(c) for c in _triton.candidates(layout, code, block)]


# ------------------------------------------------------------------------------- choices and files
def winner(measured: Iterable[Measured], runnable: Optional[Collection[str]] = None):
    """(fastest backend, fastest Triton config, {backend: its best µs}) over the measurements that
    ran, of backends in ``runnable`` (None: any); None without a Triton measurement (an entry
    carries Triton's config). A tie goes to the backend whose name sorts first (deterministic)."""
    ok = [x for x in measured if x.us is not None and math.isfinite(x.us) and x.us > 0]
    ok = [x for x in ok if runnable is None or x.backend in runnable]
    ours = [x for x in ok if x.backend == "triton"]
    if not ours:
        return None
    best: Dict[str, float] = {}
    for x in ok:
        best[x.backend] = min(best.get(x.backend, math.inf), x.us)
    backend = min(sorted(best), key=lambda b: best[b])
    config = min(ours, key=lambda x: x.us).config
    return backend, dict(config), {b: round(best[b], 2) for b in sorted(best)}


def gemv_choice(measured: Iterable[Measured]):
    """(backend "triton", config, {"triton": best µs, "default": the default's}) of a GEMV
    problem from its candidates' measurements ("triton") and the module default's ("default"):
    the fastest candidate, or the default unless that beats it by more than GEMV_MARGIN; None
    when no candidate ran."""
    measured = list(measured)
    best = winner(measured)
    if best is None:
        return None
    _, config, us = best
    default = [x for x in measured if x.backend == "default" and x.us is not None]
    if default and us["triton"] > us["default"] * (1 - GEMV_MARGIN):
        config = dict(default[0].config)
    return "triton", config, us


def ranking(measured: Iterable[Measured]) -> List[str]:
    """One log line per measurement that ran, fastest first: µs, backend and (Triton) the config
    (the entry keeps only the winners; the log keeps what they beat)."""
    ok = (x for x in measured if x.us is not None and math.isfinite(x.us))
    ran = sorted(ok, key=lambda x: (x.us, x.backend))
    return [f"  {x.us:9.2f} {x.backend} {json.dumps(x.config) if x.config else ''}".rstrip()
            for x in ran]  # fmt: skip


def gemv_candidates(p: Problem) -> List[Tuple[int, ...]]:
    """The GEMV launch configs that fit ``p`` (a gemv_up / gemv_down problem), as timed."""
    kernel = "up" if p.layout == "gemv_up" else "down"
    return [c for c in (gemv.UP_CANDIDATES if kernel == "up" else gemv.DOWN_CANDIDATES)
            if gemv.fits(kernel, p.scheme, c, p.K, p.top_k)]  # fmt: skip


def tried(p: Problem) -> str:
    """A digest of the candidate configs the tuner times on ``p`` (its entry's ``"tried"``; ""
    for "gather", which has none): a candidate added or removed changes it."""
    if p.layout == "gather":
        return ""
    configs = gemv_candidates(p) if p.layout.startswith("gemv") else \
        candidates(p.layout, p.scheme, p.block)  # fmt: skip
    return hashlib.sha1(json.dumps(configs, sort_keys=True).encode()).hexdigest()[:10]


def gemm_entry(p: Problem, backend: str, config: Dict, us: Dict[str, float]) -> Dict:
    """The table entry of problem ``p`` (``_tuned`` module docstring; "tried": :func:`tried`)."""
    layer = dict(gate=p.gate, bias=p.bias) if p.layout in _tuned._LAYER_KEYED else {}
    digest = tried(p)
    return dict(layout=p.layout, scheme=p.scheme, N=p.N, K=p.K, E=p.E, block=p.block, m=p.m,
                **layer, config=config, backend=backend, us=us,
                **(dict(tried=digest) if digest else {}))  # fmt: skip


def gemv_cutoff(cfg, scheme: str) -> int:
    """The most tokens the one-rank "auto" layer of ``cfg`` sends to the GEMVs by its rule."""
    return gemv_max_tokens(quant.get(scheme), cfg.local_experts, cfg.top_k)


def path_variants(t: int, gemv: int = 0) -> List[Tuple[str, int]]:
    """(path, alignment) of each layer variant timed at T = ``t``: up to the GEMV cutoff ``gemv``
    the GEMVs and LL; above it LL (up to LL_MAX_TOKENS, above it "auto" takes HT) and HT at each
    alignment."""
    if t <= gemv:
        return [("gemv", 0), ("ll", 0)]
    if t > LL_MAX_TOKENS:
        return [("ht", a) for a in HT_ALIGNMENTS]
    return [("ll", 0)] + [("ht", a) for a in PATH_ALIGNMENTS]


def variant_name(path: str, alignment: int) -> str:
    """Key of a path variant in a path entry's "us": "gemv", "ll" or "ht@<alignment>"."""
    return f"ht@{alignment}" if path == "ht" else path


def path_entry(cfg, scheme: str, t: int, us: Dict[str, Optional[float]]) -> Optional[Dict]:
    """The path entry of T = ``t`` from the µs of each variant ("gemv", "ll", "ht@128", ...; None:
    did not run): the fastest, but the rule's path ("gemv" where timed, else "ll") unless beaten
    by more than PATH_MARGIN; None when none ran."""
    ran = {v: u for v, u in us.items() if u is not None and math.isfinite(u) and u > 0}
    if not ran:
        return None
    best = min(sorted(ran), key=lambda v: ran[v])
    rule = "gemv" if "gemv" in us else "ll"
    if rule in ran and ran[best] > ran[rule] * (1 - PATH_MARGIN):
        best = rule
    path, alignment = (best, 0) if best in ("gemv", "ll") else ("ht", int(best.split("@")[1]))
    return dict(layer_sizes(cfg, scheme), t=t, path=path, alignment=alignment,
                us={v: round(u, 2) for v, u in ran.items()})  # fmt: skip


def layer_sizes(cfg, scheme: str) -> Dict:
    """The layer fields of a path entry: the sizes the layer is built with (H, I unpadded), its
    gate spec and whether it has biases."""
    return dict(scheme=scheme, E=cfg.local_experts, H=cfg.hidden, I=cfg.intermediate, K=cfg.top_k,
                gate=_gate.get(cfg.gate).spec, bias=bool(cfg.bias))  # fmt: skip


def entry_key(e: Dict) -> Tuple:
    return _tuned.problem(e) + (e["m"],)


def path_key(p: Dict) -> Tuple:
    return _tuned.layer_key(p) + (p["t"],)


def pending(old: Optional[Dict], problems: Iterable[Problem] = (), cfg=None, scheme: str = "",
            tokens: Iterable[int] = ()):  # fmt: skip
    """--resume: (the ``problems`` without an entry in ``old``, the path ``tokens`` of ``cfg`` x
    ``scheme`` without a path entry there)."""
    entries = {entry_key(e) for e in (old or {}).get("entries", [])}
    paths = {path_key(p) for p in (old or {}).get("paths", [])}
    todo = [p for p in problems if entry_key(gemm_entry(p, "", {}, {})) not in entries]
    if cfg is None:
        return todo, list(tokens)
    sizes = layer_sizes(cfg, scheme)
    return todo, [t for t in tokens if path_key(dict(sizes, t=t)) not in paths]


def stale(old: Optional[Dict], problems: Iterable[Problem]) -> List[Problem]:
    """--stale: the ``problems`` without an entry in ``old``, or whose entry timed another
    candidate list (its "tried" digest, missing on entries from before it, differs from today's)."""
    have = {entry_key(e): e.get("tried", "") for e in (old or {}).get("entries", [])}
    today = ((p, gemm_entry(p, "", {}, {})) for p in problems)
    return [p for p, e in today if have.get(entry_key(e)) != e.get("tried", "")]


def merge(old: Optional[Dict], entries: Iterable[Dict], paths: Iterable[Dict],
          header: Dict) -> Dict:  # fmt: skip
    """``old`` (a table's document, or None) with ``entries`` / ``paths`` replacing those of the
    same key (problem + m; layer + t), the rest kept, both sorted by key; ``header``'s fields
    (device, versions, date, commit) over old's."""
    old = old or {}
    by_key = {entry_key(e): e for e in old.get("entries", [])}
    by_key.update((entry_key(e), e) for e in entries)
    by_layer = {path_key(p): p for p in old.get("paths", [])}
    by_layer.update((path_key(p), p) for p in paths)
    rest = {k: v for k, v in old.items() if k not in header and k not in ("entries", "paths")}
    return {**header, **rest, "entries": [by_key[k] for k in sorted(by_key)],
            "paths": [by_layer[k] for k in sorted(by_layer)]}  # fmt: skip


def dumps(doc: Dict) -> str:
    """The document as JSON text with one entry / path per line (diffs show the problems that
    changed)."""
    parts = []
    for key, value in doc.items():
        if isinstance(value, list) and value:
            rows = ",\n".join("    " + json.dumps(x) for x in value)
            parts.append(f"  {json.dumps(key)}: [\n{rows}\n  ]")
        else:
            parts.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write(path: Path, doc: Dict) -> None:
    """Write ``doc`` to ``path`` atomically (a reader never sees half a table)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(doc))
    os.replace(tmp, path)


@functools.cache
def commit() -> str:
    """The tree measured: .tree-rev where a device copy carries it (its .git may be stale), else
    ``git describe --always --dirty``, else "unknown"."""
    rev = REPO / ".tree-rev"
    if rev.is_file() and rev.read_text().strip():
        return rev.read_text().strip()
    try:
        res = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else "unknown"


def header(device_name: str) -> Dict:
    now = datetime.datetime.now(datetime.timezone.utc)
    return dict(device=device_name, triton=triton.__version__, torch=torch.__version__,
                date=now.strftime("%Y-%m-%d %H:%M:%S UTC"), commit=commit())  # fmt: skip


def summary(entries: List[Dict], paths: List[Dict]) -> str:
    """A short table of this run's entries and paths."""
    lines = [f"{'layout':10} {'scheme':6} {'N':>6} {'K':>6} {'E':>4} {'block':>5} {'m':>7}  "
             f"{'winner':10} µs by backend"]  # fmt: skip
    for e in entries:
        us = " ".join(f"{b}={u:g}" for b, u in e["us"].items())
        lines.append(f"{e['layout']:10} {e['scheme']:6} {e['N']:>6} {e['K']:>6} {e['E']:>4} "
                     f"{e['block']:>5} {e['m']:>7}  {e['backend']:10} {us}")  # fmt: skip
    if paths:
        lines.append(f"\n{'scheme':6} {'E':>4} {'H':>5} {'I':>6} {'K':>2} {'t':>4}  "
                     f"{'path':7} µs by variant")  # fmt: skip
    for p in paths:
        us = " ".join(f"{v}={u:g}" for v, u in p["us"].items())
        way = variant_name(p["path"], p["alignment"])
        lines.append(f"{p['scheme']:6} {p['E']:>4} {p['H']:>5} {p['I']:>6} {p['K']:>2} "
                     f"{p['t']:>4}  {way:7} {us}")  # fmt: skip
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- GPU: operands
def routing(T: int, E: int, K: int, device, seed: int = SEED) -> torch.Tensor:
    """int64 `[T, K]`: K distinct experts per token, uniformly at random (seeded per T, E, K)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + T * 1009 + E * 31 + K)
    return torch.rand((T, E), generator=g).argsort(dim=1)[:, :K].contiguous().to(device)


def _codes(shape, scheme, gen: torch.Generator, device) -> torch.Tensor:
    """Random codes of ``scheme``'s dtype (no float32 copy of the whole tensor)."""
    if scheme is quant.INT8:
        return torch.randint(-127, 128, shape, dtype=torch.int8, device=device, generator=gen)
    x = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen)
    return x if scheme is quant.BF16 else x.to(scheme.act_dtype)


def _acts(scheme, lead: Tuple[int, ...], K: int, gen, device):
    """(codes `[*lead, K]`, float32 scales in the layout the layer's CUDA GEMMs read, or None)."""
    a = _codes((*lead, K), scheme, gen, device)
    if not scheme.quantized:
        return a, None
    cols = scheme.act_scale_cols(K)
    if scheme.cuda_scale_layout == "deepgemm":
        s = _select.empty_fp8_act_scales(lead, cols, device)
    else:
        s = torch.empty((*lead, cols), dtype=torch.float32, device=device)
    return a, s.uniform_(0.5e-2, 1.5e-2, generator=gen)


def _weights(scheme, E: int, N: int, K: int, gen, device):
    w = _codes((E, N, K), scheme, gen, device)
    shape = scheme.weight_scale_shape(E, N, K)
    s = None if shape is None else torch.empty(shape, dtype=torch.float32, device=device)
    return w, None if s is None else s.uniform_(0.5e-3, 1.5e-3, generator=gen)


def _spread(n: int, k: int) -> torch.Tensor:
    """int64 `[min(n, k)]`: evenly spaced indices into n items, first and last included."""
    return torch.linspace(0, n - 1, min(n, k)).round().long()


def sample_picks(m_indices=None, counts=None) -> List[Tuple[int, object]]:
    """(expert, index) pairs naming the rows a check reads: up to CHECK_EXPERTS of the live
    experts, evenly spread, and CHECK_ROWS of each one's live rows. Contiguous (``m_indices``
    `[M]`): index = the rows (int64 `[n]`) of a `[M, K]` / out `[M, N]`; masked (``counts``
    `[E]`): index = (expert, its slot rows) of a `[E, T, K]` / out `[E, T, N]`."""
    picks = []
    if m_indices is not None:
        m = m_indices.cpu()
        live = torch.unique(m[m >= 0])
        for e in live[_spread(len(live), CHECK_EXPERTS)].tolist():
            rows = (m == e).nonzero().flatten()
            picks.append((e, rows[_spread(len(rows), CHECK_ROWS)].to(m_indices.device)))
        return picks
    c = counts.cpu()
    live = (c > 0).nonzero().flatten()
    for e in live[_spread(len(live), CHECK_EXPERTS)].tolist():
        picks.append((e, (e, _spread(int(c[e]), CHECK_ROWS).to(counts.device))))
    return picks


Check = Callable[[Callable[[], object]], Optional[str]]  # (fn) -> None, or what is wrong


def output_check(a, a_s, w, w_s, picks, out: torch.Tensor) -> Check:
    """A check of one GEMM call: ``check(fn)`` fills ``out`` (the buffer the Triton calls write)
    with NaN, calls ``fn`` once and compares the rows ``picks`` names (:func:`sample_picks`) of
    its result (``out`` when it returns none) with dequantized float32 math; a message where the
    relative L2 error passes CHECK_TOL (or a row was never written), else None."""
    want = []
    for e, idx in picks:
        af = reference._dequant_rows(a[idx], None if a_s is None else a_s[idx])
        wf = reference.dequantize_weights(w[e : e + 1], None if w_s is None else w_s[e : e + 1])
        want.append(af @ wf[0].t())
    want = torch.cat(want)

    def check(fn: Callable[[], object]) -> Optional[str]:
        out.fill_(math.nan)
        got = fn()
        got = got if isinstance(got, torch.Tensor) else out
        return _wrong(torch.cat([got[idx] for _, idx in picks]).float(), want)

    return check


def _wrong(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """What is wrong with sampled rows ``got`` against ``want``: their relative L2 error past
    CHECK_TOL (or NaN: rows never written), else None."""
    err = float((got - want).norm() / want.norm())
    if err <= CHECK_TOL:  # (False for NaN)
        return None
    return f"wrong output: rel L2 {err:.3g} on {len(got)} sampled rows (tolerance {CHECK_TOL})"


def gate_check(a, w, g, picks) -> Check:
    """:func:`output_check` of a bf16 GEMM1 + gate call, whose h (its first output) the call
    allocates: the rows ``picks`` names against the gate ``g`` of GEMM1's bf16-rounded rows in
    float32 math. A NaN block of h's size is freed just before the call, so the caching allocator
    hands it to h: rows never written stay NaN."""
    want = torch.cat([g.reference((a[idx].float() @ w[e].float().t()).to(torch.bfloat16))
                      for e, idx in picks])  # fmt: skip

    def check(fn: Callable[[], object]) -> Optional[str]:
        bait = torch.full((*a.shape[:-1], want.shape[1]), math.nan, dtype=torch.bfloat16,
                          device=a.device)  # fmt: skip
        del bait
        h = fn()[0]
        return _wrong(torch.cat([h[idx] for _, idx in picks]).float(), want)

    return check


# ------------------------------------------------------------------------------------- GPU: timing
class Tuner:
    """Times problems and layers on one CUDA device within a wall-clock deadline."""

    def __init__(self, device: torch.device, iters: int, deadline: float):
        self.device, self.iters, self.deadline = device, iters, deadline
        self.gen = torch.Generator(device=device).manual_seed(SEED)
        self.errors = 0

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise OutOfTime()

    def time_us(self, fn: Callable[[], object]) -> float:
        """Median µs of a CUDA-graph replay of ``fn()``, L2 flushed before each (module doc)."""
        t = _timing.time_cuda(fn, iters=self.iters)
        if t.method != "cuda_graph":
            raise RuntimeError("CUDA graph capture failed")
        return t.ms * 1e3

    def measure(self, backend: str, fn, config=None, check: Optional[Check] = None) -> Measured:
        """``fn`` timed (:meth:`time_us`; a list of calls: the sum of their times), then its
        output checked by ``check`` (a wrong one is skipped like a failed launch)."""
        self.check_time()
        try:
            us = sum(map(self.time_us, fn)) if isinstance(fn, list) else self.time_us(fn)
            wrong = None if check is None else check(fn)
            if wrong:
                raise WrongOutput(wrong)
            return Measured(backend, config, us)
        except Exception as e:  # noqa: BLE001 - a config that does not compile / fit / launch
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            if any(f in str(e) for f in _FATAL):
                raise Fatal(msg) from e
            self.errors += 1
            print(f"  skipped {backend} {config or ''}: {msg}", flush=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return Measured(backend, config, None, msg)

    def bias(self, p: Problem, rows: int) -> Optional[torch.Tensor]:
        """float32 `[E, rows]` biases in [-0.1, 0.1) for a problem of a layer with biases, else
        None."""
        if not p.bias:
            return None
        return torch.empty((p.E, rows), device=self.device).uniform_(-0.1, 0.1, generator=self.gen)

    def backends(self, p: Problem) -> List[str]:
        """The backends that run ``p`` on this device (``_select._runs``), Triton first ("gate":
        our fused kernel, and "unfused": GEMM1 then the activation stage, as the layer runs
        them)."""
        scheme, row_block = quant.get(p.scheme), p.block if "masked" not in p.layout else 0
        if p.layout.startswith("gemv"):  # (Triton kernels only, any GPU)
            return ["triton"]
        if p.layout in ("gate", "masked_gate"):
            kind = "contiguous" if p.layout == "gate" else "masked"
            ok = _select._runs("triton", scheme, kind, self.device, p.N, p.K, row_block)
            return ["triton", "unfused"] if ok else []
        names = ("triton", *OTHER_BACKENDS[p.layout])
        return [
            b for b in names if _select._runs(b, scheme, p.layout, self.device, p.N, p.K, row_block)
        ]

    def gemm(self, p: Problem, w, w_s, backends: Collection[str]) -> List[Measured]:
        """Every fitting Triton config and each other backend of ``backends``, on one set of
        operands of ``p`` (weights ``w`` / ``w_s``)."""
        scheme, dev, part = quant.get(p.scheme), self.device, functools.partial
        if "triton" not in backends:
            return []
        if p.layout.startswith("gemv"):
            return self.gemv(p, w, w_s)
        ids = routing(p.tokens, p.E, p.top_k, dev)
        if p.layout in ("gate", "masked_gate"):
            return self.gate(p, w, w_s, ids)
        if p.layout == "contiguous":
            a, a_s = _acts(scheme, (p.rows,), p.K, self.gen, dev)
            _, _, m_idx, _, offsets, _ = reference.permute(
                torch.zeros((p.tokens, 1), device=dev), ids, p.E, p.block
            )
            y = torch.empty((p.rows, p.N), dtype=torch.bfloat16, device=dev)
            chk = output_check(a, a_s, w, w_s, sample_picks(m_indices=m_idx), y)
            run = part(_triton.contiguous_triton, a, w, m_idx, a_s, w_s, p.block, out=y)
            out = [self.measure("triton", part(run, config=c), c, chk)
                   for c in candidates(p.layout, p.scheme, p.block)]  # fmt: skip
            if "deep_gemm" in backends:
                dg = _select._dg_functions()[f"{scheme}_contiguous"]
                out.append(self.measure("deep_gemm", part(_deep_gemm_contiguous, dg, a, w, m_idx,
                                                          a_s, w_s), check=chk))  # fmt: skip
            if "grouped_mm" in backends:
                offs = offsets[1:].contiguous()  # (the layer passes permute's expert ends)
                fn = part(torch._grouped_mm, a, w.transpose(1, 2), offs=offs)
                out.append(self.measure("grouped_mm", fn, check=chk))
            return out
        a, a_s = _acts(scheme, (p.E, p.rows), p.K, self.gen, dev)
        counts = torch.bincount(ids.flatten(), minlength=p.E).to(torch.int32)
        y = torch.empty((p.E, p.rows, p.N), dtype=torch.bfloat16, device=dev)
        chk = output_check(a, a_s, w, w_s, sample_picks(counts=counts), y)
        run = part(_triton.masked_triton, a, w, counts, a_s, w_s, p.m, out=y)
        out = [self.measure("triton", part(run, config=c), c, chk)
               for c in candidates(p.layout, p.scheme, p.block)]  # fmt: skip
        if "deep_gemm" in backends:
            dg = _select._dg_functions()[f"{scheme}_masked"]
            block = _select.masked_row_block(scheme, dev)
            fn = part(_deep_gemm_masked, dg, a, w, counts, a_s, w_s, p.m, block)
            out.append(self.measure("deep_gemm", fn, check=chk))
        if "bmm" in backends:
            out.append(self.measure("bmm", part(torch.bmm, a, w.transpose(1, 2)), check=chk))
        return out

    def gate(self, p: Problem, w, w_s, ids) -> List[Measured]:
        """Every fitting config of the fused GEMM1 + gate kernel of ``p``'s layout ("gate":
        contiguous, "masked_gate": masked), and the unfused pair (GEMM1 on the backend the layer
        picks, then the activation stage), on one set of operands; then the pair's GEMM1 alone
        (UNFUSED_GEMM1: in the log only)."""
        scheme, dev, part = quant.get(p.scheme), self.device, functools.partial
        g, layout = _gate.get(p.gate), scheme.cuda_scale_layout
        if p.layout == "gate":
            a, a_s = _acts(scheme, (p.rows,), p.K, self.gen, dev)
            _, _, m_idx, _, offsets, _ = reference.permute(
                torch.zeros((p.tokens, 1), device=dev), ids, p.E, p.block
            )
            fused, picks = part(_ops.gate_triton, a, w, m_idx), sample_picks(m_indices=m_idx)
            gemm1 = part(gemm.grouped_gemm_contiguous, a, w, m_idx, a_s, w_s, offsets, True,
                         p.block)  # fmt: skip
            rows, meta = dict(m_indices=m_idx, expert_offsets=offsets), p.block
        else:
            a, a_s = _acts(scheme, (p.E, p.rows), p.K, self.gen, dev)
            counts = torch.bincount(ids.flatten(), minlength=p.E).to(torch.int32)
            fused, picks = part(_ops.masked_gate_op_triton, a, w, counts), \
                sample_picks(counts=counts)  # fmt: skip
            gemm1 = part(gemm.grouped_gemm_masked, a, w, counts, a_s, w_s, p.m, True)
            rows, meta = dict(masked_m=counts), p.m
        bias = self.bias(p, w.shape[1])
        run = part(fused, a_s, w_s, g, bias, layout, meta)
        # (bf16 without bias: h checked, as the GEMM candidates' outputs are)
        chk = None if scheme.quantized or bias is not None else gate_check(a, w, g, picks)
        out = [self.measure("triton", part(run, config=c), c, check=chk)
               for c in candidates(p.layout, p.scheme, p.block)]  # fmt: skip

        def unfused():
            y = gemm1()
            if not scheme.quantized:
                return activation.silu_and_mul(y, gate=g.spec, bias=bias, **rows)
            return activation.silu_and_mul_quant(y, p.scheme, scale_layout=layout, gate=g.spec,
                                                 bias=bias, **rows)  # fmt: skip

        out.append(self.measure("unfused", unfused))
        out.append(self.measure(UNFUSED_GEMM1, gemm1))
        return out

    def gemv(self, p: Problem, w, w_s) -> List[Measured]:
        """Every fitting launch config of ``p``'s GEMV kernel (``gemv.fits``; the op's Triton
        launch with the ids check on, as the layer launches it: the check's program and asserts
        change the kernel a config builds), pinned by ``gemv.override``, on GEMV_ROUTINGS routings
        of p.m tokens and, where more, of p.tokens (the most the entry serves; its time: the sum);
        the output (of the first) checked against that of the module's default config (the
        configs differ only in their sums' order)."""
        dev, part, up = self.device, functools.partial, p.layout == "gemv_up"
        bias = self.bias(p, w.shape[1])
        calls = []
        for t, seed in itertools.product(
            sorted({p.m, p.tokens}), range(SEED, SEED + GEMV_ROUTINGS)
        ):
            ids = routing(t, p.E, p.top_k, dev, seed)
            if up:
                x = torch.randn((t, p.K), generator=self.gen, device=dev, dtype=torch.bfloat16)
                calls.append(part(gemv.gemv_gate_up.cuda, x, ids, w, w_s, True, p.gate, bias))
            else:
                h = torch.randn((t, p.top_k, p.K), generator=self.gen, device=dev,
                                dtype=torch.bfloat16)  # fmt: skip
                tw = torch.rand((t, p.top_k), generator=self.gen, device=dev)
                calls.append(part(gemv.gemv_down.cuda, h, ids, tw, w, w_s, True, bias))
        with gemv.override():
            want = calls[0]().float()

        def check(runs: List[Callable[[], torch.Tensor]]) -> Optional[str]:
            return _wrong(runs[0]().float(), want)

        kernel = "up" if up else "down"
        field = gemv.field_name(kernel, p.scheme, p.tokens)
        with gemv.override():  # (what the launch takes without an entry)
            default = gemv.launch_config(kernel, p.scheme, p.tokens, p.N, p.K, p.E, p.top_k, dev,
                                         p.gate, p.bias)  # fmt: skip
        fitting = gemv_candidates(p)
        out = []
        for c in fitting + ([] if default in fitting else [default]):
            pinned = {field: c if up else (*c, p.top_k)}  # (down: the step as launched)

            def run(fn, pinned=pinned):
                with gemv.override(**pinned):
                    return fn()

            config = dict(block_n=c[0], block_k=c[1], num_warps=c[2])
            runs = [part(run, fn) for fn in calls]
            out.append(self.measure("triton" if c in fitting else "default", runs, config, check))
            if c == default and c in fitting:  # (its measurement is the default's too)
                out.append(out[-1]._replace(backend="default"))
        return out

    def gathers(self, p: Problem, w, w_s) -> Optional[Dict]:
        """The "gather" entry of ``p``: permute then GEMM1 as the layer runs them (fused with the
        gate where the table in force says so), copying ("copy") or gathering ("gather") the rows;
        None where GEMM1 does not run on our Triton kernels (nothing to gather into)."""
        scheme, dev, E = quant.get(p.scheme), self.device, p.E
        g = _gate.get(p.gate)
        inter = g.inter(p.N)
        fused = _select.fuses_gate(scheme, dev, inter, p.K, E, p.block, p.m, g.spec, p.bias)
        ours = _select._backend(scheme, "contiguous", dev, p.N, p.K, E, p.block, p.m) == "triton"
        if not (fused or ours):
            return None
        ids = routing(p.tokens, E, p.top_k, dev)
        x = torch.randn((p.tokens, p.K), generator=self.gen, device=dev, dtype=torch.bfloat16)
        xs = None
        if scheme.quantized:  # (the layer's quantize stage: its codes and scales)
            x, xs = epmoe.ops.quantize(x, p.scheme)
        bias = self.bias(p, p.N)
        layout = scheme.cuda_scale_layout

        def run(gather: bool):
            pp = epmoe.ops.permute(x[:, :0] if gather else x, ids, E, p.block,
                                   None if gather else xs, scale_layout=layout)  # fmt: skip
            a, a_s, rows = (x, xs, pp.src_rows) if gather else (pp.x, pp.x_scales, None)
            if fused:
                return gemm.grouped_gemm_gate(a, w, pp.m_indices, a_s, w_s, g.spec, bias,
                                              scale_layout=layout, alignment=p.block,
                                              trusted=True, a_rows=rows)  # fmt: skip
            return gemm.grouped_gemm_contiguous(a, w, pp.m_indices, a_s, w_s, pp.expert_offsets,
                                                True, p.block, rows)  # fmt: skip

        us = {}
        for name in ("copy", "gather"):
            m = self.measure(name, functools.partial(run, name == "gather"))
            if m.us is not None:
                us[name] = round(m.us, 2)
        if not us:
            return None
        best = "gather" if us.get("gather", math.inf) < us.get("copy", math.inf) else "copy"
        return gemm_entry(p, best, {}, us)

    def weights(self, p: Problem, cache: Dict[Tuple, Tuple]) -> Tuple:
        """(w, w_scales) of ``p``'s GEMM, made once per scheme and shape (``cache`` holds the
        last one: the previous shape's are freed first)."""
        gated = p.layout in ("gate", "masked_gate", "gemv_up")
        rows = _gate.get(p.gate).width(p.N) if gated else p.N  # (w1's rows)
        key = (p.scheme, p.E, rows, p.K)
        if key not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            cache[key] = _weights(quant.get(p.scheme), p.E, rows, p.K, self.gen, self.device)
        return cache[key]

    def gather_entries(self, problems: List[Problem]) -> Iterator[Dict]:
        """The "gather" entry of each problem (w1 made once per shape and scheme)."""
        weights: Dict[Tuple, Tuple] = {}
        for p in problems:
            self.check_time()
            e = self.gathers(p, *self.weights(p, weights))
            if e is None:
                print(f"  no gather entry for {p[:7]}: GEMM1 is not ours there", flush=True)
                continue
            print(json.dumps(e), flush=True)
            yield e

    def gemm_entries(self, problems: List[Problem]) -> Iterator[Dict]:
        """The entry of each problem (weights made once per GEMM)."""
        weights: Dict[Tuple, Tuple] = {}
        for p in problems:
            self.check_time()
            runs = self.backends(p)
            measured = self.gemm(p, *self.weights(p, weights), runs)
            print("\n".join(ranking(measured)), flush=True)
            best = gemv_choice(measured) if p.layout.startswith("gemv") else winner(measured, runs)
            if best is None:
                print(f"  no entry for {p[:7]}: nothing ran", flush=True)
                continue
            e = gemm_entry(p, *best)
            print(json.dumps(e), flush=True)
            yield e

    def paths(self, cfg, scheme: str, tokens: List[int], variants=path_variants) -> Iterator[Dict]:
        """The path entry of each T of ``tokens`` (see the module docstring); ``variants``: T ->
        the (path, alignment) pairs timed."""
        torch.cuda.empty_cache()  # (the GEMM phase's or the previous shape's cached blocks)
        dev, E, H, I = self.device, cfg.local_experts, cfg.hidden, cfg.intermediate  # noqa: E741
        width = _gate.get(cfg.gate).width(I)
        g = torch.Generator(device=dev).manual_seed(SEED)

        def randn(*shape, std):
            return torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16).mul_(std)

        w1, w2 = randn(E, width, H, std=W_STD), randn(E, H, I, std=W_STD)
        b1 = randn(E, width, std=0.1) if cfg.bias else None
        b2 = randn(E, H, std=0.1) if cfg.bias else None
        kw = dict(quant=scheme, backend="local", device=dev, gate=cfg.gate, bias=cfg.bias)
        held = None  # the first layer: its prepared weights are shared by the others

        def layer(**more):
            nonlocal held
            x = epmoe.EPMoE(E, H, I, cfg.top_k, **kw, **more)
            if held is None:
                x.load_weights(w1, w2, b1=b1, b2=b2)
                held = x
            else:
                for name, buf in held.named_buffers(recurse=False):
                    setattr(x, name, buf)
            return x

        ht: Dict[int, epmoe.EPMoE] = {}  # alignment -> the HT layer, sized for the largest T
        cutoff = gemv_cutoff(cfg, scheme)
        for t in tokens:
            self.check_time()
            gx = torch.Generator(device=dev).manual_seed(SEED + t)
            x = torch.randn((t, H), generator=gx, device=dev, dtype=torch.bfloat16)
            tw = torch.softmax(torch.randn((t, cfg.top_k), generator=gx, device=dev), dim=1)
            # (up to the cutoff the GEMVs' time follows which experts the choices share: the
            # variants are timed on GEMV_ROUTINGS routings, the same for each, summed)
            seeds = range(SEED, SEED + (GEMV_ROUTINGS if t <= cutoff else 1))
            ids = [routing(t, E, cfg.top_k, dev, seed) for seed in seeds]
            us: Dict[str, Optional[float]] = {}
            for path, a in variants(t, cutoff):
                if path == "gemv":  # (a set cutoff: the GEMVs whatever the table's paths say)
                    m = layer(mode="auto", max_tokens_per_rank=t)
                    m.gemv_max_tokens = t
                elif path == "ll":
                    m = layer(mode="ll", max_tokens_per_rank=t)
                else:
                    if a not in ht:
                        ht[a] = layer(mode="ht", alignment=a, max_tokens_per_rank=max(tokens),
                                      worst_case=True)  # fmt: skip
                    m = ht[a]
                name = variant_name(path, a)
                m.warmup([t])
                us[name] = self.measure(name, [functools.partial(m, x, i, tw) for i in ids]).us
            p = path_entry(cfg, scheme, t, us)
            if p is not None:
                print(json.dumps(p), flush=True)
                yield p


@contextlib.contextmanager
def reading_table(doc: Dict, device_name: str):
    """The GEMM ops read ``doc`` as this GPU's tuned table (a temporary directory in place of
    ``_tuned.DIR``): path layers run with the configs just tuned, whatever --out / --dry-run."""
    saved = _tuned.DIR
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp) / _tuned.file_name(device_name), doc)
        _tuned.DIR = Path(tmp)
        _tuned.reread()
        try:
            yield
        finally:
            _tuned.DIR = saved
            _tuned.reread()


# --------------------------------------------------------------------------------------------- main
def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(s: str, known: Collection[str], what: str) -> List[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"tune_gemm: unknown {what} {bad}; known: {sorted(known)}")
    return names


def layer_config(hidden: int, inter: int, experts: int, top_k: int, gate: str = "silu",
                 bias: bool = False) -> _configs.ModelConfig:  # fmt: skip
    """The one-rank shape of ``--layer``: a layer of these sizes (``experts`` on this GPU), gate
    spec and biases, named by them (SystemExit on sizes or a gate the layer refuses)."""
    try:
        spec = _gate.get(gate, "tune_gemm", "--gate").spec
        epmoe.EPMoE(experts, hidden, inter, top_k, device="meta", gate=spec, bias=bias)
    except ValueError as e:
        raise SystemExit(f"tune_gemm: --layer {hidden} {inter} {experts} {top_k}: {e}") from None
    name = f"H{hidden}-I{inter}-E{experts}-K{top_k}" + (f"-{spec}" if spec != "silu" else "") + \
        ("-bias" if bias else "")  # fmt: skip
    return _configs.ModelConfig(
        name=name, hidden=hidden, intermediate=inter, num_experts=experts, ranks=1, top_k=top_k,
        prefill_tokens=max(TOKENS), decode_capacity=LL_MAX_TOKENS, decode_rows_per_expert=1,
        gate=spec, bias=bias,
    )  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes",
        help=f"benchmarks/_configs.py names (default {','.join(SHAPES)}; with --layer: none)",
    )
    ap.add_argument(
        "--layer",
        nargs=4,
        type=int,
        metavar=("H", "I", "E", "K"),
        help="a layer of one's own model: hidden size, intermediate size, experts on this GPU, "
        "top-k (the entries its EPMoE looks up)",
    )
    ap.add_argument("--gate", default="silu", help="--layer's gate (an epmoe.Gate spec)")
    ap.add_argument("--bias", action="store_true", help="--layer's experts have biases")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--row-blocks", default=",".join(map(str, ROW_BLOCKS)))
    ap.add_argument(
        "--tokens",
        help=f"call sizes (default {','.join(map(str, TOKENS))}, and for the masked layouts one "
        "size of each row tile those do not reach)",
    )
    ap.add_argument("--layouts", default=",".join(_tuned.LAYOUTS))
    ap.add_argument("--paths", action="store_true", help="also the path entries (whole layers)")
    ap.add_argument("--paths-only", action="store_true", help="only the path entries")
    ap.add_argument("--budget-s", type=float, default=3000.0, help="wall-clock budget of the run")
    ap.add_argument("--iters", type=int, default=ITERS)
    ap.add_argument("--out", help="the file to merge into (default: the table of this GPU)")
    ap.add_argument("--dry-run", action="store_true", help="print the merged file, write nothing")
    which = ap.add_mutually_exclusive_group()
    which.add_argument(
        "--resume",
        action="store_true",
        help="skip the problems and path sizes the file already has (a run in parts)",
    )
    which.add_argument(
        "--stale",
        action="store_true",
        help="only the problems without an entry or tuned on another candidate list",
    )
    ap.add_argument("--list", action="store_true", help="print the problems to tune, tune none")
    a = ap.parse_args(argv)
    if a.shapes is None:
        a.shapes = "" if a.layer else ",".join(SHAPES)
    a.configs = {n: _configs.CONFIGS[n] for n in _names(a.shapes, _configs.CONFIGS, "shape")}
    if a.layer:
        cfg = layer_config(*a.layer, a.gate, a.bias)
        a.configs[cfg.name] = cfg
    elif a.gate != "silu" or a.bias:
        raise SystemExit("tune_gemm: --gate / --bias describe --layer's experts: give --layer")
    a.shapes = list(a.configs)
    a.schemes = _names(a.schemes, quant.SCHEMES, "scheme")
    a.layouts = _names(a.layouts, _tuned.LAYOUTS, "layout")
    a.every_tile = a.tokens is None
    a.row_blocks, a.tokens = _ints(a.row_blocks), _ints(a.tokens or ",".join(map(str, TOKENS)))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.list:
        if a.out is None and not torch.cuda.is_available():
            print("tune_gemm: --list without a GPU needs --out (the table)", file=sys.stderr)
            return 2
        out = Path(a.out) if a.out else _tuned.DIR / _tuned.file_name(torch.cuda.get_device_name())
        print(listing(a, json.loads(out.read_text()) if out.is_file() else None))
        return 0
    if not torch.cuda.is_available():
        print("tune_gemm: needs a CUDA GPU (it times kernels)", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    out = Path(a.out) if a.out else _tuned.DIR / _tuned.file_name(name)
    run(a, Tuner(device, a.iters, time.monotonic() + a.budget_s), name, out)
    return 0


def selected(a: argparse.Namespace, old: Optional[Dict], cfg, scheme: str
             ) -> Tuple[List[Problem], List[Tuple[str, List[Problem]]]]:  # fmt: skip
    """The GEMM problems ``a`` selects for ``cfg`` x ``scheme`` (after --resume / --stale against
    ``old``): (those timed first, GEMVs last, one GEMM's together: its weights are made once;
    [(layout, problems)] of the layouts timed after them, reading their entries: "gather",
    "masked_gate"), or none with --paths-only."""
    if a.paths_only:
        return [], []

    def keep(problems: Iterable[Problem]) -> List[Problem]:
        if a.stale:
            return stale(old, problems)
        return pending(old, problems)[0] if a.resume else list(problems)

    first: List[Problem] = []
    if "contiguous" in a.layouts:
        first += contiguous_problems(cfg, scheme, a.row_blocks, a.tokens)

    def ll_tokens(layout: str) -> List[int]:
        return every_tile(cfg, scheme, a.tokens, layout) if a.every_tile else a.tokens

    if "masked" in a.layouts:
        first += masked_problems(cfg, scheme, ll_tokens("masked"))
    if "gate" in a.layouts:
        first += gate_problems(cfg, scheme, a.row_blocks, a.tokens)
    first = keep(first + list(gemv_problems(cfg, scheme, a.layouts)))
    order: Dict[Tuple[int, int], int] = {}
    first.sort(key=lambda p: order.setdefault((p.N, p.K), len(order)))
    later = [
        ("gather", gather_problems(cfg, scheme, a.row_blocks, a.tokens)),
        ("masked_gate", masked_gate_problems(cfg, scheme, ll_tokens("masked_gate"))),
    ]
    return first, [(layout, keep(ps)) for layout, ps in later if layout in a.layouts]


def listing(a: argparse.Namespace, old: Optional[Dict]) -> str:
    """--list: the problems a run of ``a`` would tune against the table ``old``, one a line."""
    lines = [f"{'shape':<16}{'layout':<12}{'scheme':<7}{'N':>6}{'K':>6}{'E':>5}{'block':>6}"
             f"{'m':>8}{'T':>7}"]  # fmt: skip
    n = 0
    for shape in a.shapes:
        for scheme in a.schemes:
            first, later = selected(a, old, a.configs[shape], scheme)
            for p in first + [p for _, ps in later for p in ps]:
                lines.append(f"{shape:<16}{p.layout:<12}{p.scheme:<7}{p.N:>6}{p.K:>6}{p.E:>5}"
                             f"{p.block:>6}{p.m:>8}{p.tokens:>7}")  # fmt: skip
                n += 1
    return "\n".join(lines + [f"{n} problems"])


def run(a: argparse.Namespace, tuner: Tuner, name: str, out: Path) -> Dict:
    """Tune what ``a`` selects on ``tuner``'s device (GPU model ``name``), merging into ``out``
    after each shape x scheme; returns the merged document."""
    t0 = time.monotonic()
    old = json.loads(out.read_text()) if out.is_file() else None
    entries: List[Dict] = []
    paths: List[Dict] = []
    stop = ""

    def save() -> Dict:
        doc = merge(old, entries, paths, header(name))
        if not a.dry_run:
            write(out, doc)
        return doc

    work = [(s, q) for s in a.shapes for q in a.schemes]
    try:
        # one shape x scheme at a time, its paths right after its GEMMs (reading them): a run cut
        # by its budget leaves whole shapes, paths included
        for shape, scheme in work:
            cfg = a.configs[shape]
            first, later = selected(a, old, cfg, scheme)
            if not a.paths_only:
                print(f"== {shape} {scheme}", flush=True)
                for e in tuner.gemm_entries(first):
                    entries.append(e)
                save()
                # after the GEMMs, reading their entries as the layer does: gathering (GEMM1's
                # backend), masked GEMM1 + gate (the unfused pair's masked GEMM1)
                for layout, todo in later:
                    if todo:
                        measure = tuner.gather_entries if layout == "gather" else \
                            tuner.gemm_entries  # fmt: skip
                        with reading_table(merge(old, entries, paths, header(name)), name):
                            entries.extend(measure(todo))
                        save()
            if not (a.paths or a.paths_only):
                continue
            ts = sorted(set(a.tokens))
            if a.resume or a.stale:  # (paths: no digest; those the file lacks)
                _, ts = pending(old, (), cfg, scheme, ts)
            if ts:
                print(f"== paths {shape} {scheme}", flush=True)
                with reading_table(merge(old, entries, paths, header(name)), name):
                    for p in tuner.paths(cfg, scheme, ts):
                        paths.append(p)
                save()
    except OutOfTime:
        stop = f"budget of {a.budget_s:g} s spent: stopped"
    except Fatal as e:
        stop = f"CUDA context lost ({e}): stopped"
    doc = save()
    print("\n" + summary(entries, paths))
    print(f"\n{len(entries)} entries, {len(paths)} paths, {tuner.errors} skipped measurements, "
          f"{time.monotonic() - t0:.0f} s" + (f"; {stop}" if stop else ""))  # fmt: skip
    print(dumps(doc) if a.dry_run else f"wrote {out}")
    return doc


if __name__ == "__main__":
    sys.exit(main())
