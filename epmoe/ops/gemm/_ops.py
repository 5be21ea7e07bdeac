"""The grouped GEMM stages, each declared once (:func:`epmoe._stage.stage`):
:func:`grouped_gemm_contiguous` and :func:`grouped_gemm_masked` (fake, CPU reference, CUDA
kernels that dispatch to the backend :func:`_backend` picks), and the public :func:`grouped_gemm`
that picks one of them."""

from typing import Optional, Tuple

import torch

from epmoe import _checks, quant, reference
from epmoe import gate as _gate
from epmoe._stage import stage
from epmoe.kernels.scales import alloc_scales, as_layout
from epmoe.ops.gemm._deepgemm import _deep_gemm_contiguous, _deep_gemm_masked
from epmoe.ops.gemm._select import (
    OP,
    _backend,
    _dg_functions,
    _runs,
    contiguous_row_block,
    fuses_masked_gate,
    masked_row_block,
    scheme_of,
)
from epmoe.ops.gemm._triton import (
    contiguous_gate_triton,
    contiguous_triton,
    masked_gate_triton,
    masked_triton,
)
from epmoe.ops.gemm._validate import (
    CONTIGUOUS,
    GATE,
    MASKED,
    MASKED_GATE,
    OP_GATE,
    OP_MASKED_GATE,
    _check_counts,
)


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


def _contiguous_cuda(a, w, m_indices, a_scales=None, w_scales=None, expert_offsets=None,
                     trusted=False, alignment=0, a_rows=None):  # fmt: skip
    """grouped_gemm_contiguous on CUDA (metadata checked by the caller, a's device current: every
    caller makes it so); trusted: no value check of m_indices / a_rows (rows from permute)."""
    if not trusted:
        _check_rows(a, w, m_indices, a_rows, OP)
    scheme = scheme_of(a.dtype)
    M, K = m_indices.shape[0], a.shape[1]
    E, N, _ = w.shape
    block = alignment or contiguous_row_block(scheme, a.device)
    backend = _backend(scheme, "contiguous", a.device, N, K, E, block, M)
    if backend == "triton":
        return contiguous_triton(a, w, m_indices, a_scales, w_scales, block, a_rows=a_rows)
    a, a_scales = _in_order(a, a_scales, a_rows)  # (the other backends read a in row order)
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


def _masked_cuda(a, w, masked_m, a_scales=None, w_scales=None, expected_m=0, trusted=False):
    """grouped_gemm_masked on CUDA (metadata checked by the caller, a's device current: every
    caller makes it so); trusted: no value check of masked_m (counts from a dispatch that clamps
    them)."""
    scheme = scheme_of(a.dtype)
    E, T, K = a.shape
    N, dev = w.shape[1], a.device
    backend = _backend(scheme, "masked", dev, N, K, E, T, expected_m or T)
    if backend == "triton":  # the kernel itself checks the counts (trusted: none to check)
        ok = None if trusted else torch.empty((), dtype=torch.bool, device=dev)
        out = masked_triton(a, w, masked_m, a_scales, w_scales, expected_m, ok=ok)
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
    block = masked_row_block(scheme, dev)
    return _deep_gemm_masked(fn, a, w, masked_m, a_scales, w_scales, expected_m, block)


# -------------------------------------------------------------------------------------------- ops
# No autograd kernel (inference only): inputs that would need one are a ValueError (the stage's
# kernels refuse them), never a silently missing gradient. Both ops stay opaque under
# torch.compile (triton=False): deep_gemm, torch._grouped_mm and the autotuned INT8 kernels.
def _output(a, w, *_):
    """bf16 `[E, T, N]`: the masked fake's output."""
    return a.new_empty((*a.shape[:-1], w.shape[1]), dtype=torch.bfloat16)


def _contiguous_output(a, w, m_indices, *_):
    """bf16 `[M_sum, N]`: the contiguous fake's output (M_sum rows of m_indices)."""
    return a.new_empty((m_indices.shape[0], w.shape[1]), dtype=torch.bfloat16)


