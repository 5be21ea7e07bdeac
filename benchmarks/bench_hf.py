"""transformers end to end: a MoE model (Qwen3-30B-A3B-shaped by default) through transformers'
compiled static-cache step, per experts backend, with the experts' own cost isolated by a no-op
experts backend.

    PYTHONPATH=.:benchmarks python benchmarks/bench_hf.py --out OUT.json [--model qwen3-30b-a3b]
        [--layers 8] [--impls grouped_mm,epmoe,epmoe_fp8,epmoe_int8] [--batches 1,8,64,128]
        [--prefill 4096,16384] [--context 512] [--budget-s 540] [--iters 30] [--no-compile]
        [--profile]
    PYTHONPATH=.:benchmarks python benchmarks/bench_hf.py --cpu-smoke --out smoke.json [--model ..]

Models (MODELS, ``--model``), each its architecture from its checkpoint's config.json with the MoE
sizes from the named config in ``_configs.CONFIGS``, ``--layers`` of its layers (same per-layer
shapes; default MODELS' ``layers``), random init, bf16, built once on the GPU:

- ``qwen3-30b-a3b`` (QWEN3_30B_A3B; H 2048, I 768, 128 experts, top-8; 8 of its 48 layers);
- ``gpt-oss-20b`` (GPT_OSS_20B; H 2880, I 2880, 32 experts, top-4, expert biases, the clamped
  SwiGLU; ``GptOssExperts``: transposed, interleaved gate / up; 2 of its 24 layers, one sliding-
  window and one full attention);
- ``gemma4-26b-a4b`` (GEMMA4_26B_A4B, the text model of google/gemma-4-26B-A4B; H 2816, I 704,
  128 experts, top-8, GELU-tanh; its dense MLP runs beside the experts in every layer; 2 of its 30
  layers: the layer types cut to ``--layers`` with the last one full attention, as the config
  requires).

Every backend runs the same weights (``model.set_experts_implementation``). Backends: "noop" (an
experts backend that returns zeros, registered here: the step without the experts' work) and
``--impls``. An epmoe backend that runs transformers' own backend instead (epmoe's integration
declines the experts class: a warning, and the fallback's name and reason in ``epmoe_fallback``)
gets no ratio.

Cases: decode steps at batch B (``--batches``: B sequences of one token at position ``--context``
of a static cache) and prefill of T tokens (``--prefill``: one sequence, positions 0..T-1, a
static cache of T). The step is ``model(input_ids, position_ids, cache_position, cache=...,
logits_to_keep=1)`` (what generate() runs per step), compiled with ``torch.compile(fullgraph=True,
dynamic=False)`` (``fullgraph=False`` if that fails: noted), then timed by ``_timing.time_cuda``:
captured once in a CUDA graph and replayed ``--iters`` times (median ms), eager launches where
capture fails (``method``). ``torch._dynamo.reset()`` before every compile (no recompile limits).

Per case and backend: ``step_ms`` (whole step), ``experts_ms`` = step_ms - the no-op step_ms
of the same case in this run, ``experts_us_per_layer``; per case ``ratios`` of every epmoe
backend's experts_ms to grouped_mm's, and ``targets`` (the model's; qwen3-30b-a3b: issue 20:
bf16 <= 0.6x at batch 1 and <= 0.15x at batch 64; fp8 <= 0.45x at batch 1, <= 0.1x at batch 64,
<= 0.5x at prefill 4096; int8 <= 0.5x at batch 1; the others' layer targets are
bench_one_gpu.py's) with ``met`` where both sides were measured.

Robustness: every (backend, case) runs in its own try/except (``errors``), the JSON is rewritten
after each, ``--budget-s`` bounds the run (the rest is recorded as skipped), SIGTERM stops it
cleanly. Order: backends outer (each epmoe backend builds and quantizes its weights once), cases
inner in the order of the targets (batch 1, 64, prefill 4096 first). A compact table is printed.

JSON: {"schema": 1, "command", "date", "device", "versions", "args", "model" ("name", config
class, config fields, layers, parameters), "budget_s", "elapsed_s", "complete", "notes",
"skipped": [id], "runs": [{"id" ("<backend>/<case>"), "backend", "case", "kind" ("decode" |
"prefill"), "tokens", "status", "error", "step_ms", "min_ms", "method", "compile_s", "fullgraph"
(+ "fullgraph_error"), "epmoe_mode" (the layer's mode), "epmoe_path" ("gemv" | "ll" | "ht": the
path of this call size), "epmoe_gate" (the gate epmoe recognized), "epmoe_bias",
"epmoe_fallback" (an epmoe backend that ran transformers' instead: why), "kernels_us" (with
--profile: [kernel, device µs per step, launches per step])}], "cases": {case: {"noop_ms",
backend: {"step_ms", "experts_ms", "experts_us_per_layer"[, "fallback"]}, "ratios": {backend:
x}}}, "targets": [{"backend", "case", "max_ratio", "ratio", "met"}]}.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _configs  # noqa: E402
import _report  # noqa: E402

_MOE = _configs.CONFIGS["qwen3-30b-a3b"]
# Qwen/Qwen3-30B-A3B's config.json (the MoE sizes from the named config)
QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=_MOE.hidden,
    intermediate_size=6144,
    moe_intermediate_size=_MOE.intermediate,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=_MOE.num_experts,
    num_experts_per_tok=_MOE.top_k,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# a tiny model with the same structure for --cpu-smoke
TINY = dict(
    QWEN3_30B_A3B,
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
)
_GPT_OSS = _configs.CONFIGS["gpt-oss-20b"]
# openai/gpt-oss-20b's config.json (the MoE sizes from the named config; swiglu_alpha, absent from
# the checkpoint's config, is GptOssConfig's default; both are the named config's gate's)
GPT_OSS_20B = dict(
    vocab_size=201088,
    hidden_size=_GPT_OSS.hidden,
    intermediate_size=_GPT_OSS.intermediate,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=_GPT_OSS.num_experts,
    num_experts_per_tok=_GPT_OSS.top_k,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    sliding_window=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    attention_bias=True,
    tie_word_embeddings=False,
)
TINY_GPT_OSS = dict(
    GPT_OSS_20B,
    vocab_size=256,
    hidden_size=192,  # (no multiple of 128: fp8 pads, as at 2880)
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=1024,
)
_GEMMA4 = _configs.CONFIGS["gemma4-26b-a4b"]
# google/gemma-4-26B-A4B's config.json, its text_config (the MoE sizes from the named config): 30
# layers, 5 sliding-window ones then a full-attention one; each layer a dense GELU-tanh MLP of
# intermediate_size beside the experts
GEMMA4_26B_A4B = dict(
    vocab_size=262144,
    hidden_size=_GEMMA4.hidden,
    intermediate_size=2112,
    moe_intermediate_size=_GEMMA4.intermediate,
    num_hidden_layers=30,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=2,
    head_dim=256,
    global_head_dim=512,
    attention_k_eq_v=True,
    enable_moe_block=True,
    num_experts=_GEMMA4.num_experts,
    top_k_experts=_GEMMA4.top_k,
    hidden_activation="gelu_pytorch_tanh",
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    sliding_window=1024,
    final_logit_softcapping=30.0,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY_GEMMA4 = dict(
    GEMMA4_26B_A4B,
    vocab_size=256,
    hidden_size=192,
    intermediate_size=256,
    moe_intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_global_key_value_heads=1,
    head_dim=32,
    global_head_dim=64,
    num_experts=8,
    top_k_experts=2,
    sliding_window=8,
    max_position_embeddings=1024,
)
IMPLS = ("grouped_mm", "epmoe", "epmoe_fp8", "epmoe_int8")
BATCHES = (1, 64, 8, 128)  # target cases first
PREFILL = (4096, 16384)
NOOP = "noop"
# (backend, case, max experts' cost relative to grouped_mm's), issue 20
TARGETS = (
    ("epmoe", "decode_b1", 0.6),
    ("epmoe", "decode_b64", 0.15),
    ("epmoe_fp8", "decode_b1", 0.45),
    ("epmoe_fp8", "decode_b64", 0.1),
    ("epmoe_fp8", "prefill_t4096", 0.5),
    ("epmoe_int8", "decode_b1", 0.5),
)
CPU_SMOKE = dict(layers=2, batches=(1, 4), prefill=(32,), context=16, iters=2, warmup=0)


@dataclass(frozen=True)
class Model:
    """A model this benchmark builds: its transformers config class (a top-level name) and fields,
    the --cpu-smoke ones, the default --layers and the targets of its experts' cost."""

    config_class: str
    fields: dict
    tiny: dict
    layers: int
    targets: Tuple[Tuple[str, str, float], ...] = ()


