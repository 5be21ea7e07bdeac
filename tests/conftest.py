import os
import sys

import torch

# Without a GPU, Triton kernels are tested on CPU tensors through the interpreter. The variable must
# be set before triton is first imported (torch does not import it), so one `pytest` runs
# everything.
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Kernels under test must not depend on the order tests run in.
torch.manual_seed(0)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    n = _gpus()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two CUDA GPUs")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    skip_interp = pytest.mark.skip(
        reason="Triton interpreter tests need TRITON_INTERPRET=1 (no GPU)"
    )
    for item in items:
        if "interpret" in item.keywords and not interpret:
            item.add_marker(skip_interp)
        if "multi_gpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)
    # the device_triton builds take minutes each: first, so xdist starts them with the run rather
    # than leaving them for its tail, where a device call's time cap cuts them off
    items.sort(key=lambda item: "device_triton" not in item.keywords)


@pytest.fixture
def seed():
    torch.manual_seed(1234)
    return 1234


@pytest.fixture
def h200_table(monkeypatch, tmp_path):
    """A tuned-table directory of its own (``tmp_path``), read for CUDA devices as an H200's on
    this machine (GPU or not); the table's caches cleared before and after."""
    from epmoe.ops.gemm import _tuned

    monkeypatch.setattr(_tuned, "DIR", tmp_path)
    monkeypatch.setattr(_tuned, "_device_name", lambda index: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _tuned.reread()
    yield tmp_path
    _tuned.reread()


@pytest.fixture
def bf16_dots(monkeypatch):
    """The interpreter multiplies bf16 dot operands as their raw 16-bit patterns (numpy has no
    bf16; Triton 3.9's create_dot only converts 8-bit floats): widen them to float32 first, as the
    tensor cores do. The kernels are unchanged; only the CPU simulator is mended."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def widened(h):
        if h.dtype != tl.bfloat16:
            return h
        bits = h.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):
        return dot(self, widened(a), widened(b), d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture
def triton_interpret():
    """True when Triton kernels run on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pytest_runtest_logreport(report):
    """As each test ends (a run cut off by a time limit on the GPU machine keeps what ran): with
    EPMOE_FAILLOG=path, append each failure's traceback; with EPMOE_TESTLOG=path, each test's
    outcome, id and seconds. Under xdist the controller writes (the workers' reports reach it)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    path = os.environ.get("EPMOE_FAILLOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
    path = os.environ.get("EPMOE_TESTLOG")
    if path and (report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as f:
            f.write(f"{report.outcome} {report.nodeid} ({report.when}) {report.duration:.1f}s\n")
