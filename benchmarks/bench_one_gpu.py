"""The whole EPMoE layer on ONE GPU, as users call it, against what they would otherwise run.

    PYTHONPATH=.:benchmarks python benchmarks/bench_one_gpu.py --out OUT.json [--quick]
        [--only shape=qwen3-30b-a3b scheme=fp8,bf16 mode=ll T=1,32] [--budget-s 500]
        [--no-compile | --compile-all] [--no-transformers] [--no-raw] [--iters 30] [--routings 7]
    PYTHONPATH=.:benchmarks python benchmarks/bench_one_gpu.py --out OUT.json
        --only shape=gpt-oss-20b,gpt-oss-20b-silu,gemma4-26b-a4b mode=auto
    PYTHONPATH=.:benchmarks python benchmarks/bench_one_gpu.py --cpu-smoke --out smoke.json

Cases: shape x scheme x mode x T. Shapes (benchmarks/_configs.py, experts ``local_experts``), SHAPES
by default: ``qwen3-30b-a3b`` (H 2048, I 768, E 128, top-8), ``W`` (the issue's reference case: W's
per-rank experts, E 128, H 7168, I 2048, top-8) and ``dsv3-1gpu`` (all 256 DeepSeek-V3 experts, H
7168, I 2048, top-8); MODEL_SHAPES with ``--only shape=...`` (experts other than plain SiLU GLUs,
each against its own transformers experts class): ``gpt-oss-20b`` (H 2880, I 2880, E 32, top-4,
expert biases, the clamped SwiGLU "silu:alpha=1.702,limit=7.0,up_offset=1.0"; fp8 pads H / I to
2944), ``gpt-oss-20b-silu`` (the same sizes and weights, plain SiLU, no biases: what the gate and
biases cost), ``gemma4-26b-a4b`` (H 2816, I 704, E 128, top-8, GELU-tanh GLU, no biases; fp8 pads I
to 768) and ``mixtral-8x7b`` (H 4096, I 14336, E 8, top-2: choices share experts from T 2, where
"auto" leaves the per-choice GEMVs by expected re-reads). Schemes bf16 / fp8 / int8. T in TOKENS
(``--quick``: QUICK_TOKENS). Modes: "ll" (``max_tokens_per_rank=T``, only T <= LL_MAX_TOKENS), "ht"
(``worst_case=True``) and "auto" (EPMoE's default LL threshold; skipped with a note where
``mode="auto"`` raises ValueError); with ``--only mode=...`` also "ht16" / "ht32" / "ht64" (HT at
that permute alignment: fewer padding rows, our Triton GEMMs where deep_gemm needs 128; their raw
anchor stays deep_gemm at 128). All layers use ``backend="local"``. Routing: K distinct experts
per token uniformly at random (seeded,
the same for every scheme and mode at one T), weights a float32 softmax of normal logits;
x ~ N(0, 1) bf16; global weights w1 `[E, 2I, H]`, w2 `[E, H, I]` ~ 0.02 N(0, 1) (and, with the
config's ``bias``, b1 `[E, 2I]`, b2 `[E, H]` ~ 0.1 N(0, 1)), created in bf16 on the GPU (never
float32) once per shape, and freed (with every layer) before the next shape. Every layer is built
with the config's ``gate`` and ``bias``.

Per case (all ms are medians of ``--iters`` (>= 20) CUDA-event timed calls after warm-up):

- ``eager_ms``: ``layer(x, ids, w)`` launched eagerly, each call after an L2 flush (the flush, a
  ~0.1 ms read of 512 MiB, lets the host run ahead by that much, so this is close to the device
  time); ``eager_loop_ms``: back-to-back eager calls without flush (host-bound calls show their
  host time here); ``eager_queued_ms``: each call after a flush and queued behind a ~10 ms GPU
  sleep (AHEAD_CYCLES), so its host time is hidden however long: the call's device time.
- ``host_us``: host time per eager call: wall time of N calls divided by N, with the GPU first
  given a ~50 ms sleep kernel so it stays busy behind the host (launches only queue; nothing the
  host does waits for the device, and the final ``torch.cuda.synchronize`` is outside the timed
  region; ``_timing.host_us``). A call that syncs shows up as the sleep's length.
- ``launches``: device activities of one eager call from ``torch.profiler`` (CUDA activity):
  kernels, plus memcpy/memset as ``copies``; ``kernels`` counts them by name. (Under the profiler
  epmoe's eager fast path takes the dispatcher route; both launch the same kernels.)
- ``graph_ms``: a plain ``torch.cuda.CUDAGraph`` of one call (after ``layer.warmup([T])`` and
  warm-up calls), replayed after an L2 flush (``_timing.time_cuda``); ``kernel_us``: the same
  replay's device µs per kernel launch (``_timing.kernel_us``: where the time goes; a kernel
  launched with PDL counts from the end of the one before it, not from its early start).
- ``--routings R`` (R > 1): ``graph_ms`` again on R routings of the case's T (the case's own
  first, then seeds ``seed + ROUTING_SEED_STEP * i``), each call's time and floor in
  ``graph_ms_routings`` / ``floor_ms_routings`` and their medians in ``graph_median_ms`` /
  ``floor_median_ms``: at a few tokens the experts a routing touches, and how many of its
  choices share one, move a layer's time by more than configs differ (one routing cannot rank
  them; the median of several can).
- ``compile_ms`` / ``compile_ro_ms``: ``torch.compile(layer, dynamic=False)`` in the default mode
  and in ``mode="reduce-overhead"`` (compile seconds in ``compile_s`` / ``compile_ro_s``, graph
  breaks, and whether the compiled output has the eager bytes). Compiling costs seconds per
  (mode, scheme, T), so by default it runs only for COMPILE_SHAPES x COMPILE_TOKENS (Qwen3 at
  T 32 and 4096) for every scheme, on the "auto" layer (LL at 32, HT at 4096; the "ll" / "ht"
  layer where "auto" is absent), after the shape's other cases and within ``--compile-budget-s``
  (default COMPILE_BUDGET_S) of the run's budget, so the shapes after it still run.
  ``compile_loop_ms`` / ``compile_queued_ms`` / ``compile_host_us`` (and ``compile_ro_``):
  back-to-back calls, queued calls and host µs per call of the compiled layer, measured as
  ``eager_loop_ms`` / ``eager_queued_ms`` / ``host_us`` are (``compile_ro_ms`` over
  ``compile_ro_queued_ms``: the host time before the graph's replay that the flush did not
  cover), and its
  ``compile_launches`` / ``compile_copies`` / ``compile_kernels`` as ``launches`` counts them
  (reduce-overhead: the graph's kernels and the copies of non-static inputs).
- ``copy_us`` / ``device_us`` (and with the ``compile_`` prefixes): device µs of one call's
  copies and of all its device activities (profiler durations, summed).
  ``compile_sl_*``: the default mode with ``options={"static_launch_user_defined_triton_kernels":
  True}`` (Inductor launches epmoe's Triton kernels through its static launcher instead of
  Triton's; off by default in torch). ``--compile-all`` compiles every case, ``--no-compile``
  none.
- ``stack_*`` (on the compile targets, ``--stack`` N layers, default STACK_LAYERS): the layer
  called N times in one module (``LayerStack``, each call on the previous output: a model's MoE
  layers as one compiled frame, torch.compile's per-call cost paid once for N layers), eager,
  as a plain CUDA graph and compiled as each of COMPILE_VARIANTS, every time, launch count and
  host µs divided by N: ``stack_eager_ms``, ``stack_eager_loop_ms``, ``stack_eager_queued_ms``,
  ``stack_host_us``, ``stack_graph_ms``,
  ``stack_compile_*`` / ``stack_compile_ro_*`` / ``stack_compile_sl_*`` (compile seconds, copies
  and kernels per stack call).
- ``raw_ms``: deep_gemm GEMM1 + GEMM2 on the same routing in one CUDA graph: LL: the masked entry
  points on the layer's per-expert counts and `[E, C, H]` slot layout (same C; expected_m the
  layer's mean rows per expert, as a caller of deep_gemm passes it: the layer's own deep_gemm calls
  are hinted the fullest expert's rows, ``_triton.fullest_rows``);
  HT: the contiguous ones at the same M_sum with the same m_indices (reference permute at the
  layer's alignment). Activations built outside the timing (fp8 scales in deep_gemm's MN-major
  layout, as the layer passes them; x zero-padded to the layer's padded H, GEMM1's rows through
  b1 and the config's gate, b2 added in the combine). int8 has no deep_gemm: its anchor is the fp8
  raw GEMM on
  the same routing (``raw_impl`` says so). bf16 without deep_gemm: torch._grouped_mm / torch.bmm.
  ``raw_host_us``: host µs of that GEMM1 + GEMM2 pair called eagerly (as ``host_us``): the part of
  the layer's host time the GEMM library's own calls take.
- ``grouped_mm_*``: transformers' experts class of the config's ``hf_experts`` (HF_EXPERTS:
  ``Qwen3MoeExperts``, ``GptOssExperts``, ``Gemma4TextExperts``) with ``_experts_implementation =
  "grouped_mm"``, built on the meta device and holding the same global bf16 weights in its own
  layout: Qwen3 / Gemma4 ``gate_up_proj`` `[E, 2I, H]` / ``down_proj`` `[E, H, I]` are epmoe's
  tensors (no copy); gpt-oss's are transposed (``gate_up_proj`` `[E, H, 2I]`, ``down_proj``
  `[E, I, H]`, contiguous as in its checkpoint) with gate / up columns interleaved (and
  ``gate_up_proj_bias`` `[E, 2I]` too), ``down_proj_bias`` `[E, H]`. Called as ``experts(x, ids,
  w.bfloat16())``, eager and in a CUDA graph; ``rel_l2_vs_grouped_mm`` is the layer's eager output
  against it (bf16 within GROUPED_MM_TOL: ``matches_grouped_mm``, the check that the gate, the
  biases and the weight mapping are the model's).
- ``floor_ms``: bytes of the experts the routing touches (unique experts hit x (2I*H + H*I)
  weights x 2 B bf16 / 1 B fp8, int8 at the model's sizes, plus their scales and bf16 biases)
  over the copy bandwidth measured in the same run (``_timing.copy_gbps``, bytes read + written,
  the bar the GEMM benchmarks use).
- ``ratios``: layer graph / raw GEMMs, layer / grouped_mm (graph / graph, eager / eager), layer /
  floor.

Across cases (recomputed whenever the JSON is written): ``gate_bias_cost``, for a config with a
``plain`` twin (``gpt-oss-20b``: ``gpt-oss-20b-silu``) where both ran at the same (scheme, mode,
T): the layer's graph_ms over the twin's (target: at most GATE_BIAS_MAX), and eager_ms's, and
per kernel the µs it costs over the twin's (the breakdown of a miss);
``targets``: TARGETS, the "auto" layer's graph ms over a reference: gpt-oss-20b against
grouped_mm's graph on the same routing (fp8 <= 1/2 and bf16 <= 1/1.3 at T <= 128, neither above 1
beyond; int8 <= 1/2 at T <= 128); the others with the median over routings where timed on
several: issue 33's at qwen3-30b-a3b and W against the floor (bf16 <= 1.10 and fp8 <= 1.25 at
T = 32..512, fp8 <= 1.4 at T = 8), the same case in fp8 (int8 <= 1) and 0.68 ms (qwen3 bf16
T = 4096), and on an H200 against vLLM's fused MoE figures (VLLM_H200_MS, qwen3 and Mixtral:
<= 1).

Robustness: each measurement of a case runs in its own try/except (``errors`` maps the step to
the error string) and the run goes on; a CUDA error that kills the context stops the run with a
note. ``--budget-s`` (default 500) bounds the whole run: once spent, the remaining cases are
recorded as skipped with a note, and a compile step starts only with COMPILE_RESERVE_S left. The
JSON is rewritten after every case (a killed run keeps what it measured). A compact table is
printed at the end. ``--cpu-smoke`` runs the tiny ``tiny-1rank`` shape on CPU through the same
code (CUDA-only timings recorded as skipped); benchmarks/test_bench_one_gpu_cpu.py runs it.

JSON: {"schema": 1, "command", "date", "device", "versions" (torch, triton, deep_gemm,
transformers, epmoe, git), "args", "copy_gbps", "copy_by_method", "host_ref_us" ({"start",
"end"}: {"x_plus_x", "empty"}, host µs of ``x + x`` and of a ``torch.empty`` on the device at the
run's start and end: the host's speed then; host figures of two runs compare only through it, and
start and end apart mean something else ran on the host), "budget_s", "elapsed_s",
"complete", "notes": [str], "skipped": [case id], "fatal" (only when the run stopped), "cases":
[record], "gate_bias_cost": [{"shape", "plain", "scheme", "mode", "T", "graph_ms",
"plain_graph_ms", "graph_ratio", "eager_ms", "plain_eager_ms", "eager_ratio", "ratio" (the graph
ratio), "max_ratio", "met", "kernel_delta_us" {kernel name: its µs minus the twin's}}],
"targets": [{"shape", "scheme", "mode", "T", "against" ("grouped_mm" | "floor" | "fp8" | "vllm" |
ms), "reference_ms", "max_ratio", "ratio", "met"}]}. A record: "id" ("shape/scheme/mode/T<T>"),
"shape", "E", "H", "I", "K", "gate" (spec), "bias", "T", "scheme",
"mode", "path" ("ll" | "ht": the path the layer took), "status" ("ok" | "error" | "skipped"),
"errors" {step: "Type: message [file:line]"}, "skips" {step: reason}, "step_s" {step: s},
"case_s", "experts_hit", "weight_bytes", "flops", "floor_ms"; "eager_ms", "eager_loop_ms",
"eager_queued_ms",
"host_us", "launches", "copies", "copy_us", "device_us", "kernels" {name: count}, "graph_ms",
"kernel_us" {name, or "name #n" for its n-th launch: µs};
"compile_s", "compile_ms", "compile_loop_ms", "compile_queued_ms", "compile_host_us",
"compile_launches",
"compile_copies", "compile_copy_us", "compile_device_us", "compile_kernels",
"compile_graph_breaks", "compile_break_reasons", "compile_cudagraph_skips", "compile_same_bytes"
and the same with "compile_ro_" and "compile_sl_"; "raw_ms", "raw_impl", "raw_layout" ({"C",
"expected_m"} | {"M_sum", "alignment", "live_rows", "block_rows": the choices, and the rows of
their experts' alignment blocks, padding included}), "raw_rel_l2_vs_layer" (the raw GEMMs' rows
combined per token vs the layer's output: checks that the raw operands are the layer's);
"grouped_mm_eager_ms", "grouped_mm_graph_ms", "grouped_mm_host_us", "rel_l2_vs_grouped_mm",
"matches_grouped_mm" (bf16); "raw_host_us"; "stack_layers", "stack_eager_ms", "stack_eager_loop_ms",
"stack_host_us", "stack_eager_queued_ms", "stack_graph_ms", "stack_compile_*" /
"stack_compile_ro_*" / "stack_compile_sl_*" (the compile_ keys, per layer);
"ratios" {graph_over_raw, eager_over_raw, graph_over_grouped_mm_graph,
eager_over_grouped_mm_eager, graph_over_floor, eager_over_floor, raw_over_floor,
compile_over_eager, compile_ro_over_graph, compile_ro_queued_over_graph, compile_sl_over_eager,
compile_host_over_eager, compile_sl_host_over_eager, stack_compile_over_eager,
stack_compile_host_over_eager, stack_compile_ro_over_graph, stack_compile_sl_over_eager,
stack_compile_sl_host_over_eager, host_over_raw_host}. A figure that was
not measured is absent.
"""