MODELS = {
    "qwen3-30b-a3b": Model("Qwen3MoeConfig", QWEN3_30B_A3B, TINY, 8, TARGETS),
    "gpt-oss-20b": Model("GptOssConfig", GPT_OSS_20B, TINY_GPT_OSS, 2),
    "gemma4-26b-a4b": Model("Gemma4TextConfig", GEMMA4_26B_A4B, TINY_GEMMA4, 2),
}


def config_fields(fields: dict, layers: int) -> dict:
    """``fields`` with ``layers`` layers: listed ``layer_types`` cut to them, the last one full
    attention (Gemma4's config requires it; the others compute their own)."""
    out = dict(fields, num_hidden_layers=layers)
    if "layer_types" in fields:
        types = list(fields["layer_types"][:layers])
        types[-1] = "full_attention"
        out["layer_types"] = types
    return out


def noop_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """An experts backend that does no work: the step's cost without the experts. It returns zeros
    that depend on the routing, so the compiled step still computes the router (gate, softmax,
    top-k): zeros alone, or routing times 0 (which Inductor folds to 0), let the compiler drop the
    router as dead code, and its cost would then be counted as the experts'. An id is never
    negative here, but the compiler cannot know it."""
    keep = torch.where(top_k_index[..., :1] < 0, top_k_weights[..., :1], 0.0)
    return torch.zeros_like(hidden_states) + keep.to(hidden_states.dtype)


