"""Markdown tables from a bench_one_gpu.py JSON (the rows of benchmarks/results/h200/RESULTS.md).

    python benchmarks/one_gpu_report.py OUT.json [--mode auto]
    python benchmarks/one_gpu_report.py benchmarks/results/h100/measurements.jsonl [--mode auto]

One row per (shape, scheme, T) of the given layer mode: CUDA-graph replay of the layer against
transformers' grouped_mm experts (graph) and raw deep_gemm on the same routing, the weight-read
floor, eager / torch.compile default / reduce-overhead, host µs and launches per eager call. Then,
where the run has them, the cost of a gate and biases (a config's graph time over its plain-SiLU
twin's, e.g. gpt-oss-20b over gpt-oss-20b-silu), the cases timed on several routings
(``--routings``) and the targets with whether they were met.

Given a results folder's ``measurements.jsonl`` instead: the current page's layer table, one row
per case of the mode from its latest run (the routings' median where timed, else its one
routing), with the raw deep_gemm and grouped_mm figures of the latest runs that had them.
"""

import argparse
import json


def _f(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}"


def _x(a, b):
    return "-" if a is None or b is None or b == 0 else f"{b / a:.2f}x"


def rows(report: dict, mode: str):
    for c in report["cases"]:
        if c.get("mode") != mode or c.get("status") != "ok":
            continue
        g = c.get("graph_ms")
        yield (
            f"| {c['shape']} | {c['scheme']} | {c['T']} | {c.get('path')} | {_f(g)} | "
            f"{_f(c.get('grouped_mm_graph_ms'))} ({_x(g, c.get('grouped_mm_graph_ms'))}) | "
            f"{_f(c.get('raw_ms'))} ({_x(c.get('raw_ms'), g)}) | "
            f"{_f(c.get('floor_ms'))} ({_x(c.get('floor_ms'), g)}) | "
            f"{_f(c.get('eager_ms'))} / {_f(c.get('grouped_mm_eager_ms'))} | "
            f"{_f(c.get('compile_ms'))} / {_f(c.get('compile_ro_ms'))} | "
            f"{_f(c.get('host_us'), 0)} | {c.get('launches', '-')} |"
        )


HEADER = (
    "| shape | scheme | T | path | graph ms | grouped_mm graph ms (ours faster by) | "
    "raw deep_gemm ms (ours / raw) | floor ms (ours / floor) | eager ms ours / grouped_mm | "
    "compile default / reduce-overhead ms | host µs | launches |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def gate_bias_rows(report: dict, mode: str):
    for e in report.get("gate_bias_cost", []):
        if e.get("mode") == mode:
            yield (
                f"| {e['shape']} / {e['plain']} | {e['scheme']} | {e['T']} | "
                f"{_f(e.get('graph_ms'))} / {_f(e.get('plain_graph_ms'))} | "
                f"{_f(e.get('ratio'))} (<= {e['max_ratio']}: {_met(e.get('met'))}) | "
                f"{_f(e.get('eager_ratio'))} |"
            )


def kernel_delta_rows(report: dict, mode: str, top: int = 4):
    """Per gate + bias pair, the kernels that cost most over the plain twin's (graph replay)."""
    for e in report.get("gate_bias_cost", []):
        delta = e.get("kernel_delta_us")
        if e.get("mode") == mode and delta:
            worst = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:top]
            cells = "; ".join(f"{name[:48]} {us:+.1f}" for name, us in worst)
            total = sum(delta.values())
            yield f"| {e['shape']} | {e['scheme']} | {e['T']} | {total:+.1f} | {cells} |"


def routing_rows(report: dict, mode: str):
    """The cases timed on several routings (--routings): each routing's graph ms, the medians."""
    for c in report["cases"]:
        g = c.get("graph_ms_routings")
        if c.get("mode") == mode and g:
            fm = c.get("floor_median_ms")
            yield (
                f"| {c['shape']} | {c['scheme']} | {c['T']} | {c.get('path')} | "
                f"{' / '.join(_f(v) for v in g)} | {_f(c.get('graph_median_ms'))} | "
                f"{_f(fm)} ({_x(fm, c.get('graph_median_ms'))}) |"
            )


def target_rows(report: dict):
    for t in report.get("targets", []):
        yield (
            f"| {t['shape']} | {t['scheme']} | {t['mode']} | {t['T']} | {_against(t)} | "
            f"<= {t['max_ratio']:.3f} | {_f(t.get('ratio'))} | {_met(t.get('met'))} |"
        )


