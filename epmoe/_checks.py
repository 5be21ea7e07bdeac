"""Shared input validation.

Metadata checks (dtype, rank, shape, device, static ints) raise ``ValueError("op: arg expected X,
got Y")`` and are safe to call from fake implementations. Value checks (ids in range, capacity)
never become Python control flow on traced or CUDA tensors: on real CPU tensors they raise
``ValueError`` (no cost: CPU is synchronous), on CUDA they raise ``ValueError`` only in debug mode
(``EPMOE_DEBUG=1`` or :func:`set_debug`), otherwise they enqueue a device-side assert (no host sync,
CUDA-graph safe), and while tracing they become a functional assert in the graph.

While a CUDA graph is being captured, an op can put its value check on a side stream
(:func:`branch`, :func:`on_branch`, :func:`join`): the check's kernels become a parallel branch of
the graph instead of nodes between the op's own kernels (the check still runs on every replay,
and the op's result still waits for it). Only for ops whose kernels stay in bounds whatever the
values (permute, unpermute: they skip bad ids): the kernels then run before the assert does. The
grouped GEMMs keep their checks in front, because a bad count or id would send deep_gemm out of
bounds before the assert could stop it.
"""

import contextlib
import os
from typing import Dict, Iterable, Optional, Sequence

import torch

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
    """``shape`` entries may be None (any size)."""
    check_tensor(op, arg, t)
    got = t.shape
    ok = len(got) == len(shape)
    if ok:  # a plain loop: this runs on every eager call (no generator)
        for g, s in zip(got, shape, strict=True):
            if s is not None and g != s:
                ok = False
                break
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
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


def check_masked_m(op: str, masked_m: Optional[torch.Tensor], x: torch.Tensor, x_name: str) -> None:
    """masked_m (None, or int32/int64 `[E]` on x's device) of a masked `[E, T, *]` ``x``."""
    if masked_m is None:
        return
    if x.dim() != 3:
        raise fail(op, "masked_m", f"None for a 2-D {x_name}", "a tensor")
    check_dtype(op, "masked_m", masked_m, INDEX_DTYPES)
    check_shape(op, "masked_m", masked_m, (x.shape[0],))
    check_device(op, "masked_m", masked_m, x)


def plain_on(t: object, dtypes: Sequence[torch.dtype], dev: int, shape: Sequence[int]) -> bool:
    """Fast-path check (ops' one-pass ``_valid``): t is a plain ``torch.Tensor`` without grad, of
    one of ``dtypes``, on device index ``dev`` (``get_device()``), of exactly this shape. False
    sends the call to the full checks, which say what is wrong."""
    return (
        type(t) is torch.Tensor
        and not t.requires_grad
        and t.dtype in dtypes
        and t.get_device() == dev
        and t.shape == shape
    )


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


def check_values(
    ok: torch.Tensor, op: str, arg: str, expected: str, got: Optional[str] = None
) -> None:
    """Value check; ``ok`` is a 0-d bool tensor that is True when the input is valid."""
    if _tracing(ok):
        torch._assert_async(ok, f"{op}: {arg} expected {expected}")
        return
    if ok.device.type == "cpu" or _DEBUG:
        if not bool(ok):
            raise fail(op, arg, expected, got or "values outside it")
        return
    torch._assert_async(ok, f"{op}: {arg} expected {expected}")


_BRANCHES: Dict[torch.device, "torch.cuda.Stream"] = {}


def branch(t: torch.Tensor, max_numel: Optional[int] = None) -> Optional["torch.cuda.Stream"]:
    """A side stream for a value check while a CUDA graph is being captured on t's device, forked
    from the current stream (it sees every kernel launched so far); None otherwise.

    Only under capture: in a replay the branch costs nothing, while in eager calls a stream switch
    and two event waits would cost more host time than the check's few µs of device time saves.
    Never while tracing (torch.compile records the check in the graph) or in debug mode (the check
    syncs to raise a ValueError). Pair with :func:`on_branch` and :func:`join`.

    ``max_numel``: no branch when t is larger. A branch of several kernels beside a long kernel
    ends up after it (the long kernel holds every SM), so it only pays for small checks (W
    unpermute on H200: decode 14.5 -> 10.9 µs with the branch, prefill 151.6 -> 161.0).
    """
    if _DEBUG or not t.is_cuda or not torch.cuda.is_current_stream_capturing() or _tracing(t):
        return None
    if max_numel is not None and t.numel() > max_numel:
        return None
    side = _BRANCHES.get(t.device)
    if side is None:
        side = _BRANCHES[t.device] = torch.cuda.Stream(t.device)
    side.wait_stream(torch.cuda.current_stream(t.device))
    return side


def on_branch(side: Optional["torch.cuda.Stream"]):
    """Context that launches on ``side`` (from :func:`branch`), or on the current stream."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def join(side: Optional["torch.cuda.Stream"]) -> None:
    """Make the current stream wait for ``side`` (None: nothing to join). Call before the op
    returns: a capture must join every stream it forked, and the op's outputs then carry the
    check."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)


def check_ids(ids: torch.Tensor, hi: int, op: str, arg: str) -> None:
    """Ids must be -1 or in [0, hi)."""
    from epmoe.ops._range import range_ok  # (epmoe.ops imports this module)

    ok = range_ok(ids, -1, hi)
    check_values(ok, op, arg, f"ids in [0, {hi}) or -1")