import argparse
import gc
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _configs  # noqa: E402
import _report  # noqa: E402
import _timing  # noqa: E402

import epmoe  # noqa: E402
import epmoe.gate  # noqa: E402
from epmoe import reference  # noqa: E402
from epmoe.ops import gemm  # noqa: E402
from epmoe.ops.gemm._select import _dg_role  # noqa: E402

SHAPES = ("qwen3-30b-a3b", "W", "dsv3-1gpu")
# not in the default run (the device session's minutes): select them with --only shape=...
MODEL_SHAPES = ("gpt-oss-20b", "gpt-oss-20b-silu", "gemma4-26b-a4b", "mixtral-8x7b")
SCHEMES = ("bf16", "fp8", "int8")
MODES = ("ll", "ht", "auto")
# HT at the permute alignments only our Triton GEMMs take (fewer padding rows): not in the default
# run, select them with --only mode=ht16,ht32,ht64
ALIGNED_MODES = ("ht16", "ht32", "ht64")
TOKENS = (1, 8, 32, 128, 512, 4096, 16384)
QUICK_TOKENS = (1, 32, 128, 4096)
LL_MAX_TOKENS = 512  # "ll" cases only up to here (decode sizes)
COMPILE_SHAPES = ("qwen3-30b-a3b",)
COMPILE_TOKENS = (32, 4096)  # one LL-sized and one HT-sized call per scheme
COMPILE_RESERVE_S = 40.0  # a compile step starts only with this much of the run's budget left
COMPILE_BUDGET_S = 180.0  # what compile steps may spend in all (default --compile-budget-s)
# torch.compile variants: figure prefix -> torch.compile keywords ("compile_sl": the default mode
# with Inductor launching user-defined Triton kernels (epmoe's) through its static launcher)
COMPILE_VARIANTS = {
    "compile": {},
    "compile_ro": {"mode": "reduce-overhead"},
    "compile_sl": {"options": {"static_launch_user_defined_triton_kernels": True}},
}
AHEAD_CYCLES = 20_000_000  # ~10 ms of GPU sleep before a queued call (covers a stack's host time)
STACK_LAYERS = 8  # layers of the "stack" step (a model's MoE layers in one compiled frame)
W_STD = 0.02  # weight scale: GEMM outputs of O(1) at these sizes
B_STD = 0.1  # bias scale: a bias in the wrong place moves the output well past GROUPED_MM_TOL
GROUPED_MM_TOL = 1e-2  # rel L2 of the bf16 layer vs transformers' grouped_mm
CPU_SMOKE = {"shape": "tiny-1rank", "tokens": (1, 40, 200), "iters": 2, "warmup": 1}
WEIGHTS = ("w1", "w1_scale", "w2", "w2_scale")
BIASES = ("b1", "b2")  # bf16 [E, 2I] / [E, H], as created (None without biases)
# vLLM's single-GPU fused MoE Triton path on one H200 (its tuned H200 configs), as issue 33 measured
# it independently (same weights and routing, CUDA-graph replay, L2 flushed), ms by T: the bar
# of the "vllm" targets (vLLM is not installed where this runs; compared on an H200 only)
VLLM_H200_MS = {
    ("qwen3-30b-a3b", "bf16"): {1: 0.037, 8: 0.134, 32: 0.283, 128: 0.316, 512: 0.338, 4096: 0.752},
    ("qwen3-30b-a3b", "fp8"): {1: 0.038, 8: 0.090, 32: 0.163, 128: 0.185, 512: 0.242, 4096: 0.919},
    ("mixtral-8x7b", "bf16"): {1: 0.182, 8: 0.583, 32: 0.671, 128: 0.670, 512: 0.876, 4096: 4.866},
    ("mixtral-8x7b", "fp8"): {1: 0.148, 8: 0.332, 32: 0.381, 128: 0.410, 512: 0.836, 4096: 5.411},
}
# (shape, scheme, (T lo, T hi: None no bound), max ratio, against): the "auto" layer's graph ms
# over "grouped_mm" (transformers' graph; the gpt-oss issue), "floor" (the touched weights'
# read), "fp8" (the same case in fp8), "vllm" (VLLM_H200_MS) or a float (ms)
_Q3, _W = "qwen3-30b-a3b", "W"
TARGETS = (
    ("gpt-oss-20b", "fp8", (1, 128), 1 / 2, "grouped_mm"),
    ("gpt-oss-20b", "fp8", (129, None), 1.0, "grouped_mm"),
    ("gpt-oss-20b", "bf16", (1, 128), 1 / 1.3, "grouped_mm"),
    ("gpt-oss-20b", "bf16", (129, None), 1.0, "grouped_mm"),
    ("gpt-oss-20b", "int8", (1, 128), 1 / 2, "grouped_mm"),
    # issue 33: decode at the weight read, prefill bf16, int8 at or below fp8, never behind vLLM
    *((s, "bf16", (32, 512), 1.10, "floor") for s in (_Q3, _W)),
    *((s, "fp8", (32, 512), 1.25, "floor") for s in (_Q3, _W)),
    *((s, "fp8", (8, 8), 1.4, "floor") for s in (_Q3, _W)),
    (_Q3, "bf16", (4096, 4096), 1.0, 0.68),
    *((s, "int8", (1, None), 1.0, "fp8") for s in (_Q3, _W)),
    *((s, q, (1, None), 1.0, "vllm") for s, q in VLLM_H200_MS),
)
ROUTING_SEED_STEP = 1000  # --routings: routing i of a case is drawn from seed + this * i
GATE_BIAS_MAX = 1.03  # a gated config's graph time over its plain twin's (biases + clamped gate)
_FATAL = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "illegal instruction",
    "misaligned address",
)