def build_model(fields: dict, layers: int, device: torch.device, config_class="Qwen3MoeConfig"):
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = getattr(transformers, config_class)(**config_fields(fields, layers))
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, experts_implementation="grouped_mm"
        )
    return model.eval().requires_grad_(False)


def case_inputs(model, kind: str, tokens: int, context: int, device):
    """(kwargs of one step, cache): decode: ``tokens`` sequences of one token at position
    ``context``; prefill: one sequence of ``tokens`` tokens."""
    from transformers import StaticCache

    g = torch.Generator().manual_seed(tokens)
    vocab = model.config.vocab_size
    if kind == "decode":
        ids = torch.randint(0, vocab, (tokens, 1), generator=g)
        pos = torch.full((tokens, 1), context)
        cache_position = torch.tensor([context])
        cache = StaticCache(config=model.config, max_cache_len=context + 1)
    else:
        ids = torch.randint(0, vocab, (1, tokens), generator=g)
        pos = torch.arange(tokens)[None]
        cache_position = torch.arange(tokens)
        cache = StaticCache(config=model.config, max_cache_len=tokens)
    kw = dict(
        input_ids=ids.to(device),
        position_ids=pos.to(device),
        cache_position=cache_position.to(device),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return kw


class CpuTimer:
    def __init__(self, iters: int, warmup: int):
        self.iters, self.warmup = iters, warmup

    def __call__(self, fn) -> dict:
        import _timing

        times = _timing.wall_ms(fn, self.iters, self.warmup)
        return {"step_ms": statistics.median(times), "min_ms": min(times), "method": "cpu"}


class CudaTimer:
    def __init__(self, iters: int, warmup: int):
        self.iters, self.warmup = iters, warmup

    def __call__(self, fn) -> dict:
        import _timing

        t = _timing.time_cuda(fn, iters=self.iters, warmup=self.warmup)
        return {"step_ms": t.ms, "min_ms": t.min_ms, "method": t.method}


def _err(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" [{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}]" if tb else ""
    return f"{type(e).__name__}: {str(e)[:400]}{where}"


def case_name(kind: str, tokens: int) -> str:
    return f"decode_b{tokens}" if kind == "decode" else f"prefill_t{tokens}"


def run_one(model, backend: str, kind: str, tokens: int, args, timer, device) -> dict:
    """Compile and time one step of ``backend`` on one case."""
    import epmoe.integrations.transformers as et

    rec = {"backend": backend, "kind": kind, "tokens": tokens}
    model.set_experts_implementation(backend)
    kw = case_inputs(model, kind, tokens, args.context, device)
    step = model.forward
    step(**kw)  # eager: initializes the static cache (a compile before would retrace after it)
    # the static cache advances its own write position every step: put it back before each (one
    # tiny fill per layer, in the captured graph too; the same for every backend, so it cancels).
    # Sliding-window layers (gpt-oss, Gemma4) also keep it as a Python int, which picks their
    # branch (a full window rolls): set on the host before each step, the same value every time
    start = args.context if kind == "decode" else 0
    cache_layers = list(kw["cache"].layers)

    def one_step():
        for layer in cache_layers:
            layer.cumulative_length.fill_(start)
            if hasattr(layer, "cumulative_length_int"):
                layer.cumulative_length_int = start
        return step(**kw)

    t0 = time.perf_counter()
    if args.compile:
        torch._dynamo.reset()
        rec["fullgraph"] = True
        try:
            step = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=args.backend)
            one_step()
        except Exception as e:  # noqa: BLE001 - a break outside the experts: compile without
            rec["fullgraph"] = False
            rec["fullgraph_error"] = _err(e)
            torch._dynamo.reset()
            step = torch.compile(model.forward, dynamic=False, backend=args.backend)
            one_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    rec.update(timer(one_step))
    if getattr(args, "profile", False) and device.type == "cuda":
        rec["kernels_us"] = kernel_table(one_step)
    experts = _experts(model)
    layer = next((et.cached_layer(m) for m in experts if et.cached_layer(m)), None)
    if layer is not None:
        rec["epmoe_mode"] = layer.mode
        # decode: B sequences of one token; prefill: one of T, so each call has `tokens` rows
        rec["epmoe_path"] = layer.path(tokens)
        rec["epmoe_gate"], rec["epmoe_bias"] = layer.gate.spec, layer.bias
    elif backend.startswith("epmoe"):
        st = next((m.__dict__[et._STATE] for m in experts if et._STATE in m.__dict__), None)
        why = st.reason if st is not None and st.reason else "no epmoe state on the experts"
        rec["epmoe_fallback"] = f"{type(experts[0]).__name__ if experts else '?'}: {why}"
    return rec


def kernel_table(step, iters: int = 3, top: int = 40) -> list:
    """[(kernel name, device µs per step, launches per step)] of ``step``'s eager launches (the
    compiled code, not its graph), most expensive first: the same table for the no-op backend
    shows which kernels are the experts'. No L2 flush between the steps (a flush's kernels could
    share a name with a step's own)."""
    import _timing

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    per: Dict[str, list] = {}
    for name, start, end in _timing.device_activities(prof):
        acc = per.setdefault(name, [0.0, 0])
        acc[0] += end - start
        acc[1] += 1
    rows = [(n, round(us / iters, 2), round(c / iters, 2)) for n, (us, c) in per.items()]
    return sorted(rows, key=lambda r: -r[1])[:top]


def _experts(model):
    """The decoder layers' experts modules (``mlp.experts``: Qwen3, gpt-oss; ``experts``:
    Gemma4, beside its dense ``mlp``)."""
    out = []
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None) if mlp is not None else None
        if experts is None:
            experts = getattr(layer, "experts", None)
        if experts is not None:
            out.append(experts)
    return out


