"""`import epmoe` is lean: no deep_ep / deep_gemm, no CUDA initialization, ops registered."""

import subprocess
import sys

CODE = """
import sys, torch
import epmoe
from epmoe import ops, reference
assert "deep_ep" not in sys.modules and "deep_gemm" not in sys.modules, "GPU backend imported"
assert not torch.cuda.is_initialized(), "CUDA initialized on import"
names = ["quantize", "permute", "unpermute", "silu_and_mul", "silu_and_mul_quant",
         "grouped_gemm_contiguous", "grouped_gemm_masked", "grouped_gemm_gate",
         "grouped_gemm_masked_gate", "ht_dispatch",
         "ht_dispatch_exact",
         "ht_combine", "ll_dispatch", "ll_combine", "gemv_gate_up", "gemv_down"]
missing = [n for n in names if not hasattr(torch.ops.epmoe, n)]
assert not missing, missing
assert epmoe.__version__
print("ok")
"""


def test_lean_import():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_old_triton_is_named():
    """A Triton below the floor: ImportError naming both versions, not a missing name."""
    code = "import triton; triton.__version__ = '3.5.0'; import epmoe"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "ImportError: epmoe needs triton>=3.6, found triton 3.5.0" in out.stderr, out.stderr


LAZY_INTEGRATIONS = """
import sys
import epmoe
assert "epmoe.integrations" not in sys.modules, "import epmoe imported the integrations"
import epmoe.integrations.transformers as et
assert "transformers" not in sys.modules, "the integration imported transformers before register()"
assert et.NAMES
print("ok")
"""


def test_integrations_are_lazy():
    code = LAZY_INTEGRATIONS
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_missing_backend_hint(monkeypatch):
    import builtins

    from epmoe import _deps

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "deep_gemm":
            raise ImportError("No module named 'deep_gemm'")
        return real_import(name, *a, **k)

    _deps._load.cache_clear()
    monkeypatch.setattr(builtins, "__import__", fake_import)
    try:
        import pytest

        with pytest.raises(ImportError, match="pip install"):
            _deps.deep_gemm()
    finally:
        _deps._load.cache_clear()
