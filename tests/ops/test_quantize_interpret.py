"""quantize Triton kernels on CPU tensors under TRITON_INTERPRET=1: byte-exact vs the reference."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

from epmoe import reference  # noqa: E402
from epmoe.ops import quantize  # noqa: E402
from tests.ops import _stage_cases as C  # noqa: E402

pytestmark = pytest.mark.interpret
Q = C.quantize_mod


def _run(x, scheme, group_size=128, masked_m=None, layout="row", width=None):
    """Run the kernels under both poison patterns; compare written rows with the reference."""
    rq, rs = reference.quantize(x, scheme, group_size, width)
    lead = x.shape[:-1]
    rows = C.masked_rows(*(lead if x.dim() == 3 else (1, lead[0])), masked_m).reshape(lead)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            q, s = Q._quantize_triton(x, scheme, group_size, masked_m, layout, width)
        assert q.is_contiguous()
        C.assert_equal(q[rows], rq[rows], "q")
        C.assert_equal(s[rows], rs[rows], "s")
    return q, s


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [0, 1, 5])
def test_2d_matches_reference(scheme, dtype, m):
    gen = torch.Generator().manual_seed(10 + m)
    x = (torch.randn((m, 384), generator=gen) * 4).to(dtype)  # 3 groups: a masked 4th in the tile
    _run(x, scheme)


@pytest.mark.parametrize("layout", ["row", "deepgemm"])
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_3d_masked(scheme, layout):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((4, 6, 256), generator=gen).to(torch.bfloat16)
    masked_m = torch.tensor([0, 6, 3, 9], dtype=torch.int32)  # empty, full, partial, > T (clamped)
    q, s = _run(x, scheme, masked_m=masked_m, layout=layout)
    if layout == "deepgemm":
        groups = s.shape[-1]
        assert s.stride() == (groups * 8, 1, 8)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_deepgemm_layout_2d(scheme):
    x = torch.randn((5, 256), generator=torch.Generator().manual_seed(2))
    _, s = _run(x, scheme, layout="deepgemm")
    assert s.stride() == (1, 8)


def test_odd_group_size_and_width():
    """group 96 (not a power of two: masked lanes in each group) and H = 288."""
    x = torch.randn((3, 288), generator=torch.Generator().manual_seed(3))
    _run(x, "fp8", group_size=96)
    _run(torch.randn((3, 200), generator=torch.Generator().manual_seed(4)), "int8")


def test_int8_two_pass(monkeypatch):
    """Rows longer than the single-pass limit take the chunked two-pass loop."""
    C.set_config(monkeypatch, Q, int8_single_pass_max=64)
    C.set_config(monkeypatch, Q, int8_chunk=32)
    x = torch.randn((3, 200), generator=torch.Generator().manual_seed(5)) * 3
    _run(x, "int8")
    _run(x.reshape(3, 2, 100), "int8", masked_m=torch.tensor([1, 2, 0]))


def test_strided_input():
    gen = torch.Generator().manual_seed(6)
    base = torch.randn((4, 512), generator=gen).to(torch.bfloat16)
    _run(base[:, ::2], "fp8")
    _run(base[:, ::2], "int8")
    x3 = torch.randn((256, 3, 2), generator=gen).permute(1, 2, 0)  # [3, 2, 256], stride_h = 6
    _run(x3, "fp8", masked_m=torch.tensor([2, 1, 0]))


def test_rounding_edges():
    """int8 ties (s == 1 exactly), fp8 subnormals, zeros, -0.0, clamping at +-448 / +-127."""
    r0 = torch.zeros(256)
    r0[1] = -0.0
    r1 = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 0.49999997] + [0.0] * 248)
    r2 = torch.randn(256, generator=torch.Generator().manual_seed(7)) * 1e-3
    r2[0] = 448.0  # s = 1: the rest land in e4m3 subnormals
    r2[129] = -448.0
    x = torch.stack([r0, r1, r2])
    for dtype in (torch.float32, torch.bfloat16):
        _run(x.to(dtype), "fp8")
        _run(x.to(dtype), "int8")


def test_op_cpu_deepgemm_layout():
    """The CPU op (reference) honours scale_layout with the same logical values."""
    x = torch.randn((5, 3, 256), generator=torch.Generator().manual_seed(8))
    for scheme in ("fp8", "int8"):
        rq, rs = reference.quantize(x, scheme)
        q, s = quantize(x, scheme, scale_layout="deepgemm")
        C.assert_equal(q, rq, "q")
        C.assert_equal(s, rs, "s")
        assert s.stride() == (s.shape[-1] * 4, 1, 4)


def test_bad_scale_layout():
    with pytest.raises(ValueError, match="quantize: scale_layout expected one of"):
        quantize(torch.zeros(2, 128), "fp8", scale_layout="col")


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_width_matches_reference(scheme, dtype):
    """Codes wider than x (a zero-padded hidden): H = 160 into 256 columns (fp8: a partial group,
    then zeros), 256 into 512 (a whole group of zeros), strided x."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn((5, 160), generator=gen) * 4).to(dtype)
    q, s = _run(x, scheme, width=256)
    assert q.shape == (5, 256) and (q[:, 160:].float() == 0).all()
    _run(x[:0], scheme, width=256)
    base = torch.randn((3, 512), generator=gen).to(dtype)
    _run(base[:, ::2], scheme, width=512, layout="deepgemm")


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_width_3d_masked(scheme):
    gen = torch.Generator().manual_seed(12)
    x = torch.randn((4, 6, 160), generator=gen).to(torch.bfloat16)
    masked_m = torch.tensor([0, 6, 3, 9], dtype=torch.int32)
    _run(x, scheme, masked_m=masked_m, layout="deepgemm", width=384)


def test_width_odd_group_and_two_pass(monkeypatch):
    """group 96 with H = 200 into 288; int8 rows past the single-pass limit (two passes)."""
    gen = torch.Generator().manual_seed(13)
    _run(torch.randn((3, 200), generator=gen), "fp8", group_size=96, width=288)
    C.set_config(monkeypatch, Q, int8_single_pass_max=64)
    C.set_config(monkeypatch, Q, int8_chunk=32)
    x = torch.randn((3, 150), generator=gen) * 3
    _run(x, "int8", width=200)
    _run(x.reshape(3, 2, 75), "int8", masked_m=torch.tensor([1, 2, 0]), width=100)