def _check_rows(a, w, m_indices, a_rows, op: str) -> None:
    """The row arguments' values: m_indices experts of w (or -1), a_rows rows of a (or -1)."""
    _checks.check_ids(m_indices, w.shape[0], op, "m_indices")
    if a_rows is not None:
        _checks.check_ids(a_rows, a.shape[0], op, "a_rows")


def _in_order(a, a_scales, a_rows):
    """(a, a_scales) in row order: their rows gathered through a_rows (None: as they are)."""
    if a_rows is None:
        return a, a_scales
    return reference.take_rows(a, a_rows), reference.take_rows(a_scales, a_rows)


def _gathered(a, a_scales, m_indices, w, a_rows, op: str):
    """(a, a_scales) in row order: the CPU reference's view of a gathering call (its ids checked
    first, always: trusted is CUDA's)."""
    _check_rows(a, w, m_indices, a_rows, op)
    return _in_order(a, a_scales, a_rows)


def _contiguous_reference(a, w, m_indices, a_scales=None, w_scales=None, expert_offsets=None,
                          trusted=False, alignment=0, a_rows=None):  # fmt: skip
    a, a_scales = _gathered(a, a_scales, m_indices, w, a_rows, OP)
    return reference.grouped_gemm_contiguous(a, w, m_indices, a_scales, w_scales)


def _masked_reference(a, w, masked_m, a_scales=None, w_scales=None, expected_m=0, trusted=False):
    _check_counts(masked_m, a.shape[1])  # (always: trusted is CUDA's)
    return reference.grouped_gemm_masked(a, w, masked_m, a_scales, w_scales)