def _against(t):
    """A target's reference and its ms: "floor 0.141", "0.68 ms", ..."""
    a, ref = t.get("against", "grouped_mm"), t.get("reference_ms")
    if isinstance(a, (int, float)):
        return f"{a} ms"
    return f"{a} {_f(ref)}"


def _met(v):
    return "-" if v is None else ("yes" if v else "NO")


GATE_BIAS_HEADER = (
    "| shape / plain twin | scheme | T | graph ms / twin's | gate + bias cost (graph) | "
    "(eager) |\n| --- | --- | --- | --- | --- | --- |"
)
KERNEL_DELTA_HEADER = (
    "| shape | scheme | T | device µs over the twin | largest per-kernel differences (µs) |\n"
    "| --- | --- | --- | --- | --- |"
)
ROUTING_HEADER = (
    "| shape | scheme | T | path | graph ms per routing | median | floor median (ours / floor) |\n"
    "| --- | --- | --- | --- | --- | --- | --- |"
)
TARGET_HEADER = (
    "| shape | scheme | mode | T | against (ms) | layer graph / it, target | measured | met |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- |"
)


LATEST_HEADER = (
    "| shape | scheme | T | path | graph ms | floor ms (graph / floor) | "
    "raw deep_gemm ms (graph / raw) | grouped_mm graph ms | eager ms | host µs | launches | "
    "run (UTC), tree |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def latest_rows(lines, mode: str):
    """The latest figures of each layer case of ``mode`` in measurements.jsonl lines (dicts)."""
    runs, path = {}, {}  # (case, date, commit) -> {metric: value}; -> the layer's path
    for r in lines:
        if r.get("benchmark") != "bench_one_gpu" or r.get("case", "").count("/") != 3:
            continue
        k = (r["case"], r["date"], r["commit"])
        runs.setdefault(k, {})[r["metric"]] = r["value"]
        if r.get("path"):
            path[k] = r["path"]
    latest, raw, gmm = {}, {}, {}
    for k, m in runs.items():
        case, date = k[0], k[1]
        if ("graph_median_ms" in m or "graph_ms" in m) and date >= latest.get(case, ("", ""))[1]:
            latest[case] = k
        if m.get("raw_ms", 0) > 0 and date >= raw.get(case, ("", 0))[0]:
            raw[case] = (date, m["raw_ms"])
        if "grouped_mm_graph_ms" in m and date >= gmm.get(case, ("", 0))[0]:
            gmm[case] = (date, m["grouped_mm_graph_ms"])

    def order(case):
        shape, scheme, _, t = case.split("/")
        return (shape, scheme, int(t[1:]))

    def other_run(found, date, ratio_to=None):
        if found is None:
            return "-"
        d, v = found
        cell = _f(v) + (f" ({_x(v, ratio_to)})" if ratio_to is not None else "")
        return cell + ("" if d == date else f", {d[:16]}")

    for case in sorted(latest, key=order):
        shape, scheme, case_mode, t = case.split("/")
        if case_mode != mode:
            continue
        k = latest[case]
        m = runs[k]
        g = m.get("graph_median_ms", m.get("graph_ms"))
        f = m.get("floor_median_ms", m.get("floor_ms"))
        yield (
            f"| {shape} | {scheme} | {t[1:]} | {path.get(k, '-')} | {_f(g)} | "
            f"{_f(f)} ({_x(f, g)}) | "
            f"{other_run(raw.get(case), k[1], g)} | {other_run(gmm.get(case), k[1])} | "
            f"{_f(m.get('eager_ms'))} | {_f(m.get('host_us'), 0)} | "
            f"{_f(m.get('launches'), 0)} | {k[1][:16]}, `{k[2]}` |"
        )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--mode", default="auto")
    a = p.parse_args()
    if a.json.endswith(".jsonl"):
        with open(a.json) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        print(LATEST_HEADER)
        for r in latest_rows(lines, a.mode):
            print(r)
        return
    with open(a.json) as f:
        report = json.load(f)
    print(
        f"copy bandwidth {report.get('copy_gbps', 0):.0f} GB/s; {report.get('device')}; "
        f"{report.get('date')}; {report.get('versions')}"
    )
    print(HEADER)
    for r in rows(report, a.mode):
        print(r)
    for header, lines in (
        (GATE_BIAS_HEADER, list(gate_bias_rows(report, a.mode))),
        (KERNEL_DELTA_HEADER, list(kernel_delta_rows(report, a.mode))),
        (ROUTING_HEADER, list(routing_rows(report, a.mode))),
        (TARGET_HEADER, list(target_rows(report))),
    ):
        if lines:
            print()
            print(header)
            for r in lines:
                print(r)


if __name__ == "__main__":
    main()