class Skip(Exception):
    """A measurement that does not apply here (recorded under ``skips``, not an error)."""


class Fatal(Exception):
    """The CUDA context is gone: nothing later can run."""


# ------------------------------------------------------------------------------------------ timing
class CudaTimer:
    """Timings on the current CUDA device (CUDA events; graph replays via _timing)."""

    device = "cuda"

    def __init__(self, iters: int, warmup: int):
        self.iters, self.warmup = iters, warmup

    def sync(self) -> None:
        torch.cuda.synchronize()

    def _warm(self, fn) -> None:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()

    def eager(self, fn) -> float:
        """Median ms of eager calls, each after an L2 flush (warm-up on the current stream)."""
        self._warm(fn)
        return _timing.time_cuda(fn, iters=self.iters, warmup=0, use_graph=False).ms

    def loop(self, fn) -> float:
        """Median ms of back-to-back eager calls (no flush, no sync between them)."""
        self._warm(fn)
        return _timing.launch_ms(fn, self.iters)

    def queued(self, fn) -> float:
        """Median ms of eager calls, each after an L2 flush and queued behind a GPU sleep: the
        call's device time (its host time, however long, runs while the GPU sleeps)."""
        self._warm(fn)
        return _timing.time_cuda(
            fn, iters=self.iters, warmup=0, use_graph=False, ahead_cycles=AHEAD_CYCLES
        ).ms

    def graph(self, fn) -> float:
        """Median ms of replays of a CUDA graph of one call, each after an L2 flush."""
        t = _timing.time_cuda(fn, iters=self.iters, warmup=self.warmup)
        if t.method != "cuda_graph":
            raise RuntimeError(f"CUDA graph capture failed: {_capture_error(fn)}")
        return t.ms

    def host_us(self, fn, layers: int = 1) -> float:
        """Host µs per eager call with the GPU kept busy (see module docstring); ``layers``: the
        call is that many layer calls (fewer calls a pass, so the launch queue never fills)."""
        return _timing.host_us(fn, calls=max(2, _timing.HOST_CALLS // layers))

    def launches(self, fn) -> dict:
        """Device activities of one eager call (torch.profiler, CUDA activity)."""
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        acts = _timing.device_activities(prof)
        copies = [a for a in acts if a[0].startswith(("Memcpy", "Memset"))]
        kernels = [a[0] for a in acts if not a[0].startswith(("Memcpy", "Memset"))]
        names = Counter(k[: _timing.KERNEL_NAME_CHARS] for k in kernels)
        return {
            "launches": len(kernels),
            "copies": len(copies),
            "copy_us": round(sum(e - s for _, s, e in copies), 1),
            "device_us": round(sum(e - s for _, s, e in acts), 1),
            "kernels": names,
        }

    def kernel_us(self, fn) -> dict:
        """Device µs per kernel name of one graph replay after an L2 flush (``_timing``)."""
        return {"kernel_us": _timing.kernel_us(fn, iters=self.iters)}

    def copy_gbps(self) -> dict:
        return {"copy_gbps": _timing.copy_gbps(), "copy_by_method": _timing.copy_timings()}


class CpuTimer:
    """The CPU smoke run: wall-clock medians; CUDA-only measurements raise Skip."""

    device = "cpu"

    def __init__(self, iters: int, warmup: int):
        self.iters, self.warmup = iters, warmup

    def sync(self) -> None:
        pass

    def eager(self, fn) -> float:
        return statistics.median(_timing.wall_ms(fn, self.iters, self.warmup))

    def queued(self, fn) -> float:
        return self.eager(fn)

    def loop(self, fn) -> float:
        t0 = time.perf_counter()
        for _ in range(self.iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / self.iters

    def host_us(self, fn, layers: int = 1) -> float:
        return self.loop(fn) * 1e3

    def graph(self, fn) -> float:
        raise Skip("needs CUDA")

    def launches(self, fn) -> dict:
        raise Skip("needs CUDA")

    def kernel_us(self, fn) -> dict:
        raise Skip("needs CUDA")

    def copy_gbps(self) -> dict:
        src = torch.empty(4 * 2**20, dtype=torch.float32).uniform_()
        dst = torch.empty_like(src)
        ms = self.eager(lambda: dst.copy_(src))
        return {"copy_gbps": 2 * src.numel() * 4 / ms / 1e6, "copy_by_method": {"host": None}}


def _capture_error(fn) -> str:
    """Why a CUDA-graph capture of ``fn`` fails (``_timing`` only reports that it did)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - the message is the result
        torch.cuda.synchronize()
        return _err(e)
    return "capture succeeded on retry"


def _err(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" [{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}]" if tb else ""
    return f"{type(e).__name__}: {str(e)[:1500]}{where}"


# ----------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Case:
    shape: str
    scheme: str
    mode: str
    tokens: int

    @property
    def id(self) -> str:
        return f"{self.shape}/{self.scheme}/{self.mode}/T{self.tokens}"


@dataclass
class Routing:
    x: torch.Tensor  # bf16 [T, H]
    ids: torch.Tensor  # int64 [T, K], K distinct experts per token
    weights: torch.Tensor  # float32 [T, K], softmax-normalised
    experts_hit: int


def make_routing(cfg, tokens: int, seed: int, device) -> Routing:
    """Seeded uniform top-K routing over ``cfg.local_experts`` experts (ids and weights from a
    CPU generator, x from one on ``device``)."""
    E, K, H = cfg.local_experts, cfg.top_k, cfg.hidden
    g = torch.Generator().manual_seed(seed * 1_000_003 + tokens)
    ids = torch.rand((tokens, E), generator=g).argsort(dim=1)[:, :K].contiguous()
    w = torch.softmax(torch.randn((tokens, K), generator=g), dim=1)
    gx = torch.Generator(device=device).manual_seed(seed + tokens)
    x = torch.randn((tokens, H), generator=gx, device=device, dtype=torch.bfloat16)
    hit = int(torch.unique(ids).numel())
    return Routing(x, ids.to(device), w.to(device=device, dtype=torch.float32), hit)


def expert_weight_bytes(cfg, scheme: str) -> int:
    """Bytes of one expert's weights and scales (both GEMMs) in ``scheme``, and its bf16 biases:
    the model's sizes (not the zeros fp8 pads H / I with to multiples of 128; its scales per
    128x128 block of each padded half, as the layer keeps them)."""
    H, I = cfg.hidden, cfg.intermediate
    halves = epmoe.gate.get(cfg.gate).width(1)
    n = (halves + 1) * I * H
    bias = 2 * (halves * I + H) if cfg.bias else 0
    if scheme == "bf16":
        return 2 * n + bias
    if scheme == "fp8":  # 128x128 block scales

        def blocks(v):
            return -(-v // 128)

        return n + 4 * (halves + 1) * blocks(I) * blocks(H) + bias
    return n + 4 * (halves * I + H) + bias  # int8: one scale per output channel


def masked_layout(x: torch.Tensor, ids: torch.Tensor, num_experts: int, capacity: int):
    """Rows in the LL masked layout: a `[E, C, H]` (expert e's rows in (t, k) order, zeros past
    its count), masked_m int32 `[E]` and each (t, k)'s slot int64 `[T * K]` (its row is
    a[ids[t, k], slot]). Needs every count <= C."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    order = torch.sort(flat, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(flat)
    slot[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    a = x.new_zeros((num_experts, capacity, x.shape[1]))
    a[flat, slot] = x.repeat_interleave(K, dim=0)  # entry i is token i // K
    return a, counts.to(torch.int32), slot


def act_operands(a: torch.Tensor, scheme: str):
    """Quantized GEMM activations of bf16 ``a`` `[..., Kd]` (reference quantizer): (q, scales),
    fp8 scales on CUDA in deep_gemm's MN-major TMA-aligned layout (what the layer passes)."""
    if scheme == "bf16":
        return a, None
    q, s = reference.quantize(a, scheme)
    return q, _scales_like_layer(s, scheme)


def _scales_like_layer(s: torch.Tensor, scheme: str) -> torch.Tensor:
    """fp8 activation scales on CUDA in deep_gemm's MN-major layout (others as they are)."""
    if scheme == "fp8" and s.is_cuda:
        mn = gemm.empty_fp8_act_scales(tuple(s.shape[:-1]), s.shape[-1], s.device)
        mn.copy_(s)
        return mn
    return s


def _gated(cfg, y: torch.Tensor, b1: Optional[torch.Tensor], expert: torch.Tensor):
    """The layer's activation stage on GEMM1's bf16 rows ``y`` `[..., width]`: + b1 of each row's
    ``expert`` (int, y's leading shape; -1 rows: any), then the config's gate -> bf16
    `[..., width / 2]`."""
    yf = y.float()
    if b1 is not None:
        yf = yf + b1[expert.clamp(min=0).long()]
    return epmoe.gate.get(cfg.gate).reference(yf).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------- raw GEMMs
def _raw_impls(scheme: str, layout: str, device):
    """(name, fn) of the raw grouped GEMM for ``scheme`` / ``layout`` on ``device``: fn(a, s, w,
    ws, rows, em, out, offsets) writes ``out``. deep_gemm on CUDA (_baselines.py), the
    reference on CPU (the smoke run: same operands, no timing)."""
    device = torch.device(device)
    if device.type != "cuda":

        def ref(a, s, w, ws, rows, em, out, offsets):
            if layout == "masked":
                out.copy_(reference.grouped_gemm_masked(a, w, rows, s, ws))
            else:
                out.copy_(reference.grouped_gemm_contiguous(a, w, rows, s, ws))

        return "reference (CPU)", ref
    if _dg_role(f"{scheme}_{layout}", device):
        from _baselines import raw_deep_gemm_contiguous, raw_deep_gemm_masked

        if layout == "masked":
            return f"deep_gemm {scheme} masked", (
                lambda a, s, w, ws, rows, em, out, offs: raw_deep_gemm_masked(
                    scheme, a, s, w, ws, rows, em, out
                )
            )
        return f"deep_gemm {scheme} contiguous", (
            lambda a, s, w, ws, rows, em, out, offs: raw_deep_gemm_contiguous(
                scheme, a, s, w, ws, rows, out
            )
        )
    if scheme == "bf16" and layout == "masked":
        return "torch.bmm (no deep_gemm bf16 masked)", (
            lambda a, s, w, ws, rows, em, out, offs: torch.bmm(a, w.transpose(1, 2), out=out)
        )
    if scheme == "bf16" and hasattr(torch, "_grouped_mm"):
        from _baselines import raw_grouped_mm

        return "torch._grouped_mm (no deep_gemm bf16 contiguous)", (
            lambda a, s, w, ws, rows, em, out, offs: out.copy_(raw_grouped_mm(a, w, offs))
        )
    raise Skip(f"no raw {scheme} {layout} GEMM here (deep_gemm missing or unsupported GPU)")


def raw_gemms(cfg, scheme, weights, routing, path, capacity, expected_m, alignment, timer):
    """Time raw GEMM1 + GEMM2 (one CUDA graph) on the layer's layout of ``routing``.

    Args:
        weights: (w1, w1_scale, w2, w2_scale[, b1, b2]) prepared like the layer's (its own
            buffers: `[E, width, Hp]` / `[E, Hp, Ip]`, Hp / Ip the sizes the layer pads H / I to;
            b1 / b2 float32 or None). x is zero-padded to Hp; GEMM1's rows get b1 and the
            config's gate (outside the timing), GEMM2's rows b2 in the combine.
        path: "ll" (masked, `[E, capacity, *]`, ``expected_m``) or "ht" (contiguous, reference
            permute at ``alignment``).
    Returns:
        dict of raw_ms (absent, and ``_skip`` set, where the timing needs CUDA), raw_impl,
        raw_layout (C / M_sum), and ``_out``: GEMM2's rows combined per token with the routing
        weights, bf16 `[T, H]` (the layer's output computed the raw way: checks the operands).
    """
    E, H = cfg.local_experts, cfg.hidden
    w1, w1s, w2, w2s = weights[:4]
    b1, b2 = tuple(weights[4:6]) or (None, None)
    x, ids = routing.x, routing.ids
    x = torch.nn.functional.pad(x, (0, w1.shape[2] - H))  # (a copy only where the layer pads)
    dev = x.device
    if path == "ll":
        impl, fn = _raw_impls(scheme, "masked", dev)
        a, rows, slot = masked_layout(x, ids, E, capacity)
        lead, layout, offs = (E, capacity), {"C": capacity, "expected_m": expected_m}, None
        a1, s1 = act_operands(a, scheme)
        expert = torch.arange(E, device=dev)[:, None].expand(lead)
        del a
    else:
        impl, fn = _raw_impls(scheme, "contiguous", dev)
        xq, xs = (x, None) if scheme == "bf16" else reference.quantize(x, scheme)
        a1, s1, rows, inv_perm, offs, _ = reference.permute(xq, ids, E, alignment, xs)
        s1 = None if scheme == "bf16" else _scales_like_layer(s1, scheme)
        lead, layout = (a1.shape[0],), {"M_sum": int(a1.shape[0]), "alignment": alignment}
        live = ids.reshape(-1)
        counts = torch.bincount(live[live >= 0], minlength=E)  # (host reads: a benchmark)
        blocks = (counts + alignment - 1) // alignment * alignment
        layout.update(live_rows=int(counts.sum()), block_rows=int(blocks.sum()))
        expert = rows
    out1 = torch.empty((*lead, w1.shape[1]), dtype=torch.bfloat16, device=dev)
    fn(a1, s1, w1, w1s, rows, expected_m, out1, offs)
    a2, s2 = act_operands(_gated(cfg, out1, b1, expert), scheme)
    out2 = torch.empty((*lead, w2.shape[1]), dtype=torch.bfloat16, device=dev)
    fn(a2, s2, w2, w2s, rows, expected_m, out2, offs)
    timer.sync()

    def both():
        fn(a1, s1, w1, w1s, rows, expected_m, out1, offs)
        fn(a2, s2, w2, w2s, rows, expected_m, out2, offs)

    T, K = ids.shape
    picked = out2[ids.reshape(-1), slot] if path == "ll" else out2[inv_perm.reshape(-1).long()]
    picked = picked.float()
    if b2 is not None:
        picked = picked + b2[ids.reshape(-1)]
    picked = picked[:, :H]
    combined = (picked.view(T, K, -1) * routing.weights.unsqueeze(-1)).sum(1)
    res = {"raw_impl": impl, "raw_layout": layout, "_out": combined.to(torch.bfloat16)}
    try:
        res["raw_ms"] = timer.graph(both)
        res["raw_host_us"] = timer.host_us(both)
    except Skip as e:
        res["_skip"] = str(e)
    return res


# ------------------------------------------------------------------------------------ transformers
def _qwen3_moe_experts(cfg, w1, w2, b1, b2):
    """Qwen3MoeExperts: gate_up_proj `[E, 2I, H]` / down_proj `[E, H, I]`, epmoe's own layout
    (the same tensors, no copy); SiLU, no biases."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    conf = Qwen3MoeConfig(
        hidden_size=cfg.hidden,
        moe_intermediate_size=cfg.intermediate,
        num_experts=cfg.local_experts,
        num_experts_per_tok=cfg.top_k,
    )
    return Qwen3MoeExperts, conf, epmoe.gate.SILU, dict(gate_up_proj=w1, down_proj=w2)


def _gpt_oss_experts(cfg, w1, w2, b1, b2):
    """GptOssExperts: transposed (gate_up_proj `[E, H, 2I]`, down_proj `[E, I, H]`, contiguous as
    in the checkpoint) and interleaved (columns g0, u0, g1, u1, ...; gate_up_proj_bias `[E, 2I]`
    too), down_proj_bias `[E, H]`; the clamped SwiGLU with alpha / limit from ``cfg.gate``."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    g = epmoe.gate.get(cfg.gate)
    conf = GptOssConfig(
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_local_experts=cfg.local_experts,
        num_experts_per_tok=cfg.top_k,
        swiglu_alpha=g.alpha,
        swiglu_limit=g.limit if g.limit is not None else float("inf"),
    )
    computes = epmoe.gate.Gate("silu", alpha=g.alpha, limit=g.limit, up_offset=1.0)
    E, I = w1.shape[0], cfg.intermediate
    if b1 is None:  # the class always adds biases
        b1 = w1.new_zeros((E, 2 * I))
        b2 = w1.new_zeros((E, cfg.hidden))
    tensors = dict(
        gate_up_proj=_interleave(w1, I).transpose(1, 2).contiguous(),
        gate_up_proj_bias=_interleave(b1, I),
        down_proj=w2.transpose(1, 2).contiguous(),
        down_proj_bias=b2,
    )
    return GptOssExperts, conf, computes, tensors


def _interleave(t: torch.Tensor, inter: int) -> torch.Tensor:
    """`[E, 2I, ...]` gate rows then up rows -> rows g0, u0, g1, u1, ... (a new tensor)."""
    return torch.stack((t[:, :inter], t[:, inter:]), dim=2).flatten(1, 2)


def _gemma4_experts(cfg, w1, w2, b1, b2):
    """Gemma4TextExperts: Qwen3's layout (the same tensors, no copy), GELU-tanh, no biases."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    conf = Gemma4TextConfig(
        hidden_size=cfg.hidden,
        moe_intermediate_size=cfg.intermediate,
        num_experts=cfg.local_experts,
        top_k_experts=cfg.top_k,
        enable_moe_block=True,
        hidden_activation="gelu_pytorch_tanh",
        num_hidden_layers=1,
        layer_types=["full_attention"],
    )
    computes = epmoe.gate.Gate("gelu_tanh")
    return Gemma4TextExperts, conf, computes, dict(gate_up_proj=w1, down_proj=w2)


# ModelConfig.hf_experts -> fn(cfg, w1, w2, b1, b2) -> (experts class, its config, the Gate it
# computes, {parameter name: tensor} from epmoe's w1 `[E, 2I, H]`, w2 `[E, H, I]`, b1, b2)
HF_EXPERTS = {
    "qwen3_moe": _qwen3_moe_experts,
    "gpt_oss": _gpt_oss_experts,
    "gemma4": _gemma4_experts,
}


def hf_grouped_mm_experts(cfg, w1: torch.Tensor, w2: torch.Tensor, b1=None, b2=None):
    """transformers' experts class of ``cfg.hf_experts`` (HF_EXPERTS), grouped_mm backend, holding
    epmoe's ``w1`` / ``w2`` / ``b1`` / ``b2`` in its own layout (the tensors themselves where the
    layouts agree). ValueError where that class computes another gate or has no biases."""
    if cfg.hf_experts not in HF_EXPERTS:
        raise ValueError(f"hf_experts: {cfg.hf_experts!r} is none of {sorted(HF_EXPERTS)}")
    cls, conf, computes, tensors = HF_EXPERTS[cfg.hf_experts](cfg, w1, w2, b1, b2)
    if computes != epmoe.gate.get(cfg.gate):
        raise ValueError(f"{cls.__name__} computes the gate {computes.spec}, not {cfg.gate}")
    if cfg.bias and "down_proj_bias" not in tensors:
        raise ValueError(f"{cls.__name__} has no expert biases (config {cfg.name}: bias=True)")
    conf._experts_implementation = "grouped_mm"
    with torch.device("meta"):  # no float32 allocation of E x 3IH parameters
        experts = cls(conf)
    for name, t in tensors.items():
        setattr(experts, name, torch.nn.Parameter(t, requires_grad=False))
    left = [n for n, p in experts.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"{cls.__name__}: parameters {left} not set from epmoe's weights")
    return experts.eval()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# -------------------------------------------------------------------------------------- the layers
def make_layer(cfg, scheme: str, mode: str, tokens: int, max_tokens: int, device):
    kw = dict(quant=scheme, mode=mode, backend="local", device=device, gate=cfg.gate, bias=cfg.bias)
    if mode in ALIGNED_MODES:  # "ht<A>": HT at permute alignment A
        kw.update(mode="ht", alignment=int(mode[2:]))
        mode = "ht"
    if mode == "ll":
        kw["max_tokens_per_rank"] = tokens
    else:
        kw.update(worst_case=True, max_tokens_per_rank=max_tokens)
    return epmoe.EPMoE(cfg.num_experts // cfg.ranks, cfg.hidden, cfg.intermediate, cfg.top_k, **kw)


def _share_weights(dst, src) -> None:
    """dst uses src's prepared weights (same scheme): every buffer load_weights set, no second
    quantization or copy."""
    for name, buf in src.named_buffers(recurse=False):
        setattr(dst, name, buf)
    missing = [
        n for n in WEIGHTS + BIASES if getattr(dst, n, None) is None and getattr(src, n) is not None
    ]
    if missing:
        raise RuntimeError(f"weights not shared: {missing}")


def _path(layer, tokens: int) -> str:
    if hasattr(layer, "path"):
        return layer.path(tokens)
    return layer.mode


class ShapeRun:
    """One shape's global weights, routings, transformers baseline and cached raw results; the
    layers of one scheme at a time."""

    def __init__(self, cfg, device, seed: int, max_tokens: int, timer, routings: int = 1):
        self.cfg, self.device, self.seed, self.timer = cfg, torch.device(device), seed, timer
        self.max_tokens, self.routings_n = max_tokens, routings
        self.copy_gbps: Optional[float] = None  # the run's copy ceiling (GB/s), for floor_ms
        E, H, I = cfg.local_experts, cfg.hidden, cfg.intermediate
        width = epmoe.gate.get(cfg.gate).width(I)
        g = torch.Generator(device=self.device).manual_seed(seed)

        def randn(shape, std):
            t = torch.randn(shape, generator=g, device=self.device, dtype=torch.bfloat16)
            return t.mul_(std)

        # (w1 / w2 first: a config and its plain twin get the same weights)
        self.w1, self.w2 = randn((E, width, H), W_STD), randn((E, H, I), W_STD)
        self.b1 = randn((E, width), B_STD) if cfg.bias else None
        self.b2 = randn((E, H), B_STD) if cfg.bias else None
        self._routings: Dict[int, Routing] = {}
        self._hf = None
        self.hf: Dict[int, dict] = {}  # T -> grouped_mm results (or {"error": ...})
        self.raw: Dict[tuple, dict] = {}  # (scheme, path, T, layout key) -> raw results
        self.scheme: Optional[str] = None
        self.layers: Dict[tuple, object] = {}
        self._anchor = None  # fp8 layer holding the int8 cases' raw-GEMM anchor weights

    def routing(self, tokens: int) -> Routing:
        if tokens not in self._routings:
            self._routings[tokens] = make_routing(self.cfg, tokens, self.seed, self.device)
        return self._routings[tokens]

    def routings(self, tokens: int, n: int) -> Iterator[Routing]:
        """The case's routing, then n - 1 others of ``tokens`` tokens (made one at a time, not
        kept)."""
        yield self.routing(tokens)
        for i in range(1, n):
            yield make_routing(self.cfg, tokens, self.seed + ROUTING_SEED_STEP * i, self.device)

    def use_scheme(self, scheme: str) -> None:
        """Free the layers of the previous scheme (one scheme's weights in memory at a time)."""
        if scheme != self.scheme:
            self.layers.clear()
            self._anchor = None
            self.scheme = scheme
            _free()

    def layer(self, scheme: str, mode: str, tokens: int):
        self.use_scheme(scheme)
        key = (mode, tokens if mode == "ll" else None)
        if key in self.layers:
            return self.layers[key]
        base = self.layers.get(("ht", None))
        if base is None:
            base = make_layer(self.cfg, scheme, "ht", tokens, self.max_tokens, self.device)
            base.load_weights(self.w1, self.w2, b1=self.b1, b2=self.b2)
            self.layers[("ht", None)] = base
        if mode == "ht":
            return base
        if mode == "ll":  # one LL layer at a time: drop the previous T's
            for k in [k for k in self.layers if k[0] == "ll"]:
                del self.layers[k]
        layer = make_layer(self.cfg, scheme, mode, tokens, self.max_tokens, self.device)
        _share_weights(layer, base)
        self.layers[key] = layer
        return layer

    def anchor_weights(self, scheme: str):
        """Weights and biases (WEIGHTS + BIASES) of the raw GEMM that anchors ``scheme``: its own
        layer's, fp8's for int8."""
        if scheme != "int8":
            base = self.layers[("ht", None)]
        else:
            if self._anchor is None:
                self._anchor = make_layer(self.cfg, "fp8", "ht", 1, self.max_tokens, self.device)
                self._anchor.load_weights(self.w1, self.w2, b1=self.b1, b2=self.b2)
            base = self._anchor
        return tuple(getattr(base, n) for n in WEIGHTS + BIASES)

    def experts(self):
        if self._hf is None:
            try:
                self._hf = hf_grouped_mm_experts(self.cfg, self.w1, self.w2, self.b1, self.b2)
            except ImportError as e:
                raise Skip(
                    f"transformers' experts ({self.cfg.hf_experts}) not importable: {_err(e)}"
                ) from e
        return self._hf

    def close(self) -> None:
        self.layers.clear()
        self._anchor = self._hf = None
        self._routings.clear()
        self.hf.clear()
        self.w1 = self.w2 = self.b1 = self.b2 = None
        _free()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------- one case
def new_record(case: Case, cfg) -> dict:
    return {
        "id": case.id,
        "shape": case.shape,
        "E": cfg.local_experts,
        "H": cfg.hidden,
        "I": cfg.intermediate,
        "K": cfg.top_k,
        "gate": cfg.gate,
        "bias": cfg.bias,
        "T": case.tokens,
        "scheme": case.scheme,
        "mode": case.mode,
        "path": None,
        "status": "running",
        "errors": {},
        "skips": {},
        "step_s": {},
    }


def _step(rec: dict, name: str, fn: Callable[[], Optional[dict]]) -> None:
    """Run one measurement: its dict merged into rec, or its error / skip recorded."""
    t0 = time.perf_counter()
    try:
        out = fn()
        if out:
            rec.update(out)
    except Skip as e:
        rec["skips"][name] = str(e)
    except Fatal:
        raise
    except Exception as e:  # noqa: BLE001 - record it and go on
        rec["errors"][name] = _err(e)
        _after_error(e)
    finally:
        rec["step_s"][name] = round(time.perf_counter() - t0, 3)


def _after_error(e: BaseException) -> None:
    """Raise Fatal when the CUDA context cannot run anything more."""
    msg = str(e)
    if any(s in msg for s in _FATAL):
        raise Fatal(msg[:500])
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except Exception as e2:  # noqa: BLE001 - a sticky error shows here
            raise Fatal(_err(e2)) from e2
        _free()


def _grouped_mm(sr: ShapeRun, tokens: int, steps) -> dict:
    """transformers grouped_mm at T (cached per shape): eager / graph ms, host µs, output."""
    if tokens in sr.hf:
        return sr.hf[tokens]
    res: dict = {"errors": {}, "skips": {}}
    r = sr.routing(tokens)
    wb = r.weights.to(torch.bfloat16)
    try:
        experts = sr.experts()

        def call():
            return experts(r.x, r.ids, wb)

        res["out"] = call()
        sr.timer.sync()
    except Skip as e:
        res["skips"]["grouped_mm"] = str(e)
        sr.hf[tokens] = res
        return res
    except Exception as e:  # noqa: BLE001
        res["errors"]["grouped_mm"] = _err(e)
        _after_error(e)
        sr.hf[tokens] = res
        return res
    for key, fn in (
        ("grouped_mm_eager_ms", lambda: sr.timer.eager(call)),
        ("grouped_mm_graph_ms", lambda: sr.timer.graph(call)),
        ("grouped_mm_host_us", lambda: sr.timer.host_us(call) if "host" in steps else None),
    ):
        try:
            v = fn()
            if v is not None:
                res[key] = v
        except Skip as e:
            res["skips"][key] = str(e)
        except Exception as e:  # noqa: BLE001
            res["errors"][key] = _err(e)
            _after_error(e)
    sr.hf[tokens] = res
    return res


def run_case(
    sr: ShapeRun,
    case: Case,
    steps,
    rec: Optional[dict] = None,
    budget=None,
    stack: int = STACK_LAYERS,
) -> dict:
    """Measure one case (the steps named in ``steps``) into ``rec`` (a new record by default).

    Steps: "eager" (eager_ms, eager_loop_ms), "host", "launches", "graph", "kernels", "compile",
    "raw", "grouped_mm", "stack" (``stack`` calls of the layer in one module, eager, graph and
    compiled: the ``stack_`` figures, per layer). The floor and ratios are always filled in.
    """
    cfg, timer, T = sr.cfg, sr.timer, case.tokens
    rec = new_record(case, cfg) if rec is None else rec
    rec["status"] = "running"
    t_case = time.perf_counter()
    try:
        layer = sr.layer(case.scheme, case.mode, T)
    except ValueError as e:
        if case.mode == "auto" and "mode" in str(e):
            rec["status"] = "skipped"
            rec["skips"]["layer"] = f"mode='auto' not supported here: {_err(e)}"
            return rec
        rec["errors"]["layer"] = _err(e)
        rec["status"] = "error"
        return rec
    except Exception as e:  # noqa: BLE001
        rec["errors"]["layer"] = _err(e)
        rec["status"] = "error"
        _after_error(e)
        return rec
    rec["path"] = path = _path(layer, T)
    r = sr.routing(T)
    rec["experts_hit"] = r.experts_hit
    rec["weight_bytes"] = r.experts_hit * expert_weight_bytes(cfg, case.scheme)
    halves = epmoe.gate.get(cfg.gate).width(1)
    rec["flops"] = 2 * T * cfg.top_k * (halves + 1) * cfg.hidden * cfg.intermediate
    x, ids, w = r.x, r.ids, r.weights

    def call():
        return layer(x, ids, w)

    state: dict = {}

    def warm():
        if hasattr(layer, "warmup"):
            layer.warmup([T])
        state["out"] = call()
        timer.sync()

    _step(rec, "warmup", warm)
    if "warmup" in rec["errors"]:
        rec["status"] = "error"
        return rec
    if "eager" in steps:
        _step(
            rec,
            "eager",
            lambda: dict(
                eager_ms=timer.eager(call),
                eager_loop_ms=timer.loop(call),
                eager_queued_ms=timer.queued(call),
            ),
        )
    if "host" in steps:
        _step(rec, "host", lambda: {"host_us": timer.host_us(call)})
    if "launches" in steps:
        _step(rec, "launches", lambda: timer.launches(call))
    if "graph" in steps:
        _step(rec, "graph", lambda: {"graph_ms": timer.graph(call)})
    if "routings" in steps and sr.routings_n > 1 and "graph_ms" in rec:
        _step(rec, "routings", lambda: _routings_step(sr, layer, T, case.scheme))
    if "kernels" in steps:
        _step(rec, "kernels", lambda: timer.kernel_us(call))
    if "raw" in steps:
        _step(rec, "raw", lambda: _raw_step(sr, case, layer, path, rec, state["out"]))
    if "grouped_mm" in steps:
        _step(rec, "grouped_mm", lambda: _grouped_mm_step(sr, case, state["out"], rec, steps))
    if "compile" in steps:
        for name in COMPILE_VARIANTS:
            _step(
                rec,
                name,
                lambda v=name: _compile_step(layer, (x, ids, w), state["out"], v, timer, budget),
            )
    if "stack" in steps and stack > 1:
        st = LayerStack(layer, stack)
        _step(rec, "stack", lambda: _stack_eager_step(st, (x, ids, w), timer, state))
        for name in COMPILE_VARIANTS:
            if "stack_out" in state:
                _step(
                    rec,
                    f"stack_{name}",
                    lambda v=name: _stack_compile_step(st, (x, ids, w), state, v, timer, budget),
                )
    rec["floor_ms"] = rec["weight_bytes"] / (sr.copy_gbps * 1e6) if sr.copy_gbps else None
    rec["ratios"] = ratios(rec)
    rec["status"] = "error" if rec["errors"] else "ok"
    rec["case_s"] = round(rec.get("case_s", 0.0) + time.perf_counter() - t_case, 3)
    return rec


def _routings_step(sr: ShapeRun, layer, T: int, scheme: str) -> dict:
    """graph_ms and floor_ms on each of the shape run's routings of T tokens, and their medians."""
    graph, floor = [], []
    for r in sr.routings(T, sr.routings_n):
        graph.append(sr.timer.graph(lambda r=r: layer(r.x, r.ids, r.weights)))
        if sr.copy_gbps:
            floor.append(r.experts_hit * expert_weight_bytes(sr.cfg, scheme) / (sr.copy_gbps * 1e6))
    out = dict(graph_ms_routings=graph, graph_median_ms=statistics.median(graph))
    if floor:
        out.update(floor_ms_routings=floor, floor_median_ms=statistics.median(floor))
    return out


def _raw_step(sr: ShapeRun, case: Case, layer, path: str, rec: dict, out) -> dict:
    """Raw GEMM1 + GEMM2 of the case's layout; cached per (anchor scheme, path, T, layout)."""
    T = case.tokens
    anchor = "fp8" if case.scheme == "int8" else case.scheme
    if path == "ll":
        block = gemm.masked_row_block(anchor, sr.device)
        cap = getattr(layer, "ll_capacity", 0) or T
        cap = reference.round_up(cap, block)
        em = int(layer.expected_m(T)) if hasattr(layer, "expected_m") else T
        key, args = (anchor, path, T, cap, em), (cap, em, None)
    else:
        # (deep_gemm's own 128-row blocks anchor the smaller alignments of the ht<A> modes)
        align = reference.round_up(int(getattr(layer, "alignment", 128)), 128)
        key, args = (anchor, path, T, align), (None, 0, align)
    if key not in sr.raw:
        try:
            res = raw_gemms(
                sr.cfg, anchor, sr.anchor_weights(case.scheme), sr.routing(T), path, *args, sr.timer
            )
        except Skip as e:
            res = {"_skip": str(e)}
        except Exception as e:  # noqa: BLE001
            res = {"_error": _err(e)}
            _after_error(e)
        sr.raw[key] = res
    cached = sr.raw[key]
    if "_error" in cached:
        raise RuntimeError(cached["_error"])
    if "_skip" in cached:
        rec["skips"]["raw"] = cached["_skip"]
    res = {k: v for k, v in cached.items() if not k.startswith("_")}
    if "_out" in cached:
        res["raw_rel_l2_vs_layer"] = rel_l2(out, cached["_out"])
    if anchor != case.scheme and "raw_impl" in res:
        res["raw_impl"] += f" (anchor for {case.scheme}: no deep_gemm {case.scheme})"
    return res


def _grouped_mm_step(sr: ShapeRun, case: Case, out: torch.Tensor, rec: dict, steps) -> dict:
    """The (cached) grouped_mm figures of the case's T, and the layer's output against it; its
    failures go to rec's errors / skips as "grouped_mm/<key>"."""
    res = _grouped_mm(sr, case.tokens, steps)
    for k, v in res["skips"].items():
        rec["skips"][k if k == "grouped_mm" else f"grouped_mm/{k}"] = v
    for k, v in res["errors"].items():
        rec["errors"][k if k == "grouped_mm" else f"grouped_mm/{k}"] = v
    got = {k: v for k, v in res.items() if k.startswith("grouped_mm_")}
    if "out" in res:
        err = rel_l2(out, res["out"])
        got["rel_l2_vs_grouped_mm"] = err
        if case.scheme == "bf16":
            got["matches_grouped_mm"] = err <= GROUPED_MM_TOL
    return got


def _compile_step(layer, args, eager_out, variant, timer, budget, layers: int = 1) -> dict:
    """torch.compile(layer) as COMPILE_VARIANTS[variant] says on ``args``: compile seconds,
    timing, graph breaks and whether the output has the eager bytes (figures named
    ``<variant>_*``; ``layers``: layer calls in one call of ``layer``, for host_us)."""
    if timer.device != "cuda":
        raise Skip("needs CUDA")
    if budget is not None and budget.left() < COMPILE_RESERVE_S:
        raise Skip(f"budget: {budget.left():.0f} s left, a compile needs ~{COMPILE_RESERVE_S:.0f}")
    if budget is not None and budget.compile_left() <= 0:
        raise Skip("compile budget spent (--compile-budget-s)")
    import torch._dynamo

    t_step = time.perf_counter()

    prefix, kw = variant, COMPILE_VARIANTS[variant]
    mode = kw.get("mode")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(layer, dynamic=False, **kw)

    def run():
        if mode == "reduce-overhead":  # each call a new step: earlier outputs are not kept
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args)

    try:
        t0 = time.perf_counter()
        out = run().clone()
        timer.sync()
        res = {f"{prefix}_s": round(time.perf_counter() - t0, 2)}
        res[f"{prefix}_ms"] = timer.eager(run)
        res[f"{prefix}_loop_ms"] = timer.loop(run)
        res[f"{prefix}_queued_ms"] = timer.queued(run)
        res[f"{prefix}_host_us"] = timer.host_us(run, layers)
        res.update({f"{prefix}_{k}": v for k, v in timer.launches(run).items()})
        res[f"{prefix}_graph_breaks"] = int(sum(counters["graph_break"].values()))
        if counters["graph_break"]:
            res[f"{prefix}_break_reasons"] = [str(k)[:200] for k in counters["graph_break"]][:5]
        # reduce-overhead falls back to no CUDA graph silently (e.g. a cudagraph-unsafe op)
        res[f"{prefix}_cudagraph_skips"] = int(counters["inductor"].get("cudagraph_skips", 0))
        res[f"{prefix}_same_bytes"] = bool(torch.equal(out, eager_out))
        return res
    finally:
        torch._dynamo.reset()
        _free()
        if budget is not None:
            budget.compile_spent += time.perf_counter() - t_step


