"""Expert weights in the backend's layout (:func:`prepare_weights`) and kernel compilation ahead of
graph capture (:func:`warmup`)."""

import math
from typing import Optional, Sequence, Tuple

import torch

from epmoe import _checks, quant
from epmoe import gate as _gate
from epmoe.ops.gemm._ops import grouped_gemm, grouped_gemm_gate, grouped_gemm_masked_gate
from epmoe.ops.gemm._select import (
    contiguous_row_block,
    empty_fp8_act_scales,
    fuses_gate,
    fuses_masked_gate,
    gathers,
)
from epmoe.ops.gemm._triton import _mean_rows


def prepare_weights(
    w_q: torch.Tensor, w_s: Optional[torch.Tensor], scheme, device
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Expert weights in the layout the ``device`` backend reads without any per-call transform.

    Every backend reads the layout :func:`epmoe.reference.quantize_weights` produces, so this is the
    identity up to device placement and contiguity: weights `[E, N, Kd]` K-major (deep_gemm's
    ``nt`` B operand, torch._grouped_mm's column-major w.T, the INT8 kernel's K-major tiles);
    fp8 scales float32 `[E, N/128, Kd/128]` contiguous (what deep_gemm's sm90 kernels take as is);
    int8 scales float32 `[E, N]`. Nothing is repacked, so the shapes stay the logical ones; callers
    still take N and Kd from their configured sizes (as :func:`warmup` does).

    Args:
        w_q: bf16/fp8/int8 `[E, N, Kd]`. w_s: float32 scales or None (bf16). scheme: "bf16", "fp8",
            "int8" or a QuantScheme. device: where the layer runs.
    Returns:
        (weights, scales) accepted by :func:`grouped_gemm`.
    """
    want = quant.get(scheme, "prepare_weights", "scheme").act_dtype
    _checks.check_dtype("prepare_weights", "w_q", w_q, (want,))
    _checks.check_ndim("prepare_weights", "w_q", w_q, (3,))
    w_q = w_q.to(device).contiguous()
    if w_s is not None:
        w_s = w_s.to(device=device, dtype=torch.float32).contiguous()
    return w_q, w_s


def _dummy_weights(scheme, E, N, K, device):
    scheme = quant.get(scheme, "warmup", "scheme")
    w = torch.zeros((E, N, K), dtype=scheme.act_dtype, device=device)
    shape = scheme.weight_scale_shape(E, N, K)
    if shape is None:
        return w, None
    return w, torch.ones(shape, dtype=torch.float32, device=device)


def _dummy_acts(scheme, lead, K, device, mn_major):
    scheme = quant.get(scheme, "warmup", "scheme")
    a = torch.zeros((*lead, K), dtype=scheme.act_dtype, device=device)
    if not scheme.quantized:
        return a, None
    cols = scheme.act_scale_cols(K)
    s = (
        empty_fp8_act_scales(lead, cols, device)  # (deep_gemm's layout of fp8 scales)
        if mn_major and scheme is quant.FP8
        else torch.empty((*lead, cols), dtype=torch.float32, device=device)
    )
    return a, s.fill_(1.0)


def _balanced_m_indices(m: int, E: int, row_block: int, device) -> torch.Tensor:
    """int32 `[m]`: rows over all experts in ``row_block``-aligned blocks, in expert order."""
    block = max(1, row_block)
    per = max(block, math.ceil(m / E / block) * block)
    return (torch.arange(m, device=device) // per).clamp(max=E - 1).to(torch.int32)


def warmup(
    scheme,
    num_experts: int,
    n: int,
    k: int,
    device,
    contiguous_m: Sequence[int] = (),
    masked_t: Optional[int] = None,
    expected_m: Optional[int] = None,
    w: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
    alignment: int = 0,
    gate: Optional[str] = None,
    bias: Optional[torch.Tensor] = None,
) -> None:
    """Compile (and autotune) every kernel one GEMM of a layer will launch, outside graph capture.

    deep_gemm JIT-compiles per (N, K, E) and per heuristic choice, which depends on M (contiguous)
    and expected_m (masked); the INT8 Triton kernels autotune per (N, K, E) (and BLOCK_M, masked).
    Call once per weight of the layer before capturing CUDA graphs or serving.

    Args:
        scheme: "bf16", "fp8", "int8" or a QuantScheme. num_experts: E (local). n, k: the
            GEMM's logical N and Kd from the layer's configured sizes (GEMM1: 2I, H; GEMM2: H, I).
        device: the CUDA device (CPU: nothing to do).
        contiguous_m: M_sum sizes of the contiguous layout to compile for (HT: the worst-case M_sum
            of graph capture, plus typical prefill sizes; the first one drives INT8 autotuning, so
            put the largest first).
        masked_t: T of the masked layout (LL: rows per expert slot), or None when LL is unused;
            the same T as the forward pass (it decides whether deep_gemm runs on a padded copy).
        expected_m: the masked layout's static hint, exactly as the forward pass passes it.
        w, w_scales: the layer's prepared weights (avoids allocating dummies of the same size).
        alignment: the contiguous layout's row alignment, as the forward pass passes it (0: the
            default, :func:`contiguous_row_block`).
        gate, bias: GEMM1 of a layer (n = the gate's width): its gate spec and gate/up bias; the
            M_sum sizes where :func:`fuses_gate` fuses GEMM1 and the gate also compile that kernel,
            those where :func:`gathers` reads the rows through permute's src_rows its gathering
            build, the masked sizes where :func:`fuses_masked_gate` fuses them that kernel.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return
    scheme = quant.get(scheme, "warmup", "scheme")
    E, N, K = num_experts, n, k
    if w is None:
        w, w_scales = _dummy_weights(scheme, E, N, K, device)
    else:
        _checks.check_shape("warmup", "w", w, (E, N, K))
    row_block = alignment or contiguous_row_block(scheme, device)
    g = None if gate is None else _gate.get(gate, "warmup", "gate")
    inter = None if g is None else g.inter(N)  # (h's I)
    layouts = (
        (True, False) if scheme is quant.FP8 else (True,)
    )  # fp8: also deep_gemm's scale transpose
    for m in contiguous_m:
        m = int(m)
        if m <= 0:
            continue
        m_idx = _balanced_m_indices(m, E, row_block, device)
        for mn_major in layouts:
            a, a_s = _dummy_acts(scheme, (m,), K, device, mn_major)
            grouped_gemm(
                a, w, m_indices=m_idx, a_scales=a_s, w_scales=w_scales, alignment=row_block
            )
        fused = inter is not None and fuses_gate(
            scheme, device, inter, K, E, row_block, m, g.spec, bias is not None
        )
        if fused:
            a, a_s = _dummy_acts(scheme, (m,), K, device, True)
            layout = scheme.cuda_scale_layout
            grouped_gemm_gate(a, w, m_idx, a_s, w_scales, gate, bias, layout, row_block)
        if g is not None and gathers(scheme, device, N, K, E, row_block, m, g.spec,
                                     bias is not None):  # fmt: skip
            a, a_s = _dummy_acts(scheme, (m,), K, device, False)  # (the quantize stage's layout)
            rows = torch.zeros((m,), dtype=torch.int32, device=device)
            if fused:
                grouped_gemm_gate(a, w, m_idx, a_s, w_scales, gate, bias,
                                  scheme.cuda_scale_layout, row_block, a_rows=rows)  # fmt: skip
            else:
                grouped_gemm(a, w, m_indices=m_idx, a_scales=a_s, w_scales=w_scales,
                             alignment=row_block, a_rows=rows)  # fmt: skip
    if masked_t is not None and int(masked_t) > 0:
        T = int(masked_t)
        em = _mean_rows(T, int(expected_m or 0))
        counts = torch.full((E,), em, dtype=torch.int32, device=device)
        for mn_major in layouts:
            a, a_s = _dummy_acts(scheme, (E, T), K, device, mn_major)
            grouped_gemm(a, w, masked_m=counts, a_scales=a_s, w_scales=w_scales, expected_m=em)
        if inter is not None and fuses_masked_gate(scheme, device, inter, K, E, T, em, g.spec,
                                                   bias is not None):  # fmt: skip
            a, a_s = _dummy_acts(scheme, (E, T), K, device, False)  # (the scatter's layout)
            grouped_gemm_masked_gate(a, w, counts, a_s, w_scales, gate, bias,
                                     scheme.cuda_scale_layout, em)  # fmt: skip
    torch.cuda.synchronize(device)
