"""Shared input validation.

Metadata checks (dtype, rank, shape, device, static ints) raise ``ValueError("op: arg expected X,
got Y")`` and are safe to call from fake implementations. Value checks (ids in range, capacity)
never become Python control flow on traced or CUDA tensors: on real CPU tensors they raise
``ValueError`` (no cost: CPU is synchronous), on CUDA they raise ``ValueError`` only in debug mode
(``EPMOE_DEBUG=1`` or :func:`set_debug`), otherwise they enqueue a device-side assert (no host sync,
CUDA-graph safe), and while tracing they become a functional assert in the graph.

On direct launches (:func:`direct_launch`: the public functions' eager calls, the dispatcher's,
and CUDA-graph capture of either) permute and unpermute assert the values inside their own
kernels (:func:`assert_in_kernel`, :func:`assert_build`): no check kernel runs before or after
them, and a bad id or row is skipped, never read or written through. The grouped GEMMs keep their
checks in front, because a bad count or id would send deep_gemm out of bounds before the assert
could stop it.
"""

import os
from typing import Iterable, Optional, Sequence, Tuple

import torch

from epmoe import _range

_DEBUG = os.environ.get("EPMOE_DEBUG", "0") not in ("", "0")

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)  # ids, rows and counts an op accepts in either width
INT32 = (torch.int32,)  # rows, counts and offsets an op takes in this width only


def set_debug(enabled: bool) -> None:
    """Turn on eager value checks on CUDA (each costs one host sync; never use while capturing)."""
    global _DEBUG
    _DEBUG = bool(enabled)


def debug_enabled() -> bool:
    return _DEBUG


def fail(op: str, arg: str, expected: str, got: object) -> "ValueError":
    return ValueError(f"{op}: {arg} expected {expected}, got {got}")


def check_no_grad(op: str, **tensors) -> None:
    """Inference-only ops (none has a backward): with grad mode on, a tensor that requires grad is
    a ValueError, never a gradient that silently stops here or a backward that fails later."""
    if torch.is_grad_enabled():
        for name, t in tensors.items():
            if t is not None and t.requires_grad:
                raise fail(
                    op, name, "a tensor that does not require grad (inference only: call it under "
                    "torch.no_grad() or torch.inference_mode())", "requires_grad=True",
                )  # fmt: skip


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d) for d in dtypes)


def check_tensor(op: str, arg: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise fail(op, arg, "a torch.Tensor", type(t).__name__)


def check_dtype(op: str, arg: str, t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
    check_tensor(op, arg, t)
    if t.dtype not in dtypes:
        raise fail(op, arg, f"dtype {_names(dtypes)}", t.dtype)


def check_ndim(op: str, arg: str, t: torch.Tensor, ndims: Sequence[int]) -> None:
    check_tensor(op, arg, t)
    if t.dim() not in ndims:
        want = " or ".join(f"{n}-D" for n in ndims)
        raise fail(op, arg, f"a {want} tensor", f"shape {tuple(t.shape)}")


def check_shape(op: str, arg: str, t: torch.Tensor, shape: Sequence[object]) -> None:
    """``shape`` entries may be None (any size: "any" in the message, where "*" would read as any
    number of dimensions)."""
    check_tensor(op, arg, t)
    got = t.shape
    ok = len(got) == len(shape)
    if ok:  # a plain loop: this runs on every eager call (no generator)
        for g, s in zip(got, shape, strict=True):
            if s is not None and g != s:
                ok = False
                break
    if not ok:
        want = "[" + ", ".join("any" if s is None else str(s) for s in shape) + "]"
        raise fail(op, arg, f"shape {want}", f"{list(t.shape)}")


def check_device(op: str, arg: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    check_tensor(op, arg, t)
    if t.device != ref.device:
        raise fail(op, arg, f"device {ref.device} (same as the first input)", t.device)


def check_positive_int(op: str, arg: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise fail(op, arg, "a positive int", repr(v))
    return v


def check_choice(op: str, arg: str, v: object, choices: Sequence[object]) -> None:
    if v not in choices:
        raise fail(op, arg, "one of " + ", ".join(repr(c) for c in choices), repr(v))


def check_multiple(op: str, arg: str, v: int, of: int, why: str = "") -> None:
    if v % of != 0:
        raise fail(op, arg, f"a multiple of {of}{' ' + why if why else ''}", v)


def _tracing(t: torch.Tensor) -> bool:
    """Under torch.compile, or t is a fake tensor (itself or inside a functional / functorch
    wrapper, which look like plain tensors). Every eager call asks, so a plain tensor is answered
    without torch's is_fake (and its import)."""
    if _is_compiling():
        return True
    if type(t) is torch.Tensor and not _is_functional(t) and not _is_functorch_wrapped(t):
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


_is_compiling = torch.compiler.is_compiling
_is_functional = torch._is_functional_tensor
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def direct_launch(t: torch.Tensor) -> bool:
    """A Triton launch on t's device goes straight to CUDA: t is a CUDA tensor, nothing traces it
    and wrap_triton is off (eager calls of the public functions or of the dispatcher's ops, and
    graph capture of either; not the interpreter, nor torch.compile, whose launches are
    wrapped)."""
    return t.is_cuda and not _tracing(t) and not torch._library.triton.is_wrap_triton_enabled()


def assert_in_kernel(direct: bool) -> bool:
    """A direct launch (:func:`direct_launch`) asserts the values in its kernel: no check kernel
    after it. Not in debug mode, which syncs and raises a ValueError instead."""
    return direct and not _DEBUG


def assert_build(in_kernel: bool) -> dict:
    """Launch options that compile a kernel's device asserts in (debug=True) and nothing else:
    with debug on, Triton would also check every int32 add and multiply for overflow."""
    return dict(debug=True, sanitize_overflow=False) if in_kernel else {}


def _asserts_async(flag: torch.Tensor) -> bool:
    """A value check on ``flag`` is an async assert (traced, or on a device outside debug mode);
    otherwise (CPU, debug mode) it reads the flag and raises a ValueError."""
    return _tracing(flag) or (flag.device.type != "cpu" and not _DEBUG)


def check_values(
    ok: torch.Tensor, op: str, arg: str, expected: str, got: Optional[str] = None
) -> None:
    """Value check; ``ok`` is a one-element bool tensor, True when the input is valid."""
    if _asserts_async(ok):
        torch._assert_async(ok, f"{op}: {arg} expected {expected}")
    elif not bool(ok):
        raise fail(op, arg, expected, got or "values outside it")


def check_codes(code: torch.Tensor, op: str, arg: str, cases: Sequence[Tuple[str, str]]) -> None:
    """Several value checks of one kernel in one int32 ``code``: bit i is set when check i failed,
    ``cases[i]`` = (expected, got). Traced (or async on a device): one assert that code == 0, so
    one kernel under torch.compile; on CPU or in debug mode the first failed check raises."""
    if _asserts_async(code):
        expected = " and ".join(e for e, _ in cases)
        torch._assert_async(code == 0, f"{op}: {arg} expected {expected}")
        return
    c = int(code)
    for i, (expected, got) in enumerate(cases):
        if c >> i & 1:
            raise fail(op, arg, expected, got)


def check_ids(ids: torch.Tensor, hi: int, op: str, arg: str) -> None:
    """Ids must be -1 or in [0, hi)."""
    ok = _range.range_ok(ids, -1, hi)
    check_values(ok, op, arg, f"ids in [0, {hi}) or -1")