class LayerStack(torch.nn.Module):
    """``n`` calls of one layer, each on the previous call's output, in one forward: a model's MoE
    layers as torch.compile sees them (one frame, its per-call cost paid once for ``n`` layers)."""

    def __init__(self, layer, n: int):
        super().__init__()
        self.layer, self.n = layer, n

    def forward(self, x, topk_ids, topk_weights):
        for _ in range(self.n):
            x = self.layer(x, topk_ids, topk_weights)
        return x


def _stack_eager_step(stack: LayerStack, args, timer, state: dict) -> dict:
    """The stack eager and as a plain CUDA graph: ms and host µs per layer."""
    state["stack_out"] = stack(*args).clone()
    timer.sync()
    n = stack.n

    def call():
        return stack(*args)

    res = {"stack_layers": n}
    res["stack_eager_ms"] = timer.eager(call) / n
    res["stack_eager_loop_ms"] = timer.loop(call) / n
    res["stack_eager_queued_ms"] = timer.queued(call) / n
    res["stack_host_us"] = timer.host_us(call, n) / n
    if timer.device == "cuda":
        res["stack_graph_ms"] = timer.graph(call) / n
    return res


def _stack_compile_step(stack: LayerStack, args, state: dict, variant, timer, budget) -> dict:
    """torch.compile of the stack as ``variant``: _compile_step's figures as ``stack_<variant>*``;
    times, launches and device µs per layer, the rest (copies, kernels, flags) per stack call."""
    got = _compile_step(stack, args, state["stack_out"], variant, timer, budget, stack.n)
    per_layer = ("_ms", "_host_us", "_launches", "_device_us")  # (_ms: also _loop_ms, _queued_ms)
    return {f"stack_{k}": v / stack.n if k.endswith(per_layer) else v for k, v in got.items()}


