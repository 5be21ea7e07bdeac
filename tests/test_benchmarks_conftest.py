"""benchmarks/conftest.py: the README's benchmark command, without ``-n``, writes its figures (the
tests' ``--dist loadgroup`` in pyproject's addopts once made pytest-benchmark disable them all)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_enable_writes_figures(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pytest", "benchmarks/test_bench_cpu.py", "-q", "-k",
           "silu_and_mul", "-p", "no:cacheprovider", "--benchmark-enable",
           f"--benchmark-json={out}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # (not a worker)
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [b["name"] for b in json.loads(out.read_text())["benchmarks"]] == ["test_silu_and_mul"]
