"""Eager fast path: the public op functions call their CUDA implementation without the dispatcher.

A ``torch.library`` custom op or triton op adds host time to every eager call before its own
Python runs (autograd wrapper, redispatch, the dynamo-disable wrapper; measured in
``benchmarks/test_bench_overhead.py``), several times the launch of a small kernel. The public
functions of :mod:`epmoe.ops` (``quantize``, ``permute``, ...) therefore call the op's
implementation directly, with the same validation, when nothing could tell the difference:

- not under torch.compile / dynamo (the traced call is always the registered op),
- no torch function or dispatch mode active (FakeTensorMode, make_fx, functionalization,
  TorchDispatchMode-based tools all see the op), no profiler running (traces show ``epmoe::<op>``),
- every tensor argument a plain CUDA ``torch.Tensor`` (no subclass, no functorch / functional
  wrapper) that does not require grad.

Otherwise, and always with ``EPMOE_EAGER_DISPATCH=1``, the call goes through
``torch.ops.epmoe.<op>``. Results are identical either way: both run the same function.

:func:`run` calls the implementation the way a triton op's eager call does, with ``wrap_triton``
switched off: outside a triton op ``wrap_triton(kernel)[grid](...)`` otherwise routes every
launch through the triton_kernel_wrapper higher-order op (much Python per launch).
"""

import contextlib
import os

import torch
from torch._library import triton as _triton_lib

_ENABLED = os.environ.get("EPMOE_EAGER_DISPATCH", "0") != "1"


def set_enabled(enabled: bool) -> None:
    """Turn the eager fast path on or off (off: every call goes through the registered op)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def enabled() -> bool:
    return _ENABLED


# the global-state queries of plain(), bound once (each module attribute lookup costs host time
# on every eager call)
_is_compiling = torch.compiler.is_compiling
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_profiling = torch.autograd._profiler_enabled
_functorch = torch._C._are_functorch_transforms_active
_Tensor = torch.Tensor


def direct(*tensors) -> bool:
    """True when an op call with these tensor arguments (None allowed) may skip the dispatcher."""
    return _ENABLED and plain(*tensors)


def _untraced() -> bool:
    """No compile, torch function / dispatch mode, profiler or functorch transform is active
    (functorch transforms, vmap / grad / functionalize, wrap tensors that look like plain ones)."""
    return not (
        _is_compiling() or _function_modes() or _dispatch_modes() or _profiling() or _functorch()
    )


def calm() -> bool:
    """The global half of direct(): the fast path is on and nothing traces or intercepts calls.
    An op's one-pass validation then checks the tensors' half (plain ``torch.Tensor``, CUDA, no
    grad) while it reads them anyway (a contract's ``direct``, :mod:`epmoe._contract`)."""
    return _ENABLED and _untraced()


def plain(*tensors) -> bool:
    """True when nothing traces or intercepts a call on these tensors (None allowed): a kernel may
    then be launched directly, and its effect needs no record in any graph."""
    if not _untraced():
        return False
    for t in tensors:
        if t is not None and (type(t) is not _Tensor or not t.is_cuda or t.requires_grad):
            return False
    return True


class no_wrap:
    """``with no_wrap():`` Triton kernels launch directly inside the block (wrap_triton off), as
    inside an op's CUDA kernel: the layer's direct path enters it once per call."""

    __slots__ = ("prev",)

    def __enter__(self):
        self.prev = _triton_lib.is_wrap_triton_enabled()
        _triton_lib.wrap_triton_enabled.value = False
        return self

    def __exit__(self, *exc):
        _triton_lib.wrap_triton_enabled.value = self.prev
        return False


def on_device(t: torch.Tensor):
    """torch.cuda.device(t.device), or a no-op context when it already is the current device (the
    usual case; entering the device context costs two device exchanges per call)."""
    # (a CUDA tensor means CUDA is initialized: the current device needs no lazy-init check)
    d = t.get_device()
    if d < 0 or d == torch._C._cuda_getDevice():
        return _NULL
    return torch.cuda.device(d)


_NULL = contextlib.nullcontext()  # (reusable: entering and leaving it does nothing)


def run(fn, *args):
    """fn(*args) with wrap_triton disabled (its kernels launch directly), as inside an op."""
    with no_wrap():
        return fn(*args)
