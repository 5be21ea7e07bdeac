"""Append a benchmark's JSON to ``benchmarks/results/<gpu>/measurements.jsonl``, one line a figure.

    python scripts/record_results.py --gpu h200 OUT.json [MORE.json ...] [--commit SHA]
        [--date "YYYY-MM-DD HH:MM:SS"] [--results-dir benchmarks/results] [--dry-run]

Reads what the benchmarks write: ``benchmarks/bench_one_gpu.py --out``, ``bench_layer.py --out``,
``bench_hf.py --out``, ``bench_deepep.py --out``, ``bench_weight_stream.py --out``, a
pytest-benchmark ``--benchmark-json`` and
``python -m epmoe bench``'s ``bench.json`` and ``scripts/tune_gemm.py``'s table (the format is
recognised from the document). Each line
is one JSON object::

    {"gpu": "h200", "commit": "ab03a73", "date": "2026-12-03 11:52:36",
     "benchmark": "bench_one_gpu", "case": "qwen3-30b-a3b/fp8/auto/T32", "path": "ll",
     "metric": "graph_ms", "value": 0.17254400253295898, "unit": "ms",
     "source": "one_gpu_q32_1152.json"}

``gpu`` is the machine kind (the folder: h200 = 1x H200, h200x2 = 2x H200); ``commit`` the tree the
run measured: ``--commit``, else the one the JSON names (``versions.git``, pytest-benchmark's
``commit_info``), else "unknown"; ``date`` the run's: ``--date``, else the JSON's, else now (UTC).
``path`` is the layer's path where the benchmark records it. Values are copied as the JSON holds
them; units come from the key's suffix (``_ms``, ``_us``, ``gbps``, ``tflops``, ``launches``) or
are "ratio". The file is append-only: a new run adds lines, nothing is rewritten.
"""

import argparse
import datetime
import json
import os
import sys
from typing import Dict, Iterator, List, Optional, Tuple

RESULTS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results"
)
FIELDS = (
    "gpu",
    "commit",
    "date",
    "benchmark",
    "case",
    "path",
    "metric",
    "value",
    "unit",
    "source",
)
# one (case, metric, value, unit, extra fields) a measurement
Row = Tuple[str, str, float, str, Dict[str, str]]


def unit_of(key: str) -> Optional[str]:
    """The unit of a figure named ``key``, or None when the key is not a measurement."""
    k = key.lower()
    if k.endswith("_ms") or k == "ms":
        return "ms"
    if k.endswith("_us") or k == "us":
        return "us"
    if k.endswith("gbps"):
        return "GB/s"
    if k.endswith("tflops"):
        return "TFLOP/s"
    if k.endswith("launches"):
        return "count"
    if k.startswith(("vs_", "frac_of_", "speedup_vs_")) or k.endswith("_over_stages"):
        return "ratio"
    return None


def _numbers(
    d: dict, unit: Optional[str] = None, prefix: str = ""
) -> Iterator[Tuple[str, float, str]]:
    """(key, value, unit) of every measurement in ``d``.

    A nested dict counts only under a key with a unit, its entries named ``outer.inner`` in that
    unit (``host_us.permute``); others (kernel counts, step seconds, layouts) are not figures.
    """
    for k, v in d.items():
        if isinstance(v, dict):
            if unit is None and unit_of(k):
                yield from _numbers(v, unit_of(k), f"{prefix}{k}.")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        u = unit or unit_of(k)
        if u:
            yield prefix + k, v, u


def kind(doc: dict) -> str:
    """Which benchmark wrote ``doc``."""
    if doc.get("benchmark") == "weight_stream":
        return "weight_stream"
    if isinstance(doc.get("benchmarks"), list):
        return "pytest_benchmark"
    if isinstance(doc.get("results"), list) and "shape" in doc:
        return "epmoe_bench"
    if "slower_rank" in doc:
        return "bench_layer"
    if "summary" in doc and "workload" in doc:
        return "bench_deepep"
    if isinstance(doc.get("runs"), list) and isinstance(doc.get("cases"), dict):
        return "bench_hf"
    if isinstance(doc.get("cases"), list):
        return "bench_one_gpu"
    if isinstance(doc.get("entries"), list) and "device" in doc:
        return "tune_gemm"
    raise ValueError(
        "record_results: expected the JSON of bench_one_gpu.py, bench_layer.py, bench_hf.py, "
        "bench_deepep.py, bench_weight_stream.py, pytest-benchmark, epmoe bench or tune_gemm.py, "
        f"got keys {sorted(doc)[:12]}"
    )


