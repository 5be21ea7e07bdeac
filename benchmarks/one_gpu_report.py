"""Markdown tables from a bench_one_gpu.py JSON (the rows of benchmarks/results/h200/RESULTS.md).

    python benchmarks/one_gpu_report.py OUT.json [--mode auto]

One row per (shape, scheme, T) of the given layer mode: CUDA-graph replay of the layer against
transformers' grouped_mm experts (graph) and raw deep_gemm on the same routing, the weight-read
floor, eager / torch.compile default / reduce-overhead, host µs and launches per eager call. Then,
where the run has them, the cost of a gate and biases (a config's graph time over its plain-SiLU
twin's, e.g. gpt-oss-20b over gpt-oss-20b-silu), the cases timed on several routings
(``--routings``) and the targets with whether they were met.
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--mode", default="auto")
    a = p.parse_args()
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
