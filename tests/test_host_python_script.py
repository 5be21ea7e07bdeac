"""scripts/host_python.py (the eager chain's Python host cost, launches stubbed) still runs every
path of the current layer: in a subprocess, since it patches the launch modules process-wide."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_host_python_runs_every_path():
    res = subprocess.run(
        [sys.executable, "scripts/host_python.py", "--iters", "3", "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = dict(
        line.rsplit(None, 2)[0:2] for line in res.stdout.splitlines() if line.endswith("us")
    )
    for quant in ("bf16", "fp8", "int8"):
        for path, tokens in (("gemv", 1), ("ll", 32), ("ht", 32)):
            assert float(rows[f"{quant} {path} T={tokens}"]) > 0