def ratios(rec: dict) -> dict:
    """Layer time over each baseline (None where a side is missing)."""

    def q(a, b):
        va, vb = rec.get(a), rec.get(b)
        return va / vb if va is not None and vb else None

    out = {
        "graph_over_raw": q("graph_ms", "raw_ms"),
        "eager_over_raw": q("eager_ms", "raw_ms"),
        "graph_over_grouped_mm_graph": q("graph_ms", "grouped_mm_graph_ms"),
        "eager_over_grouped_mm_eager": q("eager_ms", "grouped_mm_eager_ms"),
        "graph_over_floor": q("graph_ms", "floor_ms"),
        "graph_median_over_floor_median": q("graph_median_ms", "floor_median_ms"),
        "eager_over_floor": q("eager_ms", "floor_ms"),
        "raw_over_floor": q("raw_ms", "floor_ms"),
        "compile_over_eager": q("compile_ms", "eager_ms"),
        "compile_ro_over_graph": q("compile_ro_ms", "graph_ms"),
        "compile_sl_over_eager": q("compile_sl_ms", "eager_ms"),
        "compile_host_over_eager": q("compile_host_us", "host_us"),
        "compile_sl_host_over_eager": q("compile_sl_host_us", "host_us"),
        "compile_ro_queued_over_graph": q("compile_ro_queued_ms", "graph_ms"),
        "stack_compile_over_eager": q("stack_compile_ms", "stack_eager_ms"),
        "stack_compile_host_over_eager": q("stack_compile_host_us", "stack_host_us"),
        "stack_compile_ro_over_graph": q("stack_compile_ro_ms", "stack_graph_ms"),
        "stack_compile_sl_over_eager": q("stack_compile_sl_ms", "stack_eager_ms"),
        "stack_compile_sl_host_over_eager": q("stack_compile_sl_host_us", "stack_host_us"),
        "host_over_raw_host": q("host_us", "raw_host_us"),
    }
    return {k: v for k, v in out.items() if v is not None}


