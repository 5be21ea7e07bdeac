"""grouped_gemm on CPU: contiguous and masked, every scheme, vs a per-row loop; opcheck; errors."""

import pytest
import torch

from epmoe import ops, reference
from tests._opcheck import opcheck
from tests._tol import GEMM_VS_QUANT_AWARE, rel_l2


def _operands(scheme, lead, E, N, Kd):
    a = torch.randn(*lead, Kd)
    w = torch.randn(E, N, Kd) / Kd**0.5
    if scheme == "bf16":
        return a.bfloat16(), None, w.bfloat16(), None, a.bfloat16().float(), w.bfloat16().float()
    aq, as_ = reference.quantize(a, scheme)
    wq, ws = reference.quantize_weights(w, scheme)
    return aq, as_, wq, ws, reference.dequantize(aq, as_), reference.dequantize_weights(wq, ws)


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_contiguous(scheme, seed):
    E, N, Kd, M = 3, 128, 256, 20
    a, as_, w, ws, ad, wd = _operands(scheme, (M,), E, N, Kd)
    m_idx = torch.randint(-1, E, (M,), dtype=torch.int32)
    m_idx[:4] = 1  # expert 0 or 2 may be empty: that must work too
    y = ops.grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    for r in range(M):
        e = int(m_idx[r])
        if e >= 0:
            want = ad[r] @ wd[e].t()
            assert rel_l2(y[r], want) < GEMM_VS_QUANT_AWARE


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_masked(scheme, seed):
    E, T, N, Kd = 3, 6, 128, 128
    a, as_, w, ws, ad, wd = _operands(scheme, (E, T), E, N, Kd)
    masked_m = torch.tensor([0, 3, 6], dtype=torch.int32)
    y = ops.grouped_gemm(a, w, masked_m=masked_m, a_scales=as_, w_scales=ws, expected_m=3)
    assert y.shape == (E, T, N)
    for e in range(E):
        n = int(masked_m[e])
        if n:
            assert rel_l2(y[e, :n], ad[e, :n] @ wd[e].t()) < GEMM_VS_QUANT_AWARE


def test_gemm_opcheck(seed):
    a, as_, w, ws, _, _ = _operands("fp8", (8,), 2, 128, 128)
    m_idx = torch.tensor([0, 0, 1, -1, 1, 1, -1, 0], dtype=torch.int32)
    opcheck(torch.ops.epmoe.grouped_gemm_contiguous.default, (a, w, m_idx, as_, ws))
    a3, as3, w3, ws3, _, _ = _operands("int8", (2, 4), 2, 64, 32)
    mm = torch.tensor([1, 4], dtype=torch.int32)
    opcheck(torch.ops.epmoe.grouped_gemm_masked.default, (a3, w3, mm, as3, ws3, 2))


def test_gemm_bad_input(seed):
    a, as_, w, ws, _, _ = _operands("fp8", (4,), 2, 128, 128)
    m_idx = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="grouped_gemm: m_indices/masked_m expected exactly one"):
        ops.grouped_gemm(a, w, a_scales=as_, w_scales=ws)
    with pytest.raises(ValueError, match="grouped_gemm: a_scales/w_scales expected tensors"):
        ops.grouped_gemm(a, w, m_indices=m_idx)
    with pytest.raises(ValueError, match="grouped_gemm: w expected dtype"):
        ops.grouped_gemm(a, w.float(), m_indices=m_idx, a_scales=as_, w_scales=ws)
    with pytest.raises(ValueError, match="grouped_gemm: m_indices expected ids"):
        ops.grouped_gemm(
            a, w, m_indices=torch.full((4,), 2, dtype=torch.int32), a_scales=as_, w_scales=ws
        )
    with pytest.raises(ValueError, match="grouped_gemm: a_scales expected shape"):
        ops.grouped_gemm(a, w, m_indices=m_idx, a_scales=as_[:, :0], w_scales=ws)
