"""The JSON header the script benchmarks (bench_one_gpu.py, bench_hf.py) start their report with."""

import os
import subprocess
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def versions() -> dict:
    """torch, epmoe, triton, deep_gemm and transformers versions, and the checkout's commit."""
    out = {"torch": torch.__version__}
    for name in ("epmoe", "triton", "deep_gemm", "transformers"):
        try:
            out[name] = getattr(__import__(name), "__version__", "?")
        except Exception as e:  # noqa: BLE001 - absent is a value here
            out[name] = f"unavailable ({type(e).__name__})"
    tree = os.path.join(_HERE, "..", ".tree-rev")  # written by the caller where .git is stale
    if os.path.exists(tree):
        with open(tree) as f:
            out["git"] = f.read().strip()
        return out
    try:
        out["git"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=_HERE,
        ).stdout.strip()  # fmt: skip
    except Exception:  # noqa: BLE001
        out["git"] = None
    return out


def header(script: str, argv, args, device: torch.device, items: str) -> dict:
    """A report that lists its measurements under ``items`` (empty), for ``script`` run with
    ``argv`` (None: sys.argv) and parsed ``args`` (its ``budget_s`` is the run's budget)."""
    words = sys.argv[1:] if argv is None else argv
    return {
        "schema": 1,
        "command": f"python benchmarks/{script} " + " ".join(words),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": versions(),
        "args": vars(args),
        "budget_s": args.budget_s,
        "elapsed_s": 0.0,
        "complete": False,
        "notes": [],
        "skipped": [],
        items: [],
    }