@stage(
    contract=CONTIGUOUS,
    fake=_contiguous_output,
    reference=_contiguous_reference,
    cuda=_contiguous_cuda,
    triton=False,
    chain=dict(trusted=True),  # the layer's rows come from its own permute: -1 or in range
)
def grouped_gemm_contiguous(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    expert_offsets: Optional[torch.Tensor] = None,
    trusted: bool = False,
    alignment: int = 0,
    a_rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Grouped GEMM out[r] = a[r] @ w[m_indices[r]].T on the contiguous (HT) layout (with
    ``a_rows``: a[a_rows[r]]).

    Args:
        a: bf16/fp8/int8 `[M_sum, Kd]` (with a_rows: `[M, Kd]`, the rows a_rows names).
        w: same dtype `[E, N, Kd]` (as returned by :func:`prepare_weights`).
        m_indices: int32 `[M_sum]` expert per row, -1 to skip; expert blocks start at multiples of
            ``alignment``.
        a_scales, w_scales: float32 scales for fp8/int8 (see the package docstring).
        expert_offsets: optional int32 `[E + 1]` expert block starts (permute's
            ``expert_offsets``); only the torch._grouped_mm backend uses it.
        trusted: m_indices comes from permute, whose values are -1 or in range by construction:
            the CUDA backends skip their device-side value check. The CPU reference always checks.
        alignment: the row multiple every expert block starts at (permute's ``alignment``); 0:
            :func:`contiguous_row_block`. On CUDA a multiple of :func:`smallest_row_block`; it
            picks the backend (deep_gemm needs its 128-row blocks; our Triton kernels take 16+).
        a_rows: optional int32 `[M_sum]`: the row of a (and of a_scales) each row reads, -1 on
            padding (permute's ``src_rows``, permute then copying no row: ``x[:, :0]``). Our
            Triton kernels load those rows themselves; the other backends get a gathered copy.
    Returns:
        bf16 `[M_sum, N]`; rows with m_indices == -1 unspecified. CUDA-graph safe after
        :func:`warmup`.
    """


@stage(
    contract=MASKED,
    fake=_output,
    reference=_masked_reference,
    cuda=_masked_cuda,
    triton=False,
    chain=dict(trusted=True),  # the layer's counts come from a dispatch that clamps them
)
def grouped_gemm_masked(
    a: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    expected_m: int = 0,
    trusted: bool = False,
) -> torch.Tensor:
    """Grouped GEMM out[e, t] = a[e, t] @ w[e].T on the masked (LL) layout, t < masked_m[e].

    Args:
        a: bf16/fp8/int8 `[E, T, Kd]`.
        w: same dtype `[E, N, Kd]` (as returned by :func:`prepare_weights`).
        masked_m: int32 `[E]` live rows per expert (on the device; rows past it are never read).
            Any T works; with deep_gemm, T a multiple of :func:`masked_row_block` saves a copy.
        a_scales, w_scales: float32 scales for fp8/int8 (see the package docstring).
        expected_m: static hint of the mean rows per expert (0: T); tiles (ours and deep_gemm's)
            are sized for the fullest expert about that mean. Picks tile shapes, never results.
        trusted: masked_m comes from a dispatch that clamps the counts to T: the CUDA backends
            skip their value check. The CPU reference always checks.
    Returns:
        bf16 `[E, T, N]`; rows t >= masked_m[e] unspecified. CUDA-graph safe after
        :func:`warmup`.
    """


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
    alignment: int = 0,
    a_rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Grouped GEMM out = a @ w[e].T; pass exactly one of ``m_indices`` (contiguous), ``masked_m``.

    Args:
        a: bf16/fp8/int8 `[M_sum, Kd]` (contiguous) or `[E, T, Kd]` (masked).
        w: same dtype `[E, N, Kd]` (as returned by :func:`prepare_weights`).
        m_indices: int32 `[M_sum]` expert per row, -1 to skip; expert blocks start at multiples of
            ``alignment`` (0: :func:`contiguous_row_block`).
        masked_m: int32 `[E]` live rows per expert (on the device; rows past it are never read).
            Any T works; with deep_gemm, T a multiple of :func:`masked_row_block` saves a copy.
        a_scales, w_scales: float32 scales for fp8/int8 (see module docstring).
        expected_m: static hint of rows per expert for the masked layout (default T).
        expert_offsets: optional int32 `[E + 1]` expert block starts of the contiguous layout
            (permute's ``expert_offsets``); only the torch._grouped_mm backend uses it.
        trusted: m_indices / masked_m come from permute / ll_scatter, whose values are in range
            by construction: the CUDA backends skip their device-side value check (the layer's
            own chain). The CPU reference always checks.
        alignment, a_rows: contiguous only: see :func:`grouped_gemm_contiguous`.
    Returns:
        bf16 `[M_sum, N]` or `[E, T, N]`. CUDA-graph safe after :func:`warmup`.
    """
    if (m_indices is None) == (masked_m is None):
        raise _checks.fail(OP, "m_indices/masked_m", "exactly one of them", "both or neither")
    if m_indices is not None:
        return grouped_gemm_contiguous(
            a, w, m_indices, a_scales, w_scales, expert_offsets, trusted, alignment, a_rows
        )
    if a_rows is not None:
        raise _checks.fail(OP, "a_rows", "None with masked_m (the contiguous layout's)", "a tensor")
    em = int(expected_m or 0)
    return grouped_gemm_masked(a, w, masked_m, a_scales, w_scales, em, trusted)


# -------------------------------------------------------------------- GEMM1 and the gate, fused
def _gate_outputs(a, w, m_indices, a_scales=None, w_scales=None, gate="silu", bias=None,
                  scale_layout="row", alignment=0, trusted=False, a_rows=None):  # fmt: skip
    """(h `[M_sum, I]` in a's dtype, float32 scales `[M_sum, I/128]` (fp8) or `[M_sum, 0]`)."""
    g = _gate.get(gate, OP_GATE, "gate")
    return _h_outputs(a, (m_indices.shape[0],), g.inter(w.shape[1]), scale_layout)


def _h_outputs(a, lead, inter, scale_layout):
    """(h `[*lead, inter]` in a's dtype, its float32 scales in ``scale_layout``, or `[*lead, 0]`
    where a's scheme has none): the GEMM1 + gate ops' outputs."""
    h = a.new_empty((*lead, inter))
    groups = quant.of_dtype(a.dtype).act_scale_cols(inter)
    if not groups:
        return h, _no_scales(h)
    return h, alloc_scales(lead, groups, scale_layout, a.device)


def _no_scales(h):
    """bf16 h's scales: float32 `[M_sum, 0]` / `[E, T, 0]` (the op returns a tensor either way)."""
    return h.new_empty((*h.shape[:-1], 0), dtype=torch.float32)


def _unfused_act(y, scheme, g, bias, scale_layout, **rows):
    """The activation stage on GEMM1's y, as the GEMM1 + gate ops return it (``rows``: the
    activation's m_indices or masked_m)."""
    from epmoe.ops import activation  # (the unfused pair: no fused kernel for the call)

    if scheme is quant.BF16:
        return activation.silu_and_mul(y, gate=g.spec, bias=bias, **rows), _no_scales(y)
    return activation.silu_and_mul_quant(y, scheme.name, scale_layout=scale_layout, gate=g.spec,
                                         bias=bias, **rows)  # fmt: skip


def _reference_act(y, dtype, gate, bias, scale_layout, rows_expert=None):
    """The reference activation stage on GEMM1's reference y for operands of ``dtype``, as the
    GEMM1 + gate ops return it (``rows_expert``: 2-D y's m_indices)."""
    if dtype == torch.bfloat16:
        return reference.silu_and_mul(y, gate, bias, rows_expert), _no_scales(y)
    q, s = reference.silu_and_mul_quant(y, quant.of_dtype(dtype), quant.FP8_GROUP, gate, bias,
                                        rows_expert)  # fmt: skip
    return q, as_layout(s, scale_layout)


def _gate_reference(a, w, m_indices, a_scales=None, w_scales=None, gate="silu", bias=None,
                    scale_layout="row", alignment=0, trusted=False, a_rows=None):  # fmt: skip
    a, a_scales = _gathered(a, a_scales, m_indices, w, a_rows, OP_GATE)
    y = reference.grouped_gemm_contiguous(a, w, m_indices, a_scales, w_scales)
    return _reference_act(y, a.dtype, gate, bias, scale_layout, m_indices)


def gate_triton(a, w, m_indices, a_scales, w_scales, g, bias, scale_layout, row_block,
                a_rows=None, config=None):  # fmt: skip
    """Our GEMM1 + gate kernel (``g`` a Gate; ``config``: explicit meta-parameters, the tuner's)
    and the op's outputs: int8 operands give the kernel's bf16 h, then each row quantized (a row's
    scale needs all of it), the unfused pair's bytes."""
    if a.dtype != torch.int8:
        h, s = _gate_outputs(a, w, m_indices, gate=g.spec, scale_layout=scale_layout)
        contiguous_gate_triton(a, w, m_indices, a_scales, w_scales, g, bias, h, s, row_block,
                               config, a_rows)  # fmt: skip
        return h, s
    from epmoe.ops.quantize import quantize  # (the quantize stage, on h's rows)

    h = a.new_empty((m_indices.shape[0], g.inter(w.shape[1])), dtype=torch.bfloat16)
    contiguous_gate_triton(a, w, m_indices, a_scales, w_scales, g, bias, h, _no_scales(h),
                           row_block, config, a_rows)  # fmt: skip
    return quantize(h, "int8", scale_layout=scale_layout)


def _gate_cuda(a, w, m_indices, a_scales=None, w_scales=None, gate="silu", bias=None,
               scale_layout="row", alignment=0, trusted=False, a_rows=None):  # fmt: skip
    """grouped_gemm_gate on CUDA: our fused kernel where it runs, else GEMM1 and the activation
    stage (the same values: the kernel rounds GEMM1's output to bf16 before the gate)."""
    if not trusted:
        _check_rows(a, w, m_indices, a_rows, OP_GATE)
    scheme = quant.of_dtype(a.dtype)
    block = alignment or contiguous_row_block(scheme, a.device)
    g = _gate.get(gate, OP_GATE, "gate")
    if _runs("triton", scheme, "contiguous", a.device, w.shape[1], a.shape[1], block):
        return gate_triton(a, w, m_indices, a_scales, w_scales, g, bias, scale_layout, block,
                           a_rows)  # fmt: skip
    # (the unfused pair: no fused kernel on this GPU)
    y = _contiguous_cuda(a, w, m_indices, a_scales, w_scales, trusted=True, alignment=block,
                         a_rows=a_rows)  # fmt: skip
    return _unfused_act(y, scheme, g, bias, scale_layout, m_indices=m_indices)


@stage(
    contract=GATE,
    fake=_gate_outputs,
    reference=_gate_reference,
    cuda=_gate_cuda,
    triton=False,
    chain=dict(trusted=True),  # the layer's rows come from its own permute: -1 or in range
)
def grouped_gemm_gate(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    gate: str = "silu",
    bias: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
    alignment: int = 0,
    trusted: bool = False,
    a_rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 and the activation stage in one kernel on the contiguous layout: h = the gate of
    (a[r] @ w[m_indices[r]].T rounded to bf16, plus bias[m_indices[r]] in float32), rounded to
    bf16, then (fp8) quantized per 128 channels: the bytes of :func:`grouped_gemm_contiguous` then
    :func:`epmoe.ops.silu_and_mul` / ``silu_and_mul_quant`` on the same GEMM backend, without y's
    round trip through memory or the activation's launch. int8: the kernel writes h in bf16 (half
    of y's bytes) and the quantize stage makes each row's codes and scale (it needs the whole row).

    Args:
        a: bf16/fp8/int8 `[M_sum, Kd]`; with a_rows `[M, Kd]`, the rows a_rows names.
        w: same dtype `[E, W, Kd]`: W = 2I, the gate rows then the up rows (I without a gate
            half), as returned by :func:`prepare_weights`.
        m_indices: int32 `[M_sum]` expert per row, -1 to skip; blocks aligned to ``alignment``.
        a_scales, w_scales: float32 scales for fp8 / int8 (see the package docstring).
        gate: the gate's spec (:func:`epmoe.gate.parse`). bias: optional float `[E, W]`.
        scale_layout: fp8 / int8 output scales "row" or "deepgemm" (what GEMM2 reads without a
            copy).
        alignment: as in :func:`grouped_gemm_contiguous`.
        trusted: m_indices comes from permute (the CUDA kernel skips its value check).
        a_rows: optional int32 `[M_sum]`: the row of a each row reads, -1 on padding, as in
            :func:`grouped_gemm_contiguous`.
    Returns:
        (h bf16/fp8/int8 `[M_sum, I]`, float32 `[M_sum, I/128]` (fp8), `[M_sum, 1]` (int8) or
        `[M_sum, 0]` (bf16)); rows with m_indices == -1 unspecified. CUDA-graph safe after
        warmup.
    """


# ------------------------------------------------------- masked GEMM1 and the gate, fused (LL)
def _masked_gate_outputs(a, w, masked_m, a_scales=None, w_scales=None, gate="silu", bias=None,
                         scale_layout="row", expected_m=0, trusted=False):  # fmt: skip
    """(h `[E, T, I]` in a's dtype, float32 scales `[E, T, I/128]` (fp8), `[E, T, 1]` (int8) or
    `[E, T, 0]`)."""
    g = _gate.get(gate, OP_MASKED_GATE, "gate")
    return _h_outputs(a, tuple(a.shape[:2]), g.inter(w.shape[1]), scale_layout)


def _masked_gate_reference(a, w, masked_m, a_scales=None, w_scales=None, gate="silu", bias=None,
                           scale_layout="row", expected_m=0, trusted=False):  # fmt: skip
    _check_counts(masked_m, a.shape[1], OP_MASKED_GATE)  # (always: trusted is CUDA's)
    y = reference.grouped_gemm_masked(a, w, masked_m, a_scales, w_scales)
    return _reference_act(y, a.dtype, gate, bias, scale_layout)


def masked_gate_op_triton(a, w, masked_m, a_scales, w_scales, g, bias, scale_layout,
                          expected_m=0, config=None):  # fmt: skip
    """Our masked GEMM1 + gate kernel (``g`` a Gate; ``config``: explicit meta-parameters, the
    tuner's) and the op's outputs: int8 operands give the kernel's bf16 h, then each live row
    quantized (a row's scale needs all of it), the unfused pair's bytes."""
    if a.dtype != torch.int8:
        h, s = _masked_gate_outputs(a, w, masked_m, a_scales, w_scales, g.spec, None,
                                    scale_layout)  # fmt: skip
        masked_gate_triton(a, w, masked_m, a_scales, w_scales, g, bias, h, s, expected_m, config)
        return h, s
    from epmoe.ops.quantize import quantize  # (the quantize stage, on h's live rows)

    h = a.new_empty((*a.shape[:2], g.inter(w.shape[1])), dtype=torch.bfloat16)
    masked_gate_triton(a, w, masked_m, a_scales, w_scales, g, bias, h,
                       h.new_empty((0,), dtype=torch.float32), expected_m, config)  # fmt: skip
    return quantize(h, "int8", masked_m=masked_m, scale_layout=scale_layout)


def _masked_gate_cuda(a, w, masked_m, a_scales=None, w_scales=None, gate="silu", bias=None,
                      scale_layout="row", expected_m=0, trusted=False):  # fmt: skip
    """grouped_gemm_masked_gate on CUDA: our fused kernel where this GPU's table measured it
    faster, else masked GEMM1 and the activation stage (the same bytes: the kernel rounds GEMM1's
    output to bf16 before the gate, on GEMM1's tile)."""
    E, T, K = a.shape
    if not trusted:
        _check_counts(masked_m, T, OP_MASKED_GATE)
    g = _gate.get(gate, OP_MASKED_GATE, "gate")
    inter, scheme = g.inter(w.shape[1]), quant.of_dtype(a.dtype)
    if fuses_masked_gate(scheme, a.device, inter, K, E, T, expected_m, g.spec, bias is not None):
        return masked_gate_op_triton(a, w, masked_m, a_scales, w_scales, g, bias, scale_layout,
                                     expected_m)  # fmt: skip
    y = _masked_cuda(a, w, masked_m, a_scales, w_scales, expected_m, trusted=True)
    return _unfused_act(y, scheme, g, bias, scale_layout, masked_m=masked_m)


@stage(
    contract=MASKED_GATE,
    fake=_masked_gate_outputs,
    reference=_masked_gate_reference,
    cuda=_masked_gate_cuda,
    triton=False,
    chain=dict(trusted=True),  # the layer's counts come from a dispatch that clamps them
)
def grouped_gemm_masked_gate(
    a: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    gate: str = "silu",
    bias: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
    expected_m: int = 0,
    trusted: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 and the activation stage on the masked (LL) layout: h[e, t] = the gate of
    (a[e, t] @ w[e].T rounded to bf16, plus bias[e] in float32), rounded to bf16, then quantized
    (fp8: per 128 channels; int8: per row), for t < masked_m[e]: the bytes of
    :func:`grouped_gemm_masked` then :func:`epmoe.ops.silu_and_mul` / ``silu_and_mul_quant``.
    One kernel where this GPU's tuned table measured it faster (our Triton kernel: no y round trip
    through memory, no activation launch; int8: the kernel writes h in bf16 and the quantize
    stage makes each row's codes and scale), else the two stages.

    Args:
        a: bf16/fp8/int8 `[E, T, Kd]`.
        w: same dtype `[E, W, Kd]`: W = 2I, the gate rows then the up rows (I without a gate
            half), as returned by :func:`prepare_weights`.
        masked_m: int32 `[E]` live rows per expert (on the device; rows past it are never read).
        a_scales, w_scales: float32 scales for fp8 / int8 (see the package docstring).
        gate: the gate's spec (:func:`epmoe.gate.parse`). bias: optional float `[E, W]`.
        scale_layout: fp8 / int8 output scales "row" or "deepgemm" (what GEMM2 reads without a
            copy).
        expected_m: static hint of rows per expert (0: T); picks tiles and the kernel, never
            results.
        trusted: masked_m comes from a dispatch that clamps the counts to T: no value check on
            CUDA. The CPU reference always checks.
    Returns:
        (h bf16/fp8/int8 `[E, T, I]`, float32 `[E, T, I/128]` (fp8), `[E, T, 1]` (int8) or
        `[E, T, 0]` (bf16)); rows t >= masked_m[e] unspecified. CUDA-graph safe after warmup.
    """