# ------------------------------------------------------------------------------------------- plan
class Budget:
    """The run's wall-clock budget, and the part of it compile steps may spend."""

    def __init__(self, seconds: float, compile_seconds: float = 0.0):
        self.seconds, self.t0 = seconds, time.perf_counter()
        self.compile_seconds, self.compile_spent = compile_seconds, 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def compile_left(self) -> float:
        return self.compile_seconds - self.compile_spent


def parse_only(items: List[str]) -> Dict[str, list]:
    """``--only`` filters: ``key=v1,v2`` (keys shape, scheme, mode, T) or bare values (a shape,
    scheme, mode name or a token count). Values of one key are OR-ed, keys AND-ed."""
    keys = {"shape": "shape", "shapes": "shape", "scheme": "scheme", "schemes": "scheme"}
    keys.update({"quant": "scheme", "mode": "mode", "modes": "mode", "t": "T", "tokens": "T"})
    out: Dict[str, list] = {}
    for item in items or []:
        for part in item.split():
            key, _, vals = part.partition("=")
            if not vals:  # a bare value
                vals, key = key, None
            for v in (v for v in vals.split(",") if v):
                k = keys.get(key.lower()) if key else _dimension_of(v)
                if k is None:
                    raise SystemExit(f"--only: unknown key or value {part!r}")
                val = int(v) if k == "T" else v
                if k == "shape" and val not in _configs.CONFIGS:
                    raise SystemExit(f"--only: unknown shape {v!r}; known {list(_configs.CONFIGS)}")
                bad_mode = k == "mode" and val not in MODES + ALIGNED_MODES
                if (k == "scheme" and val not in SCHEMES) or bad_mode:
                    raise SystemExit(f"--only: unknown {k} {v!r}")
                out.setdefault(k, []).append(val)
    return out