def _one_gpu(doc: dict) -> Iterator[Row]:
    if isinstance(doc.get("copy_gbps"), (int, float)):
        yield "copy", "copy_gbps", doc["copy_gbps"], "GB/s", {}
    for rec in doc["cases"]:
        if rec.get("status") == "skipped":
            continue
        extra = {"path": rec["path"]} if rec.get("path") else {}
        for key, v, unit in _numbers({k: v for k, v in rec.items() if k != "ratios"}):
            yield rec["id"], key, v, unit, extra


def _hf(doc: dict) -> Iterator[Row]:
    model = doc.get("model") or {}
    layers = model.get("num_hidden_layers", "?")
    name = model.get("name", "qwen3-30b-a3b")  # (runs before bench_hf wrote its model's name)
    for case, entry in doc["cases"].items():
        prefix = f"{name}-L{layers}/{case}"
        if isinstance(entry.get("noop_ms"), (int, float)):
            yield f"{prefix}/noop", "step_ms", entry["noop_ms"], "ms", {}
        for backend, figures in entry.items():
            if backend == "ratios" or not isinstance(figures, dict):
                continue
            for key in ("step_ms", "experts_us_per_layer"):
                if isinstance(figures.get(key), (int, float)):
                    yield f"{prefix}/{backend}", key, figures[key], unit_of(key) or "us", {}


def _layer(doc: dict) -> Iterator[Row]:
    case = (
        f"{doc.get('config', '?')}/{doc.get('quant', '?')}/LL{doc.get('ll_tokens_per_rank')}"
        f"-HT{doc.get('ht_tokens_per_rank')}"
    )
    for key, v, unit in _numbers(doc["slower_rank"]):
        yield case, key, v, unit, {}


def _deepep(doc: dict) -> Iterator[Row]:
    workload = (doc.get("workload") or {}).get("name", "?")
    for case, figures in doc["summary"].items():
        for key in ("ours_us", "raw_us", "ours_GBps", "raw_GBps"):
            if isinstance(figures.get(key), (int, float)):
                yield f"{workload}/{case}", key, figures[key], unit_of(key) or "", {}


def _pytest_benchmark(doc: dict) -> Iterator[Row]:
    for b in doc["benchmarks"]:
        info = {k: v for k, v in (b.get("extra_info") or {}).items() if not k.startswith("target")}
        figures = list(_numbers(info))
        # pytest-benchmark's own median only where the benchmark reports no time of its own
        # (the GPU benchmarks time CUDA-graph replays themselves and report them in extra_info)
        if b.get("stats") and not any(u in ("ms", "us") for _, _, u in figures):
            figures.insert(0, ("median_ms", b["stats"]["median"] * 1e3, "ms"))
        for key, v, unit in figures:
            yield b["name"], key, v, unit, {}


def _epmoe_bench(doc: dict) -> Iterator[Row]:
    shape = doc["shape"]["name"]
    for r in doc["results"]:
        name = "/".join(str(r[k]) for k in ("impl", "scheme", "mode") if r.get(k))
        extra = {"path": r["path"]} if r.get("path") else {}
        for key in ("ms", "graph_ms"):
            if isinstance(r.get(key), (int, float)):
                yield f"{shape}/T{r['T']}/{name}", key, r[key], "ms", extra


