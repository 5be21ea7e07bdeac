"""scripts/host_python.py (the eager chain's Python host cost, launches stubbed) still runs every
path of the current layer: in a subprocess, since it patches the launch modules process-wide."""

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_host_python_runs_every_path():
    res = subprocess.run(
        [sys.executable, "scripts/host_python.py", "--iters", "3", "--repeats", "1", "--stages"],
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
    assert any("permute" in name for name in rows) and any("ll gemm1" in n for n in rows)


def test_host_python_against_another_tree():
    """--against DIR: both trees' own copies of the script, alternating; one row per case with the
    two best µs and their ratio (here the tree against itself)."""
    res = subprocess.run(
        [sys.executable, "scripts/host_python.py", "--iters", "3", "--repeats", "1",
         "--quant", "bf16", "--against", str(REPO), "--rounds", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line[:22].strip(): line[22:].split() for line in res.stdout.splitlines()[1:]}
    for path, tokens in (("gemv", 1), ("ll", 32), ("ht", 32)):
        base, this, ratio = map(float, rows[f"bf16 {path} T={tokens}"])
        assert base > 0 and this > 0 and ratio == pytest.approx(this / base, abs=1e-3)
