"""Input checks of the grouped GEMM: the one-pass ``_valid`` and the full checks behind it."""

import torch

from epmoe import _checks
from epmoe._range import range_ok
from epmoe.ops.gemm._select import A_DTYPES, OP, scheme_of


def _valid(a, w, a_scales, w_scales, masked: bool, rows=None, offsets=None) -> bool:
    """The common all-good case (CUDA operands) in one pass: every eager call pays for validation
    (the full checks below cost several small calls per argument). Each tensor attribute read
    costs host time, so this reads each once: shapes kept as locals, devices as ints
    (get_device), dtypes compared by identity. ``rows``: masked_m (masked) or m_indices, int32;
    ``offsets``: expert_offsets or None. Any False falls through to the full checks, which say
    what is wrong."""
    try:
        dt = a.dtype
        if dt not in A_DTYPES or w.dtype is not dt or not a.is_cuda:
            return False
        # plain tensors without grad (see _eager.calm; a Parameter w takes the registered op)
        if (
            type(a) is not torch.Tensor
            or type(w) is not torch.Tensor
            or a.requires_grad
            or w.requires_grad
        ):
            return False
        dev = a.get_device()
        ash, wsh = a.shape, w.shape
        if len(ash) != (3 if masked else 2) or len(wsh) != 3 or w.get_device() != dev:
            return False
        kd, e, n = ash[-1], wsh[0], wsh[1]
        if wsh[2] != kd or (masked and ash[0] != e):
            return False
        if rows is not None and not _checks.plain_on(
            rows, _checks.INT32, dev, (e,) if masked else ash[:1]
        ):
            return False
        if offsets is not None and not _checks.plain_on(offsets, _checks.INT32, dev, (e + 1,)):
            return False
        if dt is torch.bfloat16:
            return a_scales is None and w_scales is None
        if (
            type(a_scales) is not torch.Tensor
            or type(w_scales) is not torch.Tensor
            or a_scales.requires_grad
            or w_scales.requires_grad
            or a_scales.dtype is not torch.float32
            or w_scales.dtype is not torch.float32
            or a_scales.get_device() != dev
            or w_scales.get_device() != dev
        ):
            return False
        ssh = a_scales.shape
        if dt is torch.int8:
            return ssh[:-1] == ash[:-1] and ssh[-1] == 1 and w_scales.shape == (e, n)
        return (
            kd % 128 == 0
            and n % 128 == 0
            and ssh[:-1] == ash[:-1]
            and ssh[-1] == kd // 128
            and w_scales.shape == (e, n // 128, kd // 128)
        )
    except (AttributeError, TypeError, IndexError):
        return False


def _validate(a, w, a_scales, w_scales, masked: bool) -> None:
    if _valid(a, w, a_scales, w_scales, masked):
        return
    _checks.check_dtype(OP, "a", a, A_DTYPES)
    _checks.check_ndim(OP, "a", a, (3,) if masked else (2,))
    _checks.check_dtype(OP, "w", w, (a.dtype,))
    _checks.check_ndim(OP, "w", w, (3,))
    _checks.check_device(OP, "w", w, a)
    Kd = a.shape[-1]
    E, N = w.shape[0], w.shape[1]
    if w.shape[2] != Kd:
        raise _checks.fail(OP, "w", f"shape [E, N, {Kd}] (K of a)", list(w.shape))
    if masked and a.shape[0] != E:
        raise _checks.fail(OP, "a", f"shape [{E}, T, {Kd}] (E of w)", list(a.shape))
    scheme = scheme_of(a.dtype)
    lead = tuple(a.shape[:-1])
    if scheme == "bf16":
        for name, t in (("a_scales", a_scales), ("w_scales", w_scales)):
            if t is not None:
                raise _checks.fail(OP, name, "None for bf16 operands", "a tensor")
        return
    if a_scales is None or w_scales is None:
        raise _checks.fail(OP, "a_scales/w_scales", f"tensors for {scheme} operands", "None")
    _checks.check_dtype(OP, "a_scales", a_scales, (torch.float32,))
    _checks.check_dtype(OP, "w_scales", w_scales, (torch.float32,))
    _checks.check_device(OP, "a_scales", a_scales, a)
    _checks.check_device(OP, "w_scales", w_scales, a)
    if scheme == "fp8":
        _checks.check_multiple(OP, "K", Kd, 128, "(fp8 scale blocks)")
        _checks.check_multiple(OP, "N", N, 128, "(fp8 weight blocks)")
        _checks.check_shape(OP, "a_scales", a_scales, lead + (Kd // 128,))
        _checks.check_shape(OP, "w_scales", w_scales, (E, N // 128, Kd // 128))
    else:
        _checks.check_shape(OP, "a_scales", a_scales, lead + (1,))
        _checks.check_shape(OP, "w_scales", w_scales, (E, N))


def _validate_contiguous(a, w, m_indices, a_scales, w_scales, expert_offsets=None) -> None:
    if m_indices is not None and _valid(a, w, a_scales, w_scales, False, m_indices, expert_offsets):
        return
    _validate(a, w, a_scales, w_scales, masked=False)
    _checks.check_dtype(OP, "m_indices", m_indices, (torch.int32,))
    _checks.check_shape(OP, "m_indices", m_indices, (a.shape[0],))
    _checks.check_device(OP, "m_indices", m_indices, a)
    if expert_offsets is not None:
        _checks.check_dtype(OP, "expert_offsets", expert_offsets, (torch.int32,))
        _checks.check_shape(OP, "expert_offsets", expert_offsets, (w.shape[0] + 1,))
        _checks.check_device(OP, "expert_offsets", expert_offsets, a)


def _validate_masked(a, w, masked_m, a_scales, w_scales) -> None:
    if masked_m is not None and _valid(a, w, a_scales, w_scales, True, masked_m):
        return
    _validate(a, w, a_scales, w_scales, masked=True)
    _checks.check_dtype(OP, "masked_m", masked_m, (torch.int32,))
    _checks.check_shape(OP, "masked_m", masked_m, (w.shape[0],))
    _checks.check_device(OP, "masked_m", masked_m, a)


def _check_counts(masked_m: torch.Tensor, t: int) -> None:
    ok = range_ok(masked_m, 0, t + 1)
    _checks.check_values(ok, OP, "masked_m", f"counts in [0, {t}]")
