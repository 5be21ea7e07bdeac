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


# each HT GEMM's backend in the layer's chain, then in --stages' calls of the same stages
_STAGE_BACKENDS = """
import sys
sys.path.insert(0, "scripts")
import host_python as hp
from epmoe.ops.gemm import _ops

hp.stub_launches()
seen, backend = [], _ops._backend
_ops._backend = lambda *a: seen.append((a[1], backend(*a))) or seen[-1][1]
for quant in ("bf16", "fp8", "int8"):
    layer = hp.build(quant)
    hp.call_of(layer, "ht", 32)()
    chain = [b for layout, b in seen if layout == "contiguous"]
    stages = hp.stage_calls(layer, 32)
    seen.clear()
    stages["ht gemm1"]()
    stages["ht gemm2"]()
    print(quant, *chain, "|", *[b for layout, b in seen if layout == "contiguous"])
    seen.clear()
"""


def test_stages_run_the_layers_gemm_backends():
    """--stages times each HT GEMM on the backend the layer's chain takes (its alignment's): not
    torch's grouped_mm or the CPU reference, which a call without the layer's alignment picked."""
    res = subprocess.run([sys.executable, "-c", _STAGE_BACKENDS], cwd=REPO, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 3
    for line in lines:
        chain, stages = line.split(" | ")
        quant, *chain = chain.split()
        assert len(chain) == 2 and stages.split() == chain, (quant, chain, stages)
        assert "reference" not in chain, quant


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
