"""pytest-benchmark entry for the 2-GPU deep_ep benchmark (``bench_deepep.py``).

pytest-benchmark times a callable in this process, which does not fit two ranks; this wrapper runs
the multi-process benchmark once and puts its numbers (ours vs raw deep_ep per case, GB/s, overhead)
in ``extra_info``. The recorded time itself is the whole run and means nothing.

Run on the GPU machine:
  python -m pytest benchmarks/test_bench_deepep.py --benchmark-enable --benchmark-json=deepep.json
(or directly: python benchmarks/bench_deepep.py --out deepep.json); record the JSON with
``python scripts/record_results.py --gpu h200x2 deepep.json``.
"""

import json
import os

import pytest
import torch

from epmoe import _deps

pytestmark = [
    pytest.mark.multi_gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and not _deps.available("deep_ep"), reason="needs deep_ep"
    ),
]


def test_deepep_ops_vs_raw(benchmark, tmp_path):
    import bench_deepep  # benchmarks/ is on sys.path for its own test modules

    out = os.environ.get("EPMOE_DEEPEP_BENCH_JSON", str(tmp_path / "deepep.json"))
    report = {}

    def run():
        report.update(bench_deepep.run("W"))

    benchmark.pedantic(run, rounds=1, iterations=1)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    benchmark.extra_info.update(
        workload="W",
        device=report["device"],
        target_overhead_pct=bench_deepep.TARGET_OVERHEAD_PCT,
        **{
            f"{case}.{k}": round(v, 3)
            for case, e in report["summary"].items()
            for k, v in e.items()
            if k in ("ours_us", "raw_us", "overhead_pct", "ours_GBps", "raw_GBps")
        },
    )