def _tune_gemm(doc: dict) -> Iterator[Row]:
    """The tuned table (scripts/tune_gemm.py): each GEMM problem's best µs per backend, each path
    entry's µs per variant (the winner in ``path``)."""
    for e in doc["entries"]:
        case = (f"{e['layout']}/{e['scheme']}/N{e['N']}-K{e['K']}-E{e['E']}/block{e['block']}"
                f"/M{e['m']}")  # fmt: skip
        for backend, us in sorted(e["us"].items()):
            yield case, f"{backend}_us", us, "us", {"path": e["backend"]}
    for p in doc.get("paths", []):
        case = f"path/{p['scheme']}/E{p['E']}-H{p['H']}-I{p['I']}-K{p['K']}/T{p['t']}"
        way = "ll" if p["path"] == "ll" else f"ht@{p['alignment']}"
        for variant, us in sorted(p["us"].items()):
            yield case, f"{variant}_us", us, "us", {"path": way}


READERS = {
    "bench_one_gpu": _one_gpu,
    "bench_hf": _hf,
    "bench_layer": _layer,
    "bench_deepep": _deepep,
    "pytest_benchmark": _pytest_benchmark,
    "epmoe_bench": _epmoe_bench,
    "tune_gemm": _tune_gemm,
    "weight_stream": _one_gpu,  # (the same layout: copy_gbps, then cases by id)
}


def _commit(doc: dict) -> Optional[str]:
    git = (doc.get("versions") or {}).get("git")
    if git:
        return str(git)
    if isinstance(doc.get("commit"), str) and doc["commit"] != "unknown":  # (tune_gemm)
        return doc["commit"]
    ci = doc.get("commit_info") or {}
    if ci.get("id") and ci["id"] != "unknown":
        return ci["id"][:7] + ("-dirty" if ci.get("dirty") else "")
    return None


def _date(doc: dict) -> Optional[str]:
    raw = doc.get("date") or doc.get("datetime")
    if not raw:
        return None
    raw = str(raw).removesuffix(" UTC")  # (tune_gemm writes the zone)
    try:  # pytest-benchmark: ISO with a UTC offset
        t = datetime.datetime.fromisoformat(str(raw))
    except ValueError:
        return str(raw)
    if t.tzinfo is not None:
        t = t.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    fmt = "%Y-%m-%d" if len(str(raw)) == 10 else "%Y-%m-%d %H:%M:%S"
    return t.strftime(fmt)


def rows(
    doc: dict,
    gpu: str,
    source: str,
    commit: Optional[str] = None,
    date: Optional[str] = None,
) -> List[dict]:
    """The measurement lines of one benchmark JSON document."""
    k = kind(doc)
    head = {
        "gpu": gpu,
        "commit": commit or _commit(doc) or "unknown",
        "date": date
        or _date(doc)
        or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = []
    for case, metric, value, unit, extra in READERS[k](doc):
        line = dict(head, benchmark=k, case=case, **extra, metric=metric, value=value, unit=unit)
        line["source"] = source
        out.append({f: line[f] for f in FIELDS if line.get(f) is not None})
    return out


def append(path: str, lines: List[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="benchmark JSON files")
    ap.add_argument("--gpu", required=True, help="machine kind: the results folder (h200, h200x2)")
    ap.add_argument("--commit", default=None, help="the tree measured (default: the JSON's)")
    ap.add_argument("--date", default=None, help="the run's date (default: the JSON's, else now)")
    ap.add_argument("--results-dir", default=RESULTS_DIR)
    ap.add_argument("--dry-run", action="store_true", help="print the lines, append nothing")
    a = ap.parse_args(argv)
    if not a.gpu or os.sep in a.gpu or a.gpu.startswith("."):
        ap.error(f"--gpu expected a folder name such as h200, got {a.gpu!r}")
    out = os.path.join(a.results_dir, a.gpu, "measurements.jsonl")
    lines = []
    for path in a.json:
        with open(path) as f:
            doc = json.load(f)
        try:
            got = rows(doc, a.gpu, os.path.basename(path), a.commit, a.date)
        except ValueError as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
        if not got:
            print(f"{path}: no measurement found", file=sys.stderr)
            return 2
        lines += got
        print(
            f"{path}: {len(got)} measurements ({got[0]['benchmark']}, commit {got[0]['commit']}, "
            f"{got[0]['date']})"
        )
    if a.dry_run:
        for line in lines:
            print(json.dumps(line, ensure_ascii=False))
        return 0
    append(out, lines)
    print(f"appended {len(lines)} lines to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
