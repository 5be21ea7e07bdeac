"""unpermute Triton kernel on CPU tensors under TRITON_INTERPRET=1 against the reference."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

from epmoe import reference  # noqa: E402
from tests.ops import _stage_cases as C  # noqa: E402

pytestmark = pytest.mark.interpret
U = C.unpermute_mod


def _inputs(m, k, rows, h, dtype, gen, neg=0.4):
    y = (torch.randn((rows, h), generator=gen) * 3).to(dtype)
    inv = torch.randint(0, max(rows, 1), (m, k), generator=gen)
    inv = torch.where(torch.rand((m, k), generator=gen) < neg, -1, inv).to(torch.int32)
    w = torch.rand((m, k), generator=gen)
    return y, inv, w


def _run(y, inv, w):
    ref = reference.unpermute(y, inv, w)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            out = U._unpermute_triton(y, inv, w)
        assert out.dtype == y.dtype and out.shape == ref.shape
        C.assert_close(out, ref)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_reference(dtype, monkeypatch):
    C.set_config(monkeypatch, U, block_bytes=64)  # H = 40 spans several column chunks
    gen = torch.Generator().manual_seed(0)
    _run(*_inputs(9, 4, 30, 40, dtype, gen))


@pytest.mark.parametrize("m,k,neg", [(0, 4, 0.5), (1, 1, 0.0), (6, 3, 1.0), (5, 8, 0.5)])
def test_edge_cases(m, k, neg):
    gen = torch.Generator().manual_seed(m + k)
    out = _run(*_inputs(m, k, 20, 24, torch.bfloat16, gen, neg))
    if neg == 1.0:
        assert torch.equal(out, torch.zeros_like(out))


def test_int64_bf16_weights_strided():
    gen = torch.Generator().manual_seed(3)
    y, inv, w = _inputs(7, 3, 16, 33, torch.bfloat16, gen)
    inv64 = inv.long().t().contiguous().t()
    w16 = w.to(torch.bfloat16).t().contiguous().t()
    _run(y[:, :33], inv64, w16)
    y_strided = torch.randn((16, 66), generator=gen).to(torch.bfloat16)[:, ::2]
    _run(y_strided, inv, w)


def test_fp32_exact_single_choice():
    """One live choice per token with weight 1: the output is the row itself, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    y = torch.randn((10, 24), generator=gen)
    inv = torch.tensor([[3, -1], [-1, 9], [0, -1]], dtype=torch.int32)
    out = U._unpermute_triton(y, inv, torch.ones((3, 2)))
    C.assert_equal(out, y[[3, 9, 0]], "rows")


def test_bad_rows_raise():
    y = torch.zeros((4, 8))
    with pytest.raises(ValueError, match=r"unpermute: inv_perm expected ids in \[0, 4\) or -1"):
        U._unpermute_triton(y, torch.tensor([[0, 4]], dtype=torch.int32), torch.ones((1, 2)))


def test_unchecked_launch_same_bytes_no_flag():
    """check=False (the layer's chain off the direct path): the same output, no row check, and a
    row past M_sum is still never read (its term is 0)."""
    gen = torch.Generator().manual_seed(5)
    y, inv, w = _inputs(6, 3, 12, 24, torch.bfloat16, gen)
    C.assert_equal(U._unpermute_triton(y, inv, w, False), U._unpermute_triton(y, inv, w), "out")
    bad = inv.clone()
    bad[0, 0] = 12
    out = U._unpermute_triton(y, bad, w, False)  # no ValueError: nothing checks
    fixed = bad.clone()
    fixed[0, 0] = -1
    C.assert_equal(out, U._unpermute_triton(y, fixed, w), "out")


def _bias(e, h, rows, dtype, gen):
    """bias `[e, h]` of ``dtype`` (a strided view) and m_indices int32 `[rows]` in [-1, e)."""
    b = (torch.randn((e, h + 3), generator=gen) * 2).to(dtype)[:, 3:]
    return b, torch.randint(-1, e, (rows,), generator=gen, dtype=torch.int32)


def _run_bias(y, inv, w, b, m_idx, hidden, check=True, poison=C.POISON_BYTES):
    ref = reference.unpermute(y, inv, w, b, m_idx, hidden)
    for byte in poison:
        with C.poisoned_empty(byte):
            out = U._unpermute_triton(y, inv, w, check, b, m_idx, hidden)
        assert out.dtype == y.dtype and out.shape == ref.shape
        C.assert_close(out, ref)
    return out


@pytest.mark.parametrize(
    "dtype,bias_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
    ],
)
def test_bias_hidden_matches_reference(dtype, bias_dtype, monkeypatch):
    """bias[m_indices[row]] added before the weighting (m_indices -1: none), the first Ho
    columns; columns past Ho never read."""
    C.set_config(monkeypatch, U, block_bytes=64)  # several column chunks
    gen = torch.Generator().manual_seed(7)
    y, inv, w = _inputs(9, 4, 30, 48, dtype, gen)
    b, m_idx = _bias(5, 48, 30, bias_dtype, gen)
    for hidden in (None, 40, 1):
        if hidden is not None:
            y[:, hidden:] = float("nan")  # (past Ho: never read)
        _run_bias(y, inv, w, b, m_idx, hidden)
        _run_bias(y, inv, w, b[:, : hidden or 48], m_idx, hidden, check=False, poison=(0xFF,))
        out = _run_bias(y, inv, w, None, None, hidden, poison=(0xFF,))  # no bias
        if hidden is None:
            full = out  # (no bias: the first Ho columns of the full output)
        C.assert_equal(out, full[:, : hidden or 48], "out")


def test_bias_exact_single_choice():
    """One live choice with weight 1, fp32: y[r] + bias[m_indices[r]] in float32, bit for bit."""
    gen = torch.Generator().manual_seed(8)
    y = torch.randn((10, 24), generator=gen)
    b = torch.randn((3, 24), generator=gen)
    m_idx = torch.tensor([0, 1, 2, -1, 0, 1, 2, 0, 1, 2], dtype=torch.int32)
    inv = torch.tensor([[3, -1], [-1, 9], [0, -1]], dtype=torch.int32)
    out = U._unpermute_triton(y, inv, torch.ones((3, 2)), True, b, m_idx)
    C.assert_equal(out, torch.stack([y[3], y[9] + b[2], y[0] + b[0]]), "rows")


def test_bias_with_permute_rows():
    """inv_perm and m_indices from permute (padding rows -1): the reference's result."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn((12, 32), generator=gen).to(torch.bfloat16)
    ids = C.routing(12, 2, 4, gen, local=0.8)
    p = reference.permute(x, ids, 4, 8)
    b, _ = _bias(4, 32, 1, torch.bfloat16, gen)
    w = torch.rand((12, 2), generator=gen)
    _run_bias(p[0], p[3], w, b, p[2], 24)