def _drop_states(model) -> None:
    import epmoe.integrations.transformers as et

    for m in _experts(model):
        m.__dict__.pop(et._STATE, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def summarize(report: dict, layers: int, targets=TARGETS) -> None:
    cases: Dict[str, dict] = {}
    fallbacks: Dict[tuple, str] = {}  # (case, backend) -> why epmoe did not run
    for r in report["runs"]:
        if r.get("status") == "ok":
            cases.setdefault(r["case"], {})[r["backend"]] = r["step_ms"]
            if r.get("epmoe_fallback"):
                fallbacks[(r["case"], r["backend"])] = r["epmoe_fallback"]
    out = {}
    for case, ms in cases.items():
        row: Dict[str, object] = {"ratios": {}}
        noop = ms.get(NOOP)
        row["noop_ms"] = noop
        for b, v in ms.items():
            if b == NOOP:
                continue
            e = {"step_ms": v}
            if noop is not None:
                e["experts_ms"] = v - noop
                e["experts_us_per_layer"] = (v - noop) * 1e3 / layers
            if (case, b) in fallbacks:
                e["fallback"] = fallbacks[(case, b)]
            row[b] = e
        base = row.get("grouped_mm", {}).get("experts_ms")
        for b in ms:
            if not (b.startswith("epmoe") and base) or "fallback" in row[b]:
                continue
            if "experts_ms" in row[b]:
                row["ratios"][b] = row[b]["experts_ms"] / base
        out[case] = row
    report["cases"] = out
    report["targets"] = []
    for b, case, limit in targets:
        ratio = out.get(case, {}).get("ratios", {}).get(b)
        t = {"backend": b, "case": case, "max_ratio": limit, "ratio": ratio}
        t["met"] = None if ratio is None else bool(ratio <= limit)
        report["targets"].append(t)


def table(report: dict) -> str:
    lines = ["case            backend       step_ms  experts_ms  us/layer  x grouped_mm"]
    for case, row in report.get("cases", {}).items():
        lines.append(f"{case:15s} {'noop':12s} {row.get('noop_ms') or float('nan'):8.3f}")
        for b, e in row.items():
            if b in ("ratios", "noop_ms"):
                continue
            r = row["ratios"].get(b)
            lines.append(
                f"{case:15s} {b:12s} {e['step_ms']:8.3f}  {e.get('experts_ms', float('nan')):10.3f}"
                f"  {e.get('experts_us_per_layer', float('nan')):8.1f}"
                + (f"  {r:.3f}" if r is not None else "")
            )
    for t in report.get("targets", []):
        lines.append(
            f"target {t['backend']} {t['case']} <= {t['max_ratio']}: {t['ratio']} {t['met']}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=None, help="default: the model's (MODELS)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--batches", default=None, help=f"decode batches (default {BATCHES})")
    p.add_argument("--prefill", default=None, help=f"prefill lengths (default {PREFILL})")
    p.add_argument("--context", type=int, default=512, help="decode position in the cache")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--backend", default=None, help="torch.compile backend (default: inductor)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, dynamo only")
    p.add_argument("--profile", action="store_true", help="per-kernel device µs of each step")
    return p


def _ints(s: str) -> List[int]:
    return [int(v) for v in s.split(",") if v]


def main(argv: Optional[List[str]] = None) -> dict:
    args = build_parser().parse_args(argv)
    from transformers.integrations import moe

    import epmoe.integrations.transformers as et

    et.register()
    moe.ExpertsInterface.register(NOOP, noop_experts_forward)
    torch.set_grad_enabled(False)
    spec = MODELS[args.model]
    if args.cpu_smoke:
        device = torch.device("cpu")
        fields, s = spec.tiny, CPU_SMOKE
        args.layers, args.context = s["layers"], s["context"]
        args.batches = args.batches or ",".join(map(str, s["batches"]))
        args.prefill = args.prefill or ",".join(map(str, s["prefill"]))
        args.backend = args.backend or "eager"
        timer = CpuTimer(s["iters"], s["warmup"])
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_hf: needs a CUDA GPU (or --cpu-smoke)")
        args.batches = args.batches or ",".join(map(str, BATCHES))
        args.prefill = args.prefill or ",".join(map(str, PREFILL))
        device = torch.device("cuda", torch.cuda.current_device())
        fields = spec.fields
        args.layers = args.layers or spec.layers
        args.backend = args.backend or "inductor"
        timer = CudaTimer(args.iters, args.warmup)
    backends = [NOOP] + [b for b in args.impls.split(",") if b]
    cases = [("decode", b) for b in _ints(args.batches)]
    cases += [("prefill", t) for t in _ints(args.prefill)]
    t_start = time.perf_counter()
    report = _report.header("bench_hf.py", argv, args, device, "runs")

    def save():
        report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        summarize(report, args.layers, spec.targets)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(tmp, args.out)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        model = build_model(fields, args.layers, device, spec.config_class)
        report["model"] = dict(
            {k: v for k, v in config_fields(fields, args.layers).items() if k != "mlp_only_layers"},
            name=args.model,
            config_class=spec.config_class,
            parameters=sum(p.numel() for p in model.parameters()),
        )
        save()
        for backend in backends:
            for kind, tokens in cases:
                rid = f"{backend}/{case_name(kind, tokens)}"
                if time.perf_counter() - t_start > args.budget_s:
                    report["skipped"].append(rid)
                    continue
                rec = {"id": rid, "case": case_name(kind, tokens)}
                try:
                    rec.update(run_one(model, backend, kind, tokens, args, timer, device))
                    rec["status"] = "ok"
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    rec.update(backend=backend, kind=kind, tokens=tokens, status="error")
                    rec["error"] = _err(e)
                    if device.type == "cuda" and "illegal" in str(e):
                        report["notes"].append(f"stopped after a CUDA error in {rid}")
                        report["runs"].append(rec)
                        raise KeyboardInterrupt("CUDA error") from e
                report["runs"].append(rec)
                print(rid, rec.get("step_ms", rec.get("error")), flush=True)
                save()
            _drop_states(model)
        report["complete"] = not report["skipped"]
    except KeyboardInterrupt as e:
        report["notes"].append(f"interrupted: {e}")
    finally:
        signal.signal(signal.SIGTERM, old)
        torch._dynamo.reset()
        save()
        print(table(report), flush=True)
    return report


if __name__ == "__main__":
    main()
