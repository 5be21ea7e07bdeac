"""The grouped GEMM ops: torch.library registration (fakes, CPU reference kernels, CUDA kernels
that dispatch to the backend :func:`_backend` picks) and the public :func:`grouped_gemm`."""

from typing import Optional

import torch

from epmoe import _checks, _eager, reference
from epmoe.ops.gemm._deepgemm import _deep_gemm_contiguous, _deep_gemm_masked
from epmoe.ops.gemm._int8 import _int8_contiguous_triton, _int8_masked_triton
from epmoe.ops.gemm._select import OP, _backend, _dg_functions, masked_row_block, scheme_of
from epmoe.ops.gemm._validate import CONTIGUOUS, MASKED, _check_counts


# ---------------------------------------------------------------------------------- CUDA backends
def _group_ends(m_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 `[E]` cumulative end row of each expert's rows (torch._grouped_mm ``offs``), sync-free.

    Padding (-1) rows between experts land in the next expert's group: their output is unspecified.
    """
    rows = torch.arange(1, m_indices.numel() + 1, device=m_indices.device, dtype=torch.int32)
    valid = m_indices >= 0
    ends = torch.zeros(num_experts, dtype=torch.int32, device=m_indices.device)
    ends.scatter_reduce_(
        0, m_indices.clamp(min=0).long(), torch.where(valid, rows, 0), reduce="amax"
    )
    return torch.cummax(ends, 0).values


def _contiguous_cuda_impl(a, w, m_indices, a_scales, w_scales, expert_offsets):
    scheme = scheme_of(a.dtype)
    M, K = a.shape
    E, N = w.shape[0], w.shape[1]
    backend = _backend(scheme, "contiguous", a.device, N, K)
    if backend == "triton":
        return _int8_contiguous_triton(a, w, m_indices, a_scales, w_scales)
    if backend == "reference" or M == 0:
        return reference.grouped_gemm_contiguous(a, w, m_indices, a_scales, w_scales)
    if backend == "grouped_mm":
        if expert_offsets is None:
            offs = _group_ends(m_indices, E)
        else:
            offs = expert_offsets[1:].contiguous()
        return torch._grouped_mm(a.contiguous(), w.transpose(1, 2), offs=offs)
    fn = _dg_functions()[f"{scheme}_contiguous"]
    return _deep_gemm_contiguous(fn, a, w, m_indices, a_scales, w_scales)


def _masked_cuda_impl(a, w, masked_m, a_scales, w_scales, expected_m, trusted=False):
    scheme = scheme_of(a.dtype)
    E, T, K = a.shape
    N = w.shape[1]
    backend = _backend(scheme, "masked", a.device, N, K)
    if backend == "triton":  # the kernel itself checks the counts (trusted: none to check)
        ok = None if trusted else torch.empty((), dtype=torch.bool, device=a.device)
        out = _int8_masked_triton(a, w, masked_m, a_scales, w_scales, expected_m, ok=ok)
        if ok is not None:
            _checks.check_values(ok, OP, "masked_m", f"counts in [0, {T}]")
        return out
    if not trusted:
        _check_counts(masked_m, T)
    if backend == "reference" or T == 0:
        return reference.grouped_gemm_masked(a, w, masked_m, a_scales, w_scales)
    if backend == "bmm":
        return torch.bmm(a, w.transpose(1, 2))
    fn = _dg_functions()[f"{scheme}_masked"]
    block = masked_row_block(scheme, a.device)
    return _deep_gemm_masked(fn, a, w, masked_m, a_scales, w_scales, expected_m, block)


# -------------------------------------------------------------------------------------------- ops
# Defined on a torch.library.Library, not with custom_op: the compiled layer calls both GEMMs
# through the dispatcher, where custom_op's Python autograd and aliasing wrappers cost several
# times a plain registration. No autograd kernel (inference only): inputs that would need one
# are a ValueError in every kernel (_check_no_grad), never a silently missing gradient.
_LIB = torch.library.Library("epmoe", "FRAGMENT")
_LIB.define(
    "grouped_gemm_contiguous(Tensor a, Tensor w, Tensor m_indices, Tensor? a_scales=None, "
    "Tensor? w_scales=None, Tensor? expert_offsets=None, bool trusted=False) -> Tensor"
)
_LIB.define(
    "grouped_gemm_masked(Tensor a, Tensor w, Tensor masked_m, Tensor? a_scales=None, "
    "Tensor? w_scales=None, int expected_m=0, bool trusted=False) -> Tensor"
)


def _check_no_grad(a, w, a_scales, w_scales) -> None:
    _checks.check_no_grad(OP, a=a, w=w, a_scales=a_scales, w_scales=w_scales)


def _contiguous_fake(
    a, w, m_indices, a_scales=None, w_scales=None, expert_offsets=None, trusted=False
):
    CONTIGUOUS.check(a, w, m_indices, a_scales, w_scales, expert_offsets)
    _check_no_grad(a, w, a_scales, w_scales)
    return a.new_empty((a.shape[0], w.shape[1]), dtype=torch.bfloat16)


def _contiguous_reference(
    a, w, m_indices, a_scales=None, w_scales=None, expert_offsets=None, trusted=False
):
    CONTIGUOUS.check(a, w, m_indices, a_scales, w_scales, expert_offsets)
    _check_no_grad(a, w, a_scales, w_scales)
    _checks.check_ids(m_indices, w.shape[0], OP, "m_indices")
    return reference.grouped_gemm_contiguous(a, w, m_indices, a_scales, w_scales)


def _contiguous_cuda(
    a, w, m_indices, a_scales=None, w_scales=None, expert_offsets=None, trusted=False
):
    CONTIGUOUS.check(a, w, m_indices, a_scales, w_scales, expert_offsets)
    _check_no_grad(a, w, a_scales, w_scales)
    if not trusted:
        _checks.check_ids(m_indices, w.shape[0], OP, "m_indices")
    with _eager.on_device(a):  # Triton and deep_gemm launch on the current device
        return _contiguous_cuda_impl(a, w, m_indices, a_scales, w_scales, expert_offsets)


def _masked_fake(a, w, masked_m, a_scales=None, w_scales=None, expected_m=0, trusted=False):
    MASKED.check(a, w, masked_m, a_scales, w_scales)
    _check_no_grad(a, w, a_scales, w_scales)
    return a.new_empty((a.shape[0], a.shape[1], w.shape[1]), dtype=torch.bfloat16)


def _masked_reference(a, w, masked_m, a_scales=None, w_scales=None, expected_m=0, trusted=False):
    MASKED.check(a, w, masked_m, a_scales, w_scales)
    _check_no_grad(a, w, a_scales, w_scales)
    _check_counts(masked_m, a.shape[1])
    return reference.grouped_gemm_masked(a, w, masked_m, a_scales, w_scales)


def _masked_cuda(a, w, masked_m, a_scales=None, w_scales=None, expected_m=0, trusted=False):
    MASKED.check(a, w, masked_m, a_scales, w_scales)
    _check_no_grad(a, w, a_scales, w_scales)
    with _eager.on_device(a):  # (checks masked_m: the int8 kernel does it in its own launch)
        return _masked_cuda_impl(a, w, masked_m, a_scales, w_scales, expected_m, trusted)


for _name, _fake, _ref, _cuda in (
    ("grouped_gemm_contiguous", _contiguous_fake, _contiguous_reference, _contiguous_cuda),
    ("grouped_gemm_masked", _masked_fake, _masked_reference, _masked_cuda),
):
    # the reference serves every device but CUDA (CPU: the same bytes compiled or eager)
    _LIB.impl(_name, _ref, "CompositeExplicitAutograd")
    _LIB.impl(_name, _cuda, "CUDA")
    _LIB.impl(_name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"epmoe::{_name}", _fake, lib=_LIB)

_contiguous_op = torch.ops.epmoe.grouped_gemm_contiguous.default
_masked_op = torch.ops.epmoe.grouped_gemm_masked.default


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: Optional[torch.Tensor] = None,
    masked_m: Optional[torch.Tensor] = None,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    expected_m: Optional[int] = None,
    expert_offsets: Optional[torch.Tensor] = None,
    trusted: bool = False,
) -> torch.Tensor:
    """Grouped GEMM out = a @ w[e].T; pass exactly one of ``m_indices`` (contiguous), ``masked_m``.

    Args:
        a: bf16/fp8/int8 `[M_sum, Kd]` (contiguous) or `[E, T, Kd]` (masked).
        w: same dtype `[E, N, Kd]` (as returned by :func:`prepare_weights`).
        m_indices: int32 `[M_sum]` expert per row, -1 to skip; expert blocks start at multiples of
            :func:`contiguous_row_block`.
        masked_m: int32 `[E]` live rows per expert (on the device; rows past it are never read).
            Any T works; with deep_gemm, T a multiple of :func:`masked_row_block` saves a copy.
        a_scales, w_scales: float32 scales for fp8/int8 (see module docstring).
        expected_m: static hint of rows per expert for the masked layout (default T).
        expert_offsets: optional int32 `[E + 1]` expert block starts of the contiguous layout
            (permute's ``expert_offsets``); only the torch._grouped_mm backend uses it.
        trusted: m_indices / masked_m come from permute / ll_scatter, whose values are in range
            by construction: the CUDA backends skip their device-side value check (the layer's
            own chain). The CPU reference always checks.
    Returns:
        bf16 `[M_sum, N]` or `[E, T, N]`. CUDA-graph safe after :func:`warmup`.
    """
    if (m_indices is None) == (masked_m is None):
        raise _checks.fail(OP, "m_indices/masked_m", "exactly one of them", "both or neither")
    if m_indices is not None:
        direct = _eager.direct(a, w, m_indices, a_scales, w_scales, expert_offsets)
        run = _contiguous_cuda if direct else _contiguous_op
        return run(a, w, m_indices, a_scales, w_scales, expert_offsets, trusted)
    em = int(expected_m or 0)
    if _eager.calm() and MASKED.direct(a, w, masked_m, a_scales, w_scales):
        with _eager.on_device(a):  # the usual eager call, validated in one pass
            return _masked_cuda_impl(a, w, masked_m, a_scales, w_scales, em, trusted)
    run = _masked_cuda if _eager.direct(a, w, masked_m, a_scales, w_scales) else _masked_op
    return run(a, w, masked_m, a_scales, w_scales, em, trusted)


def _grouped_gemm_trusted(
    a, w, m_indices=None, masked_m=None, a_scales=None, w_scales=None, expected_m=None,
    expert_offsets=None,
):  # fmt: skip
    """The layer's entry on its direct path (eager, plain CUDA tensors checked at the layer's
    boundary or made by the stage before, rows from permute / a dispatch): the CUDA backend
    without the metadata or value checks."""
    with _eager.on_device(a):
        if m_indices is not None:
            return _contiguous_cuda_impl(a, w, m_indices, a_scales, w_scales, expert_offsets)
        em = int(expected_m or 0)
        return _masked_cuda_impl(a, w, masked_m, a_scales, w_scales, em, trusted=True)