def _dimension_of(v: str) -> Optional[str]:
    if v in _configs.CONFIGS:
        return "shape"
    if v in SCHEMES:
        return "scheme"
    if v in MODES + ALIGNED_MODES:
        return "mode"
    return "T" if v.isdigit() else None


def plan_cases(shapes, schemes, modes, tokens) -> List[Case]:
    return [
        Case(s, q, m, t)
        for s in shapes
        for q in schemes
        for m in modes
        for t in tokens
        if not (m == "ll" and t > LL_MAX_TOKENS)
    ]


def compile_targets(records: List[dict], args) -> List[dict]:
    """The records to compile: every measured one (--compile-all) or, per (shape, scheme, T) of
    COMPILE_SHAPES x COMPILE_TOKENS, the "auto" record, else "ll" (T <= LL_MAX_TOKENS) / "ht"."""
    ok = [r for r in records if r["status"] in ("ok", "error") and "warmup" not in r["errors"]]
    if args.compile_all:
        return ok
    shapes = args.compile_shapes.split(",") if args.compile_shapes else COMPILE_SHAPES
    tokens = [int(t) for t in args.compile_tokens.split(",")] if args.compile_tokens else None
    tokens = tokens or COMPILE_TOKENS
    groups: Dict[tuple, Dict[str, dict]] = {}
    for r in ok:
        if r["shape"] in shapes and r["T"] in tokens:
            groups.setdefault((r["shape"], r["scheme"], r["T"]), {})[r["mode"]] = r
    out = []
    for (_, _, t), by_mode in groups.items():
        pick = by_mode.get("auto") or by_mode.get("ll" if t <= LL_MAX_TOKENS else "ht")
        pick = pick or next(iter(by_mode.values()))
        out.append(pick)
    return out


# ----------------------------------------------------------------------------------------- summary
def summarize(report: dict) -> None:
    """The run's comparisons across cases, rewritten with the JSON: ``gate_bias_cost`` (a config
    with a ``plain`` twin against that twin at the same scheme, mode and T, where both ran) and
    ``targets`` (TARGETS, on the "auto" layer's cases that ran)."""
    done = {
        (r["shape"], r["scheme"], r["mode"], r["T"]): r
        for r in report["cases"]
        if r.get("status") in ("ok", "error")
    }
    report["gate_bias_cost"] = []
    for (shape, scheme, mode, T), r in done.items():
        plain = _configs.CONFIGS[shape].plain if shape in _configs.CONFIGS else None
        p = done.get((plain, scheme, mode, T))
        if p is None:
            continue
        e = {"shape": shape, "plain": plain, "scheme": scheme, "mode": mode, "T": T}
        for k in ("graph", "eager"):
            a, b = r.get(f"{k}_ms"), p.get(f"{k}_ms")
            e.update({f"{k}_ms": a, f"plain_{k}_ms": b, f"{k}_ratio": a / b if a and b else None})
        e["ratio"], e["max_ratio"] = e["graph_ratio"], GATE_BIAS_MAX
        a, b = r.get("kernel_us") or {}, p.get("kernel_us") or {}
        e["kernel_delta_us"] = {k: round(a.get(k, 0.0) - b.get(k, 0.0), 1) for k in {*a, *b}}
        e["met"] = None if e["ratio"] is None else bool(e["ratio"] <= GATE_BIAS_MAX)
        report["gate_bias_cost"].append(e)
    h200 = "H200" in str(report.get("device", ""))
    report["targets"] = []
    for shape, scheme, (lo, hi), limit, against in TARGETS:
        for (s, q, m, T), r in done.items():
            if (s, q, m) != (shape, scheme, "auto") or T < lo or (hi is not None and T > hi):
                continue
            ratio, ref = _target_ratio(r, against, done, h200)
            if against == "vllm" and ref is None:
                continue  # (no figure at this T, or not an H200)
            t = {"shape": s, "scheme": q, "mode": m, "T": T, "against": against,
                 "reference_ms": ref, "max_ratio": limit, "ratio": ratio}  # fmt: skip
            t["met"] = None if ratio is None else bool(ratio <= limit)
            report["targets"].append(t)


def _graph(r: Optional[dict]) -> Optional[float]:
    """A record's graph ms: the median over its routings where it has them."""
    return (r.get("graph_median_ms") or r.get("graph_ms")) if r else None


def _target_ratio(r: dict, against, done: dict, h200: bool):
    """(the layer's graph ms over the target's reference, the reference's ms) of record ``r``
    (None where the reference did not run)."""
    if against == "grouped_mm":
        return r.get("ratios", {}).get("graph_over_grouped_mm_graph"), r.get("grouped_mm_graph_ms")
    if against == "floor":
        ref = r.get("floor_median_ms") if r.get("graph_median_ms") else r.get("floor_ms")
    elif against == "fp8":
        ref = _graph(done.get((r["shape"], "fp8", r["mode"], r["T"])))
    elif against == "vllm":
        ref = VLLM_H200_MS.get((r["shape"], r["scheme"]), {}).get(r["T"]) if h200 else None
    else:
        ref = float(against)
    g = _graph(r)
    return (g / ref if g and ref else None), ref


def summary_lines(report: dict) -> List[str]:
    lines = [
        f"gate_bias_cost {e['shape']} / {e['plain']} {e['scheme']} {e['mode']} T{e['T']}: "
        f"graph {_fmt(e['ratio'])} eager {_fmt(e['eager_ratio'])} (<= {e['max_ratio']}: "
        f"{e['met']})"
        for e in report.get("gate_bias_cost", [])
    ]
    lines += [
        f"target {t['shape']} {t['scheme']} {t['mode']} T{t['T']} graph / {t['against']} "
        f"<= {t['max_ratio']:.3f}: {_fmt(t['ratio'])} {t['met']}"
        for t in report.get("targets", [])
    ]
    return lines


