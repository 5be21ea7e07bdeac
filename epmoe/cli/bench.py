"""``epmoe bench``: the EPMoE layer per quant scheme and mode, timed against the dense reference
and torch's grouped_mm, with a JSON, markdown and PNG report.

Ships with the package: it needs no source checkout. For one named shape (SHAPES), every token
count T, quant scheme and mode, it times on one device:

- ``epmoe``: ``EPMoE(backend="local")`` called eagerly (on CUDA also the replay of a CUDA graph of
  one call); ``path`` is the path the layer took ("gemv", "ll" or "ht");
- ``reference``: ``epmoe.reference.dense_moe`` on the same bf16 weights (float32, every expert on
  every token: the naive layer);
- ``grouped_mm``: the same MLP on ``torch._grouped_mm`` (tokens sorted by expert, bf16; the route
  of transformers' ``grouped_mm`` experts backend), where this torch build runs it;

and checks every output against the reference (relative L2 error). Times are medians of
``--iters`` calls (CUDA events on a GPU, wall clock on CPU), after warm-up calls. It writes into
``--out-dir`` (default ``./epmoe-bench``): ``bench.json`` (every measurement), ``bench.md`` (one
table) and ``bench.png`` (ms per implementation, one panel per T). ``--from-json FILE`` renders
the markdown and PNG of an earlier run without running anything. ``--tiny`` is a few-second CPU
run on the tiny shape.

Stage-level benchmarks (bytes against the HBM copy ceiling, raw DeepGEMM / DeepEP, transformers
end to end) are the repository's ``benchmarks/`` suite, for contributors.
"""

import argparse
import dataclasses
import datetime
import functools
import importlib
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

SCHEMES = ("bf16", "fp8", "int8")
MODES = ("ht", "ll", "auto")
# LL buffers hold E x T rows of H: beyond this T the LL mode is not what a caller would run
LL_MAX_TOKENS = 512
DEFAULT_OUT_DIR = "epmoe-bench"
# What the report needs beyond the core install (module, pip name)
REPORT_PACKAGES = (("matplotlib", "matplotlib"),)


@dataclasses.dataclass(frozen=True)
class Shape:
    """An MoE layer's experts: E experts, hidden H, intermediate I, top-K; default token counts."""

    name: str
    E: int
    H: int
    I: int
    K: int
    tokens: Tuple[int, ...]


SHAPES = {
    s.name: s
    for s in (
        Shape("tiny", E=8, H=256, I=128, K=2, tokens=(64,)),  # --tiny: seconds on a CPU
        Shape("small", E=16, H=1024, I=512, K=4, tokens=(16, 256)),  # the CPU default
        # Qwen3-30B-A3B's experts: the GPU default
        Shape("qwen3-30b-a3b", E=128, H=2048, I=768, K=8, tokens=(1, 32, 128, 4096)),
    )
}
# (iterations, warm-up calls) of --tiny: a smoke test of the tool and its report, not a measurement
TINY_ITERS = (3, 1)


# -------------------------------------------------------------------------------------- baselines
def grouped_mm_moe(x, topk_ids, topk_weights, w1, w2) -> torch.Tensor:
    """The MoE MLP on ``torch._grouped_mm``: choices sorted by expert, two grouped GEMMs in bf16.

    x bf16 `[T, H]`; topk_ids int `[T, K]` (-1 skips); topk_weights float `[T, K]`; w1 `[E, 2I, H]`;
    w2 `[E, H, I]` -> bf16 `[T, H]`. No host sync (CUDA-graph capturable).
    """
    T, K = topk_ids.shape
    E = w1.shape[0]
    flat = topk_ids.reshape(-1).long()
    valid = flat >= 0
    key = torch.where(valid, flat, E)  # skipped choices sort after every expert
    order = torch.argsort(key, stable=True)
    # counts by scatter_add, not bincount: bincount sizes its output from the ids (a host sync)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts[:E], 0).to(torch.int32)
    token = order // K
    h = torch._grouped_mm(x[token], w1.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    a = (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs).float()
    # rows past offs[-1] (skipped choices) are never written by the GEMM: masked, not multiplied
    w = torch.where(valid, topk_weights.reshape(-1).float(), 0.0)[order]
    y = torch.where(valid[order, None], y * w[:, None], 0.0)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, y).to(x.dtype)


