"""Every Triton kernel of the local stages compiles for sm90 (no GPU needed).

The interpreter that runs the kernels in CI accepts code the compiler rejects (e.g. one name with
two types in the two branches of an ``if``); scripts/compile_kernels.py compiles each kernel as the
stages launch it, with the local Triton and its bundled ptxas, in a process without
TRITON_INTERPRET.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return ""
    return triton.__version__


def _compile_kernels(*args: str) -> subprocess.CompletedProcess:
    """scripts/compile_kernels.py ``args`` in a process without TRITON_INTERPRET (skips where
    this Triton has no CUDA backend; fails on its exit code)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_kernels.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if "No module named" in proc.stderr and "triton.backends" in proc.stderr:
        pytest.skip("this Triton build has no CUDA backend")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


# two shards: CI's two pytest workers share the builds (about 3.5 min of each with a cold cache)
@pytest.mark.parametrize("shard", ["0/2", "1/2"])
def test_kernels_compile_for_sm90(shard):
    assert " 0 failure(s)" in _compile_kernels("--shard", shard).stdout


# every candidate config in every variant (what the autotuner and the tuner launch), with the GPU
# machine's Triton: a newer one accepts code that 3.6 rejects; the device's test step runs it
@pytest.mark.device_triton
@pytest.mark.skipif(not triton_version().startswith("3.6."), reason="the device's Triton: 3.6")
@pytest.mark.parametrize("shard", [f"{i}/4" for i in range(4)])
def test_every_candidate_config_compiles_for_sm90(shard):
    assert " 0 failure(s)" in _compile_kernels("--every-config", "--shard", shard).stdout


# the masked GEMM builds whose wgmmas ptxas serializes (compile_kernels --wgmma): only the bf16
# COOP tile stored from registers; an fp8 Gluon loop that reads a step's sum before its wait
# (or any new build that trips ptxas) fails here. With the device's Triton (3.6) and its ptxas
# only: Triton 3.9's builds (CI's) trip none of these notes, the known ones included.
@pytest.mark.device_triton
@pytest.mark.skipif(not triton_version().startswith("3.6."), reason="the device's Triton: 3.6")
def test_masked_gemm_wgmmas_not_serialized():
    proc = _compile_kernels("--wgmma", "--every-config", "--only", "masked GEMMs with")
    built = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok ", "SER "))]
    serial = [ln for ln in built if ln.startswith("SER ")]
    assert any("'QUANT': 1" in ln and "'GLUON': True" in ln for ln in built)
    assert all("'COOP': True" in ln and "'QUANT': 0" in ln for ln in serial), serial