# ------------------------------------------------------------------------------------------ report
def _clean(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


def write_json(path: str, report: dict) -> None:
    """Atomic rewrite (a run killed mid-write keeps the previous file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(report), f, indent=1)
    os.replace(tmp, path)


def _fmt(v, nd=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


TABLE_COLUMNS = (
    ("case", lambda r: f"{r['shape'][:16]:16s} {r['scheme']:>4} {r['mode']:>4} {r['T']:>5}"),
    ("path", lambda r: r.get("path")),
    ("eager", lambda r: r.get("eager_ms")),
    ("graph", lambda r: r.get("graph_ms")),
    ("cmp", lambda r: r.get("compile_ms")),
    ("cmp_ro", lambda r: r.get("compile_ro_ms")),
    ("raw", lambda r: r.get("raw_ms")),
    ("gmm_e", lambda r: r.get("grouped_mm_eager_ms")),
    ("gmm_g", lambda r: r.get("grouped_mm_graph_ms")),
    ("floor", lambda r: r.get("floor_ms")),
    ("g/raw", lambda r: r.get("ratios", {}).get("graph_over_raw")),
    ("g/gmm", lambda r: r.get("ratios", {}).get("graph_over_grouped_mm_graph")),
    ("g/flr", lambda r: r.get("ratios", {}).get("graph_over_floor")),
    ("host_us", lambda r: r.get("host_us")),
    ("lnch", lambda r: r.get("launches")),
    ("rel", lambda r: r.get("rel_l2_vs_grouped_mm")),
    ("status", lambda r: r["status"] + (f" ({','.join(r['errors'])})" if r.get("errors") else "")),
)


def table(records: List[dict]) -> str:
    rows = [[name for name, _ in TABLE_COLUMNS]]
    for r in records:
        rows.append([_fmt(fn(r), 4 if name == "rel" else 3) for name, fn in TABLE_COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


# -------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON path (rewritten after every case)")
    ap.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS}")
    ap.add_argument("--only", nargs="*", default=[], help="shape=.. scheme=.. mode=.. T=..")
    ap.add_argument("--budget-s", type=float, default=500.0)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-all", action="store_true")
    ap.add_argument("--compile-budget-s", type=float, default=COMPILE_BUDGET_S)
    ap.add_argument("--compile-shapes", default=None, help=f"default {','.join(COMPILE_SHAPES)}")
    ap.add_argument("--compile-tokens", default=None, help=f"default {COMPILE_TOKENS}")
    ap.add_argument(
        "--stack",
        type=int,
        default=STACK_LAYERS,
        help="layers of the compiled-stack figures on the compile targets (0: none)",
    )
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-raw", action="store_true")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per figure (>= 20 on GPU)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--routings", type=int, default=1, help="graph_ms also on this many routings (median)"
    )
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU (no GPU timing)")
    return ap


def main(argv=None) -> dict:
    """Run the benchmark; returns the report (also written to ``--out``)."""
    args = build_parser().parse_args(argv)
    budget = Budget(args.budget_s, 0.0 if args.no_compile else args.compile_budget_s)
    torch.set_grad_enabled(False)
    only = parse_only(args.only)
    if args.cpu_smoke:
        device, timer = torch.device("cpu"), CpuTimer(CPU_SMOKE["iters"], CPU_SMOKE["warmup"])
        shapes, tokens = [CPU_SMOKE["shape"]], CPU_SMOKE["tokens"]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_one_gpu: needs a CUDA GPU (or --cpu-smoke)")
        device = torch.device("cuda", torch.cuda.current_device())
        timer = CudaTimer(max(args.iters, 20), args.warmup)
        shapes, tokens = list(SHAPES), QUICK_TOKENS if args.quick else TOKENS
    shapes = only.get("shape", shapes)
    tokens = sorted(set(only.get("T", tokens)))
    cases = plan_cases(shapes, only.get("scheme", SCHEMES), only.get("mode", MODES), tokens)
    steps = {"eager", "host", "launches", "graph", "routings", "kernels", "raw", "grouped_mm"}
    if args.no_raw:
        steps.discard("raw")
    if args.no_transformers:
        steps.discard("grouped_mm")
    report = _report.header("bench_one_gpu.py", argv, args, device, "cases")
    run = _Run(args, report, budget, device, timer, steps, max(tokens))
    try:
        report.update(timer.copy_gbps())
    except Exception as e:  # noqa: BLE001
        report["notes"].append(f"copy bandwidth not measured: {_err(e)}")
        report["copy_gbps"] = None
    _host_reference(report, timer, device, "start")

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, on_term)
    run.save()
    try:
        by_shape: Dict[str, List[Case]] = {}
        for c in cases:
            by_shape.setdefault(c.shape, []).append(c)
        for shape_cases in by_shape.values():
            if "fatal" in report:
                _skip_rest(shape_cases, report, "fatal")
            elif budget.left() <= 0:
                _skip_rest(shape_cases, report, "budget")
            else:
                _run_shape(run, shape_cases)
        report["complete"] = not report["skipped"] and "fatal" not in report
    except KeyboardInterrupt as e:
        report["notes"].append(f"interrupted: {e}")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        _host_reference(report, timer, device, "end")
        run.save()
        print(table(report["cases"]), flush=True)
        for line in summary_lines(report):
            print(line, flush=True)
        for n in report["notes"]:
            print("note:", n, flush=True)
    return report


def host_reference(timer, device) -> Dict[str, float]:
    """Host µs per call of ``x + x`` and of ``torch.empty`` on ``device`` (timer.host_us)."""
    x = torch.ones(1024, device=device)
    return {
        "x_plus_x": round(timer.host_us(lambda: x + x), 2),
        "empty": round(timer.host_us(lambda: torch.empty(1024, device=device)), 2),
    }


def _host_reference(report: dict, timer, device, when: str) -> None:
    try:
        report.setdefault("host_ref_us", {})[when] = host_reference(timer, device)
    except Exception as e:  # noqa: BLE001  (a reference, not a case: the run goes on)
        report["notes"].append(f"host reference ({when}) not measured: {_err(e)}")


@dataclass
class _Run:
    args: argparse.Namespace
    report: dict
    budget: "Budget"
    device: torch.device
    timer: object
    steps: set
    max_tokens: int

    def save(self) -> None:
        self.report["elapsed_s"] = round(self.budget.elapsed(), 1)
        summarize(self.report)
        write_json(self.args.out, self.report)


def _run_shape(run: _Run, cases: List[Case]) -> None:
    """One shape: its cases (weights built once), then torch.compile of its compile targets."""
    report, budget = run.report, run.budget
    shape = cases[0].shape
    cfg = _configs.CONFIGS[shape]
    try:
        sr = ShapeRun(cfg, run.device, run.args.seed, run.max_tokens, run.timer, run.args.routings)
    except Exception as e:  # noqa: BLE001
        report["notes"].append(f"{shape}: weights not built: {_err(e)}")
        _skip_rest(cases, report, "weights not built")
        _free()
        return
    sr.copy_gbps = report.get("copy_gbps")
    mine: List[dict] = []
    try:
        for i, case in enumerate(cases):
            if budget.left() <= 0:
                _skip_rest(cases[i:], report, "budget")
                break
            rec = new_record(case, cfg)
            report["cases"].append(rec)
            mine.append(rec)
            if not _guarded(run, sr, case, run.steps, rec):
                _skip_rest(cases[i + 1 :], report, "fatal")
                return
        if budget.compile_left() > 0:
            for rec in compile_targets(mine, run.args):
                if budget.left() < COMPILE_RESERVE_S or budget.compile_left() <= 0:
                    report["notes"].append(
                        f"compile of {rec['id']} and later skipped: budget "
                        f"({budget.left():.0f} s left, compile {budget.compile_left():.0f} s)"
                    )
                    break
                case = Case(rec["shape"], rec["scheme"], rec["mode"], rec["T"])
                if not _guarded(run, sr, case, {"compile", "stack"}, rec, compile_only=True):
                    return
    finally:
        sr.close()
        del sr
        _free()


def _guarded(run: _Run, sr, case: Case, steps, rec: dict, compile_only: bool = False) -> bool:
    """run_case, then progress and the JSON; False when the CUDA context is gone."""
    try:
        run_case(sr, case, steps, rec, run.budget, run.args.stack)
    except Fatal as e:
        rec["status"] = "error"
        rec["errors"]["fatal"] = str(e)
        run.report["fatal"] = f"{case.id}: {e}"
        run.report["notes"].append(f"CUDA context lost at {case.id}; run stopped")
        run.save()
        return False
    print(_progress(rec, run.budget, compile_only), flush=True)
    run.save()
    return True


def _skip_rest(cases, report, why: str) -> None:
    """Record ``cases`` as skipped (``why``) with one note."""
    if not cases:
        return
    for c in cases:
        rec = {"id": c.id, "shape": c.shape, "scheme": c.scheme, "mode": c.mode, "T": c.tokens}
        rec.update(status="skipped", errors={}, skips={"case": why})
        report["cases"].append(rec)
        report["skipped"].append(c.id)
    report["notes"].append(f"{len(cases)} case(s) skipped ({why}), from {cases[0].id}")


def _progress(rec: dict, budget: Budget, compile_only: bool = False) -> str:
    """A case's log line (graph_ms: the case's own routing; graph_median_ms, with --routings: the
    median over them, what the targets divide)."""
    keys = ("compile_ms", "compile_ro_ms") if compile_only else \
        ("eager_ms", "graph_ms", "graph_median_ms", "raw_ms")  # fmt: skip
    vals = " ".join(f"{k}={_fmt(rec.get(k))}" for k in keys if k in rec or k != "graph_median_ms")
    errs = f" errors={list(rec['errors'])}" if rec.get("errors") else ""
    return f"[{budget.elapsed():6.1f}s] {rec['id']} {rec['status']} {vals}{errs}"


if __name__ == "__main__":
    main()