# ----------------------------------------------------------------------------------------- timing
class Timer:
    """Median ms of a call: CUDA events on a GPU, the wall clock on CPU."""

    def __init__(self, device: torch.device, iters: int, warmup: int):
        self.device, self.iters, self.warmup = device, iters, warmup

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def eager_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        self._sync()
        times = []
        for _ in range(self.iters):
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def graph_ms(self, fn: Callable[[], object]) -> float:
        """One call captured in a CUDA graph, the replay timed (CUDA only)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(max(self.warmup, 1)):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.eager_ms(graph.replay)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _inputs(shape: Shape, T: int, device: torch.device, seed: int):
    """x, ids, weights of T tokens, and the global bf16 weights (uniform top-K routing)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, shape.H, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, shape.E, generator=g).topk(shape.K, dim=1).indices
    w = torch.softmax(torch.randn(T, shape.K, generator=g), dim=1)
    return x.to(device), ids.to(device), w.to(device)


def _weights(shape: Shape, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    w1 = (torch.randn(shape.E, 2 * shape.I, shape.H, generator=g) / shape.H**0.5).bfloat16()
    w2 = (torch.randn(shape.E, shape.H, shape.I, generator=g) / shape.I**0.5).bfloat16()
    return w1.to(device), w2.to(device)


# -------------------------------------------------------------------------------------------- run
def _scheme_status(scheme: str, device: torch.device) -> Optional[str]:
    """None when ``scheme`` runs on ``device`` here, else why not."""
    from epmoe.cli import env

    status = env.quant_status(scheme, device.type)
    return None if status.ok else status.why


def run(
    shape: Shape,
    tokens: Sequence[int],
    schemes: Sequence[str],
    modes: Sequence[str],
    device: torch.device,
    iters: int,
    warmup: int,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Measure every (T, implementation); returns the JSON document (``results``, ``notes``)."""
    import epmoe
    from epmoe import reference

    timer = Timer(device, iters, warmup)
    results: List[dict] = []
    notes: List[str] = []
    has_grouped_mm = hasattr(torch, "_grouped_mm")
    if not has_grouped_mm:
        notes.append(f"grouped_mm: torch {torch.__version__} has no torch._grouped_mm")
    w1, w2 = _weights(shape, device, seed)

    def add(rec: dict) -> None:
        results.append(rec)
        what = "/".join(str(rec[k]) for k in ("impl", "scheme", "mode") if rec.get(k))
        got = rec.get("error") or rec.get("skipped") or f"{rec['ms']:.4g} ms"
        log(f"epmoe bench: T={rec['T']} {what}: {got}")

    with torch.no_grad():
        for T in tokens:
            x, ids, w = _inputs(shape, T, device, seed + T)
            ref = reference.dense_moe(x, ids, w, w1, w2)
            ms = timer.eager_ms(functools.partial(reference.dense_moe, x, ids, w, w1, w2))
            add({"impl": "reference", "T": T, "ms": ms})
            if has_grouped_mm:
                rec = {"impl": "grouped_mm", "T": T}
                try:
                    call = functools.partial(grouped_mm_moe, x, ids, w, w1, w2)
                    rec["rel_err"] = _rel_err(call(), ref)
                    _time(timer, call, rec)
                except Exception as e:  # noqa: BLE001 - a baseline that does not run is a result
                    rec["error"] = _err(e)
                add(rec)
            for scheme in schemes:
                why = _scheme_status(scheme, device)
                for mode in modes:
                    rec = {"impl": "epmoe", "scheme": scheme, "mode": mode, "T": T}
                    if why:
                        add(dict(rec, skipped=why))
                        continue
                    if mode == "ll" and T > LL_MAX_TOKENS:
                        add(dict(rec, skipped=f"LL above {LL_MAX_TOKENS} tokens"))
                        continue
                    try:
                        layer = epmoe.EPMoE(
                            shape.E,
                            shape.H,
                            shape.I,
                            shape.K,
                            quant=scheme,
                            mode=mode,
                            backend="local",
                            max_tokens_per_rank=T,
                            worst_case=True,
                            device=device,
                        )
                        layer.load_weights(w1, w2)
                        rec["path"] = layer.path(T)
                        call = functools.partial(layer, x, ids, w)
                        rec["rel_err"] = _rel_err(call(), ref)
                        _time(timer, call, rec)
                    except Exception as e:  # noqa: BLE001 - one case failing keeps the rest
                        rec["error"] = _err(e)
                    add(rec)
                    layer = call = None  # free the layer's buffers before the next one
    return {"results": results, "notes": notes}


def _time(timer: Timer, call: Callable[[], object], rec: dict) -> None:
    """``ms`` (eager) into ``rec``, and on a GPU ``graph_ms`` (or why it was not measured)."""
    rec["ms"] = timer.eager_ms(call)
    if timer.device.type == "cuda":
        try:
            rec["graph_ms"] = timer.graph_ms(call)
        except Exception as e:  # noqa: BLE001 - eager figure stands without a graph
            rec["graph_error"] = _err(e)


def _versions() -> Dict[str, str]:
    import epmoe

    out = {"epmoe": epmoe.__version__, "torch": torch.__version__}
    for name in ("triton", "deep_gemm"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception:  # noqa: BLE001 - absent is a value here
            out[name] = "not installed"
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ----------------------------------------------------------------------------------------- report
def _fmt_ms(v: Optional[float]) -> str:
    if v is None:
        return ""
    return f"{v:.3f}" if v < 100 else f"{v:.1f}"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{b / a:.2f}x" if a and b else ""


def render_markdown(doc: dict) -> str:
    """The report's table: per T, the baselines' ms, then each epmoe case against them."""
    s = doc["shape"]
    lines = [
        "# epmoe bench",
        "",
        f"- date: {doc['date']}",
        f"- command: `{doc['command']}`",
        f"- device: {doc['device']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()),
        f"- shape: {s['name']} (E {s['E']}, H {s['H']}, I {s['I']}, top-{s['K']}); "
        f"median of {doc['iters']} calls",
        "",
        "Speedups are the baseline's ms over epmoe's (above 1: epmoe is faster); on a GPU against "
        "the same kind of timing (CUDA graph replay when both have one).",
        "",
        "| T | implementation | path | ms | graph ms | vs reference | vs grouped_mm | rel. error |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    by_t: Dict[int, List[dict]] = {}
    for r in doc["results"]:
        by_t.setdefault(r["T"], []).append(r)
    for T, recs in by_t.items():
        base = {r["impl"]: r for r in recs if r["impl"] != "epmoe"}
        ref, gmm = base.get("reference", {}), base.get("grouped_mm", {})
        for r in recs:
            name = r["impl"] if r["impl"] != "epmoe" else f"epmoe {r['scheme']} {r['mode']}"
            if r.get("skipped") or r.get("error"):
                lines.append(f"| {T} | {name} | | {r.get('skipped') or r['error']} | | | | |")
                continue
            vs_ref = vs_gmm = ""
            if r["impl"] != "reference":
                vs_ref = _ratio(r.get("ms"), ref.get("ms"))
            if r["impl"] == "epmoe":
                both_graph = r.get("graph_ms") and gmm.get("graph_ms")
                key = "graph_ms" if both_graph else "ms"
                vs_gmm = _ratio(r.get(key), gmm.get(key))
            err = f"{r['rel_err']:.4f}" if "rel_err" in r else ""
            lines.append(
                f"| {T} | {name} | {r.get('path', '')} | {_fmt_ms(r.get('ms'))} | "
                f"{_fmt_ms(r.get('graph_ms'))} | {vs_ref} | {vs_gmm} | {err} |"
            )
    for n in doc.get("notes", []):
        lines.append(f"\nnote: {n}")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    """PNG: ms per implementation (graph replay where measured), one panel per T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_t: Dict[int, List[Tuple[str, float, str]]] = {}
    for r in doc["results"]:
        ms = r.get("graph_ms") or r.get("ms")
        if not ms:
            continue
        if r["impl"] == "epmoe":
            label, color = f"epmoe {r['scheme']} {r['mode']} ({r.get('path', '?')})", "tab:green"
        else:
            label, color = r["impl"], "tab:gray"
        by_t.setdefault(r["T"], []).append((label, ms, color))
    panels = list(by_t.items()) or [(0, [])]
    heights = [max(1.5, 0.3 * len(rows) + 1.0) for _, rows in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(9, sum(heights)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (T, rows) in zip(axes[:, 0], panels, strict=True):
        ys = range(len(rows))
        ax.barh(list(ys), [ms for _, ms, _ in rows], color=[c for *_, c in rows], alpha=0.85)
        for y, (_, ms, _) in zip(ys, rows, strict=True):
            ax.text(ms, y, f" {_fmt_ms(ms)}", va="center", fontsize=8)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([label for label, *_ in rows], fontsize=8)
        ax.invert_yaxis()
        ms_all = [ms for _, ms, _ in rows]
        if ms_all and min(ms_all) > 0 and max(ms_all) / min(ms_all) > 100:
            ax.set_xscale("log")
        ax.set_xlabel("ms per call (median; CUDA graph replay where measured)")
        ax.set_title(f"T = {T}" if rows else "no measurement", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"epmoe bench, {doc['shape']['name']}, {doc['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(doc: dict, out_dir: Path) -> Tuple[Path, Path]:
    """Write ``bench.md`` and ``bench.png`` of ``doc`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, png = out_dir / "bench.md", out_dir / "bench.png"
    md.write_text(render_markdown(doc))
    plot(doc, png)
    return md, png


def missing_packages(modules: Sequence[Tuple[str, str]] = REPORT_PACKAGES) -> List[str]:
    """pip names of the report's packages that do not import here."""
    missing = []
    for module, pip_name in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(pip_name)
    return missing


def _check_packages() -> bool:
    """Print one line naming the pip command when a package is missing; True when all import."""
    missing = missing_packages()
    if missing:
        print(
            f"epmoe bench: needs {', '.join(missing)}: pip install {' '.join(missing)}",
            file=sys.stderr,
        )
    return not missing


# -------------------------------------------------------------------------------------------- cli
def _csv(value: str, allowed: Sequence[str], flag: str) -> List[str]:
    items = [v for v in value.split(",") if v]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise ValueError(f"{flag} expected a comma list of {', '.join(allowed)}, got {value!r}")
    return items


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out-dir", default=None, help=f"report directory (default: ./{DEFAULT_OUT_DIR})"
    )
    p.add_argument("--tiny", action="store_true", help="the tiny shape on CPU, a few seconds")
    p.add_argument(
        "--shape",
        default=None,
        choices=sorted(SHAPES),
        help="default: qwen3-30b-a3b on a GPU, small on CPU",
    )
    p.add_argument("--tokens", default=None, help="comma list of T (default: the shape's)")
    p.add_argument("--quant", default=",".join(SCHEMES), help="comma list of schemes")
    p.add_argument("--mode", default=",".join(MODES), help="comma list of modes")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per figure (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="only render bench.md / bench.png from an earlier bench.json",
    )


def main(args: argparse.Namespace, extra: Sequence[str] = ()) -> int:
    extra = list(extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if extra:
        print(f"epmoe bench: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    if not _check_packages():
        return 2
    if args.from_json:
        src = Path(args.from_json)
        md, png = write_report(json.loads(src.read_text()), Path(args.out_dir or src.parent))
        print(f"epmoe bench: wrote {md}, {png}")
        return 0
    try:
        default = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
        device = torch.device(args.device or default)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        default = "tiny" if args.tiny else "qwen3-30b-a3b" if device.type == "cuda" else "small"
        name = args.shape or default
        shape = SHAPES[name]
        tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(shape.tokens)
        if not tokens or min(tokens) < 1:
            raise ValueError(f"--tokens expected positive token counts, got {args.tokens!r}")
        schemes = _csv(args.quant, SCHEMES, "--quant")
        modes = _csv(args.mode, MODES, "--mode")
    except (ValueError, RuntimeError) as e:
        print(f"epmoe bench: {e}", file=sys.stderr)
        return 2
    iters, warmup = TINY_ITERS if args.tiny else (args.iters or 20, 3)
    if args.iters:
        iters = args.iters
    out = Path(args.out_dir or DEFAULT_OUT_DIR)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    if json_path.exists():
        json_path.unlink()  # never report a stale run
    doc = {
        "schema": 1,
        "command": "epmoe " + shlex.join(getattr(args, "argv", None) or ["bench"]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "device": _device_name(device),
        "versions": _versions(),
        "shape": dataclasses.asdict(shape),
        "iters": iters,
        "warmup": warmup,
    }
    print(f"epmoe bench: {shape.name} on {doc['device']}, T in {tokens}", flush=True)
    doc.update(run(shape, tokens, schemes, modes, device, iters, warmup, args.seed, log=_log))
    json_path.write_text(json.dumps(_clean(doc), indent=1))
    md, png = write_report(doc, out)
    print(f"epmoe bench: wrote {json_path}, {md}, {png}", flush=True)
    # a baseline that does not run here is a result; an epmoe case that fails is not
    failed = [r for r in doc["results"] if r["impl"] == "epmoe" and r.get("error")]
    return 1 if failed else 0


def _log(line: str) -> None:
    print(line, flush=True)


def _clean(obj):
    """JSON-safe: non-finite floats as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj
