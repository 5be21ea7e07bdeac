"""Lazy imports of the optional GPU backends, with install hints.

Nothing here runs on ``import epmoe``.
"""

import functools
import importlib

_HINTS = {
    "deep_ep": (
        "deep_ep is not installed. Install the prebuilt wheel (Python 3.12, CUDA 13, torch 2.11): "
        "pip install 'epmoe[gpu]'  (or pip install tokenspeed-deepep), or build from source: "
        "https://github.com/deepseek-ai/DeepEP"
    ),
    "deep_gemm": (
        "deep_gemm is not installed. Install the prebuilt wheel "
        "(Python 3.12, CUDA 13, torch 2.11): "
        "pip install 'epmoe[gpu]'  (or pip install tokenspeed-deepgemm), or build from source: "
        "https://github.com/deepseek-ai/DeepGEMM"
    ),
    "triton": "triton is not installed: pip install triton",
}


@functools.cache
def _load(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(_HINTS[name]) from e


def deep_ep():
    """Import ``deep_ep`` or raise ImportError saying how to install it."""
    return _load("deep_ep")


def deep_gemm():
    """Import ``deep_gemm`` or raise ImportError saying how to install it."""
    return _load("deep_gemm")


def available(name: str) -> bool:
    try:
        _load(name)
    except Exception:  # noqa: BLE001 - a backend that fails to load for any reason is unusable
        return False
    return True
